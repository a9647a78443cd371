"""``python -m bench [SECTION ...] [--quick] [--repeats N] [--no-dbos]``

Sections: latency (a + raw checkpoint, bare hop and DBOS latency), throughput (b + bare hop
and DBOS rates), replay (d), inflight (c), recovery (e), realclient (f: runs in flight through
the real model clients over HTTP, beside the bare SDK and DBOS; sizes by ``--real-level``
and ``--real-frameworks``); ``all`` (the default) runs them all.
``diagnose`` (not in ``all``) measures what events and logging cost and profiles a worker.
Prints the table and writes bench/results/bench-<time>.json and bench/results/latest.json.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from bench import plots, report
from bench.dbos_bench import available as dbos_available
from bench.env import prepare
from bench.suite import EXTRA, SECTIONS, Plan, run


def _level(raw: str) -> tuple[int, int, int]:
    runs, calls, ms = (int(x) for x in raw.lower().split("x"))
    return runs, calls, ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[1])
    ap.add_argument(
        "sections", nargs="*", default=["all"], help="all, " + ", ".join([*SECTIONS, *EXTRA])
    )
    ap.add_argument("--quick", action="store_true", help="one repeat, smaller workloads (~3 min)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per figure (default 3)")
    ap.add_argument("--no-dbos", action="store_true", help="skip DBOS even when installed")
    ap.add_argument(
        "--real-level",
        action="append",
        metavar="RUNSxCALLSxMS",
        help="realclient: a workload through the real clients, e.g. 2000x3x10000 (default) "
        "or 10000x1x60000; repeat for several",
    )
    ap.add_argument(
        "--real-frameworks",
        metavar="RUNSxCALLSxMS",
        help="realclient: the framework agents' workload (default 200x1x10000), or 'none'",
    )
    args = ap.parse_args(argv)
    # `timeout`, a CI job's cancel, kill: stop the worker processes we started on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = list(SECTIONS) if "all" in args.sections else args.sections
    unknown = [n for n in names if n not in SECTIONS and n not in EXTRA]
    if unknown:
        known = ", ".join([*SECTIONS, *EXTRA])
        ap.error(f"unknown section(s) {', '.join(unknown)}; known: all, {known}")
    plan = Plan.make(quick=args.quick, repeats=args.repeats, dbos=not args.no_dbos)
    if args.real_level:
        plan.real_levels = tuple(_level(x) for x in args.real_level)
    if args.real_frameworks:
        fw = args.real_frameworks
        plan.real_framework_level = None if fw == "none" else _level(fw)
    env = prepare()
    info = report.machine(env.server_info())
    info["dbos"] = dbos_available() if plan.dbos else "skipped (--no-dbos)"
    print(
        f"bench: {info['cpus']} CPUs ({info['cpu_model']}), load {info['loadavg_start'][0]:.1f}, "
        f"PostgreSQL {info['postgres']}, Redis {info['redis']}, "
        f"DBOS {info['dbos'] or 'not installed'}, "
        f"database {env.database_url.rsplit('/', 1)[-1]}, broker {env.redis_url}",
        flush=True,
    )
    t0 = time.monotonic()
    try:
        res = run(env, plan, names)
    finally:
        env.close()
    info["loadavg_end"] = os.getloadavg()
    info["total_s"] = time.monotonic() - t0
    rows = report.rows(res.sections)
    print()
    print(report.table(rows))
    for line in report.profile_lines(res.sections):
        print(line)
    path = report.write(
        {
            "machine": info,
            "plan": res.plan,
            "timings_s": res.timings_s,
            "rows": rows,
            "sections": res.sections,
        }
    )
    for picture in plots.write(res.sections):
        print(f"bench: wrote {picture}")
    print(f"\n{len(rows)} figures in {info['total_s']:.0f}s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
