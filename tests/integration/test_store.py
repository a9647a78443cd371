"""The store against real PostgreSQL: claims, fencing, cancel, the reaper's sweep."""

from __future__ import annotations

import threading
import uuid
from decimal import Decimal

import pytest
from sqlalchemy import text

from db.errors import LeaseLost
from db.records import NewStep, RunStatus, StepKind, StepStatus, Usage
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tests.support import expire_lease, register_agent, submit


def _checkpoint(seq: int = 1) -> NewStep:
    """A model call's row, as the model-call sequence checkpoints it."""
    return NewStep(
        seq=seq,
        step_key=f"model:{seq}",
        kind=StepKind.MODEL,
        status=StepStatus.DONE,
        response=[{"type": "text", "text": "hi"}],
        attempt=1,
        model="m",
        prompt_hash="h",
        usage=Usage(7, 3, 2, 1),
        cost_usd=Decimal("0.001"),
        latency_ms=5,
        request_id="req_1",
        stop_reason="end_turn",
    )


def test_eight_concurrent_claimers_never_claim_the_same_run(runtime: Runtime) -> None:
    runs = {submit(runtime.store)[0].id for _ in range(20)}
    claimed: list[uuid.UUID] = []
    lock = threading.Lock()
    barrier = threading.Barrier(8)

    def claimer(n: int) -> None:
        barrier.wait()
        while True:
            claim = runtime.store.claim_next(f"claimer-{n}", 30)
            if claim is None:
                return
            with lock:
                claimed.append(claim.run_id)

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(claimed) == sorted(runs), "every run claimed exactly once"


def test_claim_needs_the_current_token_and_a_free_lease(runtime: Runtime) -> None:
    run, dispatch = submit(runtime.store)
    assert runtime.store.claim(run.id, uuid.uuid4(), "w", 30) is None, "stale token"
    claim = runtime.store.claim(run.id, dispatch.token, "w", 30)
    assert claim is not None
    assert claim.epoch == 1
    assert claim.run.status is RunStatus.RUNNING
    assert runtime.store.claim(run.id, dispatch.token, "w2", 30) is None, "lease is live"
    assert runtime.store.claim_next("w3", 30) is None, "a live lease is never taken"


def test_checkpoint_commits_step_tokens_and_hands_the_lease_on(runtime: Runtime) -> None:
    run, dispatch = submit(runtime.store)
    claim = runtime.store.claim(run.id, dispatch.token, "w", 30)
    assert claim is not None
    nxt = runtime.store.checkpoint_model(claim, _checkpoint())
    after = runtime.store.get_run(run.id)
    assert after.tokens_used == 13
    assert after.usage == Usage(7, 3, 2, 1)
    assert after.cost_usd == Decimal("0.001")
    assert after.locked_by is None
    assert after.locked_until is None
    assert after.dispatch_token == nxt.token != dispatch.token
    assert after.claims_without_progress == 0
    # The old message is now stale; the new one claims.
    assert runtime.store.claim(run.id, dispatch.token, "w", 30) is None
    assert runtime.store.claim(run.id, nxt.token, "w", 30) is not None


def _tool_row(tool_use_id: str) -> NewStep:
    return NewStep(
        1,
        f"tool:{tool_use_id}",
        StepKind.TOOL,
        StepStatus.STARTED,
        tool_name="x",
        tool_use_id=tool_use_id,
    )


