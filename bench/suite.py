"""The benchmark sections and what each measures; ``python -m bench`` runs them.

Baselines are measured in the same section as the figure they are compared with, on the
same database and broker, interleaved repeat by repeat (baseline, runtime, baseline, ...),
so that a machine whose load drifts during the run (other jobs, a noisy neighbour) shifts
both sides alike. Each figure is the median over the repeats.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from bench import inproc
from bench import runtime_bench as rb
from bench.baselines import broker_floor, hop_latency, hop_throughput, raw_checkpoint
from bench.dbos_bench import DbosFleet, dbos_latency, dbos_throughput, reset_schema
from bench.dbos_bench import available as dbos_available
from bench.env import BenchEnv
from bench.models import spec
from bench.stack import HopFleet, RuntimeFleet
from bench.stats import median
from runtime.config import Settings

DEFAULT_LEASE = Settings().lease_seconds


@dataclass
class Plan:
    quick: bool = False
    repeats: int = 3
    throughput_repeats: int = 5
    """(b) is cheap (seconds a repeat) and DBOS's own rate swings by a third between repeats on
    a shared 2-core host: its medians take more repeats."""
    concurrency: int = 16
    """Threads per worker process (``--pool threads``), runtime and bare hop alike."""
    dbos: bool = True
    # (a) and the latency baselines
    raw_seconds: float = 2.0
    hop_latency_hops: int = 300
    overhead_runs: int = 5
    overhead_tools: int = 20
    dbos_latency_steps: int = 200
    # (b) and the throughput baselines
    processes: tuple[int, ...] = (1, 2, 4)
    runs: int = 50
    tools: int = 10
    """Each run: ``tools`` model turns calling ``noop``, then a final turn: 2*tools+1 steps."""
    # (d)
    long_tools: int = 500
    """A run of 2 * long_tools + 1 steps: step ~1,000 against steps 1-10."""
    long_runs: int = 3
    # (c)
    inflight_levels: tuple[tuple[int, int], ...] = ((50, 10), (100, 10), (500, 5))
    inflight_concurrency: int = 256
    gevent_levels: tuple[tuple[int, int, int], ...] = (
        (200, 5, 1000),
        (500, 5, 1000),
        (2000, 3, 10000),
    )
    """(runs, steps each, model latency ms) on a gevent pool of ``gevent_concurrency``."""
    gevent_concurrency: int = 1200
    inflight_workers: int = 2
    model_latency_ms: int = 1000
    # (c) with the shipped defaults
    defaults_level: tuple[int, int, int] = (2000, 3, 10000)
    """(runs, steps each, model latency ms) on the worker as the Procfile ships it."""
    blocking_level: tuple[int, int, int] = (1000, 3, 5000)
    """Model calls beside the blocking tool: (runs, steps each, model latency ms)."""
    blocking_tools: int = 12
    """Calls of the blocking tool (50 MB hashed 20 times each, ~2 s of C code)."""
    # (f) through the real model clients, against bench.fake_llm over HTTP
    real_levels: tuple[tuple[int, int, int], ...] = ((2000, 3, 10000),)
    """(runs, calls each, model latency ms) through the Anthropic client, streamed; the first
    also unstreamed and on DBOS. ``python -m bench --real-level 10000x1x60000`` adds sizes."""
    real_framework_level: tuple[int, int, int] | None = (200, 1, 10000)
    """The Pydantic AI and OpenAI Agents SDK agents' workload (``None``: skipped)."""
    # (e)
    recovery_runs: int = 16
    recovery_configs: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
        (f"default (DAR_LEASE_SECONDS={DEFAULT_LEASE:g})", ()),
        ("DAR_LEASE_SECONDS=5", (("DAR_LEASE_SECONDS", "5"),)),
    )
    sections: tuple[str, ...] = (
        "latency",
        "throughput",
        "replay",
        "inflight",
        "defaults",
        "recovery",
        "realclient",
    )

    @property
    def steps_per_run(self) -> int:
        return 2 * self.tools + 1

    @classmethod
    def make(cls, *, quick: bool, repeats: int | None, dbos: bool) -> Plan:
        if not quick:
            p = cls(dbos=dbos)
        else:
            p = cls(
                quick=True,
                repeats=1,
                throughput_repeats=3,
                dbos=dbos,
                raw_seconds=1.0,
                tools=5,
                hop_latency_hops=150,
                overhead_runs=2,
                dbos_latency_steps=100,
                long_runs=1,
                inflight_levels=((500, 4),),
                gevent_levels=((250, 4, 1000), (2000, 3, 10000)),
                real_levels=((300, 3, 3000),),
                real_framework_level=(50, 1, 3000),
                recovery_configs=((f"default (DAR_LEASE_SECONDS={DEFAULT_LEASE:g})", ()),),
            )
        if repeats:
            p.repeats = p.throughput_repeats = repeats
        return p


