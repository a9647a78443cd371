"""The one step executor: claim -> read -> guard -> execute one step -> checkpoint -> hand over.

It knows no Celery and no HTTP: a Celery task, a test or a plain loop calls
:meth:`Driver.drive` (for a dispatched message) or :meth:`Driver.drive_next` (poll), and sends
the returned :class:`Dispatch`, if any, only after this call has returned, that is after the
step has been committed.

Both programming models are programs over the same step log, run by the same :class:`Task`:
the agent loop (:mod:`runtime.agentloop.loop`) and durable functions (:mod:`runtime.durable`).
Where each behaviour lives, once:

- what differs per kind of step, and the one lookup of a step key: :mod:`runtime.pipeline.kinds`;
- fencing: every write in :mod:`db.store` (``LeaseLost`` when the lease is gone);
- the guard, every record (across a database blip) and the ways a task ends (checkpoint,
  timer, finish): :mod:`runtime.pipeline.checkpoint`;
- STARTED / in-doubt / timeout of every step with an effect, and its row:
  :mod:`runtime.pipeline.effects`;
- the model-call sequence, its attempts and its billing: :mod:`runtime.pipeline.modelcall`;
- stopping a durable function early, with its compensations: ``Execution.stop``
  (:mod:`runtime.durable.execution`, :mod:`runtime.durable.compensation`).
"""

from __future__ import annotations

import logging
import random
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

from db.errors import DatabaseUnavailable, ValueRefused
from db.records import Claim, Dispatch, RunStatus, Step, StepStatus
from db.store import RunStore
from runtime.admission.concurrency_keys import KeyGate, KeyWait, Slot, tenant_key
from runtime.admission.flow_control import FlowControl
from runtime.agentloop.loop import run_agent
from runtime.agents import Agent, AgentRegistry, UnknownAgent
from runtime.config import Settings
from runtime.durable.api import DurableAgent
from runtime.durable.compensation import unwind_recorded
from runtime.durable.execution import Execution
from runtime.llm.base import LlmClient
from runtime.llm.pricing import PriceTable
from runtime.mcp.client import McpClients
from runtime.observe.logctx import log_context
from runtime.observe.metrics import Metrics
from runtime.pipeline.checkpoint import Outcome, Services, StepResult, Task, short
from runtime.pipeline.faults import crash_point
from runtime.pipeline.heartbeat import Heartbeat
from runtime.pipeline.modelcall import estimate_tokens
from runtime.pipeline.prompthash import PromptHashes, prompt_hash
from runtime.pipeline.replay import ReplayCache

if (
    TYPE_CHECKING
):  # runtime.observe.live_channel imports redis (and ssl): not before gevent patches it
    from runtime.observe.live_channel import LiveChannel

log = logging.getLogger(__name__)

CLAIM_RETRY_SECONDS = (1.0, 5.0)
"""A message whose claim met a database outage comes back after this long (uniform)."""
MAX_WAITERS_SKIPPED = 20
"""Waiters no longer parked that one released slot skips before giving up to their timers."""

__all__ = [
    "Dispatch",
    "Driver",
    "Outcome",
    "StepResult",
    "estimate_tokens",
    "prompt_hash",
    "short",
]