def test_fenced_checkpoint_rolls_back_everything(runtime: Runtime) -> None:
    run, dispatch = submit(runtime.store)
    stale = runtime.store.claim(run.id, dispatch.token, "w", 30)
    assert stale is not None
    expire_lease(runtime.engine, run.id)
    (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
    assert runtime.store.claim(run.id, redispatch.token, "w", 30) is not None
    with pytest.raises(LeaseLost):
        runtime.store.checkpoint_model(stale, _checkpoint())
    with pytest.raises(LeaseLost):
        runtime.store.start_step(stale, _tool_row("t"))
    with pytest.raises(LeaseLost):
        runtime.store.finish(stale, RunStatus.SUCCEEDED)
    assert runtime.store.steps(run.id) == []
    after = runtime.store.get_run(run.id)
    assert after.tokens_used == 0
    assert after.status is RunStatus.RUNNING


def test_heartbeat_renews_held_leases_and_reports_only_takeovers(runtime: Runtime) -> None:
    run1, d1 = submit(runtime.store)
    run2, d2 = submit(runtime.store)
    run3, d3 = submit(runtime.store)
    c1 = runtime.store.claim(run1.id, d1.token, "w", 2)
    c2 = runtime.store.claim(run2.id, d2.token, "w", 2)
    c3 = runtime.store.claim(run3.id, d3.token, "w", 2)
    assert c1 is not None
    assert c2 is not None
    assert c3 is not None
    # run2 is taken over by another worker; run3's step commits (this worker lets it go).
    expire_lease(runtime.engine, run2.id)
    (redispatch,) = [d for d in runtime.store.redispatch_due(redispatch_after=3600)]
    assert runtime.store.claim(run2.id, redispatch.token, "other", 30) is not None
    runtime.store.checkpoint_model(c3, _checkpoint())
    held = [(c.run_id, c.epoch) for c in (c1, c2, c3)]
    assert runtime.store.renew_leases("w", held, 60) == {run2.id}, "only the takeover"
    renewed = runtime.store.get_run(run1.id)
    assert renewed.locked_until is not None
    assert (renewed.locked_until - c1.db_now).total_seconds() > 50
    assert runtime.store.get_run(run3.id).locked_until is None, "a released lease stays released"
    assert runtime.store.get_run(run2.id).locked_by == "other", "never extends another's lease"


def test_a_row_locked_by_a_slow_transaction_does_not_hold_back_the_other_renewals(
    runtime: Runtime,
) -> None:
    """On a saturated gevent worker a greenlet may keep a run's row locked for seconds (a
    write waiting for its turn of the hub). The heartbeat renews every lease in one statement:
    it must renew the others at once, not wait for that lock while every lease lapses and
    another worker takes the runs over (issue 36's saturated-worker test, 6 of 40 calls paid
    twice at a 3 s lease before this)."""
    run1, d1 = submit(runtime.store)
    run2, d2 = submit(runtime.store)
    c1 = runtime.store.claim(run1.id, d1.token, "w", 2)
    c2 = runtime.store.claim(run2.id, d2.token, "w", 2)
    assert c1 is not None
    assert c2 is not None
    held = [(c1.run_id, c1.epoch), (c2.run_id, c2.epoch)]
    answer: dict[str, set[uuid.UUID]] = {}
    with runtime.engine.connect() as slow:
        slow.execute(text("SELECT 1 FROM run WHERE id = :id FOR UPDATE"), {"id": run1.id})
        renewal = threading.Thread(
            target=lambda: answer.update(taken=runtime.store.renew_leases("w", held, 60)),
            daemon=True,
        )
        renewal.start()
        renewal.join(5)
        blocked = renewal.is_alive()
        slow.rollback()  # (lets a blocked renewal finish)
    renewal.join(10)
    assert not blocked, "the renewal waited for the row a slow transaction held"
    assert answer["taken"] == set(), "a lease skipped because its row is busy is not taken"
    renewed = runtime.store.get_run(run2.id)
    assert renewed.locked_until is not None
    assert (renewed.locked_until - c2.db_now).total_seconds() > 50, "the other is renewed"
    assert runtime.store.renew_leases("w", [(c1.run_id, c1.epoch)], 60) == set()
    later = runtime.store.get_run(run1.id)
    assert later.locked_until is not None
    assert (later.locked_until - c1.db_now).total_seconds() > 50, "renewed once the row is free"


def test_cancel_queued_ends_it_at_once(runtime: Runtime) -> None:
    run, dispatch = submit(runtime.store)
    assert runtime.store.cancel(run.id) is RunStatus.CANCELLED
    cancelled = runtime.store.get_run(run.id)
    assert cancelled.status is RunStatus.CANCELLED
    assert cancelled.finished_at is not None
    assert runtime.store.claim(run.id, dispatch.token, "w", 30) is None
    assert runtime.store.cancel(run.id) is None, "a finished run cannot be cancelled"
    assert runtime.store.cancel(uuid.uuid4()) is None


def test_cancel_running_is_noticed_by_the_next_guard(runtime: Runtime, llm: ScriptedLlm) -> None:
    llm.then_tool_use("toolu_1", "noop").then_text("never")
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)
    claim = runtime.store.claim(run.id, dispatch.token, "worker-A", 30)
    assert claim is not None
    # The lease is live: cancel only sets the flag.
    assert runtime.store.cancel(run.id) is RunStatus.RUNNING
    result = runtime.driver().execute(claim)  # the step in flight completes...
    assert result.dispatch is not None
    result = runtime.driver().drive(run.id, result.dispatch.token)  # ...the next one stops
    after = runtime.store.get_run(run.id)
    assert after.status is RunStatus.CANCELLED
    assert after.error == "cancelled by request"
    assert len(llm.requests) == 1, "no model call after the cancel was noticed"
    assert [s.status for s in runtime.store.steps(run.id)] == [StepStatus.DONE]


