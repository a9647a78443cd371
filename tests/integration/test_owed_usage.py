"""Billed tokens that arrive while the database is unreachable are kept in the process and
counted when it answers again (db/owed.py), through a real cut between the store and a
real PostgreSQL (tests/netproxy.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from decimal import Decimal

import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from db.errors import DatabaseUnavailable
from db.records import NewStep, RunStatus, StepKind, StepStatus, Usage
from db.store import RunStore
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.scripted import ScriptedLlm
from runtime.pipeline import modelcall
from tests.netproxy import TcpProxy
from tests.support import (
    SimulatedCrash,
    drive_to_end,
    expire_lease,
    proxied_engine,
    register_agent,
    submit,
)

USAGE = Usage(1234, 56)
MODEL = "claude-test-model"


@pytest.fixture
def cut_store(database_url: str) -> Iterator[tuple[RunStore, TcpProxy]]:
    with proxied_engine(database_url, pool_size=1, max_overflow=0) as (engine, proxy):
        yield RunStore(engine), proxy
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


def test_usage_written_when_the_database_returns_runs_what_follows_it(
    runtime: Runtime, cut_store: tuple[RunStore, TcpProxy]
) -> None:
    """An owed count's ``then`` (erasing the call's record, taking back an estimate counted
    meanwhile) runs once the count is written, late as it is: else the record outlives the
    count and the run's next admission counts the call a second time, as lost."""
    store, proxy = cut_store
    run, _ = submit(runtime.store)
    done = threading.Event()
    proxy.cut(reject=True)
    assert store.record_unrecorded_usage(run.id, USAGE, Decimal(0), then=done.set) is False
    assert not done.is_set(), "not before it is written"
    proxy.heal()
    _settled(store)
    assert runtime.store.get_run(run.id).unrecorded_tokens == USAGE.total
    assert done.wait(5), "written, and what follows it never ran"


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


# -- the exact count replaces the estimate of a call lost with its worker, never both -------


class CutOffWithTheAnswer:
    """Worker P's model: P's answer arrives as P loses PostgreSQL (its connection through
    ``proxy`` is refused); while P tries its checkpoint again, its lease lapses and worker B
    takes the run over (``taken_over``, on a thread of its own)."""

    def __init__(self, proxy: TcpProxy, taken_over: Callable[[], None]) -> None:
        self.proxy = proxy
        self.taken_over = taken_over
        self.thread: threading.Thread | None = None
        self.failed: list[BaseException] = []

    def send(self, request: LlmRequest) -> LlmResponse:
        self.proxy.cut(reject=True)
        self.thread = threading.Thread(target=self._take_over, daemon=True)
        self.thread.start()
        content: list[dict[str, object]] = [{"type": "text", "text": "too late"}]
        return LlmResponse(content, "end_turn", LATE, request.model)

    def _take_over(self) -> None:
        time.sleep(0.5)  # P's answer is settled and P is trying its checkpoint again
        try:
            self.taken_over()
        except BaseException as e:
            self.failed.append(e)


LATE = Usage(300, 7)


def test_usage_owed_while_the_database_was_away_replaces_the_estimate_counted_meanwhile(
    runtime: Runtime, llm: ScriptedLlm, settings: Settings, database_url: str
) -> None:
    """A partition: worker P's answer arrives while PostgreSQL is away from P; while P tries
    its checkpoint again the run's next admission (worker B, after P's lease) counts P's
    call as lost (an estimate); when P's usage, owed in its process, is written, the
    estimate is taken back: the exact count replaces it, never both."""
    register_agent(runtime.agents)
    llm.then_text("done", 20, 2)
    run, dispatch = submit(runtime.store, model=MODEL)
    url = make_url(database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    estimated: list[int] = []

    def taken_over() -> None:
        expire_lease(runtime.engine, run.id)
        (again,) = runtime.store.redispatch_due(redispatch_after=3600)
        drive_to_end(runtime.driver(worker="worker-B"), again)
        estimated.append(runtime.store.get_run(run.id).unrecorded_estimated_tokens)

    p_settings = replace(
        settings,
        database_url=url.set(host="127.0.0.1", port=proxy.port).render_as_string(
            hide_password=False
        ),
        lease_seconds=3.0,  # how long P tries its checkpoint before it owes the usage
        worker_name="worker-P",
    )
    model = CutOffWithTheAnswer(proxy, taken_over)
    p = Runtime.build(p_settings, llm=model, pool_size=1)
    try:
        register_agent(p.agents)
        with pytest.raises(DatabaseUnavailable) as raised:
            p.driver(worker="worker-P").drive(dispatch.run_id, dispatch.token)
        assert isinstance(raised.value.__cause__, OperationalError), raised.value
        assert model.thread is not None
        model.thread.join(10)
        assert not model.failed, model.failed
        assert estimated, "B did not drive the run"
        assert estimated[0] > 0, "B's admission counted P's call as lost"
        assert p.store.owed.pending == 1
        proxy.heal()
        _settled(p.store)
    finally:
        p.close()
        proxy.close()
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.tokens_used == 22  # B's answer, on its row
    assert (done.unrecorded_tokens, done.unrecorded_estimated_tokens) == (LATE.total, 0)


def test_a_call_recorded_by_a_worker_killed_before_it_erased_the_record_is_not_estimated(
    runtime: Runtime, llm: ScriptedLlm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker A's answer is on its step row, and A dies before erasing the call's record
    in flow control: the run's next admission finds the record, and the row of that step and
    lease epoch says the call was recorded: no estimate beside the exact count."""
    register_agent(runtime.agents)
    llm.then_response(
        LlmResponse([{"type": "text", "text": "go on"}], "pause_turn", Usage(20, 2), MODEL)
    ).then_text("done", 20, 2)
    run, dispatch = submit(runtime.store, model=MODEL)

    def killed(task: object) -> None:  # the checkpoint committed; the erase never runs
        raise SimulatedCrash

    with monkeypatch.context() as m:
        m.setattr(modelcall, "_forget", killed)
        with pytest.raises(SimulatedCrash):
            runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    assert [s.step_key for s in runtime.store.steps(run.id)] == ["model:1"]
    expire_lease(runtime.engine, run.id)
    (again,) = runtime.store.redispatch_due(redispatch_after=1)
    drive_to_end(runtime.driver(worker="worker-B"), again)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.tokens_used == 44
    assert (done.unrecorded_tokens, done.unrecorded_estimated_tokens) == (0, 0)
