"""The driver measured in-process, phase by phase: where a step's time goes, without Celery.

A plain loop calls ``Driver.drive`` and follows the returned dispatch, as the Celery task
would, so the broker hop is the one thing left out. Each store call, the replay, the model
call, the request hash and the tool call are timed by wrapping them in this process only
(a ``RunStore`` subclass and a ``Driver`` subclass; ``ReplayCache.replay`` and
``modelcall.request_hash`` are replaced by timed wrappers while the loop runs). The model is
the zero-latency bench model, so every millisecond here is runtime overhead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sqlalchemy import Engine, event

import runtime.pipeline.effects as effects_mod
import runtime.pipeline.modelcall as modelcall_mod
from bench.env import RESULTS, BenchEnv
from bench.models import BenchModel, spec
from db.engine import PING_AFTER_IDLE_SECONDS
from db.records import Dispatch
from db.store import RunStore
from runtime.engine.bootstrap import load_agents
from runtime.engine.driver import Driver
from runtime.observe.logctx import CONSOLE_FORMAT, ContextFilter
from runtime.pipeline.heartbeat import Heartbeat
from runtime.pipeline.replay import ReplayCache

T = TypeVar("T")

_current: dict[str, float] = defaultdict(float)
_calls: Counter[str] = Counter()
"""Per drive() call: pings of idle pooled connections, statements, and the commits and
rollbacks of explicit transactions, counted by SQLAlchemy events on the engine."""


def _auto(conn: Any) -> bool:
    return bool(conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT")


def _count_ping(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """A checkout pings only a connection idle longer than the engine's threshold."""
    since = record.info.get("dar_checked_in")
    if since is not None and time.monotonic() - since >= PING_AFTER_IDLE_SECONDS:
        _calls.update(["checkouts"])


def _count_db_calls(engine: Engine) -> None:
    if getattr(engine, "_bench_counting", False):
        return
    event.listen(engine, "checkout", _count_ping)
    event.listen(engine, "before_cursor_execute", lambda *a, **k: _calls.update(["statements"]))
    # BEGIN and COMMIT/ROLLBACK are round trips only outside autocommit (a single statement
    # in autocommit is its own transaction: no BEGIN, no COMMIT).
    event.listen(engine, "commit", lambda c: _calls.update([] if _auto(c) else ["commits"]))
    event.listen(engine, "rollback", lambda c: _calls.update([] if _auto(c) else ["rollbacks"]))
    engine._bench_counting = True  # type: ignore[attr-defined]


def _timed(name: str, fn: Callable[..., T]) -> Callable[..., T]:
    def wrapper(*args: Any, **kwargs: Any) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _current[name] += time.perf_counter() - t0

    return wrapper


STORE_PHASES = {
    "claim": "claim",
    "steps": "read_steps",
    "checkpoint_model": "checkpoint_model",
    "start_step": "start_step",
    "record_steps": "record_steps",
    "finish": "finish_run",
    "get_run": "get_run",
}


class TimedStore(RunStore):
    pass


for _method, _phase in STORE_PHASES.items():
    setattr(
        TimedStore,
        _method,
        (lambda m, p: lambda self, *a, **k: _timed(p, getattr(RunStore, m))(self, *a, **k))(
            _method, _phase
        ),
    )


class TimedDriver(Driver):
    pass


class TimedModel(BenchModel):
    def send(self, request: Any) -> Any:
        return _timed("model_call", super().send)(request)


@contextlib.contextmanager
def _patched() -> Iterator[None]:
    saved = ReplayCache.replay, modelcall_mod.request_hash, effects_mod._run
    ReplayCache.replay = _timed("replay", saved[0])  # type: ignore[method-assign]
    modelcall_mod.request_hash = _timed("prompt_hash", saved[1])
    effects_mod._run = _timed("tool_call", saved[2])  # type: ignore[assignment]
    try:
        yield
    finally:
        ReplayCache.replay, modelcall_mod.request_hash, effects_mod._run = saved  # type: ignore[method-assign,assignment]


