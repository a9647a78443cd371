"""A network partition, not a crash: one LIVE worker loses PostgreSQL while it keeps running
(issue 27.2).

The chaos suite's stack (private PostgreSQL and Redis, gunicorn, beat, the fake Messages API)
with two thread-pool workers: ``worker-A`` connects directly, ``worker-P`` through a TCP
proxy (``tests/netproxy.py``) that the test cuts while worker-P holds runs with model calls
in flight, for several leases, then heals:

- ``silent``: nothing answers (a partition: statements hang until the network returns);
- ``reject``: every connection is reset and new ones refused (a host down, a firewall
  answering with resets): the checkpoint retries within the lease, then gives up;
- ``redis``: silence between worker-P and Redis instead (the broker, flow control): its
  steps in flight still record (PostgreSQL answers), the next messages it cannot send are
  re-sent by the reaper, and its consumer reconnects by itself after the heal;
- ``failover``: the database's address behind worker-P's name moves (the proxy re-pointed,
  every open connection dropped), as at a failover to a new primary: it follows without a
  restart. (Here the new address leads to the same server: the data is the replica's.)

Then: every run succeeds; the runs worker-P held moved to worker-A after the lease; worker-P
wrote no step of them once healed (fenced); no tool effect happened twice (one comment per
run, each tool step once); no billed token is lost (per run, what the fake billed equals the
step rows' tokens plus the run's unrecorded tokens); and worker-P works again by itself
(it records steps of new runs after the heal, with no restart).
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
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from sqlalchemy import Engine, text

from cli.embedded import free_port
from db.engine import make_engine
from db.records import RunStatus, StepKind
from db.store import RunStore
from tests.chaos.harness import ChaosStack, WorkerSpec
from tests.fakes.messages_api import FakeMessagesApi, Reply, tool_uses
from tests.fakes.messages_api import text as text_reply
from tests.netproxy import TcpProxy

pytestmark = [pytest.mark.e2e, pytest.mark.chaos, pytest.mark.timeout(300)]

LEASE_SECONDS = 3.0
CUT_SECONDS = 12.0
"""Four leases: worker-P's runs are taken over while it is cut off."""
LATENCY_SECONDS = 1.5
RUNS = 8
TAG_RE = re.compile(r"\[part (\w+)\]")


class Responder:
    """Turn 1: ``add_comment`` on ticket 101 (a real effect, idempotent by the tool_use id);
    turn 2: ``end_turn``. Every reply bills a distinct number of tokens."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def __call__(self, request: dict[str, Any]) -> Reply:
        with self._lock:
            self._n += 1
            n = self._n
        messages = request.get("messages") or []
        found = TAG_RE.search(str(messages[0].get("content"))) if messages else None
        tag = found.group(1) if found else "x"
        turn = 1 + sum(1 for m in messages if m.get("role") == "assistant")
        time.sleep(LATENCY_SECONDS)
        usage = {
            "input_tokens": 300 + n,
            "output_tokens": 20 + turn,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        if turn == 1:
            return tool_uses(
                [(f"toolu_{tag}_{n}", "add_comment", {"ticket_id": 101, "text": f"[{tag}]"})],
                preamble=f"part reply {n}",
                usage=usage,
            )
        return text_reply(f"part reply {n} for {tag}: done.", usage=usage)


@dataclass
class Partition:
    stack: ChaosStack
    fake: FakeMessagesApi
    proxy: TcpProxy
    """worker-P's way to PostgreSQL."""
    broker_proxy: TcpProxy
    """worker-P's way to Redis (the broker, flow control, the live stream)."""
    engine: Engine
    store: RunStore


