"""The driver: claim a run, execute exactly one checkpointed step, hand the run on.

It knows no Celery and no HTTP: a Celery task, a test or a plain loop calls
:meth:`Driver.drive` (for a dispatched message) or :meth:`Driver.drive_next` (poll), and sends
the returned :class:`Dispatch`, if any, only after this call has returned, that is after the
step has been committed.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import enum
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, TypeVar

from db.errors import LeaseLost
from db.records import Claim, Dispatch, ModelCheckpoint, RunStatus, Step, StepStatus, Usage
from db.store import RunStore
from runtime.agents import Agent, AgentRegistry, UnknownAgent
from runtime.config import Settings
from runtime.durable import DurableAgent, _Execution
from runtime.faults import crash_point
from runtime.guard import guard
from runtime.heartbeat import Heartbeat, HeldLease
from runtime.llm.base import LlmClient, LlmError, LlmRequest, LlmResponse
from runtime.llm.retry import RetryLater
from runtime.logctx import log_context, set_step
from runtime.metrics import Metrics
from runtime.pricing import PriceTable
from runtime.replay import Conversation, model_step_key, replay, tool_step_key
from runtime.tools import Reconciled, ToolContext, ToolInputError, render_output
from runtime.tracing import Span, run_span, step_span

log = logging.getLogger(__name__)
T = TypeVar("T")

_tool_pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="dar-tool")


class Outcome(enum.StrEnum):
    CONTINUE = "CONTINUE"
    """A step was committed; send ``dispatch`` to run the next one."""
    FINISHED = "FINISHED"
    """The run ended (or is parked for a human); nothing to send."""
    DROPPED = "DROPPED"
    """The message was stale or duplicated, or the run is held by a live lease: nothing ran."""
    WAITING = "WAITING"
    """The run is parked on a durable timer; ``dispatch`` (if any) is sent with its delay."""


@dataclass(frozen=True, slots=True)
class StepResult:
    outcome: Outcome
    dispatch: Dispatch | None = None
    status: RunStatus | None = None


def short(run_id: uuid.UUID) -> str:
    return str(run_id)[:8]


def estimate_tokens(body: dict[str, Any]) -> int:
    """A deliberately high estimate of a request's input tokens (about 3 characters per
    token; real English text averages nearer 4)."""
    return len(json.dumps(body, separators=(",", ":"), ensure_ascii=False)) // 3 + 1


def prompt_hash(body: dict[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


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
    ) -> None:
        self.store = store
        self.agents = agents
        self.llm = llm
        self.settings = settings
        self.pricing = pricing or PriceTable.from_json(None)
        self.worker = worker or settings.worker_name
        self.metrics = metrics
        self.heartbeat = heartbeat or Heartbeat(
            store,
            self.worker,
            lease_seconds=settings.lease_seconds,
            interval_seconds=settings.heartbeat_seconds,
        )

    # -- entry points -------------------------------------------------------------------

    def drive(self, run_id: uuid.UUID, token: uuid.UUID) -> StepResult:
        """Handle one drive_run message: at most one step."""
        claim = self.store.claim(run_id, token, self.worker, self.settings.lease_seconds)
        if claim is None:
            log.debug("run=%s message dropped (stale, duplicate, or lease held)", short(run_id))
            return StepResult(Outcome.DROPPED)
        crash_point("after_claim")
        result = self.execute(claim)
        if result.dispatch is not None:
            crash_point("after_checkpoint")
        return result

    def drive_next(self) -> StepResult | None:
        """Claim whichever run is due and execute one step; ``None`` when nothing is due."""
        claim = self.store.claim_next(self.worker, self.settings.lease_seconds)
        return None if claim is None else self.execute(claim)

    # -- one step -----------------------------------------------------------------------

    def execute(self, claim: Claim) -> StepResult:
        run = claim.run
        with (
            log_context(run_id=str(run.id), worker=self.worker, step_seq="-"),
            self.heartbeat.hold(claim) as lease,
        ):
            # Checked before anything else may fail on this run (reading its steps included),
            # so a run that keeps breaking its worker ends instead of being retried forever.
            if run.claims_without_progress > self.settings.max_claims_without_progress:
                return self._finish(
                    claim,
                    RunStatus.FAILED,
                    error=(
                        f"the run stopped its worker {run.claims_without_progress - 1} times "
                        "without completing a step; giving up "
                        f"(DAR_MAX_CLAIMS_WITHOUT_PROGRESS="
                        f"{self.settings.max_claims_without_progress})"
                    ),
                )
            steps = self.store.steps(run.id)
            next_seq = len(steps) + 1
            if run.claims_without_progress > 1:
                log.info("run=%s resumed at seq=%d", short(run.id), self._resume_seq(steps))
            try:
                agent = self.agents.get(run.agent)
            except UnknownAgent as e:
                return self._finish(claim, RunStatus.FAILED, error=str(e))
            if isinstance(agent, DurableAgent):
                return _Execution(self, claim, agent, steps, lease).run()

            conversation = replay(run.input, steps)
            halt = self._halt_reason(conversation)
            next_is_model = not conversation.pending and not conversation.finished and not halt
            stop = guard(run, now=claim.db_now, steps_taken=len(steps), next_is_model=next_is_model)
            if stop is not None:
                return self._finish(claim, stop.status, error=stop.reason)
            if conversation.pending:
                use = conversation.pending[0]
                with step_span(
                    f"execute_tool {use['name']}",
                    {
                        **self._span_attributes(claim, "TOOL"),
                        "gen_ai.operation.name": "execute_tool",
                        "gen_ai.tool.name": use["name"],
                        "gen_ai.tool.call.id": use["id"],
                    },
                ):
                    return self._tool_step(claim, agent, use, steps, lease)
            if conversation.finished:
                return self._finish(claim, RunStatus.SUCCEEDED, result=conversation.final_text)
            if halt:
                return self._finish(claim, RunStatus.FAILED, error=halt)
            with step_span(
                f"chat {run.model}",
                {
                    **self._span_attributes(claim, "MODEL"),
                    "dar.step_seq": next_seq,
                    "gen_ai.operation.name": "chat",
                    "gen_ai.provider.name": "anthropic",
                    "gen_ai.request.model": run.model,
                },
            ) as span:
                return self._model_step(claim, agent, conversation, next_seq, lease, span)

    @staticmethod
    def _span_attributes(claim: Claim, kind: str) -> dict[str, Any]:
        return {
            "dar.run_id": str(claim.run_id),
            "dar.agent": claim.run.agent,
            "dar.step_kind": kind,
            "dar.lease_epoch": claim.epoch,
        }

    def _halt_reason(self, conversation: Conversation) -> str | None:
        """Why the last model turn ends the run without success, or ``None`` when the next
        step is a model call (first call, tool results to send, or a turn to continue)."""
        stop = conversation.stop_reason
        if stop in (None, "tool_use", "pause_turn") or conversation.finished:
            return None
        if stop == "max_tokens":
            if conversation.last_turn_has_tool_use:
                return (
                    "the model's response was cut off by max_tokens in the middle of a tool "
                    "call; the truncated call was not executed (raise DAR_MAX_TOKENS)"
                )
            if self.settings.on_max_tokens == "continue":
                return None
            return (
                "the model's response was cut off by max_tokens (raise DAR_MAX_TOKENS, or set "
                "DAR_ON_MAX_TOKENS=continue to let the model continue its answer)"
            )
        if stop == "refusal":
            return "the model refused to continue (stop_reason=refusal)"
        if stop == "model_context_window_exceeded":
            return "the conversation no longer fits in the model's context window"
        return f"the model stopped with an unexpected stop_reason {stop!r}"

    @staticmethod
    def _resume_seq(steps: list[Step]) -> int:
        started = [s.seq for s in steps if s.status is StepStatus.STARTED]
        return started[0] if started else len(steps) + 1

    def _finish(
        self, claim: Claim, status: RunStatus, *, result: Any = None, error: str | None = None
    ) -> StepResult:
        self.store.finish(claim, status, result=result, error=error)
        run = self.store.get_run(claim.run_id)
        if run.finished_at is not None:
            if self.metrics is not None:
                took = (run.finished_at - run.created_at).total_seconds()
                self.metrics.run_finished(str(status), took)
            run_span(str(run.id), run.agent, str(status), run.created_at, run.finished_at)
        detail = f" reason={error}" if error else ""
        log.info("run=%s %s tokens=%d%s", short(run.id), status, run.tokens_used, detail)
        return StepResult(Outcome.FINISHED, status=status)

    # -- model step ---------------------------------------------------------------------

    def _request(self, claim: Claim, agent: Agent, conversation: Conversation) -> LlmRequest:
        system = (
            [
                {
                    "type": "text",
                    "text": agent.system_prompt,
                    "cache_control": {"type": "ephemeral"},
                }
            ]
            if agent.system_prompt
            else []
        )
        return LlmRequest(
            model=claim.run.model,
            max_tokens=agent.max_tokens or self.settings.max_tokens,
            system=system,
            tools=agent.tool_definitions(),
            messages=conversation.messages,
        )

    def _model_step(
        self,
        claim: Claim,
        agent: Agent,
        conversation: Conversation,
        seq: int,
        lease: HeldLease,
        span: Span | None = None,
    ) -> StepResult:
        set_step(seq)
        request = self._request(claim, agent, conversation)
        body = request.to_json()
        if self.settings.strict_budget:
            refusal = self._strict_budget_refusal(claim, request, body)
            if refusal:
                return self._finish(claim, RunStatus.FAILED, error=refusal)
        crash_point("before_model_call")
        started = time.monotonic()
        try:
            response = self.llm.send(request)
        except RetryLater as e:
            self._observe("MODEL", "retry_later", started)
            return self._wait(claim, seq, e, started)
        except LlmError as e:
            self._observe("MODEL", "error", started)
            rid = f" (request id {e.request_id})" if e.request_id else ""
            status = "I/O error or timeout" if e.status == -1 else f"HTTP {e.status}"
            return self._finish(
                claim, RunStatus.FAILED, error=f"model call failed: {status}: {e}{rid}"
            )
        latency_ms = int((time.monotonic() - started) * 1000)
        crash_point("after_model_response")
        cost = self.pricing.cost(response.model or request.model, response.usage)
        if self.metrics is not None:  # billed, whatever happens to the checkpoint
            self.metrics.model_call(response.model or request.model, response.usage, cost)
        if span is not None:
            span.set(
                {
                    "gen_ai.request.max_tokens": request.max_tokens,
                    "gen_ai.response.model": response.model,
                    "gen_ai.response.id": response.request_id,
                    "gen_ai.response.finish_reasons": [response.stop_reason or ""],
                    "gen_ai.usage.input_tokens": response.usage.input_tokens,
                    "gen_ai.usage.output_tokens": response.usage.output_tokens,
                    "gen_ai.usage.cache_creation.input_tokens": (
                        response.usage.cache_creation_input_tokens
                    ),
                    "gen_ai.usage.cache_read.input_tokens": response.usage.cache_read_input_tokens,
                }
            )
        try:
            if lease.lost.is_set():
                raise LeaseLost(claim.run_id, "heartbeat found the lease taken over")
            dispatch = self._checkpoint_model(
                claim, conversation, seq, request, body, response, cost, latency_ms
            )
        except LeaseLost:
            # The call was billed: count it against the run even though it is not a step.
            self.store.record_unrecorded_usage(claim.run_id, response.usage, cost)
            self._observe("MODEL", "lease_lost", started)
            raise
        self._observe("MODEL", "ok", started)
        log.info(
            "run=%s seq=%d MODEL stop=%s in=%d out=%d latency=%dms",
            short(claim.run_id),
            seq,
            response.stop_reason,
            response.usage.input_tokens,
            response.usage.output_tokens,
            latency_ms,
        )
        return StepResult(Outcome.CONTINUE, dispatch=dispatch)

    def _checkpoint_model(
        self,
        claim: Claim,
        conversation: Conversation,
        seq: int,
        request: LlmRequest,
        body: dict[str, Any],
        response: LlmResponse,
        cost: Decimal,
        latency_ms: int,
    ) -> Dispatch:
        return self.store.checkpoint_model(
            claim,
            ModelCheckpoint(
                seq=seq,
                step_key=model_step_key(conversation.model_turns + 1),
                model=response.model or request.model,
                prompt_hash=prompt_hash(body),
                request=body if self.settings.store_requests else None,
                response=response.content,
                stop_reason=response.stop_reason,
                usage=response.usage,
                cost_usd=cost,
                latency_ms=latency_ms,
                request_id=response.request_id,
            ),
        )

    def _wait(self, claim: Claim, seq: int, e: RetryLater, started: float) -> StepResult:
        """The model asked us to come back later: a durable timer, not a sleeping worker."""
        elapsed = time.monotonic() - started
        remaining = (claim.run.deadline_at - claim.db_now).total_seconds() - elapsed
        if e.delay_seconds >= remaining:
            return self._finish(
                claim,
                RunStatus.TIMED_OUT,
                error=(
                    f"model call failed ({e.error}) and the retry it asks for in "
                    f"{e.delay_seconds:.1f}s would pass the run's deadline"
                ),
            )
        message_at_due = e.delay_seconds <= self.settings.max_countdown_seconds
        status = "I/O error" if e.status == -1 else f"HTTP {e.status}"
        dispatch = self.store.schedule(
            claim,
            e.delay_seconds,
            reason=f"model call {status}; retrying in {e.delay_seconds:.1f}s",
            message_at_due=message_at_due,
        )
        log.info(
            "run=%s seq=%d MODEL %s; waiting %.1fs on a durable timer",
            short(claim.run_id),
            seq,
            status,
            e.delay_seconds,
        )
        return StepResult(Outcome.WAITING, dispatch=dispatch if message_at_due else None)

    def _strict_budget_refusal(
        self, claim: Claim, request: LlmRequest, body: dict[str, Any]
    ) -> str | None:
        """In strict mode, refuse a model call whose worst case could cross a budget."""
        run = claim.run
        worst_in = estimate_tokens(body)
        worst = Usage(input_tokens=worst_in, output_tokens=request.max_tokens)
        spent = run.tokens_used + run.unrecorded_tokens
        if spent + worst.total > run.token_budget:
            return (
                f"strict budget: the next model call could use up to {worst.total} tokens "
                f"({worst_in} in, {request.max_tokens} out) and {spent} of "
                f"{run.token_budget} are spent"
            )
        if run.cost_budget_usd is not None:
            cost = run.cost_usd + run.unrecorded_cost_usd
            worst_cost = self.pricing.cost(request.model, worst)
            if cost + worst_cost > run.cost_budget_usd:
                return (
                    f"strict budget: the next model call could cost up to ${worst_cost:.4f} "
                    f"and ${cost:.4f} of ${run.cost_budget_usd:.4f} is spent"
                )
        return None

    # -- tool step ----------------------------------------------------------------------

    def _tool_step(
        self,
        claim: Claim,
        agent: Agent,
        use: dict[str, Any],
        steps: list[Step],
        lease: HeldLease,
    ) -> StepResult:
        tool_use_id: str = use["id"]
        name: str = use["name"]
        key = tool_step_key(tool_use_id)
        existing = next((s for s in steps if s.step_key == key), None)
        tool = agent.tools_by_name.get(name)
        context = ToolContext(run_id=claim.run_id, tool_use_id=tool_use_id)
        rid = short(claim.run_id)
        reconciled: Reconciled | None = None

        if existing is not None:  # STARTED by a worker that stopped before recording it
            seq = existing.seq
            set_step(seq)
            if tool is not None and not tool.idempotent and existing.resolution != "retry":
                if tool.reconcile is None:
                    return self._needs_attention(
                        claim,
                        f"tool {name!r} (tool_use id {tool_use_id}, seq={seq}) was started but "
                        "its worker stopped before recording a result, and the tool is not "
                        "declared idempotent, so it was not run again: check whether its effect "
                        "happened, then resolve the run (supply_result, retry or fail)",
                    )
                try:
                    reconciled = self._call(tool.reconcile, tool.timeout_seconds, context)
                except Exception as e:
                    return self._needs_attention(
                        claim,
                        f"tool {name!r} (tool_use id {tool_use_id}, seq={seq}) was left started "
                        f"and its reconcile hook failed ({type(e).__name__}: {e}); resolve the "
                        "run (supply_result, retry or fail)",
                    )
                verdict = "had happened" if reconciled else "had not happened: running it"
                log.info("run=%s seq=%d TOOL %s reconciled: the effect %s", rid, seq, name, verdict)
        else:
            seq = len(steps) + 1
            set_step(seq)
            self.store.start_tool(
                claim, seq=seq, step_key=key, tool_name=name, tool_use_id=tool_use_id
            )
            log.info("run=%s seq=%d TOOL %s id=%s started", rid, seq, name, tool_use_id)
            crash_point("after_tool_start")

        started = time.monotonic()  # the tool's own time (a reconcile hook's, on resume)
        status = StepStatus.DONE
        error: str | None = None
        limit = self.settings.max_tool_output_chars
        if reconciled is not None:
            output = render_output(reconciled.output, limit)
        elif tool is None:
            known = ", ".join(sorted(agent.tools_by_name)) or "none"
            output = error = f"error: unknown tool {name!r}; known tools: {known}"
            status = StepStatus.ERROR
        else:
            try:
                value = self._call(
                    tool.invoke, tool.timeout_seconds, dict(use.get("input") or {}), context
                )
                output = render_output(value, limit)
            except concurrent.futures.TimeoutError:
                output = error = f"error: tool {name!r} timed out after {tool.timeout_seconds:g}s"
                status = StepStatus.ERROR
            except ToolInputError as e:
                output = error = f"error: {e}"
                status = StepStatus.ERROR
            except Exception as e:  # a failing tool is information for the model
                output = error = render_output(f"error: {type(e).__name__}: {e}", limit)
                status = StepStatus.ERROR
        latency_ms = int((time.monotonic() - started) * 1000)
        crash_point("after_tool_effect")
        if lease.lost.is_set():
            raise LeaseLost(claim.run_id, "heartbeat found the lease taken over")
        dispatch = self.store.finish_tool(
            claim,
            step_key=key,
            status=status,
            output=output,
            latency_ms=latency_ms,
            error=error,
        )
        verdict = "done" if status is StepStatus.DONE else "error"
        self._observe("TOOL", "ok" if status is StepStatus.DONE else "error", started)
        log.info(
            "run=%s seq=%d TOOL %s id=%s %s %dms", rid, seq, name, tool_use_id, verdict, latency_ms
        )
        return StepResult(Outcome.CONTINUE, dispatch=dispatch)

    def _observe(self, kind: str, outcome: str, started: float) -> None:
        if self.metrics is not None:
            self.metrics.step(kind, outcome, time.monotonic() - started)

    @staticmethod
    def _call(fn: Callable[..., T], timeout: float, *args: Any) -> T:
        """Run user code with a wall-clock limit, in a pool thread that carries the log
        context. A crash (a ``BaseException``) propagates; a timed-out call is abandoned."""
        future = _tool_pool.submit(contextvars.copy_context().run, fn, *args)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # if it never started (the pool was busy), it never will
            raise

    def _needs_attention(self, claim: Claim, reason: str) -> StepResult:
        return self._finish(claim, RunStatus.NEEDS_ATTENTION, error=reason)