@contextlib.contextmanager
def _worker_logging() -> Iterator[None]:
    """INFO lines to a file, like a worker's log, so logging costs what it costs there."""
    (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(RESULTS / "logs" / "inproc.log", mode="w")
    handler.addFilter(ContextFilter())
    handler.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    root = logging.getLogger()
    old = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(old)
        handler.close()


def _make_driver(env: BenchEnv) -> TimedDriver:
    settings = env.settings()
    store = TimedStore(env.engine)
    from db.demo import TicketStore

    agents = load_agents(settings, TicketStore(env.engine))
    hb = Heartbeat(store, "bench-inproc", lease_seconds=15, interval_seconds=5)
    _count_db_calls(env.engine)
    return TimedDriver(
        store=store,
        agents=agents,
        llm=TimedModel(),
        settings=settings,
        heartbeat=hb,
        worker="bench-inproc",
    )


def _step(drv: TimedDriver, current: Dispatch, seq: int) -> tuple[dict[str, Any], Any]:
    """One drive() call, timed phase by phase: its record and the next dispatch."""
    _current.clear()
    _calls.clear()
    t0 = time.perf_counter()
    result = drv.drive(current.run_id, current.token)
    total = time.perf_counter() - t0
    phases = {k: v * 1000 for k, v in _current.items()}
    kind = (
        "MODEL" if "checkpoint_model" in phases else "TOOL" if "start_step" in phases else "FINISH"
    )
    phases["other"] = total * 1000 - sum(phases.values())
    record = {
        "run": str(current.run_id),
        "seq": seq,
        "kind": kind,
        "total_ms": total * 1000,
        "phases": phases,
        "db_calls": dict(_calls),
    }
    return record, result.dispatch


def drive_runs(env: BenchEnv, specs: list[str]) -> list[dict[str, Any]]:
    """Drive each run to its end in this thread; one record per drive() call."""
    drv = _make_driver(env)
    records: list[dict[str, Any]] = []
    with _patched(), _worker_logging():
        for raw in specs:
            [current] = env.create_runs([raw])
            seq = 0
            while current is not None:
                seq += 1
                record, current = _step(drv, current, seq)
                records.append(record)
    return records


def drive_old_and_young(env: BenchEnv, tools: int, young_tools: int = 5) -> list[dict[str, Any]]:
    """A run of ``2 * tools + 1`` steps is driven to within ``2 * young_tools + 1`` steps of
    its end; then a fresh run starts and the two are driven alternately, one step each, so
    the old run's last steps and the young run's first ones are measured side by side."""
    drv = _make_driver(env)
    records: list[dict[str, Any]] = []
    with _patched(), _worker_logging():
        [old] = env.create_runs([spec("tools", tools=tools)])
        [young] = env.create_runs([spec("tools", tools=young_tools)])
        cur_old: Any = old
        seq_old = 0
        while seq_old < 2 * (tools - young_tools):
            seq_old += 1
            _, cur_old = _step(drv, cur_old, seq_old)
        cur_young: Any = young
        seq_young = 0
        while cur_old is not None or cur_young is not None:
            if cur_young is not None:
                seq_young += 1
                record, cur_young = _step(drv, cur_young, seq_young)
                records.append({**record, "role": "young"})
            if cur_old is not None:
                seq_old += 1
                record, cur_old = _step(drv, cur_old, seq_old)
                records.append({**record, "role": "old"})
    return records


def phase_table(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median ms of each phase, by step kind."""
    from bench.stats import median

    out: dict[str, dict[str, float]] = {}
    for kind in ("MODEL", "TOOL"):
        rs = [r for r in records if r["kind"] == kind]
        if not rs:
            continue
        names = sorted({p for r in rs for p in r["phases"]})
        out[kind] = {"total": median([r["total_ms"] for r in rs])}
        for p in names:
            out[kind][p] = median([r["phases"].get(p, 0.0) for r in rs])
    return out


def db_calls(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean database calls per step by kind, and the round trips they make: one per
    ping of an idle connection, statement, BEGIN, and COMMIT or ROLLBACK of an explicit
    transaction."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("MODEL", "TOOL"):
        rs = [r["db_calls"] for r in records if r["kind"] == kind]
        if not rs:
            continue
        m = {
            k: sum(r.get(k, 0) for r in rs) / len(rs)
            for k in ("checkouts", "statements", "commits", "rollbacks")
        }
        m["round_trips"] = m["checkouts"] + m["statements"] + 2 * (m["commits"] + m["rollbacks"])
        out[kind] = m
    return out


def breakdown(env: BenchEnv, runs: int, tools: int) -> dict[str, Any]:
    env.truncate()
    drive_runs(env, [spec("tools", tools=3)])  # warm-up
    records = drive_runs(env, [spec("tools", tools=tools)] * runs)
    steps = [r for r in records if r["kind"] != "FINISH"]
    from bench.stats import summary

    return {
        "runs": runs,
        "tools_per_run": tools,
        "ms_per_step": summary([r["total_ms"] for r in steps]),
        "phases_p50": phase_table(records),
        "db_calls_per_step": db_calls(records),
    }


def read_variants(env: BenchEnv, run_id: str, repeats: int = 30) -> dict[str, float]:
    """Ways to read a long run's steps, median ms each: what ``RunStore.steps`` costs, and
    what reading less would cost (for the analysis of (d); nothing here is the runtime's)."""
    import statistics
    import uuid

    from sqlalchemy import text

    rid = uuid.UUID(run_id)
    store = RunStore(env.engine)
    with env.engine.connect() as conn:
        last = int(
            conn.execute(
                text("SELECT max(seq) FROM run_step WHERE run_id = :id"), {"id": rid}
            ).scalar_one()
        )

    def q(sql: str, **params: Any) -> Callable[[], Any]:
        def run() -> Any:
            with env.engine.connect() as conn:
                return conn.execute(text(sql), {"id": rid, **params}).mappings().all()

        return run

    variants: dict[str, Callable[[], Any]] = {
        "store.steps()": lambda: store.steps(rid),
        "SELECT * (no conversion to Step)": q(
            "SELECT * FROM run_step WHERE run_id = :id ORDER BY seq"
        ),
        "only the columns replay uses": q(
            "SELECT seq, kind, status, step_key, tool_use_id, response, stop_reason, resolution"
            " FROM run_step WHERE run_id = :id ORDER BY seq"
        ),
        "only the last 5 rows (seq > last - 5)": q(
            "SELECT * FROM run_step WHERE run_id = :id AND seq > :after ORDER BY seq",
            after=last - 5,
        ),
    }
    out: dict[str, float] = {"rows": float(last)}
    for name, fn in variants.items():
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
        out[name] = statistics.median(times)
    return out


def old_and_young(env: BenchEnv, tools: int, repeats: int) -> list[dict[str, Any]]:
    env.truncate()
    out: list[dict[str, Any]] = []
    for _ in range(repeats):
        out += drive_old_and_young(env, tools)
    return out
