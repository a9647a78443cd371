"""Billed tokens that arrive while the database is unreachable are kept in the process and
counted when it answers again (db/owed.py), through a real cut between the store and a
real PostgreSQL (tests/netproxy.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from decimal import Decimal

import pytest
from sqlalchemy.engine import make_url

from db.engine import make_engine
from db.records import NewStep, StepKind, StepStatus, Usage
from db.store import RunStore
from runtime.bootstrap import Runtime
from tests.netproxy import TcpProxy
from tests.support import submit

USAGE = Usage(1234, 56)


@pytest.fixture
def cut_store(database_url: str) -> Iterator[tuple[RunStore, TcpProxy]]:
    url = make_url(database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    engine = make_engine(
        url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False),
        pool_size=1,
        max_overflow=0,
    )
    try:
        yield RunStore(engine), proxy
    finally:
        engine.dispose()
        proxy.close()


def _settled(store: RunStore, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    store.owed.settle_now()
    while store.owed.pending:
        assert time.monotonic() < deadline, "the owed usage was never written"
        time.sleep(0.1)


def test_usage_billed_while_the_database_is_away_is_counted_when_it_returns(
    runtime: Runtime, cut_store: tuple[RunStore, TcpProxy]
) -> None:
    store, proxy = cut_store
    run, _ = submit(runtime.store)
    proxy.cut(reject=True)
    assert store.record_unrecorded_usage(run.id, USAGE, Decimal("0.01")) is False
    assert store.owed.pending == 1
    time.sleep(1.5)  # a retry or two while it is still away: still owed, nothing lost
    assert store.owed.pending == 1
    assert runtime.store.get_run(run.id).unrecorded_tokens == 0
    proxy.heal()
    _settled(store)
    after = runtime.store.get_run(run.id)
    assert after.unrecorded_tokens == USAGE.total
    assert after.unrecorded_cost_usd == Decimal("0.01")


def test_usage_whose_checkpoint_did_commit_is_not_counted_twice(
    runtime: Runtime, cut_store: tuple[RunStore, TcpProxy]
) -> None:
    store, proxy = cut_store
    run, dispatch = submit(runtime.store)
    claim = runtime.store.claim(run.id, dispatch.token, "worker-A", 30)
    assert claim is not None
    runtime.store.record_steps(
        claim,
        [
            NewStep(
                seq=1,
                step_key="model:1",
                kind=StepKind.MODEL,
                status=StepStatus.DONE,
                response={"content": []},
                usage=USAGE,
            )
        ],
    )
    proxy.cut(reject=True)
    owed = store.record_unrecorded_usage(
        run.id, USAGE, Decimal("0.01"), unless_step=("model:1", claim.epoch)
    )
    assert owed is False
    proxy.heal()
    _settled(store)
    assert runtime.store.get_run(run.id).unrecorded_tokens == 0, "its row counts it already"
    assert store.record_unrecorded_usage(
        run.id, USAGE, Decimal("0.01"), unless_step=("model:1", claim.epoch + 1)
    )
    assert runtime.store.get_run(run.id).unrecorded_tokens == USAGE.total