class Driver:
    def __init__(
        self,
        *,
        store: RunStore,
        agents: AgentRegistry,
        llm: LlmClient,
        settings: Settings,
        pricing: PriceTable | None = None,
        heartbeat: Heartbeat | None = None,
        worker: str | None = None,
        metrics: Metrics | None = None,
        mcp: McpClients | None = None,
        live: LiveChannel | None = None,
        flow: FlowControl | None = None,
        keys: KeyGate | None = None,
        end_in_place: bool = True,
    ) -> None:
        self.store = store
        self.end_in_place = end_in_place
        """End a run in the task whose step ended its conversation (:meth:`_end_here`);
        off, the end is a task of its own, from its message (tests of that task)."""
        self.agents = agents
        self.llm = llm
        self.settings = settings
        self.pricing = pricing or PriceTable.from_json(None)
        self.worker = worker or settings.worker_name
        self.metrics = metrics
        self.mcp = mcp
        self.live = live
        self.flow = flow
        self.replays = ReplayCache()
        self.hashes = PromptHashes()
        self.heartbeat = heartbeat or Heartbeat(
            store,
            self.worker,
            lease_seconds=settings.lease_seconds,
            interval_seconds=settings.heartbeat_seconds,
        )
        self.keys = keys
        if keys is not None:  # key slots live exactly as long as the leases of their steps
            self.heartbeat.also_renew(keys.renew)

    # -- entry points -------------------------------------------------------------------

    def drive(self, run_id: uuid.UUID, token: uuid.UUID) -> StepResult:
        """Handle one drive_run message: at most one step. The heartbeat renews the lease
        from the moment the claim may have committed (:meth:`Heartbeat.claiming`), not
        only once its answer was read: on a busy hub that can be seconds later."""
        with self.heartbeat.claiming(run_id, token, self.worker):
            try:
                claim = self.store.claim(run_id, token, self.worker, self.settings.lease_seconds)
            except DatabaseUnavailable as e:
                # PostgreSQL is unreachable or out of connections: nothing was claimed (or, if
                # the claim committed and its answer was lost, its lease lapses as any crash's
                # would). The same message again in a few seconds, rather than the run waiting
                # for the reaper's sweep; jittered, so a fleet's messages do not return at once.
                delay = random.uniform(*CLAIM_RETRY_SECONDS)
                log.warning(
                    "run=%s could not be claimed (%s); its message comes back in %.1fs",
                    short(run_id),
                    e,
                    delay,
                    extra={"run_id": str(run_id)},
                )
                return StepResult(Outcome.WAITING, dispatch=Dispatch(run_id, token, delay))
            if claim is None:
                elsewhere = self._of_another_version(run_id, token)
                if elsewhere is not None:
                    return elsewhere
                log.debug(
                    "run=%s message dropped (stale, duplicate, or lease held)",
                    short(run_id),
                    extra={"run_id": str(run_id)},
                )
                return StepResult(Outcome.DROPPED)
            crash_point("after_claim")
            result = self.execute(claim, token)
            if result.dispatch is not None:
                crash_point("after_checkpoint")
                if result.ends_next and self.end_in_place and not result.dispatch.delay_seconds:
                    return self._end_here(result)
            return result

    def _of_another_version(self, run_id: uuid.UUID, token: uuid.UUID) -> StepResult | None:
        """A message this worker could not claim because its run is of another version (it
        reached the wrong queue: sent before an upgrade, or to ``DAR_QUEUE`` when its version
        could not be read): nothing runs here, and the message goes on to the run's own
        version's queue rather than being lost. ``None`` for any other refused claim."""
        serves = self.store.deployment
        if serves is None:
            return None
        try:
            run = self.store.get_run(run_id)
        except Exception:  # gone, or the database away: the reaper sends it later
            return None
        if (
            run.dispatch_token != token
            or run.status not in (RunStatus.QUEUED, RunStatus.RUNNING)
            or run.deployment in (None, serves)
        ):
            return None
        log.info(
            "run=%s is of version %s; this worker serves %s: its message goes to its own queue",
            short(run_id),
            run.deployment,
            serves,
            extra={"run_id": str(run_id)},
        )
        return StepResult(Outcome.REROUTED, dispatch=Dispatch(run_id, token))

    def _end_here(self, result: StepResult) -> StepResult:
        """The step just checkpointed ended the run's conversation: what is left is the
        run's end, no step. This worker claims it with the token it handed the run on with,
        as the message would have, and ends it, instead of sending the message through the
        broker for a task (anywhere) to claim, read the step log and end it: ~a quarter of
        a short run's tasks. The claim is any message's (a new lease epoch, fenced), so a
        duplicate or a reaper's copy of the message finds the run claimed or ended. When it
        does not claim (a message was posted to the run meanwhile, whose delivery is a step;
        the database away), the message goes out as usual."""
        assert result.dispatch is not None
        run_id, token = result.dispatch.run_id, result.dispatch.token
        with self.heartbeat.claiming(run_id, token, self.worker):
            try:
                claim = self.store.claim_to_end(
                    run_id, token, self.worker, self.settings.lease_seconds
                )
            except DatabaseUnavailable:
                return result
            if claim is None:
                return result
            crash_point("after_claim")
            ended = self.execute(claim, token)
        return replace(ended, wakes=result.wakes + ended.wakes) if result.wakes else ended

    def drive_next(self) -> StepResult | None:
        """Claim whichever run is due and execute one step; ``None`` when nothing is due."""
        claim = self.store.claim_next(self.worker, self.settings.lease_seconds)
        return None if claim is None else self.execute(claim)

    # -- one step -----------------------------------------------------------------------

    def execute(self, claim: Claim, token: uuid.UUID | None = None) -> StepResult:
        """One step of the claimed run; ``token`` is the one its message carried. A run with
        a concurrency key takes a slot of its key first
        (:mod:`runtime.admission.concurrency_keys`), or waits for one on a durable timer,
        holding nothing."""
        run = claim.run
        services = Services(
            store=self.store,
            llm=self.llm,
            settings=self.settings,
            pricing=self.pricing,
            metrics=self.metrics,
            worker=self.worker,
            mcp=self.mcp,
            live=self.live,
            flow=self.flow,
            replays=self.replays,
            hashes=self.hashes,
            run_defaults=self.agents.run_defaults,
        )
        with (
            log_context(run_id=str(run.id), worker=self.worker, step_seq="-"),
            self.heartbeat.hold(claim) as lease,
        ):
            task = Task(services, claim, lease, steps=[])
            if self.keys is None or run.concurrency_key is None:
                return self._run_program(task, token)
            got = self.keys.acquire(
                tenant_key(run.tenant, run.concurrency_key),
                run.id,
                claim.epoch,
                priority=run.priority,
                submitted_at=run.created_at.timestamp(),
                label=run.concurrency_key,
            )
            if got is None:  # no limit for this key, or Redis is away (fail open)
                return self._run_program(task, token)
            if isinstance(got, KeyWait):  # woken when a slot frees; the timer is the fallback
                parked = task.schedule(
                    got.delay_seconds,
                    got.reason,
                    model_attempts=run.model_attempts,
                    admission=True,
                    wakeable=True,
                )
                return self._wake_if_missed(task, got, parked)
            try:
                result = self._run_program(task, token)
            except BaseException:
                self._release(task, got, continuing=False, send=False)
                raise
            wakes = self._release(task, got, continuing=result.outcome is Outcome.CONTINUE)
            return replace(result, wakes=result.wakes + wakes) if wakes else result

    def _release(
        self, task: Task, slot: Slot, *, continuing: bool, send: bool = True
    ) -> tuple[Dispatch, ...]:
        """Give a key slot back; the run it wakes, as a message to send (``send`` false: for
        the reaper's next sweep to send, as the step is unwinding from an error). A waiter
        that is not parked any more (cancelled while it waited, ended, already claimed) is
        dropped from the key's queue and the next one woken instead."""
        assert self.keys is not None
        woken = self.keys.release(slot, continuing=continuing)
        for _ in range(MAX_WAITERS_SKIPPED):
            if woken is None:
                return ()
            dispatch = task.wake(woken, send=send)
            if dispatch is not None:
                return (dispatch,) if send else ()
            woken = self.keys.skip(slot, woken, continuing=continuing)
        return ()  # the rest are woken by their fallback timers

    def _wake_if_missed(self, task: Task, wait: KeyWait, parked: StepResult) -> StepResult:
        """A slot freed between this run's refusal and its park could not wake it: the run
        still held its lease, so the release dropped it from the key's queue (or woke the
        next one) and it would sit out its whole fallback timer. Asked once the park has
        committed, so a release either comes after it and finds the run parked, or came
        before and is seen here: then the run wakes itself and asks for a slot again."""
        assert self.keys is not None
        if parked.outcome is not Outcome.WAITING or self.keys.still_waiting(wait.key, task.run_id):
            return parked
        woken = task.wake(task.run_id)
        return replace(parked, wakes=(*parked.wakes, woken)) if woken is not None else parked

    def _run_program(self, task: Task, token: uuid.UUID | None) -> StepResult:
        """The run's program (its agent loop or durable function), to its next step or end,
        under the task's lease (held by :meth:`execute`)."""
        claim = task.claim
        run = claim.run
        # Checked before anything else may fail on this run (reading its steps included),
        # so a run that keeps breaking its worker ends instead of being retried forever.
        if run.claims_without_progress > self.settings.max_claims_without_progress:
            reason = (
                f"the run stopped its worker {run.claims_without_progress - 1} times "
                "without completing a step; giving up "
                f"(DAR_MAX_CLAIMS_WITHOUT_PROGRESS="
                f"{self.settings.max_claims_without_progress})"
            )
            if task.stopping is not None:  # its unwinding breaks the worker too: end
                return task.finish(
                    RunStatus.FAILED,
                    error=f"{task.stopping}; then its compensations stopped the worker "
                    "too, so the rest were not run",
                )
            task.begin_stop(reason)  # its compensations run, one per task, then it ends
        task.steps = self.store.steps(
            run.id, token=token, epoch=claim.epoch, status_changes=claim.status_changes
        )
        if run.claims_without_progress > 1:  # claimed before, no step since: a recovery
            seq = self._resume_seq(task.steps)
            log.info("run=%s resumed at seq=%d", short(run.id), seq)
            self.store.record_recovery(
                run.id,
                tenant=run.tenant,
                actor=self.worker,
                action="recovery.resumed",
                detail={"seq": seq, "worker": self.worker},
            )
        try:
            agent = self.agents.get(run.agent)
        except UnknownAgent as e:  # its compensations are found from its rows
            return unwind_recorded(task, RunStatus.FAILED, task.stopping or str(e))
        try:
            if isinstance(agent, DurableAgent):
                return Execution(task, agent).run()
            assert isinstance(agent, Agent)
            if task.stopping is not None:  # an agent loop has nothing to compensate
                return task.finish(RunStatus.FAILED, error=task.stopping)
            return run_agent(task, agent)
        except BaseException as e:
            # The database refused a value of this step (not a blip: the same value is
            # refused every time). Left RUNNING, the run would be claimed, and its step
            # run and refused, again and again; it stops here, saying why. A durable
            # function stops as on every early end: its completed steps' compensations
            # first, one per task (a refusal while they run ends it at once).
            refused = _refused_value(e)
            if refused is None:
                raise
            what = str(refused)
            log.error("run=%s the database refused a value of its step: %s", task.rid, what)
            reason = f"the database refused to store a value of this step ({what})"
            if isinstance(agent, DurableAgent) and task.stopping is None:
                task.begin_stop(reason)
                self.store.step_logs.forget(run.id)  # this task's copy missed the refusal
                task.steps = self.store.steps(run.id)
                return Execution(task, agent).run()
            return task.finish(RunStatus.FAILED, error=task.stopping or reason)

    @staticmethod
    def _resume_seq(steps: list[Step]) -> int:
        started = [s.seq for s in steps if s.status is StepStatus.STARTED]
        return started[0] if started else max((s.seq for s in steps), default=0) + 1


def _refused_value(e: BaseException | None) -> ValueRefused | None:
    """The database's refusal of a value (the store's :class:`ValueRefused`) behind ``e``, if
    that is what it is (the durable engine wraps it as an ``InfrastructureError``)."""
    while e is not None:
        if isinstance(e, ValueRefused):
            return e
        e = e.__cause__
    return None