def test_reaper_skips_live_leases_and_fresh_messages(runtime: Runtime) -> None:
    run, dispatch = submit(runtime.store)
    assert runtime.store.redispatch_due(redispatch_after=30) == [], "message is fresh"
    claim = runtime.store.claim(run.id, dispatch.token, "w", 30)
    assert claim is not None
    assert runtime.store.redispatch_due(redispatch_after=0) == [], "lease is live"
    expire_lease(runtime.engine, run.id)
    first = runtime.store.redispatch_due(redispatch_after=30)
    assert [d.run_id for d in first] == [run.id]
    # A second reaper (two beats) right after finds nothing to do.
    assert runtime.store.redispatch_due(redispatch_after=30) == []
    assert runtime.store.get_run(run.id).dispatch_token == first[0].token


def test_two_reapers_at_once_dispatch_each_run_once(runtime: Runtime) -> None:
    for _ in range(30):
        _run, _d = submit(runtime.store)
        runtime.store.mark_undispatched(_d)
    results: list[list[uuid.UUID]] = []
    barrier = threading.Barrier(2)

    def reaper() -> None:
        barrier.wait()
        results.append([d.run_id for d in runtime.store.redispatch_due(redispatch_after=30)])

    threads = [threading.Thread(target=reaper) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    all_ids = results[0] + results[1]
    assert len(all_ids) == 30
    assert len(set(all_ids)) == 30, "no run dispatched by both reapers"


def test_a_run_that_keeps_killing_its_worker_ends_failed(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)
    limit = runtime.settings.max_claims_without_progress
    token = dispatch.token
    for _ in range(limit):
        claim = runtime.store.claim(run.id, token, "w", 30)
        assert claim is not None
        # the worker dies here, every time
        expire_lease(runtime.engine, run.id)
        (redispatch,) = runtime.store.redispatch_due(redispatch_after=3600)
        token = redispatch.token
    result = runtime.driver().drive(run.id, token)
    assert result.status is RunStatus.FAILED
    failed = runtime.store.get_run(run.id)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None
    assert f"{limit} times" in failed.error
    assert llm.requests == []


def test_a_claim_that_meets_a_database_outage_sends_its_message_again_soon(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    """PostgreSQL refusing connections (a restart, "too many clients") at the claim: the
    message comes back in seconds with the same token, instead of the run waiting for the
    reaper's sweep; the run is untouched and the next delivery claims it."""
    from db.engine import make_engine
    from db.store import RunStore
    from runtime.engine.driver import CLAIM_RETRY_SECONDS, Driver
    from runtime.pipeline.checkpoint import Outcome

    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store)
    unreachable = make_engine("postgresql://postgres@127.0.0.1:1/postgres", pool_size=1)
    try:
        down = Driver(
            store=RunStore(unreachable),
            agents=runtime.agents,
            llm=llm,
            settings=runtime.settings,
            worker="worker-A",
        )
        result = down.drive(dispatch.run_id, dispatch.token)
    finally:
        unreachable.dispose()
    assert result.outcome is Outcome.WAITING
    assert result.dispatch is not None
    assert (result.dispatch.run_id, result.dispatch.token) == (run.id, dispatch.token)
    low, high = CLAIM_RETRY_SECONDS
    assert low <= result.dispatch.delay_seconds <= high
    assert runtime.store.get_run(run.id).status is RunStatus.QUEUED
    llm.then_text("done")
    again = runtime.driver(worker="worker-A").drive(run.id, result.dispatch.token)
    # the model step ran and was checkpointed; its answer ended the run, there and then
    assert again.outcome is Outcome.FINISHED
    assert [s.step_key for s in runtime.store.steps(run.id)] == ["model:1"]
