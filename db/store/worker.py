"""The worker's statements: claiming a run and recording what its steps did, fenced by the
lease (every write conditioned on the holder and epoch, ``LeaseLost`` when it is gone)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal
from typing import Any

from db import jsontext
from db.errors import LeaseLost
from db.queries import QUERIES as Q
from db.records import (
    Claim,
    Dispatch,
    NewAudit,
    NewRun,
    NewStep,
    Run,
    RunStatus,
    Step,
    StepOrigin,
    TreeSpend,
    Usage,
)
from db.store.base import (
    MESSAGE_SIGNAL,
    StoreBase,
    _end_children,
    _fence,
    _insert_signal,
    _json,
    _new_run_params,
    _record_audit,
    _run,
    _step,
    _wake,
)


class WorkerStore(StoreBase):
    """What a worker writes while it holds a run: claims, every fenced record of the
    pipeline's checkpoint (steps, model calls, timers, the run's end, messages and signals
    delivered, children started), wakes, and billing. Only ``runtime/pipeline`` and the
    driver call these (``tests/unit/test_one_pipeline.py``)."""

    def _claimed(self, row: Mapping[Any, Any] | None, worker: str) -> Claim | None:
        if row is None:
            return None
        run = _run(row)
        return Claim(
            run=run,
            worker=worker,
            epoch=run.lease_epoch,
            db_now=row["db_now"],
            status_changes=row["status_changes"],
        )

    def claim(
        self, run_id: uuid.UUID, token: uuid.UUID, worker: str, lease_s: float
    ) -> Claim | None:
        """Claim the run for the message carrying ``token``; ``None`` when the message is
        stale or duplicated, the lease is live, or the run is not due."""
        row = self._fast.one(
            "claim_run",
            {
                "id": run_id,
                "token": token,
                "worker": worker,
                "lease_seconds": lease_s,
                "deployment": self.deployment,
            },
        )
        return self._claimed(row, worker)

    def claim_to_end(
        self, run_id: uuid.UUID, token: uuid.UUID, worker: str, lease_s: float
    ) -> Claim | None:
        """:meth:`claim`, by the worker that handed the run on with ``token`` after a step
        that ended its conversation, to end it without a message; ``None`` also when a
        message was posted to the run meanwhile (its delivery is a step: send ``token``)."""
        row = self._fast.one(
            "claim_run_to_end",
            {
                "id": run_id,
                "token": token,
                "worker": worker,
                "lease_seconds": lease_s,
                "deployment": self.deployment,
            },
        )
        return self._claimed(row, worker)

    def claim_next(self, worker: str, lease_s: float) -> Claim | None:
        """Claim any due run (QUEUED, or RUNNING with a lapsed lease)."""
        with self._statement() as conn:
            row = (
                conn.execute(
                    Q["claim_next_run"],
                    {"worker": worker, "lease_seconds": lease_s, "deployment": self.deployment},
                )
                .mappings()
                .first()
            )
        return self._claimed(row, worker)

    def renew_leases(
        self, worker: str, held: Iterable[tuple[uuid.UUID, int]], lease_seconds: float
    ) -> set[uuid.UUID]:
        """Extend the leases this worker holds; returns the run ids taken over by another
        claim since (a lease this worker released itself is not reported)."""
        pairs = list(held)
        if not pairs:
            return set()
        epochs = dict(pairs)
        with self._statement() as conn:
            rows = conn.execute(
                Q["renew_leases"],
                {
                    "worker": worker,
                    "lease_seconds": lease_seconds,
                    "ids": [p[0] for p in pairs],
                    "epochs": [p[1] for p in pairs],
                },
            ).all()
        return {r.id for r in rows if not r.renewed and r.lease_epoch != epochs[r.id]}

    def renew_claims(
        self, worker: str, claiming: Iterable[tuple[uuid.UUID, uuid.UUID]], lease_seconds: float
    ) -> None:
        """Extend the leases of the runs this worker is claiming for (run id, token) whose
        claim may have committed though its answer was not read yet (the epoch is not known:
        the token and the holder's name stand for it until then)."""
        pairs = list(claiming)
        if not pairs:
            return
        with self._statement() as conn:
            conn.execute(
                Q["renew_claims"],
                {
                    "worker": worker,
                    "lease_seconds": lease_seconds,
                    "ids": [p[0] for p in pairs],
                    "tokens": [p[1] for p in pairs],
                },
            )

    # -- checkpoints (fenced) -----------------------------------------------------------

    def checkpoint_model(self, claim: Claim, step: NewStep) -> Dispatch:
        """A model call's row, token counters and lease hand-over in one statement."""
        token = uuid.uuid4()
        written = self._record(None, claim, step, token)
        self.step_logs.wrote(claim.run_id, claim.epoch, [written], token)
        return Dispatch(claim.run_id, token)

    def schedule(
        self,
        claim: Claim,
        delay_seconds: float,
        *,
        reason: str,
        model_attempts: int = 0,
        admission: bool = False,
        wakeable: bool = False,
    ) -> Dispatch:
        """Park the run on a durable timer and release the lease; nothing recorded, so it
        is not progress. ``model_attempts`` persists the attempts of the model step in flight.
        ``admission``: the step was refused capacity before it began, so this claim does not
        count as one without progress either. ``wakeable``: a wake (:meth:`wake`, a freed
        concurrency-key slot) may bring it forward; otherwise the timer is a floor (a
        server's retry-after, a backoff). Fenced."""
        with self._fenced(claim, transaction=False) as f:
            self._schedule(
                None,
                claim,
                delay_seconds,
                f.token,
                reason,
                False,
                model_attempts,
                admission,
                wakeable=wakeable,
            )
            f.written = []
        return Dispatch(claim.run_id, f.token, delay_seconds)

    def record_unrecorded_usage(
        self,
        run_id: uuid.UUID,
        usage: Usage,
        cost: Decimal,
        *,
        unless_step: tuple[str, int] | None = None,
        estimated_tokens: int = 0,
        then: Callable[[], None] | None = None,
    ) -> bool:
        """Count a billed model call whose checkpoint was refused against the run; with
        ``unless_step`` (key, epoch) only when no such step row was written. With the
        database away the count is kept in this process and written when it answers again
        (:class:`db.owed.OwedUsage`): returns ``False`` then. ``estimated_tokens`` of it are
        an estimate (a call lost with its worker; negative when the API's count replaces
        an estimate). ``then`` runs once it is written, now or later."""
        key, epoch = unless_step if unless_step is not None else (None, None)
        params = {
            "id": run_id,
            "total_tokens": usage.total,
            "cost_usd": cost,
            "step_key": key,
            "epoch": epoch,
            "estimated_tokens": estimated_tokens,
        }
        return self.owed.write_or_owe(params, then)

    def record_steps(
        self,
        claim: Claim,
        steps: list[NewStep],
        *,
        delay_seconds: float | None = None,
        reason: str | None = None,
        model_attempts: int = 0,
        wakeable: bool = False,
    ) -> Dispatch:
        """Checkpoint steps: the rows, the token counters and the lease hand-over (or a
        durable timer, with ``delay_seconds``; ``wakeable`` as for :meth:`schedule`) in one
        transaction. Fenced."""
        token = uuid.uuid4()
        if delay_seconds is None and len(steps) == 1:  # the common case: one statement
            written = [self._record(None, claim, steps[0], token)]
            self.step_logs.wrote(claim.run_id, claim.epoch, written, token)
            return Dispatch(claim.run_id, token)
        with self._fenced(claim, token) as f:
            f.written = [self._record(f.conn, claim, step) for step in steps]
            self._hand_over(
                f.conn,
                claim,
                token,
                delay_seconds,
                reason,
                bool(steps),
                model_attempts,
                wakeable=wakeable,
            )
        return Dispatch(claim.run_id, token, delay_seconds or 0.0)

    def suspend_for_approval(
        self,
        claim: Claim,
        step: NewStep,
        *,
        role: str,
        payload: Any,
        timeout_seconds: float,
        timeout_policy: str,
        discard_copied: bool = False,
    ) -> uuid.UUID:
        """Record the PENDING approval and suspend the run (no lease). Fenced. With
        ``discard_copied``, a fork asks again for an approval it copied: the row becomes its
        own and the copied rows nested in it are dropped, in the same transaction."""
        self.step_logs.forget(claim.run_id)  # a decision gives the run a new token anyway
        with self.engine.begin() as conn:
            if discard_copied:
                conn.execute(
                    Q["discard_copied_step"], {"id": claim.run_id, "step_key": step.step_key}
                )
            self._record(conn, claim, step)
            suspended = conn.execute(
                Q["suspend_run"],
                {
                    **_fence(claim),
                    "next_token": uuid.uuid4(),
                    "reason": f"waiting for approval by {role} ({step.step_key})",
                },
            ).first()
            if suspended is None:
                raise LeaseLost(claim.run_id, "suspend refused by the fence")
            approval_id: uuid.UUID = conn.execute(
                Q["insert_approval"],
                {
                    "approval_id": uuid.uuid4(),
                    "id": claim.run_id,
                    "step_key": step.step_key,
                    "role": role,
                    "payload": _json(payload),
                    "payload_hash": step.input_hash,
                    "timeout_policy": timeout_policy,
                    "timeout_seconds": timeout_seconds,
                },
            ).scalar_one()
            if suspended.status == RunStatus.CANCELLED:  # cancelled while the step ran
                conn.execute(Q["cancel_pending_approvals"], {"id": claim.run_id})
        return approval_id

    def start_step(self, claim: Claim, step: NewStep) -> None:
        """Record a step with an effect STARTED before its code runs (or again, when it is
        entered once more). Fenced."""
        row = self._fast.one(
            "start_step",
            {
                **_fence(claim),
                "seq": step.seq,
                "step_key": step.step_key,
                "kind": str(step.kind),
                "tool_name": step.tool_name,
                "tool_use_id": step.tool_use_id,
                "attempt": step.attempt,
                "input_hash": step.input_hash,
            },
        )
        if row is None:
            self.step_logs.forget(claim.run_id)
            raise LeaseLost(claim.run_id, "step start refused by the fence")
        self.step_logs.wrote(claim.run_id, claim.epoch, [_step(row)])

    def record_child(self, claim: Claim, step: NewStep) -> None:
        """Record a step inside a step that is still running (a model call inside
        ``steps.llm``, a nested step) and add its tokens to the run, without handing the
        lease on. Fenced."""
        with self._statement() as conn:
            written = self._record(conn, claim, step)
        self.step_logs.wrote(claim.run_id, claim.epoch, [written])

    def begin_stop(self, claim: Claim, reason: str) -> None:
        """Mark the run as stopping for ``reason`` while its compensations run. Fenced."""
        with self._statement() as conn:
            row = conn.execute(Q["begin_stop"], {**_fence(claim), "error": reason}).first()
        if row is None:
            raise LeaseLost(claim.run_id, "stop refused by the fence")

    def finish(
        self,
        claim: Claim,
        status: RunStatus,
        *,
        result: Any = None,
        error: str | None = None,
    ) -> Run:
        """End the run (or park it NEEDS_ATTENTION) and release the lease; the run as it
        ends. Fenced."""
        self.step_logs.forget(claim.run_id)
        row = self._fast.one(
            "finish_run",
            {
                **_fence(claim),
                "status": str(status),
                "result": _json(result),
                "error": jsontext.text(error),
            },
        )
        if row is None:
            raise LeaseLost(claim.run_id, "finish refused by the fence")
        return _run(row)

    # -- control ------------------------------------------------------------------------

    def park_for_child(
        self, claim: Claim, child_id: uuid.UUID, delay_seconds: float, reason: str
    ) -> Dispatch | None:
        """Park the parent until its child ends (a timer of ``delay_seconds`` as a fallback),
        unless the child has ended already (``None``: read its result now). Under the
        parent's row lock, as :meth:`wait_for_signal`: a child that ends meanwhile finds the
        parent parked and wakes it. Fenced."""
        token = uuid.uuid4()
        with self.engine.begin() as conn:
            conn.execute(Q["lock_run_row"], {"id": claim.run_id})
            child = conn.execute(Q["get_run"], {"id": child_id}).first()
            if child is None or RunStatus(child.status).terminal:
                return None
            # a wait is progress; woken when the child ends
            self._schedule(conn, claim, delay_seconds, token, reason, True, 0, wakeable=True)
        return Dispatch(claim.run_id, token, delay_seconds)

    def hold_tree_budget(
        self,
        claim: Claim,
        step_key: str,
        tokens: int,
        cost: Decimal,
        admit: Callable[[TreeSpend], bool],
    ) -> tuple[TreeSpend, bool]:
        """For a model call of a child run: under the tree's lock, what the tree has spent
        and holds; when ``admit`` says the call may start, hold its worst case (``tokens``,
        ``cost``) against the root's budget until :meth:`release_tree_budget`. Returns the
        spend read and whether the hold was written. Holds of ended runs are swept."""
        params = {"id": claim.run_id, "epoch": claim.epoch}
        with self.engine.begin() as conn:
            root = conn.execute(Q["tree_root"], params).scalar_one()
            conn.execute(Q["lock_tree_budget"], {"root": root})
            conn.execute(Q["sweep_tree_holds"], {"root": root})
            row = conn.execute(Q["tree_spend"], {**params, "root": root}).mappings().one()
            spend = TreeSpend(
                root=root,
                token_budget=row["token_budget"],
                cost_budget_usd=row["cost_budget_usd"],
                spent=int(row["spent"]),
                cost=Decimal(row["cost"]),
                held=int(row["held"]),
                held_cost=Decimal(row["held_cost"]),
                in_flight=int(row["in_flight"]),
            )
            admitted = admit(spend)
            if admitted:
                conn.execute(
                    Q["hold_tree_budget"],
                    {
                        **params,
                        "root": root,
                        "step_key": step_key,
                        "tokens": tokens,
                        "cost_usd": cost,
                    },
                )
        return spend, admitted

    def release_tree_budget(self, run_id: uuid.UUID, epoch: int) -> None:
        """The model call's tokens are counted on its run: its hold (and those of the run's
        earlier leases) go."""
        with self._statement() as conn:
            conn.execute(Q["release_tree_budget"], {"id": run_id, "epoch": epoch})

    def cancel_children(self, run_id: uuid.UUID) -> None:
        """Cancel a run's live children, down the tree (the run itself ended early). The
        run's ``steps.child`` steps that waited for a child cancelled here become
        ``RETRYING``, in the same transaction: a resume starts those children again."""
        with self.engine.begin() as conn:
            _end_children(conn, run_id)

    def start_children(
        self,
        claim: Claim,
        started: list[tuple[NewStep, NewRun, uuid.UUID]],
        recheck: float,
        reason: str,
    ) -> list[Dispatch]:
        """Insert each child run with its parent's ``PENDING`` step, and park the parent (a
        timer of ``recheck`` seconds, woken sooner when a child ends), in one transaction:
        a child exists exactly when its step does. Returns the children's first drive_run
        messages. Fenced."""
        created: list[Dispatch] = []
        with self._fenced(claim) as f:
            written = []
            for step, child, child_id in started:
                params = _new_run_params(child, child_id, self.deployment)
                row = f.conn.execute(Q["create_run"], params).mappings().one()
                created.append(Dispatch(row["id"], row["dispatch_token"]))
                written.append(self._record(f.conn, claim, step))
            self._hand_over(f.conn, claim, f.token, recheck, reason, True, 0, wakeable=True)
            f.written = written
        return created

    def record_recovery(
        self, run_id: uuid.UUID, *, tenant: str, actor: str, action: str, detail: Any
    ) -> None:
        """One entry of a run's recovery trail (``recovery.*``): an audit event, and through
        the trigger of migration 0019 a ``run.recovery`` event of its live stream."""
        with self.engine.begin() as conn:
            _record_audit(
                conn, run_id, NewAudit(actor=actor, action=action, tenant=tenant, detail=detail)
            )

    def record_replayed(
        self, claim: Claim, step: NewStep, original: Step, *, hand_over: bool
    ) -> Dispatch | None:
        """Record a model step a fork answered from ``original`` (the source run's row) without
        calling the model: no tokens billed, what the original paid kept apart. With
        ``hand_over`` it is the task's step (the lease is handed on, as a checkpoint does);
        else a child step of a running durable step. Fenced."""
        token = uuid.uuid4() if hand_over else None
        with self.engine.begin() as conn:
            self._record(conn, claim, step, token)
            marked = (
                conn.execute(
                    Q["mark_step_origin"],
                    {
                        "id": claim.run_id,
                        "step_key": step.step_key,
                        "origin": str(StepOrigin.REPLAYED),
                        "original_tokens": (original.original_tokens or 0) + original.usage.total,
                        "original_cost_usd": (original.original_cost_usd or 0) + original.cost_usd,
                    },
                )
                .mappings()
                .one()
            )
        self.step_logs.wrote(claim.run_id, claim.epoch, [_step(marked)], token)
        return Dispatch(claim.run_id, token) if token is not None else None

    # -- the live stream's durable events -------------------------------------------------

    def wake(self, run_id: uuid.UUID, *, send: bool = True) -> Dispatch | None:
        """A run parked on something that has come (a concurrency-key slot, its child's end)
        goes now: the message to send, or ``None`` when it is not parked any more. With
        ``send`` false the reaper's next sweep sends it (the message returned is for
        information only)."""
        with self._statement() as conn:
            return _wake(conn, run_id, send=send)

    def deliver_message(self, claim: Claim, row_for: Callable[[Any], NewStep]) -> Dispatch | None:
        """Deliver the oldest pending message: consume it, count it delivered and record the
        step ``row_for(content)`` in one transaction, handing the lease on (never lost,
        never twice). ``None`` when there is none. Fenced."""
        with self._fenced(claim) as f:
            params = {"run_id": claim.run_id, "name": MESSAGE_SIGNAL}
            found = f.conn.execute(Q["pending_signal"], params).first()
            if found is None:
                return None
            step = row_for(found.payload)
            f.conn.execute(Q["consume_signal"], {"id": found.id, "step_key": step.step_key})
            f.conn.execute(Q["message_delivered"], {"id": claim.run_id})
            f.written = [self._record(f.conn, claim, step, f.token)]
        return Dispatch(claim.run_id, f.token)

    def wait_for_signal(
        self,
        claim: Claim,
        rows: list[NewStep],
        *,
        signal: str | None,
        delay_seconds: float,
        reason: str,
    ) -> Dispatch | None:
        """Record ``rows`` and park the run on a durable timer, unless a signal named
        ``signal`` is already there (then nothing is written and ``None`` returned: consume
        it). The check and the parking hold the run's row lock, so a signal that commits
        meanwhile either is seen here or finds the run parked and wakes it. Fenced."""
        with self._fenced(claim) as f:
            if signal is not None:
                f.conn.execute(Q["lock_run_row"], {"id": claim.run_id})
                params = {"run_id": claim.run_id, "name": signal}
                if f.conn.execute(Q["pending_signal"], params).first() is not None:
                    return None
            written = [self._record(f.conn, claim, step) for step in rows]
            # A wait is progress: a run that waits long is not a run that keeps killing
            # workers. A wait for a signal is woken by it; a sleep's timer is a floor.
            self._schedule(
                f.conn, claim, delay_seconds, f.token, reason, True, 0, wakeable=signal is not None
            )
            f.written = written
        return Dispatch(claim.run_id, f.token, delay_seconds)

    def consume_signal(
        self, claim: Claim, name: str, row_for: Callable[[Any], NewStep]
    ) -> tuple[Any, Dispatch] | None:
        """Consume the oldest pending signal ``name`` and record the step ``row_for(payload)``
        in one transaction, handing the lease on: the signal is delivered once. ``None``
        when there is none. Fenced."""
        with self._fenced(claim) as f:
            params = {"run_id": claim.run_id, "name": name}
            found = f.conn.execute(Q["pending_signal"], params).first()
            if found is None:
                return None
            step = row_for(found.payload)
            f.conn.execute(Q["consume_signal"], {"id": found.id, "step_key": step.step_key})
            f.written = [self._record(f.conn, claim, step, f.token)]
        return found.payload, Dispatch(claim.run_id, f.token)

    def send_signal(
        self,
        claim: Claim,
        step: NewStep,
        *,
        target: uuid.UUID,
        name: str,
        payload: Any,
        idempotency_key: str,
    ) -> tuple[Dispatch, Dispatch | None]:
        """``steps.send``: the signal for ``target``, the sender's step row and the wake of
        the target in one transaction (the key makes a second insert a no-op): exactly once,
        and a sender that dies after it never leaves the target asleep on a signal it has.
        Returns the sender's next message and the target's (``None``: it was not parked).
        Raises :class:`RunNotFound` (no such run in the sender's tenant) or
        :class:`InvalidTransition` (it ended), writing nothing. Fenced."""
        with self._fenced(claim) as f:
            # Both rows locked in one order: two runs sending to each other at once queue
            # instead of deadlocking.
            f.conn.execute(Q["lock_runs_in_order"], {"ids": [claim.run_id, target]})
            _insert_signal(
                f.conn, target, name, payload, idempotency_key, f"run:{claim.run_id}",
                claim.run.tenant,
            )  # fmt: skip
            f.written = [self._record(f.conn, claim, step, f.token)]
            woken = _wake(f.conn, target, send=True)
        return Dispatch(claim.run_id, f.token), woken

    # -- schedules ------------------------------------------------------------------------