@pytest.fixture(scope="module")
def partition_stack() -> Iterator[Partition]:
    """One stack for the file's four modes: its private PostgreSQL (an initdb), Redis and six
    processes took ~30 s to start and stop per mode. Each mode ends with every run ended and
    worker-P working again by itself (the test asserts it), which is where the next begins."""
    tmp = Path(tempfile.mkdtemp(prefix="dar-partition-"))
    with FakeMessagesApi(default_responder=Responder()) as fake:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DAR_", "ANTHROPIC_"))}
        env.pop("DATABASE_URL", None)
        env.pop("REDIS_URL", None)
        env.update(
            {
                "DAR_QUEUE": "dar-partition",
                "DAR_LEASE_SECONDS": str(LEASE_SECONDS),
                "DAR_HEARTBEAT_SECONDS": "0.5",
                "DAR_REAPER_INTERVAL_SECONDS": "0.5",
                "DAR_REDISPATCH_AFTER_SECONDS": "3",
                "DAR_MAX_CLAIMS_WITHOUT_PROGRESS": "50",
                "DAR_MODEL_TIMEOUT_SECONDS": "30",
                "DAR_LOG_LEVEL": "INFO",
                "PYTHONFAULTHANDLER": "1",
                "ANTHROPIC_API_KEY": "test",
                "ANTHROPIC_BASE_URL": fake.url,
            }
        )
        proxy: TcpProxy | None = None
        broker_proxy: TcpProxy | None = None
        spec_p = WorkerSpec(concurrency=8)
        stack = ChaosStack(
            data_dir=tmp,
            port=free_port(),
            env=env,
            specs={"A": WorkerSpec(concurrency=8), "P": spec_p},
            beats=1,
            log_dir=tmp / "logs",
        )
        engine: Engine | None = None
        try:
            stack.prepare()
            stack.start_services()
            socket_dir = parse_qs(urlparse(stack.database_url).query)["host"][0]
            proxy = TcpProxy(socket_dir, 5432)
            db = urlparse(stack.database_url)
            spec_p.env["DATABASE_URL"] = (
                f"postgresql://{db.username or 'postgres'}@127.0.0.1:{proxy.port}{db.path}"
            )
            assert stack.broker is not None
            broker_proxy = TcpProxy("127.0.0.1", stack.broker.port)
            spec_p.env["REDIS_URL"] = f"redis://127.0.0.1:{broker_proxy.port}/0"
            stack.start_web()
            for letter in stack.specs:
                stack.start_worker(letter)
            stack.start_beat()
            stack.wait_ready(90)
            engine = make_engine(stack.database_url, pool_size=2, max_overflow=0)
            yield Partition(stack, fake, proxy, broker_proxy, engine, RunStore(engine))
        finally:
            if engine is not None:
                engine.dispose()
            stack.stop()
            for each in (proxy, broker_proxy):
                if each is not None:
                    each.close()
            shutil.rmtree(tmp / "pgdata", ignore_errors=True)
            print(f"partition: process logs in {stack.log_dir}", flush=True)


@pytest.fixture
def partition(partition_stack: Partition) -> Partition:
    """The file's stack with both of worker-P's ways passing traffic (a mode that failed
    half-way may have left one cut) and every process of it running."""
    p = partition_stack
    p.proxy.heal()
    p.broker_proxy.heal()
    for name, proc in p.stack.processes.items():
        assert proc.poll() is None, f"{name} exited (code {proc.returncode}) in an earlier mode"
    return p


def _submit(p: Partition, tag: str) -> uuid.UUID:
    body = {"input": f"[part {tag}] Remind the owner of ticket 101.", "tokenBudget": 1_000_000}
    req = urllib.request.Request(
        p.stack.api_url + "/api/runs", data=json.dumps(body).encode(), method="POST"
    )
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=15) as resp:
        return uuid.UUID(json.loads(resp.read())["id"])


def _billed(fake: FakeMessagesApi) -> dict[str, int]:
    """Tokens the fake billed per run tag (answers it sent, whoever read them)."""
    out: dict[str, int] = {}
    for rec in fake.requests:
        if rec.path.split("?")[0] != "/v1/messages" or rec.status != 200:
            continue
        messages = (rec.json or {}).get("messages") or []
        found = TAG_RE.search(str(messages[0].get("content"))) if messages else None
        if found:
            u = json.loads(rec.response_body)["usage"]
            out[found.group(1)] = out.get(found.group(1), 0) + sum(
                u[k]
                for k in (
                    "input_tokens",
                    "output_tokens",
                    "cache_creation_input_tokens",
                    "cache_read_input_tokens",
                )
            )
    return out


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout:.0f}s")


