"""The heartbeat renews a lease from the moment its claim may have committed (issue 36).

On a busy gevent hub the greenlet that sent a claim may read its answer seconds after it
committed; until then it holds no :class:`HeldLease` for the heartbeat to renew, and the
lease it does hold lapses while it is alive: another worker takes the run over, a claim is
wasted and a model call may be paid twice. :meth:`Heartbeat.claiming` covers that window,
by the message's token and the holder's name (the epoch is not known yet)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import text

from db.records import Claim
from runtime.engine.bootstrap import Runtime
from runtime.pipeline.heartbeat import Heartbeat
from tests.support import expire_lease, register_agent, submit


def _nearly_lapsed(runtime: Runtime, run_id: uuid.UUID) -> None:
    """The claim's answer is read late: its lease has a second left."""
    with runtime.engine.begin() as conn:
        conn.execute(
            text("UPDATE run SET locked_until = now() + interval '1 second' WHERE id = :id"),
            {"id": run_id},
        )


def _lapsed(runtime: Runtime, run_id: uuid.UUID) -> bool:
    with runtime.engine.connect() as conn:
        return bool(
            conn.execute(
                text("SELECT locked_until < now() + interval '30 seconds' FROM run WHERE id = :id"),
                {"id": run_id},
            ).scalar_one()
        )


def test_a_claim_not_read_yet_is_renewed_by_its_token(runtime: Runtime) -> None:
    beat = Heartbeat(runtime.lease_store(), "w", lease_seconds=60, interval_seconds=1)
    mine, d1 = submit(runtime.store)
    others, d2 = submit(runtime.store)
    moved_on, d3 = submit(runtime.store)
    with (
        beat.claiming(mine.id, d1.token, "w"),
        beat.claiming(others.id, d2.token, "w"),
        beat.claiming(moved_on.id, d3.token, "w"),
    ):
        assert runtime.store.claim(mine.id, d1.token, "w", 2) is not None
        assert runtime.store.claim(others.id, d2.token, "other", 2) is not None
        assert runtime.store.claim(moved_on.id, d3.token, "w", 2) is not None
        for run_id in (mine.id, others.id, moved_on.id):
            _nearly_lapsed(runtime, run_id)
        with runtime.engine.begin() as conn:  # a step of that run committed meanwhile
            conn.execute(
                text("UPDATE run SET dispatch_token = :t, locked_by = NULL WHERE id = :id"),
                {"t": uuid.uuid4(), "id": moved_on.id},
            )
        beat.beat()
        assert not _lapsed(runtime, mine.id), "the claim sent and not read yet is renewed"
        assert _lapsed(runtime, others.id), "never a lease another worker holds"
        assert runtime.store.get_run(moved_on.id).locked_until is not None
        assert _lapsed(runtime, moved_on.id), "never a run whose token moved on"


def test_a_lapsed_lease_under_the_same_name_and_token_is_not_renewed(runtime: Runtime) -> None:
    """A dead predecessor of the same name (a restarted container) held the run with the
    token this claim carries; its lease lapsed, which is why the message came again. The
    claim being sent must not keep that lease alive, or it would find it held and drop."""
    beat = Heartbeat(runtime.lease_store(), "w", lease_seconds=60, interval_seconds=1)
    run, dispatch = submit(runtime.store)
    assert runtime.store.claim(run.id, dispatch.token, "w", 2) is not None  # the dead one
    expire_lease(runtime.engine, run.id)
    with beat.claiming(run.id, dispatch.token, "w"):
        beat.beat()  # before this claim reached the database
        assert runtime.store.claim(run.id, dispatch.token, "w", 2) is not None


def test_once_held_a_claim_is_renewed_by_its_epoch_only(runtime: Runtime) -> None:
    beat = Heartbeat(runtime.lease_store(), "w", lease_seconds=60, interval_seconds=1)
    run, dispatch = submit(runtime.store)
    with beat.claiming(run.id, dispatch.token, "w"):
        claim = runtime.store.claim(run.id, dispatch.token, "w", 2)
        assert claim is not None
        with beat.hold(claim):
            pass  # the step ran and let the lease go
        # A claim of the same message by the same name, later (its own lease): the first
        # claim's window is closed, so the heartbeat does not keep that lease alive.
        expire_lease(runtime.engine, run.id)
        again = runtime.store.claim(run.id, dispatch.token, "w", 2)
        assert again is not None
        _nearly_lapsed(runtime, run.id)
        beat.beat()
        assert _lapsed(runtime, run.id)


def test_drive_renews_its_claim_before_it_reads_the_answer(runtime: Runtime) -> None:
    """The driver's claim is inside the heartbeat's window: a beat that runs between the
    claim's commit and its answer keeps the lease."""
    register_agent(runtime.agents)
    runtime.llm.then_text("done")  # type: ignore[attr-defined]
    driver = runtime.driver(worker="worker-A")
    run, dispatch = submit(runtime.store)
    claim_of = runtime.store.claim
    seen: list[bool] = []

    def claim_late(*args: Any, **kwargs: Any) -> Claim | None:
        claim = claim_of(*args, **kwargs)
        _nearly_lapsed(runtime, run.id)  # the greenlet reads the answer as the lease ends
        driver.heartbeat.beat()  # ... and the heartbeat ran meanwhile
        seen.append(runtime.store.get_run(run.id).lease_epoch == 1 and _renewed(run.id))
        return claim

    def _renewed(run_id: uuid.UUID) -> bool:
        with runtime.engine.connect() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT locked_until > now() + interval '3 seconds' FROM run WHERE id = :id"
                    ),
                    {"id": run_id},
                ).scalar_one()
            )

    runtime.store.claim = claim_late  # type: ignore[method-assign]
    try:
        driver.drive(run.id, dispatch.token)
    finally:
        del runtime.store.claim
    assert seen == [True], "the lease lapsed before the claim's answer was read"
