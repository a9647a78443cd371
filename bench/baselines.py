"""(f) Baselines, on the same database and broker as the runtime's figures.

- raw checkpoint transactions per second: the store's checkpoint (UPDATE run + INSERT
  run_step, one transaction) in a loop, from 1 and from 8 threads of one process;
- the bare Celery hop: a task that checkpoints and re-enqueues itself, one chain alone
  (ms per hop) and 50 chains at once on 1, 2 and 4 worker processes (hops per second).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from typing import Any

from sqlalchemy import event

from bench.cpu import CpuMeter, per_step_ms
from bench.env import BenchEnv
from bench.hop import HOP_TASK, HOP_TIMES, checkpoint
from bench.models import spec
from bench.stack import HopFleet
from bench.stats import median, span_rate, summary, window_rate
from db.engine import make_engine


def raw_checkpoint(env: BenchEnv, threads: int, seconds: float) -> dict[str, Any]:
    """Checkpoint transactions per second from ``threads`` threads, each on its own run."""
    env.truncate()
    runs = env.create_runs([spec()] * threads)
    engine = make_engine(env.database_url, pool_size=threads, max_overflow=0)
    calls: Counter[str] = Counter()
    event.listen(engine, "checkout", lambda *a: calls.update(["checkouts"]))
    event.listen(engine, "before_cursor_execute", lambda *a, **k: calls.update(["statements"]))
    event.listen(engine, "commit", lambda *a: calls.update(["commits"]))
    lat: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def loop(i: int) -> None:
        run_id, token = runs[i].run_id, runs[i].token
        seq = 0
        with engine.connect():
            pass  # open the connection before the clock starts
        start.wait()
        while time.perf_counter() < stop_at[0]:
            seq += 1
            nxt = uuid.uuid4()
            t0 = time.perf_counter()
            with engine.begin() as conn:
                ok = checkpoint(conn, run_id, token, nxt, seq, "raw")
            lat[i].append(time.perf_counter() - t0)
            assert ok
            token = nxt

    ts = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    stop_at[0] = time.perf_counter() + seconds + 60  # provisional, reset at the barrier
    start.wait()
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    engine.dispose()
    all_lat = [x * 1000 for xs in lat for x in xs]
    n = max(1, len(all_lat))
    per_tx = {k: v / n for k, v in calls.items()}
    per_tx["round_trips"] = (
        per_tx.get("checkouts", 0) + per_tx.get("statements", 0) + 2 * per_tx.get("commits", 0)
    )
    return {
        "db_calls_per_tx": per_tx,
        "threads": threads,
        "tx": len(all_lat),
        "tx_per_s": len(all_lat) / elapsed,
        "latency_ms": summary(all_lat),
    }


def _start_chains(fleet: HopFleet, env: BenchEnv, chains: int, hops: int) -> list[Any]:
    """Each chain stored, then its first message sent, one after the other (as the runtime's
    runs are submitted)."""
    runs = []
    for _ in range(chains):
        [d] = env.create_runs([spec()])
        fleet.app.send_task(HOP_TASK, args=[str(d.run_id), str(d.token), 1, hops])
        runs.append(d)
    return runs


def _wait_hops(env: BenchEnv, runs: list[Any], hops: int, timeout: float) -> list[dict[str, Any]]:
    ids = [d.run_id for d in runs]
    deadline = time.monotonic() + timeout
    from sqlalchemy import text

    while True:
        with env.engine.connect() as conn:
            n = conn.execute(
                text("SELECT count(*) FROM run_step WHERE run_id = ANY(:ids)"), {"ids": ids}
            ).scalar_one()
        if n >= len(ids) * hops:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"bare hop: {n} of {len(ids) * hops} hops after {timeout}s")
        time.sleep(0.2)
    return env.step_rows(ids)


def broker_floor(env: BenchEnv, fleet: HopFleet, chains: int, hops: int) -> dict[str, Any]:
    """The bare hop with no database at all: what Celery and Redis alone allow. A runtime
    that hands every step on through the broker cannot step faster than this."""
    import redis

    r = redis.Redis.from_url(env.redis_url)
    r.delete(HOP_TIMES)
    meter = CpuMeter(fleet.pids().values()).start()
    for _ in range(chains):
        fleet.app.send_task(HOP_TASK, args=[str(uuid.uuid4()), "-", 1, hops, False])
    deadline = time.monotonic() + 300
    while r.llen(HOP_TIMES) < chains * hops:
        if time.monotonic() > deadline:
            raise TimeoutError(f"broker floor: {r.llen(HOP_TIMES)} of {chains * hops} hops")
        time.sleep(0.2)
    stamps = [float(x) for x in r.lrange(HOP_TIMES, 0, -1)]
    r.delete(HOP_TIMES)
    return {
        "steps_per_s": window_rate(stamps),
        "cpu_ms_per_step": per_step_ms(meter.stop(), len(stamps)),
    }


def hop_latency(env: BenchEnv, fleet: HopFleet, hops: int) -> dict[str, Any]:
    """One chain alone: milliseconds per hop (commit to commit)."""
    env.truncate()
    runs = _start_chains(fleet, env, 1, hops)
    rows = _wait_hops(env, runs, hops, timeout=120)
    commits = [r["finished"] for r in rows]
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(commits)][1:]
    return {"hops": hops, "ms_per_hop": summary(gaps)}


def hop_throughput(
    env: BenchEnv, fleet: HopFleet, chains: int, hops: int, repeats: int
) -> dict[str, Any]:
    """``chains`` chains at once: hops per second in the steady window, median of repeats."""
    rates: list[float] = []
    spans: list[float] = []
    cpus: list[dict[str, float]] = []
    for _ in range(repeats):
        env.truncate()
        meter = CpuMeter(fleet.pids().values()).start()
        t0 = time.time()
        runs = _start_chains(fleet, env, chains, hops)
        rows = _wait_hops(env, runs, hops, timeout=300)
        cpus.append(per_step_ms(meter.stop(), len(rows)))
        rates.append(window_rate([r["finished"] for r in rows]))
        spans.append(span_rate(t0, [r["finished"] for r in rows]))
    return {
        "processes": fleet.n,
        "concurrency": fleet.concurrency,
        "events": fleet.events,
        "chains": chains,
        "hops": hops,
        "steps_per_s": median(rates),
        "span_steps_per_s": median(spans),
        "repeats": rates,
        "cpu_ms_per_step": cpus[len(cpus) // 2],
    }


def run_hops(
    env: BenchEnv,
    *,
    processes: list[int],
    concurrency: int,
    chains: int,
    hops: int,
    latency_hops: int,
    repeats: int,
    events_variant: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {"throughput": {}}
    for n in processes:
        env.reset_redis()
        with HopFleet(env, workers=n, concurrency=concurrency, name=f"hop-{n}") as fleet:
            if n == 1:
                hop_latency(env, fleet, 20)  # warm-up
                out["latency"] = hop_latency(env, fleet, latency_hops)
            out["throughput"][n] = hop_throughput(env, fleet, chains, hops, repeats)
    if events_variant:
        env.reset_redis()
        with HopFleet(
            env, workers=2, concurrency=concurrency, events=True, name="hop-2-events"
        ) as fleet:
            out["throughput_events_2"] = hop_throughput(env, fleet, chains, hops, repeats)
    return out