@pytest.mark.parametrize("mode", ["silent", "reject", "redis", "failover"])
def test_a_partitioned_worker_is_fenced_loses_no_token_and_recovers(
    partition: Partition, mode: str
) -> None:
    p = partition
    prefix = mode[:3]  # the runs' tags, unique across the modes sharing the stack and the fake
    runs = {f"{prefix}{i:02d}": _submit(p, f"{prefix}{i:02d}") for i in range(RUNS)}

    def held_by_p() -> dict[uuid.UUID, int]:
        """Runs worker-P holds, with the lease epoch it holds them under."""
        with p.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, lease_epoch FROM run WHERE locked_by = 'worker-P' "
                    "AND status = 'RUNNING' AND id = ANY(:ids)"
                ),
                {"ids": list(runs.values())},
            )
            return {r[0]: int(r[1]) for r in rows}

    # worker-A may take a whole wave before worker-P consumes (it may still be connecting,
    # through its proxies, on a loaded host): a wave that ended without worker-P holding two
    # of its runs is followed by another, up to four.
    deadline = time.monotonic() + 90
    waves = 1
    while len(held_by_p()) < 2:
        if time.monotonic() > deadline:
            raise AssertionError(f"worker-P never held two runs of {waves} waves within 90s")
        if waves < 4 and all(p.store.get_run(r).status.terminal for r in runs.values()):
            runs.update(
                {f"{prefix}w{waves}{i}": _submit(p, f"{prefix}w{waves}{i}") for i in range(RUNS)}
            )
            waves += 1
        time.sleep(0.1)
    moved = held_by_p()
    held_at_cut = len(moved)
    cut = p.broker_proxy if mode == "redis" else p.proxy
    cut_at = time.time()
    if mode == "failover":
        # The database's address moves (a new primary behind the same name): every
        # connection worker-P has dies, new ones go to the new address.
        host, port = p.proxy.target
        p.proxy.repoint(host, port, reset=True)
        moved = {}  # it may keep its leases: nothing needs to move
    else:
        cut.cut(reject=mode == "reject")
        time.sleep(CUT_SECONDS)
        cut.heal()
    healed_at = time.time()

    def ended() -> bool:
        return all(p.store.get_run(r).status.terminal for r in runs.values())

    try:
        _wait(ended, 120, "the runs did not all end")
    except AssertionError:
        print(_tails(p.stack))
        raise

    # worker-P works again by itself: new runs, some of them recorded by worker-P.
    fresh = {f"{prefix}n{i}": _submit(p, f"{prefix}n{i}") for i in range(RUNS)}

    def p_recorded_after_heal() -> bool:
        with p.engine.connect() as conn:
            return bool(
                conn.execute(
                    text("SELECT 1 FROM run_step WHERE worker = 'worker-P' AND run_id = ANY(:ids)"),
                    {"ids": list(fresh.values())},
                ).first()
            )

    _wait(
        lambda: all(p.store.get_run(r).status.terminal for r in fresh.values()),
        120,
        "the new runs did not end",
    )
    problems: list[str] = []
    if not p_recorded_after_heal():
        problems.append("worker-P recorded no step of the runs submitted after the heal")

    billed = _billed(p.fake)
    with p.engine.connect() as conn:
        comments = {
            tag: int(
                conn.execute(
                    text("SELECT count(*) FROM acme_comment WHERE body = :b"), {"b": f"[{tag}]"}
                ).scalar_one()
            )
            for tag in {**runs, **fresh}
        }
    unrecorded_total = 0
    for tag, run_id in {**runs, **fresh}.items():
        run = p.store.get_run(run_id)
        steps = p.store.steps(run_id)
        if run.status is not RunStatus.SUCCEEDED:
            problems.append(f"run {tag} ended {run.status}: {run.error}")
        recorded = sum(s.usage.total for s in steps)
        unrecorded_total += run.unrecorded_tokens
        # unrecorded tokens are exact counts (the API's usage) plus estimates of calls lost
        # with their worker (issue 26.3, an upper bound): what the rows and the exact counts
        # do not hold must be covered by the estimates, and the exact counts never exceed
        # what was billed
        exact = run.unrecorded_tokens - run.unrecorded_estimated_tokens
        lost = billed.get(tag, 0) - recorded - exact
        if lost < 0 or lost > run.unrecorded_estimated_tokens:
            problems.append(
                f"run {tag}: billed {billed.get(tag, 0)}, on step rows {recorded}, "
                f"unrecorded {run.unrecorded_tokens} (estimated "
                f"{run.unrecorded_estimated_tokens})"
            )
        tools = [s for s in steps if s.kind is StepKind.TOOL]
        if len(tools) != 1 or comments[tag] != 1:
            problems.append(f"run {tag}: {len(tools)} tool steps, {comments[tag]} comments")
        if run_id in moved and mode in ("silent", "reject"):
            late = [
                s.seq
                for s in steps
                if s.lease_epoch == moved[run_id]
                and (s.finished_at or s.started_at).timestamp() > cut_at
            ]
            if late:
                problems.append(
                    f"run {tag}: steps {late} written under worker-P's lease after the cut"
                )
            if not any(s.worker == "worker-A" for s in steps):
                problems.append(f"run {tag} held by worker-P did not move to worker-A")
    print(
        f"\npartition ({mode}): worker-P held {held_at_cut} runs at the cut, cut "
        f"{healed_at - cut_at:.1f}s (lease {LEASE_SECONDS:.0f}s); "
        f"{sum(billed.values())} tokens billed, {unrecorded_total} of them unrecorded "
        f"(answers whose checkpoint was fenced out), none lost",
        flush=True,
    )
    if problems:
        print(_tails(p.stack))
    assert not problems, "\n".join(problems)


def _tails(stack: ChaosStack, lines: int = 40) -> str:
    out = []
    for name in sorted(stack.processes):
        with contextlib.suppress(OSError):
            tail = stack.log_path(name).read_text("utf-8", "replace").splitlines()
            out.append(f"--- {name} (last {lines} lines) ---")
            out += tail[-lines:]
    return "\n".join(out)
