"""Every billed token counted once, with a worker frozen past its lease (issue 35.4).

The Procfile's worker as shipped (gevent pool, default concurrency, flow control on), two of
them and a beat, against a fake Messages API that counts what it bills. Worker A is
SIGSTOPped while its model calls are in flight, until its leases lapse and worker B has
taken its runs over (B's admission counts each of A's calls as lost with its worker: an
estimate); then A is SIGCONTed: its calls complete, their checkpoints are refused, and their
real counts must replace the estimates. Nothing was killed, so what the runs record is
exactly what the API billed."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli.devstack import DevStack
from db.engine import make_engine
from db.records import Run
from db.store import RunStore
from runtime.config import WORKER_CONCURRENCY, WORKER_POOL, Settings
from tests.e2e.stack import FAST_LEASES
from tests.fakes.messages_api import FakeMessagesApi, Reply, slow, text, tool_uses
from tests.support import stack_against

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RUNS = 12
LEASE_SECONDS = float(FAST_LEASES["DAR_LEASE_SECONDS"])


def _answer(request: dict[str, Any]) -> Reply:
    """Two model calls a run, each ~1.2 s in flight (so a SIGSTOP finds calls in flight),
    with sizes that differ per run and turn (a sum cannot match by accident)."""
    messages = request.get("messages") or []
    seed = sum(len(str(m)) for m in messages) % 97
    usage = {"input_tokens": 300 + seed, "output_tokens": 40 + seed % 13}
    if len(messages) == 1:
        reply = tool_uses(
            [(f"toolu_{abs(hash(str(messages[0]))) % 10**9}", "list_tickets", {})], usage=usage
        )
    else:
        reply = text("The overdue tickets are listed above.", usage=usage)
    return slow(reply, chunk=4, interval=0.1)


@pytest.fixture
def api() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi(default_responder=_answer) as fake:
        yield fake


@pytest.fixture
def stack(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path, api: FakeMessagesApi
) -> Iterator[DevStack]:
    with stack_against(
        api.url,
        database_url=database_url,
        redis_url=redis_url,
        settings=settings,
        tmp_path=tmp_path,
        workers=2,
        env=FAST_LEASES,
        tail=30000,
    ) as s:
        yield s


def _recorded(run: Run) -> int:
    return run.tokens_used + run.unrecorded_tokens


def test_a_worker_frozen_past_its_lease_records_exactly_what_the_api_billed(
    stack: DevStack, api: FakeMessagesApi
) -> None:
    assert (stack.pool, stack.concurrency) == (WORKER_POOL, WORKER_CONCURRENCY)
    engine = make_engine(stack.database_url, pool_size=2)
    store = RunStore(engine)
    frozen = stack.processes["worker-A"]
    stopped = False
    try:
        ids = []
        for i in range(RUNS):
            status, body = stack.request(
                "POST", "/api/runs", {"input": f"Which acme tickets are overdue? ({i})"}
            )
            assert status == 201, body
            ids.append(uuid.UUID(body["id"]))

        # A holds runs whose model calls are in flight: freeze it there.
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "worker-A never held a run"
            runs = [store.get_run(i) for i in ids]
            held = {r.id: r.lease_epoch for r in runs if r.locked_by == "worker-A"}
            if len(held) >= 2:
                break
            time.sleep(0.05)
        os.kill(frozen.pid, signal.SIGSTOP)
        stopped = True

        # ... until its leases lapsed and B took every run it held over (or ended it).
        time.sleep(LEASE_SECONDS)
        deadline = time.monotonic() + 30
        while not all(
            (r := store.get_run(i)).lease_epoch > e or r.status.terminal for i, e in held.items()
        ):
            assert time.monotonic() < deadline, "worker-A's runs were not taken over"
            time.sleep(0.1)
        time.sleep(1.0)
        os.kill(frozen.pid, signal.SIGCONT)
        stopped = False

        deadline = time.monotonic() + 120
        while True:
            runs = [store.get_run(i) for i in ids]
            if all(r.status.terminal for r in runs):
                break
            assert time.monotonic() < deadline, [str(r.status) for r in runs]
            time.sleep(0.5)
        time.sleep(LEASE_SECONDS)  # A's last fenced writes land
        runs = [store.get_run(i) for i in ids]
    finally:
        if stopped:
            os.kill(frozen.pid, signal.SIGCONT)
        engine.dispose()

    assert all(r.status.terminal for r in runs)
    billed = api.billed_tokens
    recorded = sum(_recorded(r) for r in runs)
    estimated = sum(r.unrecorded_estimated_tokens for r in runs)
    fenced = sum(r.unrecorded_tokens - r.unrecorded_estimated_tokens for r in runs)
    print(
        f"billed {billed} tokens in {len(api.billed)} calls; recorded {recorded} "
        f"(in steps {sum(r.tokens_used for r in runs)}, fenced-out calls {fenced}, "
        f"estimates left {estimated})"
    )
    assert fenced > 0, "no call of the frozen worker completed after it was fenced out"
    assert estimated == 0, "an estimate of a call that was not lost is still counted"
    assert recorded == billed