@dataclass
class Results:
    plan: dict[str, Any]
    sections: dict[str, Any] = field(default_factory=dict)
    timings_s: dict[str, float] = field(default_factory=dict)


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return median(xs) if xs else math.nan


# -- (a) + latency baselines --------------------------------------------------------------


def section_latency(env: BenchEnv, plan: Plan) -> dict[str, Any]:
    """(a) the runtime's per-step overhead, one run at a time on one worker process, against
    one bare-hop chain alone, the raw checkpoint transaction, and one DBOS workflow alone."""
    env.reset_redis()
    use_dbos = plan.dbos and dbos_available()
    if use_dbos:
        reset_schema(env)
    rep: dict[str, list[Any]] = {"raw_1": [], "raw_8": [], "hop": [], "runtime": [], "dbos": []}
    with (
        HopFleet(env, workers=1, concurrency=plan.concurrency, name="latency-hop") as hop,
        RuntimeFleet(env, workers=1, concurrency=plan.concurrency, name="latency-runtime") as rt,
        _maybe_dbos(env, 1 if use_dbos else 0) as dbos,
    ):
        hop_latency(env, hop, 20)  # warm-up
        rb.overhead(env, rt, 1, 3)
        for i in range(plan.repeats):
            _log(f"latency: repeat {i + 1}/{plan.repeats}")
            rep["raw_1"].append(raw_checkpoint(env, 1, plan.raw_seconds))
            rep["raw_8"].append(raw_checkpoint(env, 8, plan.raw_seconds))
            rep["hop"].append(hop_latency(env, hop, plan.hop_latency_hops))
            rep["runtime"].append(rb.overhead(env, rt, plan.overhead_runs, plan.overhead_tools))
            if dbos is not None:
                rep["dbos"].append(dbos_latency(dbos, plan.dbos_latency_steps))
    _log("latency: in-process breakdown")
    breakdown = inproc.breakdown(env, plan.overhead_runs, plan.overhead_tools)
    rt_p50 = [r["ms_per_step"]["p50"] for r in rep["runtime"]]
    hop_p50 = [r["ms_per_hop"]["p50"] for r in rep["hop"]]
    out: dict[str, Any] = {
        "runtime_p50_ms": _med(rt_p50),
        "runtime_p99_ms": _med([r["ms_per_step"]["p99"] for r in rep["runtime"]]),
        "runtime_by_kind_p50_ms": {
            k: _med([r["by_kind"][k]["p50"] for r in rep["runtime"]]) for k in ("MODEL", "TOOL")
        },
        "hop_p50_ms": _med(hop_p50),
        "hop_p99_ms": _med([r["ms_per_hop"]["p99"] for r in rep["hop"]]),
        "ratio_to_hop_p50": _med([a / b for a, b in zip(rt_p50, hop_p50, strict=True)]),
        "raw_checkpoint_p50_ms": _med([r["latency_ms"]["p50"] for r in rep["raw_1"]]),
        "raw_checkpoint_tx_per_s_1": _med([r["tx_per_s"] for r in rep["raw_1"]]),
        "raw_checkpoint_tx_per_s_8": _med([r["tx_per_s"] for r in rep["raw_8"]]),
        "inproc": breakdown,
        "db_calls_per_step": breakdown["db_calls_per_step"],
        "hop_db_calls_per_step": rep["raw_1"][-1]["db_calls_per_tx"],
        "repeats": rep,
    }
    if use_dbos:
        dbos_p50 = [r["ms_per_step"]["p50"] for r in rep["dbos"]]
        out["dbos_p50_ms"] = _med(dbos_p50)
        out["dbos_p99_ms"] = _med([r["ms_per_step"]["p99"] for r in rep["dbos"]])
        out["ratio_to_dbos_p50"] = _med([a / b for a, b in zip(rt_p50, dbos_p50, strict=True)])
    return out


