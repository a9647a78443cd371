"""The runtime's own figures, through real worker processes (Celery, Redis, PostgreSQL):

(a) step overhead at low load, (b) steps/s with a zero-latency model, (c) runs in flight with
a 1 s model and the connections each worker process holds, (d) the cost of step 200 against
the first steps, (e) recovery after SIGKILL of a whole worker.

Step times come from the database: ``run_step.finished_at`` is ``now()`` of the transaction
that checkpointed the step (the same point of every step), so the gap between two
consecutive steps of a run is everything one step costs: the Celery hop, the claim, reading
the steps, replay, the model or tool call, the checkpoint. The model's own time is in
``run_step.latency_ms`` and is subtracted; with the zero-latency bench model and the ``noop``
tool it is zero to the millisecond.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import threading
import time
import uuid
from collections import defaultdict
from typing import Any

import psutil
from sqlalchemy import text

from bench.cpu import CpuMeter, per_step_ms
from bench.env import BenchEnv
from bench.models import spec
from bench.stack import RuntimeFleet, pg_client_ports, pg_sockets
from bench.stats import median, pct, span_rate, summary, window_rate
from tasks.dispatch import send_drive


def submit(
    env: BenchEnv, fleet: RuntimeFleet, specs: list[str], *, spread_s: float = 0.0
) -> list[uuid.UUID]:
    """Submit each run as the API does (store it, send its message): all at once, or evenly
    over ``spread_s`` seconds (runs that started at different times, as in steady
    operation)."""
    t0 = time.monotonic()
    ids: list[uuid.UUID] = []
    for i, s in enumerate(specs):
        if spread_s:
            time.sleep(max(0.0, t0 + spread_s * i / len(specs) - time.monotonic()))
        [d] = env.create_runs([s])
        send_drive(fleet.app, env.store, d)
        ids.append(d.run_id)
    return ids


def step_gaps(rows: list[dict[str, Any]], *, subtract_model: bool = True) -> list[dict[str, Any]]:
    """Per step after the first of each run: commit-to-commit gap minus the model's time."""
    by_run: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_run[r["run_id"]].append(r)
    out = []
    for steps in by_run.values():
        steps.sort(key=lambda r: r["seq"])
        for prev, cur in itertools.pairwise(steps):
            gap = (cur["finished"] - prev["finished"]) * 1000
            if subtract_model and cur["kind"] == "MODEL":
                gap -= cur["latency_ms"] or 0
            out.append({"seq": cur["seq"], "kind": cur["kind"], "ms": gap})
    return out


# -- (a) ----------------------------------------------------------------------------------


def overhead(env: BenchEnv, fleet: RuntimeFleet, runs: int, tools: int) -> dict[str, Any]:
    """One run at a time on one worker process: the per-step overhead."""
    env.truncate()
    ids: list[uuid.UUID] = []
    for _ in range(runs):
        [rid] = submit(env, fleet, [spec("tools", tools=tools)])
        env.wait_terminal([rid], timeout=120, poll=0.02)
        ids.append(rid)
    gaps = step_gaps(env.step_rows(ids))
    ms = [g["ms"] for g in gaps]
    return {
        "runs": runs,
        "steps": len(ms),
        "ms_per_step": summary(ms),
        "by_kind": {
            k: summary([g["ms"] for g in gaps if g["kind"] == k]) for k in ("MODEL", "TOOL")
        },
    }


# -- (b) ----------------------------------------------------------------------------------


def throughput(env: BenchEnv, fleet: RuntimeFleet, runs: int, tools: int) -> dict[str, Any]:
    """``runs`` runs at once, each ``2 * tools + 1`` steps: steps/s in the steady window."""
    env.truncate()
    meter = CpuMeter(fleet.pids().values()).start()
    t0 = time.time()
    ids = submit(env, fleet, [spec("tools", tools=tools)] * runs)
    counts = env.wait_terminal(ids, timeout=600)
    rows = env.step_rows(ids)
    cpu = per_step_ms(meter.stop(), len(rows))
    return {
        "steps_per_s": window_rate([r["finished"] for r in rows]),
        "span_steps_per_s": span_rate(t0, [r["finished"] for r in rows]),
        "steps": len(rows),
        "statuses": counts,
        "cpu_ms_per_step": cpu,
    }


# -- (c) ----------------------------------------------------------------------------------


