"""``python -m bench.cli_startup [--repeats N]``: the CPU one ``dar`` command costs.

Each command runs as a fresh process (as a user types it); its CPU (user + system) is read
from ``getrusage(RUSAGE_CHILDREN)``. The API is pointed at a closed port, so ``runs`` and
``show`` measure the command's own start-up and error path, not a server. Baselines from the
same run: a bare interpreter, and importing the Flask app (what every command loaded before
the CLI's imports were made lazy). Target: under 0.3 s of CPU.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
from pathlib import Path

DAR = str(Path(sys.executable).with_name("dar"))
CLOSED = "http://127.0.0.1:9"

COMMANDS: dict[str, list[str]] = {
    "python -c pass (baseline)": [sys.executable, "-c", "pass"],
    "import api.app (the old cost)": [sys.executable, "-c", "import api.app"],
    "dar --help": [DAR, "--help"],
    "dar --version": [DAR, "--version"],
    "dar runs": [DAR, "runs", "--api", CLOSED],
    "dar show ID": [DAR, "show", "6f1c0a52", "--api", CLOSED],
}


def cpu_seconds(argv: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cli_startup")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    print(f"{'command':34} {'median CPU s':>12} {'min':>7} {'max':>7}  (n={args.repeats})")
    for name, command in COMMANDS.items():
        cpu_seconds(command)  # warm the page cache and the bytecode
        samples = [cpu_seconds(command) for _ in range(args.repeats)]
        print(
            f"{name:34} {statistics.median(samples):12.3f} {min(samples):7.3f} {max(samples):7.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