# -- (b) + throughput baselines -----------------------------------------------------------


def section_throughput(env: BenchEnv, plan: Plan) -> dict[str, Any]:
    """(b) steps/s of ``plan.runs`` runs at once with the zero-latency model, on 1, 2 and 4
    worker processes, against the bare hop (same chains, same process count) and DBOS."""
    use_dbos = plan.dbos and dbos_available()
    if use_dbos:
        reset_schema(env)
    steps = plan.steps_per_run
    reps = plan.throughput_repeats
    out: dict[str, Any] = {"runs": plan.runs, "steps_per_run": steps, "by_processes": {}}
    for n in plan.processes:
        env.reset_redis()
        rep: dict[str, list[Any]] = {
            "runtime": [],
            "hop": [],
            "floor": [],
            "dbos": [],
            "cpu": [],
            "hop_cpu": [],
            "span": [],
            "hop_span": [],
            "dbos_span": [],
        }
        # One fleet at a time: 4 runtime processes (20 connections each) beside 4 bare-hop
        # processes exceed PostgreSQL's default max_connections of 100, and a step that
        # cannot connect measures the server's limit, not the runtime.
        with HopFleet(env, workers=n, concurrency=plan.concurrency, name=f"tput-hop-{n}") as hop:
            for i in range(reps):
                _log(f"throughput: {n} process(es), bare hop, repeat {i + 1}/{reps}")
                h = hop_throughput(env, hop, plan.runs, steps, 1)
                rep["hop"].append(h["steps_per_s"])
                rep["hop_cpu"].append(h["cpu_ms_per_step"])
                rep["hop_span"].append(h["span_steps_per_s"])
                rep["floor"].append(broker_floor(env, hop, plan.runs, steps)["steps_per_s"])
        with (
            RuntimeFleet(
                env, workers=n, concurrency=plan.concurrency, name=f"tput-runtime-{n}"
            ) as rt,
            _maybe_dbos(env, n if use_dbos and n <= 2 else 0) as dbos,
        ):
            for i in range(reps):
                _log(f"throughput: {n} process(es), runtime, repeat {i + 1}/{reps}")
                r = rb.throughput(env, rt, plan.runs, plan.tools)
                rep["runtime"].append(r["steps_per_s"])
                rep["cpu"].append(r["cpu_ms_per_step"])
                rep["span"].append(r["span_steps_per_s"])
                if dbos is not None:
                    d = dbos_throughput(dbos, plan.runs, steps)
                    rep["dbos"].append(d["steps_per_s"])
                    rep["dbos_span"].append(d["span_steps_per_s"])
        row: dict[str, Any] = {
            "runtime_steps_per_s": _med(rep["runtime"]),
            "hop_steps_per_s": _med(rep["hop"]),
            "broker_floor_steps_per_s": _med(rep["floor"]),
            "span_steps_per_s": _med(rep["span"]),
            "hop_span_steps_per_s": _med(rep["hop_span"]),
            "ratio_to_hop": _med([a / b for a, b in zip(rep["runtime"], rep["hop"], strict=True)]),
            "runtime_cpu_ms_per_step": _median_dict(rep["cpu"]),
            "hop_cpu_ms_per_step": _median_dict(rep["hop_cpu"]),
            "repeats": rep,
        }
        if rep["dbos"]:
            row["dbos_steps_per_s"] = _med(rep["dbos"])
            row["dbos_span_steps_per_s"] = _med(rep["dbos_span"])
            row["ratio_to_dbos"] = _med(
                [a / b for a, b in zip(rep["runtime"], rep["dbos"], strict=True)]
            )
        out["by_processes"][n] = row
    return out