def _sample_connections(
    env: BenchEnv, fleet: RuntimeFleet, stop: threading.Event, out: dict[str, Any]
) -> None:
    per_proc: dict[str, list[int]] = defaultdict(list)
    rss: dict[str, list[int]] = defaultdict(list)
    in_flight: list[tuple[float, int]] = []
    activity: list[dict[str, int]] = []
    while not stop.is_set():
        pids = fleet.pids()
        for name, pid in pids.items():
            per_proc[name].append(pg_sockets(pid))
            with contextlib.suppress(psutil.Error):
                rss[name].append(psutil.Process(pid).memory_info().rss)
        with env.engine.connect() as conn:
            n = conn.execute(
                text("SELECT count(*) FROM run WHERE status = 'RUNNING' AND locked_until > now()")
            ).scalar_one()
            acts = conn.execute(
                text(
                    "SELECT application_name, client_port FROM pg_stat_activity"
                    " WHERE datname = current_database()"
                )
            ).all()
        in_flight.append((time.time(), int(n)))
        ports = {name: pg_client_ports(pid) for name, pid in pids.items()}
        snap: dict[str, int] = defaultdict(int)
        for app_name, port in acts:
            owner = next((nm for nm, ps in ports.items() if port in ps), None)
            snap[f"{app_name}@{owner or 'other'}"] += 1
        activity.append(dict(snap))
        stop.wait(0.5)
    out["per_process"] = {k: {"max": max(v), "median": median(v)} for k, v in per_proc.items()}
    out["rss_mib_max"] = {k: max(v) / 2**20 for k, v in rss.items() if v}
    out["in_flight_samples"] = in_flight
    peak = max(activity, key=lambda s: sum(s.values())) if activity else {}
    out["pg_stat_activity_at_peak"] = peak


def in_flight(
    env: BenchEnv,
    fleet: RuntimeFleet,
    runs: int,
    steps: int,
    latency_ms: int,
    *,
    spread: bool = True,
    beside: tuple[str, ...] = (),
) -> dict[str, Any]:
    """``runs`` runs at once, each ``steps`` model steps of ``latency_ms``: the steps/s
    sustained against the ideal runs / latency, and the database connections held.

    ``beside``: the specs of runs submitted first and running alongside (a tool blocking in
    C code): they are waited for but not counted; ``model_stretch_ms`` says how much later
    than ``latency_ms`` the counted runs' model calls returned.

    The runs' first messages go out evenly over one model latency (``spread``): runs in
    steady operation started at different times. Sent all at once, their model calls return
    in waves far above the steady rate (2,000 in the 5 s a submit takes: ~400 steps/s for
    an ideal of 200) and the figure measures the waves' queueing, not the rate.

    Two figures against the ideal: ``ratio_to_ideal``, Little's law (runs in flight over
    the mean time a step takes, model latency plus overhead: the steady rate this host
    sustains), and ``window_ratio_to_ideal``, commits per second between the 5th and 95th
    percentile of their times (biased upwards when a run has few steps)."""
    env.truncate()
    stop = threading.Event()
    conns: dict[str, Any] = {}
    sampler = threading.Thread(target=_sample_connections, args=(env, fleet, stop, conns))
    meter = CpuMeter(fleet.pids().values()).start()
    t_submit = time.time()
    others = submit(env, fleet, list(beside)) if beside else []
    ids = submit(
        env,
        fleet,
        [spec("pause", steps=steps, latency_ms=latency_ms)] * runs,
        spread_s=latency_ms / 1000 if spread else 0.0,
    )
    submit_s = time.time() - t_submit
    sampler.start()
    try:
        timeout = steps * latency_ms / 1000 * 10 + 120
        counts = env.wait_terminal(ids, timeout=timeout, poll=0.5)
        beside_counts: dict[str, int] = {}
        if others:
            try:
                beside_counts = env.wait_terminal(others, timeout=60, poll=0.5)
            except TimeoutError as e:  # a run blocking its own worker may lose its lease
                beside_counts = {"unfinished": len(others), "error": str(e)}  # type: ignore[dict-item]
    finally:
        stop.set()
        sampler.join()
    rows = env.step_rows(ids)
    cpu = per_step_ms(meter.stop(), len(rows))
    commits = sorted(r["finished"] for r in rows)
    lo, hi = pct(commits, 5), pct(commits, 95)
    held = [n for t, n in conns.pop("in_flight_samples") if lo <= t <= hi]
    gaps = [g["ms"] for g in step_gaps(rows)]
    ideal = runs / (latency_ms / 1000)
    window = window_rate(commits)
    step_s = latency_ms / 1000 + (sum(gaps) / len(gaps) / 1000 if gaps else math.nan)
    rate = runs / step_s
    stretch = [r["latency_ms"] - latency_ms for r in rows if r["kind"] == "MODEL"]
    return {
        "beside": list(beside),
        "beside_statuses": beside_counts,
        "model_stretch_ms": summary(stretch),
        "runs": runs,
        "steps_per_run": steps,
        "model_latency_ms": latency_ms,
        "submit_s": submit_s,
        "statuses": counts,
        "steps_per_s": rate,
        "ideal_steps_per_s": ideal,
        "ratio_to_ideal": rate / ideal,
        "window_steps_per_s": window,
        "window_ratio_to_ideal": window / ideal,
        "submit_spread_s": latency_ms / 1000 if spread else 0.0,
        "leases_held_median": median(held) if held else float("nan"),
        "overhead_ms_per_step": summary(gaps),
        "connections": conns,
        "cpu_ms_per_step": cpu,
    }


