"""PostgreSQL restarts while ~30 model calls are in flight: an answer that arrived during the
outage is not thrown away, its checkpoint is retried while the lease lasts.

A black-box test with real processes (the chaos suite's :class:`ChaosStack`: private embedded
PostgreSQL and Redis, gunicorn, two thread-pool Celery workers, a beat) and the fake Messages
API on loopback. Each round submits :data:`RUNS` runs of the acme agent (one or two model
calls each, the second after a read-only ``list_tickets``). Every first-turn call is held at
the fake until the database is down; then PostgreSQL is stopped (``-m fast``, or
``-m immediate``, a crash), the held calls are answered during the outage, and PostgreSQL
comes back after :data:`DOWN_SECONDS`, well inside the lease (:data:`LEASE_SECONDS`, set
explicitly: on a loaded machine a 3 s outage measured 6.7 s from stop to start, plus
PgBouncer's reconnect, and outlasted the default 8 s lease, which is the crash path and not
what this test is about). Every run must succeed with no repeated model call (calls the
fake answered for the run minus model steps recorded) and with every billed token on its
step rows.

One stack serves both rounds (the second on the restarted server), and both ways to the
server at once: worker-A and a beat connect directly, worker-B, the web and the other beat
through a PgBouncer in transaction mode (which holds a client's transaction while the server
is away). Each worker holds runs whose calls are in flight at the stop (asserted: 30 runs,
16 slots each). Two stacks (direct, pooled) of four rounds took ~110 s to start and stop on a
loaded 2-core machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from cli.embedded import free_port
from db.engine import make_engine
from db.records import RunStatus, StepKind, Usage
from db.store import RunStore
from tests.chaos.harness import ChaosStack, WorkerSpec
from tests.fakes.messages_api import FakeMessagesApi, Reply, text, tool_uses

pytestmark = [pytest.mark.e2e, pytest.mark.chaos, pytest.mark.timeout(240)]

RUNS = 30
WORKERS = {"A": 16, "B": 16}
"""Thread-pool workers and their concurrency: together more slots than runs (prefetch 1), each
fewer, so both hold runs."""
DIRECT = frozenset({"worker-A", "beat"})
"""What connects to PostgreSQL directly; the rest go through the PgBouncer."""
LATENCY_SECONDS = 2.0
"""Every call is answered this long after it arrived (the first turn's also waits for
:attr:`Responder.release`)."""
ANSWER_AFTER_SECONDS = 1.0
"""The held first-turn calls are released this long after PostgreSQL went down."""
DOWN_SECONDS = 3.0
HOLD_LIMIT_SECONDS = 60.0
"""A held call is answered anyway after this long (a test that fails does not hang)."""
LEASE_SECONDS = 20.0
"""The workers' lease: well above the outage even on a loaded machine. A longer outage is
the crash path (the runs move, a lost answer is covered by its estimate), tested elsewhere."""
TAG_RE = re.compile(r"\[pg (\w+)\]")


def two_calls(tag: str) -> bool:
    """Two runs in three make a second model call (after a read-only tool), the rest one."""
    return int(tag[-2:]) % 3 != 0


class Responder:
    """The fake's answers: per run (tagged in its input) a ``list_tickets`` turn then an
    ``end_turn``, or an ``end_turn`` at once; every reply bills a distinct token count."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._n = 0

    def __call__(self, request: dict[str, Any]) -> Reply:
        with self._lock:
            self._n += 1
            n = self._n
        messages = request.get("messages") or []
        found = TAG_RE.search(str(messages[0].get("content"))) if messages else None
        tag = found.group(1) if found else "x00"
        turn = 1 + sum(1 for m in messages if m.get("role") == "assistant")
        time.sleep(LATENCY_SECONDS)
        if turn == 1:
            self.release.wait(HOLD_LIMIT_SECONDS)
        usage = {
            "input_tokens": 200 + n,
            "output_tokens": 10 + turn,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        if turn == 1 and two_calls(tag):
            return tool_uses(
                [(f"toolu_{tag}_{n}", "list_tickets", {"overdue": True})],
                preamble=f"pg reply {n} for {tag}",
                usage=usage,
            )
        return text(f"pg reply {n} for {tag}: done.", usage=usage)


@dataclass
class Pg:
    stack: ChaosStack
    fake: FakeMessagesApi
    responder: Responder
    engine: Engine
    store: RunStore
    round: str = field(default_factory=lambda: uuid.uuid4().hex[:8])


@pytest.fixture(scope="module")
def pg() -> Iterator[Pg]:
    """The stack, some of its processes connecting to PostgreSQL directly (:data:`DIRECT`),
    the others through a PgBouncer in transaction mode."""
    tmp = Path(tempfile.mkdtemp(prefix="dar-pg-restart-"))
    responder = Responder()
    with FakeMessagesApi(default_responder=responder) as fake:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DAR_", "ANTHROPIC_"))}
        env.pop("DATABASE_URL", None)
        env.pop("REDIS_URL", None)
        env.update(
            {
                "DAR_QUEUE": "dar-pg-restart",
                "DAR_MODEL_TIMEOUT_SECONDS": str(HOLD_LIMIT_SECONDS + 30),
                "DAR_LOG_LEVEL": "INFO",
                "DAR_LEASE_SECONDS": str(LEASE_SECONDS),
                "PYTHONFAULTHANDLER": "1",
                "ANTHROPIC_API_KEY": "test",
                "ANTHROPIC_BASE_URL": fake.url,
            }
        )
        stack = ChaosStack(
            data_dir=tmp,
            port=free_port(),
            env=env,
            specs={letter: WorkerSpec(concurrency=c) for letter, c in WORKERS.items()},
            beats=2,
            log_dir=tmp / "logs",
            pooler=True,
            direct=DIRECT,
        )
        engine: Engine | None = None
        try:
            stack.start(timeout=90)
            engine = make_engine(stack.database_url, pool_size=2, max_overflow=0)
            yield Pg(stack, fake, responder, engine, RunStore(engine))
        finally:
            if engine is not None:
                engine.dispose()
            stack.stop()
            shutil.rmtree(tmp / "pgdata", ignore_errors=True)  # the logs stay, not the data
            print(f"pg-restart: process logs in {stack.log_dir}", flush=True)


def _submit(pg: Pg, tag: str) -> uuid.UUID:
    """POST /api/runs, again on a 503 (the API's first statements after a restart of the
    database may meet a connection that died with it), with an Idempotency-Key."""
    body = {
        "input": f"[pg {tag}] List the overdue acme tickets, then summarise.",
        "tokenBudget": 1_000_000,
    }
    deadline = time.monotonic() + 30
    while True:
        req = urllib.request.Request(
            pg.stack.api_url + "/api/runs", data=json.dumps(body).encode(), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        req.add_header("Idempotency-Key", f"pg-restart-{pg.round}-{tag}")
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                return uuid.UUID(json.loads(resp.read())["id"])
        except urllib.error.HTTPError as e:
            if e.code != 503 or time.monotonic() > deadline:
                raise AssertionError(f"POST /api/runs: HTTP {e.code}: {e.read()[:300]!r}") from e
        time.sleep(0.3)


def _calls(fake: FakeMessagesApi, prefix: str) -> list[tuple[str, int, Usage | None]]:
    """(run tag, status answered (0: not yet), usage billed) of this round's model calls."""
    out = []
    for rec in fake.requests:
        if rec.path.split("?")[0] != "/v1/messages" or not isinstance(rec.json, dict):
            continue
        messages = rec.json.get("messages") or []
        found = TAG_RE.search(str(messages[0].get("content"))) if messages else None
        if not found or not found.group(1).startswith(prefix):
            continue
        usage = None
        if rec.status == 200:
            u = json.loads(rec.response_body)["usage"]
            usage = Usage(
                u["input_tokens"],
                u["output_tokens"],
                u["cache_creation_input_tokens"],
                u["cache_read_input_tokens"],
            )
        out.append((found.group(1), rec.status, usage))
    return out


def _wait(predicate: Any, timeout: float, what: str) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        with contextlib.suppress(Exception):
            if predicate():
                return time.monotonic() - began
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout:.0f}s")


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_an_answer_that_arrived_during_a_postgres_restart_is_not_thrown_away(
    pg: Pg, mode: str
) -> None:
    assert pg.stack.pg is not None
    prefix = mode[0]
    pg.responder.release.clear()
    runs = {f"{prefix}{i:02d}": _submit(pg, f"{prefix}{i:02d}") for i in range(RUNS)}

    def in_flight() -> int:
        return sum(1 for _, status, _ in _calls(pg.fake, prefix) if status == 0)

    try:
        _wait(lambda: in_flight() >= RUNS, 60, f"{RUNS} first-turn calls were not in flight")
        flying = in_flight()
        holders = Counter(pg.store.get_run(run_id).locked_by for run_id in runs.values())
        pg.stack.pg.stop_server(mode)
        down_at = time.monotonic()
        time.sleep(ANSWER_AFTER_SECONDS)
    finally:
        pg.responder.release.set()  # the held calls are answered now, during the outage
    time.sleep(max(0.0, down_at + DOWN_SECONDS - time.monotonic()))
    answered_in_outage = sum(1 for _, status, _ in _calls(pg.fake, prefix) if status == 200)
    pg.stack.pg.start_server()
    up_at = time.monotonic()
    assert up_at - down_at < LEASE_SECONDS - 5, (
        f"the outage lasted {up_at - down_at:.1f}s: not well inside the {LEASE_SECONDS:.0f}s "
        "lease, so this round tests the crash path instead"
    )

    def ended() -> bool:
        return all(pg.store.get_run(run_id).status.terminal for run_id in runs.values())

    try:
        settle = _wait(ended, 90, "the runs did not all end")
    except AssertionError:
        print(_tails(pg.stack))
        raise

    calls = _calls(pg.fake, prefix)
    problems: list[str] = []
    repeats: dict[str, int] = {}
    for tag, run_id in runs.items():
        run = pg.store.get_run(run_id)
        if run.status is not RunStatus.SUCCEEDED:
            problems.append(f"run {tag} {run_id} ended {run.status}: {run.error}")
        model_steps = [s for s in pg.store.steps(run_id) if s.kind is StepKind.MODEL]
        answered = [u for t, status, u in calls if t == tag and status == 200 and u is not None]
        repeats[tag] = len(answered) - len(model_steps)
        billed = sum((u.total for u in answered), 0)
        recorded = sum(s.usage.total for s in model_steps)
        if billed != recorded:
            problems.append(
                f"run {tag}: {billed} tokens billed by the fake, {recorded} on its step rows"
            )
        if run.tokens_used != recorded or run.unrecorded_tokens:
            problems.append(
                f"run {tag}: tokens_used={run.tokens_used} unrecorded={run.unrecorded_tokens}, "
                f"step rows {recorded}"
            )
    repeated = {tag: n for tag, n in repeats.items() if n}
    print(
        f"\npg-restart -m {mode}: {flying} model calls in flight at the stop, "
        f"(held by {dict(holders)}), {answered_in_outage} answered during the outage, "
        f"down {up_at - down_at:.1f}s "
        f"(lease {LEASE_SECONDS:.0f}s), repeats {sum(repeats.values())} "
        f"in {len(repeated)} run(s), all {len(runs)} runs ended {settle:.1f}s after the restart",
        flush=True,
    )
    if repeated:
        problems.append(f"repeated model calls (run tag: repeats): {repeated}")
    if problems:
        print(_tails(pg.stack))
    assert flying >= RUNS
    assert all(holders[f"worker-{w}"] for w in WORKERS), f"both ways in flight: {holders}"
    assert not problems, "\n".join(problems)


def _tails(stack: ChaosStack, lines: int = 40) -> str:
    out = []
    for name in sorted(stack.processes):
        with contextlib.suppress(OSError):
            tail = stack.log_path(name).read_text("utf-8", "replace").splitlines()
            out.append(f"--- {name} (last {lines} lines) ---")
            out += tail[-lines:]
    return "\n".join(out)