@contextlib.contextmanager
def _maybe_dbos(env: BenchEnv, processes: int) -> Iterator[DbosFleet | None]:
    if not processes:
        yield None
        return
    with DbosFleet(env, processes) as fleet:
        yield fleet


def _median_dict(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = ds[0].keys() if ds else []
    return {k: _med([d[k] for d in ds]) for k in keys}


# -- (d) -----------------------------------------------------------------------------------


def section_replay(env: BenchEnv, plan: Plan) -> dict[str, Any]:
    """(d) the cost of step ~200 of a run against steps 1-10 of another run measured at the
    same moments, end to end through one worker process, and in-process phase by phase."""
    env.reset_redis()
    last = 2 * plan.long_tools + 1
    with RuntimeFleet(env, workers=1, concurrency=plan.concurrency, name="replay") as rt:
        _log(f"replay: {plan.long_runs} run(s) of {last} steps, each followed by a fresh run")
        e2e = rb.long_run(env, rt, plan.long_tools, plan.long_runs)
    _log("replay: in-process, old and young runs alternately")
    records = inproc.old_and_young(env, plan.long_tools, plan.long_runs)
    phases: dict[str, Any] = {}
    for label, role, lo, hi in (("first", "young", 2, 11), ("last", "old", last - 9, last)):
        rs = [
            r
            for r in records
            if r["role"] == role and lo <= r["seq"] <= hi and r["kind"] != "FINISH"
        ]
        names = sorted({p for r in rs for p in r["phases"]})
        phases[label] = {"total": median([r["total_ms"] for r in rs])} | {
            p: median([r["phases"].get(p, 0.0) for r in rs]) for p in names
        }
    old_run = next(r["run"] for r in reversed(records) if r["role"] == "old")
    return {
        **e2e,
        "read_variants_ms": inproc.read_variants(env, old_run),
        "inproc_first_ms": phases["first"]["total"],
        "inproc_last_ms": phases["last"]["total"],
        "inproc_ratio": phases["last"]["total"] / phases["first"]["total"],
        "inproc_phases_p50": phases,
    }


# -- (c) -----------------------------------------------------------------------------------


def section_inflight(env: BenchEnv, plan: Plan) -> dict[str, Any]:
    """(c) many runs in flight on one host (2 worker processes): a thread pool with a 1 s
    model, then a gevent pool with 1 s and 10 s models."""
    env.reset_redis()
    levels = []
    with RuntimeFleet(
        env,
        workers=plan.inflight_workers,
        concurrency=plan.inflight_concurrency,
        name="inflight",
    ) as rt:
        for runs, steps in plan.inflight_levels:
            _log(f"in flight: {runs} runs x {steps} steps of {plan.model_latency_ms} ms")
            levels.append(rb.in_flight(env, rt, runs, steps, plan.model_latency_ms))
    for lv in levels:
        lv["pool"] = "threads"
    env.reset_redis()
    with RuntimeFleet(
        env,
        workers=plan.inflight_workers,
        concurrency=plan.gevent_concurrency,
        name="inflight-gevent",
        pool="gevent",
    ) as rt:
        for runs, steps, latency in plan.gevent_levels:
            _log(f"in flight (gevent): {runs} runs x {steps} steps of {latency} ms")
            lv = rb.in_flight(env, rt, runs, steps, latency)
            lv["pool"] = "gevent"
            levels.append(lv)
    ok = [lv["runs"] for lv in levels if lv["ratio_to_ideal"] >= 0.9]
    conns = [c["max"] for lv in levels for c in lv["connections"]["per_process"].values()]
    return {
        "workers": plan.inflight_workers,
        "concurrency": plan.inflight_concurrency,
        "gevent_concurrency": plan.gevent_concurrency,
        "levels": levels,
        "largest_level_at_90pct": max(ok) if ok else None,
        "max_connections_per_process": max(conns) if conns else None,
    }


def section_defaults(env: BenchEnv, plan: Plan) -> dict[str, Any]:
    """(c) with the shipped defaults: the worker exactly as the Procfile runs it (pool and
    concurrency from runtime.config, no tuning environment), 2 processes; and a tool blocking
    in C code (hashing 50 MB, again and again) beside 1,000 model calls, against the same
    1,000 calls alone and against the same hashing done on the step's own greenlet (what a
    tool did before tool bodies ran on native threads)."""
    from runtime.config import WORKER_CONCURRENCY, WORKER_POOL

    env.reset_redis()
    runs, steps, latency = plan.defaults_level
    levels = []
    with RuntimeFleet(
        env,
        workers=plan.inflight_workers,
        concurrency=WORKER_CONCURRENCY,
        pool=WORKER_POOL,
        name="defaults",
    ) as rt:
        _log(f"shipped defaults: {runs} runs x {steps} steps of {latency} ms")
        lv = rb.in_flight(env, rt, runs, steps, latency)
        lv["pool"] = WORKER_POOL
        levels.append(lv)
        blocking = []
        calls, bsteps, blatency = plan.blocking_level
        for label, beside in (
            ("alone", ()),
            ("beside a blocking tool", (spec("digest", tools=plan.blocking_tools, rounds=20),)),
            (
                "beside the same on the greenlet",
                (spec("hub", tools=plan.blocking_tools, rounds=20),),
            ),
        ):
            _log(f"blocking tool: {calls} runs x {bsteps} steps of {blatency} ms, {label}")
            b = rb.in_flight(env, rt, calls, bsteps, blatency, beside=beside)
            b["label"] = label
            blocking.append(b)
    return {
        "workers": plan.inflight_workers,
        "pool": WORKER_POOL,
        "concurrency": WORKER_CONCURRENCY,
        "levels": levels,
        "blocking": blocking,
    }


# -- (e) -----------------------------------------------------------------------------------


def section_recovery(env: BenchEnv, plan: Plan) -> dict[str, Any]:
    """(e) SIGKILL of a whole worker process while it holds runs mid model call."""
    out = []
    for label, extra in plan.recovery_configs:
        _log(f"recovery: {label}")
        out.append(
            rb.recovery(
                env,
                runs=plan.recovery_runs,
                concurrency=8,
                extra_env=dict(extra),
                label=label,
            )
        )
    return {"configs": out}


def section_realclient(env: BenchEnv, plan: Plan) -> dict[str, Any]:
    """(f) runs in flight through the real model clients over HTTP, as shipped, beside the
    bare SDK and DBOS (see :mod:`bench.realclient`)."""
    from bench.realclient import Level
    from bench.realclient import section_realclient as real

    fw = plan.real_framework_level
    return real(
        env,
        tuple(Level(*lv) for lv in plan.real_levels),
        Level(*fw) if fw else None,
        dbos=plan.dbos,
    )


SECTIONS = {
    "latency": section_latency,
    "throughput": section_throughput,
    "replay": section_replay,
    "inflight": section_inflight,
    "defaults": section_defaults,
    "recovery": section_recovery,
    "realclient": section_realclient,
}


def _diagnose(env: BenchEnv, plan: Plan) -> dict[str, Any]:
    from bench.diagnose import section_diagnose

    return section_diagnose(env, plan)


EXTRA = {"diagnose": _diagnose}
"""Sections that ``all`` leaves out."""


def run(env: BenchEnv, plan: Plan, sections: list[str]) -> Results:
    res = Results(plan=asdict(plan))
    for name in sections:
        t0 = time.monotonic()
        res.sections[name] = {**SECTIONS, **EXTRA}[name](env, plan)
        res.timings_s[name] = time.monotonic() - t0
        _log(f"{name}: done in {res.timings_s[name]:.0f}s")
    env.truncate()
    return res


__all__ = ["EXTRA", "SECTIONS", "Plan", "Results", "run"]