# -- (d) ----------------------------------------------------------------------------------


def long_run(
    env: BenchEnv, fleet: RuntimeFleet, tools: int, repeats: int, young_tools: int = 5
) -> dict[str, Any]:
    """Step ~200 against steps 1-10, measured close together: a run of ``2 * tools + 1``
    steps runs alone to its end, then at once a fresh run of ``2 * young_tools + 1`` steps
    runs alone; the old run's last ten steps and the young run's first ten are a fraction of
    a second apart, so load on the machine changes little between them. (Running both at
    once would not do: on one busy worker each run's step gap includes the other's step.)
    Median over ``repeats`` pairs."""
    last = 2 * tools + 1
    ratios, firsts, lasts = [], [], []
    curve: dict[int, list[float]] = defaultdict(list)
    for _ in range(repeats):
        env.truncate()
        [old] = submit(env, fleet, [spec("tools", tools=tools)])
        env.wait_terminal([old], timeout=300, poll=0.02)
        [young] = submit(env, fleet, [spec("tools", tools=young_tools)])
        env.wait_terminal([young], timeout=60, poll=0.02)
        gaps = step_gaps(env.step_rows([old]))
        young_gaps = step_gaps(env.step_rows([young]))
        late = [g["ms"] for g in gaps if last - 9 <= g["seq"] <= last]
        early = [g["ms"] for g in young_gaps if 2 <= g["seq"] <= 11]
        firsts.append(median(early))
        lasts.append(median(late))
        ratios.append(median(late) / median(early))
        width = max(1, last // 10)
        for g in gaps:
            curve[(g["seq"] - 1) // width * width + 1].append(g["ms"])
    return {
        "steps_per_run": last,
        "repeats": repeats,
        "first_steps_ms_p50": median(firsts),
        "last_steps_ms_p50": median(lasts),
        "ratio": median(ratios),
        "ratios": ratios,
        "p50_ms_by_seq": {k: median(v) for k, v in sorted(curve.items())},
    }


def _group(rows: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    out: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[r["run_id"]].append(r)
    return out


# -- (e) ----------------------------------------------------------------------------------


def recovery(
    env: BenchEnv,
    *,
    runs: int,
    concurrency: int,
    extra_env: dict[str, str],
    label: str,
    kill_after: float = 4.0,
    latency_ms: int = 1000,
    timeout: float = 90.0,
) -> dict[str, Any]:
    """Two workers and beat; ``runs`` runs of 1 s model steps; SIGKILL worker-A mid-flight.

    For each run worker-A held at that instant: recovery = the start of its first step
    under a newer lease (the model call's start: ``run_step.started_at``) minus the kill.
    For every run: the stall = its first commit after the kill minus the kill.
    """
    env.truncate()
    env.reset_redis()
    steps = int((timeout + kill_after) * 1000 / latency_ms) + 20
    with RuntimeFleet(
        env,
        workers=2,
        concurrency=concurrency,
        name="recovery-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", label).strip("_"),
        extra_env=extra_env,
    ) as fleet:
        ids = submit(env, fleet, [spec("pause", steps=steps, latency_ms=latency_ms)] * runs)
        time.sleep(kill_after)
        with env.engine.connect() as conn:
            held = conn.execute(
                text(
                    "SELECT id, lease_epoch FROM run WHERE id = ANY(:ids) AND"
                    " locked_by = 'worker-A' AND locked_until > now()"
                ),
                {"ids": ids},
            ).all()
            kill_at = float(
                conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one()
            )
        fleet.kill("worker-A")
        epochs = {r[0]: r[1] for r in held}
        deadline = time.monotonic() + timeout
        recovered: dict[Any, float] = {}
        stalls: dict[Any, float] = {}
        while time.monotonic() < deadline:
            rows = env.step_rows(ids)
            recovered.clear()
            stalls.clear()
            for r in rows:
                rid = r["run_id"]
                if rid in epochs and r["lease_epoch"] > epochs[rid] and rid not in recovered:
                    recovered[rid] = r["started"] - kill_at
                if r["finished"] > kill_at and rid not in stalls:
                    stalls[rid] = r["finished"] - kill_at
            if len(recovered) == len(epochs) and len(stalls) == len(ids):
                break
            time.sleep(0.5)
        for rid in ids:  # stop the runs before the workers are stopped
            env.store.cancel(rid)
    rec = list(recovered.values())
    return {
        "label": label,
        "settings": extra_env,
        "runs": runs,
        "held_by_victim": len(epochs),
        "recovered": len(rec),
        "recovery_s": summary(rec) if rec else None,
        "recovery_max_s": max(rec) if rec else float("nan"),
        "not_recovered": len(epochs) - len(rec),
        "stall_max_s": max(stalls.values()) if stalls else float("nan"),
        "runs_stalled": len(ids) - len(stalls),
    }
