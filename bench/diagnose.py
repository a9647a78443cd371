"""``python -m bench diagnose``: why (b) is what it is. Not part of ``all``.

At 2 worker processes, interleaved repeat by repeat, the same 50-run workload with:

- the runtime as shipped (Celery task events off, INFO logs: one line per step);
- the runtime with ``DAR_LOG_LEVEL=WARNING`` (no per-step log lines);
- the runtime with the workers' task events switched on at run time (``celery control
  enable_events``, what Flower does when it starts);
- the bare hop, and the bare hop with task events on.

Then, when py-spy is installed (on PATH, or ``PY_SPY=/path/to/py-spy``), one worker process
of the runtime is sampled during a run and the share of its busy samples spent in each part
of a step is printed: the Celery consumer loop, the store's statements, the connection
pool's pre-ping, publishing the next message, task events, logging. The shares are of
wall-clock samples of busy threads: a CPU-bound stretch that holds the GIL while the OS has
the process descheduled (2 cores, workers and PostgreSQL competing) counts in full, so they
overstate pure-Python work such as row mapping; ``time.thread_time`` around a call tells
its real CPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections import Counter
from typing import Any

from bench import runtime_bench as rb
from bench.baselines import hop_throughput
from bench.env import HOP_QUEUE, QUEUE, RESULTS, BenchEnv
from bench.stack import HopFleet, RuntimeFleet
from bench.stats import median

# (label, frames any of which marks a sample, frames that must also be on the stack)
CATEGORIES: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("Celery consumer loop (receive, ack, events)", ("Evloop.start",), ()),
    ("  of which publishing task events", ("EventDispatcher._publish",), ("Evloop.start",)),
    ("drive_run task (the thread pool)", ("register_tasks.<locals>.drive_run",), ()),
    ("  Driver.drive", ("Driver.drive",), ()),
    ("    RunStore.claim", ("RunStore.claim",), ()),
    ("    RunStore.steps (the step log, when not cached)", ("RunStore.steps",), ()),
    ("    RunStore.checkpoint_model", ("RunStore.checkpoint_model",), ()),
    ("    RunStore.start_step", ("RunStore.start_step",), ()),
    ("    RunStore.record_steps", ("RunStore.record_steps",), ()),
    ("    RunStore.finish + get_run", ("RunStore.finish", "RunStore.get_run"), ()),
    ("    pool checkout pre-ping (all store calls)", ("DefaultDialect._do_ping_w_event",), ()),
    ("    tool call through the tool thread pool", ("effects._run",), ()),
    ("    replay", ("replay",), ("Driver.drive",)),
    ("  send_drive (publish the next message)", ("send_drive",), ()),
    ("logging (any thread)", ("Logger._log", "Logger.handle"), ()),
    ("heartbeat", ("Heartbeat.beat",), ()),
]


def py_spy() -> str | None:
    return os.environ.get("PY_SPY") or shutil.which("py-spy")


def profile_summary(raw: str) -> dict[str, float]:
    total = 0
    hits: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = {f.split(" (")[0] for f in stack.split(";")}
        for label, any_of, also in CATEGORIES:
            if any(f in frames for f in any_of) and all(f in frames for f in also):
                hits[label] += count
    return {label: 100 * hits[label] / total if total else 0.0 for label, _, _ in CATEGORIES}


def _profile(env: BenchEnv, fleet: RuntimeFleet, seconds: float) -> dict[str, Any]:
    exe = py_spy()
    if not exe:
        return {"skipped": "py-spy not found (pip install py-spy, or set PY_SPY)"}
    out = RESULTS / "profile-worker.raw"
    pid = fleet.pids()[fleet.worker_names[0]]
    result: dict[str, Any] = {}

    def run() -> None:
        result["run"] = rb.throughput(env, fleet, 50, 30)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(2)
    subprocess.run(
        [
            exe,
            "record",
            "-p",
            str(pid),
            "-d",
            str(int(seconds)),
            "-r",
            "100",
            "-f",
            "raw",
            "--nonblocking",
            "-o",
            str(out),
        ],
        check=False,
        capture_output=True,
    )
    t.join()
    if not out.exists():
        return {"skipped": "py-spy could not sample the worker (ptrace permission?)"}
    return {"shares_pct": profile_summary(out.read_text()), "raw": str(out)}


def section_diagnose(env: BenchEnv, plan: Any) -> dict[str, Any]:
    env.reset_redis()
    repeats = max(2, plan.repeats if not plan.quick else 1)
    runs, tools = plan.runs, plan.tools
    rates: dict[str, list[float]] = {
        k: [] for k in ("default", "worker_events", "log_warning", "hop", "hop_events")
    }
    cpu: dict[str, list[float]] = {k: [] for k in rates}
    c = plan.concurrency
    with (
        RuntimeFleet(env, workers=2, concurrency=c, name="diag-default") as rt,
        RuntimeFleet(
            env,
            workers=2,
            concurrency=c,
            name="diag-quiet",
            beat=False,
            first=2,
            queue=QUEUE + "-2",
            extra_env={"DAR_LOG_LEVEL": "WARNING"},
        ) as quiet,
        HopFleet(env, workers=2, concurrency=c, name="diag-hop") as hop,
        HopFleet(
            env,
            workers=2,
            concurrency=c,
            events=True,
            name="diag-hop-events",
            queue=HOP_QUEUE + "-2",
            first=2,
        ) as hop_ev,
    ):
        for i in range(repeats):
            print(f"[bench] diagnose: repeat {i + 1}/{repeats}", flush=True)
            # As shipped: task events off. Then on, as while Flower watches the workers.
            for fleet, key, events in (
                (rt, "default", False),
                (quiet, "log_warning", False),
                (rt, "worker_events", True),
            ):
                if events:
                    fleet.app.control.enable_events(destination=fleet.hostnames)
                else:
                    fleet.app.control.disable_events(destination=fleet.hostnames)
                time.sleep(0.5)
                r = rb.throughput(env, fleet, runs, tools)
                rates[key].append(r["steps_per_s"])
                cpu[key].append(r["cpu_ms_per_step"]["workers"])
            rt.app.control.disable_events(destination=rt.hostnames)
            for hfleet, key in ((hop, "hop"), (hop_ev, "hop_events")):
                h = hop_throughput(env, hfleet, runs, 2 * tools + 1, 1)
                rates[key].append(h["steps_per_s"])
                cpu[key].append(h["cpu_ms_per_step"]["workers"])
        prof = _profile(env, rt, 10)
    base = median(rates["default"])
    return {
        "processes": 2,
        "runs": runs,
        "steps_per_run": 2 * tools + 1,
        "steps_per_s": {k: median(v) for k, v in rates.items()},
        "ratio_to_default": {k: median(v) / base for k, v in rates.items()},
        "worker_cpu_ms_per_step": {k: median(v) for k, v in cpu.items()},
        "repeats": rates,
        "profile": prof,
    }


__all__ = ["profile_summary", "section_diagnose"]
