"""The agent loop as a program over the step log: what is the next step of this run?

The model decides, tools run, repeat. The conversation is rebuilt from the step rows (replay);
the next step is the first pending tool of the last turn, else a model call, else the end.
The model turn and the tool step are kinds of the one advance
(:meth:`runtime.pipeline.checkpoint.Program.advance`, a durable function's too), as
:class:`Loop` places them: :class:`ModelTurn` (through :mod:`runtime.pipeline.modelcall`) and
:class:`ToolCall` (a step with an effect, :mod:`runtime.pipeline.effects`); the advance looks
them up and records what they give it; a posted message is delivered as :class:`Message`,
sub-agents started and waited for as :class:`StartSubagents` and :class:`CollectSubagent`,
the MCP tool set listed as :class:`ListToolset`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from db.records import NewRun, NewStep, RunStatus, Step, StepKind, StepStatus
from runtime.agents import Agent
from runtime.llm.base import LlmError, LlmRequest
from runtime.mcp.client import CallResult
from runtime.mcp.servers import McpServer
from runtime.mcp.toolset import TOOLSET_KEY, Toolset
from runtime.observe.logctx import set_step
from runtime.observe.tracing import Span, step_span
from runtime.pipeline import effects, kinds, mcpcall, modelcall, usage
from runtime.pipeline.checkpoint import Outcome, Program, Record, StepResult, Task
from runtime.pipeline.faults import crash_point
from runtime.pipeline.replay import (
    FINISHING_STOPS,
    Conversation,
    model_step_key,
    replay,
    tool_step_key,
)
from runtime.tools import ToolContext, ToolInputError, render_output

log = logging.getLogger(__name__)


def run_agent(task: Task, agent: Agent) -> StepResult:
    """Execute the next step of an agent-loop run."""
    replays = task.services.replays
    run_input = task.claim.run.input
    conversation = (
        replay(run_input, task.steps)
        if replays is None
        else replays.replay(task.run_id, run_input, task.steps)
    )
    halt = halt_reason(task, conversation)
    next_is_model = not conversation.pending and not conversation.finished and not halt
    stop = task.guard(steps_taken=len(task.steps), next_is_model=next_is_model)
    if stop is not None:
        return task.finish(stop.status, error=stop.reason)
    if conversation.pending:
        handed = _subagents(task, agent, conversation.pending)
        if handed is not None:
            return handed
        use = next(u for u in conversation.pending if u["name"] not in agent.subagents_by_name)
        with step_span(
            f"execute_tool {use['name']}",
            {
                **span_attributes(task, "TOOL"),
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": use["name"],
                "gen_ai.tool.call.id": use["id"],
            },
        ):
            tool_step: StepResult = Loop(task).advance(ToolCall(agent, use))
            return tool_step
    if task.claim.run.messages_pending > 0:  # a step boundary: messages go in now
        delivered = _deliver_message(task)
        if delivered is not None:
            return delivered
    if conversation.finished:
        return task.finish(RunStatus.SUCCEEDED, result=conversation.final_text)
    if halt:
        return task.finish(RunStatus.FAILED, error=halt)
    toolset = mcpcall.recorded_toolset(task)
    if toolset is None and agent.servers and conversation.model_turns == 0:
        # Fixed before the first model step, once. (A run that started before its agent had
        # MCP servers keeps offering what it offered: no tool set, no MCP tools.)
        listed: StepResult = Loop(task).advance(ListToolset(list(agent.servers.values())))
        return listed
    with step_span(
        f"chat {task.claim.run.model}",
        {
            **span_attributes(task, "MODEL"),
            "dar.step_seq": task.next_seq,
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "anthropic",
            "gen_ai.request.model": task.claim.run.model,
        },
    ) as span:
        model_step: StepResult = Loop(task).advance(ModelTurn(agent, conversation, span, toolset))
        return model_step


# -- the loop's steps through the one advance -----------------------------------------------


@dataclass
class Here:
    """One step of the loop being advanced, as its kind sees it: its key, what the log says
    of it, its seq."""

    task: Task
    key: str
    found: kinds.Found

    @property
    def row(self) -> Step | None:
        return self.found.row

    @property
    def seq(self) -> int:
        return self.row.seq if self.row is not None else self.task.next_seq


class Loop(Program[Here]):
    """The agent loop as a program of the one advance
    (:meth:`runtime.pipeline.checkpoint.Program.advance`): its kinds name their own keys
    (``model:n`` by turn, ``tool:<tool_use id>``), and :func:`run_agent` guarded the task
    before choosing its step (the guard decides its end too)."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def locate(self, step: LoopKind) -> Here:
        return Here(self.task, step.key, self.task.look_up(step.key))


class LoopKind:
    """A kind of the agent loop's step. The loop advances only a step its conversation holds
    no answer for (a recorded row is replayed into the conversation, :mod:`replay`), so what
    its row gives back is the fold's (:func:`runtime.pipeline.kinds.turn_of`), not the
    advance's; its run gives a :class:`Record` to commit or ends the task of its own."""

    @property
    def key(self) -> str:
        raise NotImplementedError

    def settled(self, at: Here) -> bool:
        return at.found.state is kinds.State.RECORDED

    def replay(self, at: Here) -> StepResult:
        raise AssertionError(f"{at.key} is in the conversation already")

    def failed(self, at: Here) -> BaseException:
        return AssertionError(f"{at.key} is in the conversation already")

    def run(self, at: Here) -> Record | StepResult | None:
        raise NotImplementedError

    def predates(self) -> Any:
        raise NotImplementedError  # no markers in the loop


@dataclass(frozen=True)
class ListToolset(LoopKind):
    """The MCP tools the run offers, ``toolset``: listed and recorded once, before its first
    model call (:func:`runtime.pipeline.mcpcall.list_toolset`)."""

    servers: list[McpServer]

    @property
    def key(self) -> str:
        return TOOLSET_KEY

    def run(self, at: Here) -> Record | StepResult:
        return mcpcall.list_toolset(at.task, self.servers, at.seq)


def span_attributes(task: Task, kind: str) -> dict[str, Any]:
    return {
        "dar.run_id": str(task.run_id),
        "dar.agent": task.claim.run.agent,
        "dar.step_kind": kind,
        "dar.lease_epoch": task.claim.epoch,
    }


def halt_reason(task: Task, conversation: Conversation) -> str | None:
    """Why the last model turn ends the run without success, or ``None`` when the next
    step is a model call (first call, tool results to send, or a turn to continue)."""
    stop = conversation.stop_reason
    if stop in (None, "tool_use", "pause_turn", "message") or conversation.finished:
        return None
    if stop == "max_tokens":
        if conversation.last_turn_has_tool_use:
            return (
                "the model's response was cut off by max_tokens in the middle of a tool "
                "call; the truncated call was not executed (raise DAR_MAX_TOKENS)"
            )
        if task.settings.on_max_tokens == "continue":
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


# -- a message posted to the run ------------------------------------------------------------


@dataclass(frozen=True)
class Message(LoopKind):
    """The oldest message posted to the run, delivered at a step boundary as its next step,
    ``message:n``: a user turn after the last turn's tool results. The message is consumed in
    the transaction that records its step (:meth:`Task.deliver_message`), so the kind records
    it of its own; ``None`` when there is none after all."""

    delivered: int
    """The messages the run's conversation holds already (``n``)."""

    @classmethod
    def next(cls, task: Task) -> Message:
        return cls(sum(1 for s in task.steps if kinds.turn_of(s) is kinds.Turn.USER))

    @property
    def key(self) -> str:
        return f"message:{self.delivered}"

    def run(self, at: Here) -> StepResult | None:
        task, seq = at.task, at.seq
        row = NewStep(seq, at.key, kinds.KINDS[kinds.StepKind.MESSAGE].row, StepStatus.DONE,
                      attempt=1, latency_ms=0)  # fmt: skip
        task.ensure_lease()
        crash_point("before_message_delivery")
        dispatch = task.deliver_message(row)
        if dispatch is None:
            return None
        if task.services.live is not None:  # an interrupt flag for it has nothing left to stop
            task.services.live.clear_interrupt(task.run_id)
        log.info("run=%s seq=%d MESSAGE %s delivered", task.rid, seq, at.key)
        return StepResult(Outcome.CONTINUE, dispatch=dispatch)


def _deliver_message(task: Task) -> StepResult | None:
    """The next message as the task's step (:class:`Message`), through the one advance."""
    delivered: StepResult | None = Loop(task).advance(Message.next(task))
    return delivered


def _interrupted(task: Task, conversation: Conversation, key: str) -> StepResult:
    """The model call ``key`` was aborted by a message posted with ``policy: "interrupt"``
    (its billed tokens are on the run, its live attempt retracted): the message is this
    task's step, and ``key`` is made again after it, with it. A crash before the message's
    record loses nothing: the message is still pending, and the next task delivers it at
    the step boundary before any model call."""
    crash_point("after_interrupt")
    delivered = _deliver_message(task)
    if delivered is not None:
        return delivered
    # Nothing pending: delivered at a boundary meanwhile (a stale flag). Make the call again.
    return task.schedule(0.0, f"{key}: interrupted; calling the model again")


# -- sub-agents: child runs the model asked for -----------------------------------------------

CHILD_RECHECK_SECONDS = 30.0
"""A parent waiting for its children is woken when one ends; should that wake be lost, it
looks again after this long (or at its deadline, if sooner: its guard ends it)."""


def _subagents(task: Task, agent: Agent, pending: list[dict[str, Any]]) -> StepResult | None:
    """The step for the sub-agents the last turn called, if it is theirs: start those not
    started yet (all in one step), else, once the turn's other tools are done, wait for the
    children and record the first that ended. ``None``: a plain tool of the turn goes first."""
    calls = [u for u in pending if u["name"] in agent.subagents_by_name]
    if not calls:
        return None
    fresh = [u for u in calls if task.look_up(tool_step_key(u["id"])).row is None]
    if fresh:
        started: StepResult = Loop(task).advance(StartSubagents(agent, fresh))
        return started
    if len(calls) < len(pending):
        return None  # the turn's other tools run while the children work
    collected: StepResult = Loop(task).advance(CollectSubagent(calls))
    return collected


def _recheck(task: Task) -> float:
    until_deadline = (task.claim.run.deadline_at - task.claim.db_now).total_seconds()
    return max(0.0, min(CHILD_RECHECK_SECONDS, until_deadline))


def _subagent_error(seq: int, use: dict[str, Any], text: str) -> NewStep:
    kind = kinds.KINDS[kinds.StepKind.SUBAGENT].row
    return NewStep(
        seq,
        tool_step_key(use["id"]),
        kind,
        StepStatus.ERROR,
        response=text,
        error=text,
        attempt=1,
        latency_ms=0,
        tool_name=use["name"],
        tool_use_id=use["id"],
    )


@dataclass(frozen=True)
class StartSubagents(LoopKind):
    """The sub-agents of the last turn not started yet, all started in one step, placed at the
    first one's key (``tool:<tool_use id>``): a child run for each, with its ``PENDING`` row, in
    one transaction (a crash never starts one twice: the child's id and idempotency key come
    from the parent and the step key). Children started together split what the parent has
    left of its token budget, so together they cannot spend more than it."""

    agent: Agent
    fresh: list[dict[str, Any]]

    @property
    def key(self) -> str:
        return tool_step_key(self.fresh[0]["id"])

    def run(self, at: Here) -> Record | StepResult:
        task, agent, fresh = at.task, self.agent, self.fresh
        kind = kinds.KINDS[kinds.StepKind.SUBAGENT].row
        seq = at.seq
        refused: list[NewStep] = []
        for i, use in enumerate(fresh):
            work = (use.get("input") or {}).get("task")
            if not isinstance(work, str) or not work.strip():
                text = f"error: sub-agent {use['name']!r} needs a non-empty string 'task'"
                refused.append(_subagent_error(seq + i, use, text))
        if refused:  # the model learns its mistake; the valid calls start in the next step
            return Record(refused)
        share = task.budget_left() // len(fresh)
        if share <= 0:
            text = "error: no token budget left for a sub-agent"
            return Record([_subagent_error(seq + i, u, text) for i, u in enumerate(fresh)])
        started: list[tuple[NewStep, NewRun, uuid.UUID]] = []
        for i, use in enumerate(fresh):
            sub = agent.subagents_by_name[use["name"]]
            key = tool_step_key(use["id"])
            new, child_id = task.child_run(
                key,
                sub.agent,
                use["input"]["task"],
                token_budget=min(sub.token_budget or share, share),
                timeout_seconds=sub.timeout_seconds,
            )
            row = NewStep(
                seq + i,
                key,
                kind,
                StepStatus.PENDING,
                response={"runId": str(child_id), "agent": sub.agent},
                attempt=1,
                tool_name=use["name"],
                tool_use_id=use["id"],
            )
            started.append((row, new, child_id))
        names = ", ".join(f"{r.tool_name}={str(c)[:8]}" for r, _, c in started)
        task.ensure_lease()
        first = task.start_children(started, _recheck(task), f"waiting for sub-agents {names}")
        log.info("run=%s seq=%d SUBAGENT started %s", task.rid, seq, names)
        return StepResult(Outcome.WAITING, wakes=tuple(first))


def _took_ms(since: datetime, until: datetime | None) -> int:
    return max(0, int((until - since).total_seconds() * 1000)) if until is not None else 0


@dataclass(frozen=True)
class CollectSubagent(LoopKind):
    """The result of the first child that ended, recorded as its tool's result; parked
    (holding nothing) while none has. Placed at the first call's key (its ``PENDING`` row)."""

    calls: list[dict[str, Any]]

    @property
    def key(self) -> str:
        return tool_step_key(self.calls[0]["id"])

    def run(self, at: Here) -> Record | StepResult:
        task, calls = at.task, self.calls
        kind = kinds.KINDS[kinds.StepKind.SUBAGENT].row
        for _ in range(2):  # a child that ends while the parent parks is read at once
            waiting: list[uuid.UUID] = []
            for use in calls:
                found = task.look_up(tool_step_key(use["id"])).row
                assert found is not None
                child_id = uuid.UUID(found.response["runId"])
                child = task.store.get_run(child_id)
                if not child.status.terminal:
                    waiting.append(child_id)
                    continue
                cost = child.cost_usd + child.unrecorded_cost_usd
                limit = task.settings.max_tool_output_chars
                if child.status is RunStatus.SUCCEEDED:
                    status, text = StepStatus.DONE, render_output(child.result, limit)
                else:
                    status = StepStatus.ERROR
                    why = child.error or "no error recorded"
                    text = f"error: sub-agent {use['name']!r} (run {child_id}) ended {child.status}"
                    text = render_output(f"{text}: {why}", limit)
                row = NewStep(
                    found.seq,
                    found.step_key,
                    kind,
                    status,
                    response=text,
                    error=text if status is StepStatus.ERROR else None,
                    attempt=1,
                    usage=child.usage,
                    cost_usd=cost,
                    unrecorded_tokens=usage.unrecorded_in_tree(child),
                    latency_ms=_took_ms(found.started_at, child.finished_at),
                    tool_name=use["name"],
                    tool_use_id=use["id"],
                )
                log.info(
                    "run=%s seq=%d SUBAGENT %s run=%s %s",
                    task.rid,
                    found.seq,
                    use["name"],
                    str(child_id)[:8],
                    child.status,
                )
                return Record([row])
            names = ", ".join(str(c)[:8] for c in waiting)
            reason = f"waiting for sub-agent runs {names}"
            if task.park_for_child(waiting[0], _recheck(task), reason):
                return StepResult(Outcome.WAITING)
        return task.schedule(0.0, "a sub-agent ended: reading its result")


# -- model step -----------------------------------------------------------------------------


def _request(
    task: Task, agent: Agent, conversation: Conversation, toolset: Toolset | None = None
) -> LlmRequest:
    system = (
        [{"type": "text", "text": agent.system_prompt, "cache_control": {"type": "ephemeral"}}]
        if agent.system_prompt
        else []
    )
    return LlmRequest(
        model=task.claim.run.model,
        max_tokens=agent.max_tokens or task.settings.max_tokens,
        system=system,
        tools=agent.tool_definitions() + (toolset.definitions() if toolset else []),
        messages=conversation.messages,
    )


@dataclass(frozen=True)
class ModelTurn(LoopKind):
    """The model's next turn, ``model:n`` (:func:`runtime.pipeline.modelcall.call`): its answer
    recorded by the advance (billed even when the fence refuses it), a fork's answer replayed
    from the original too."""

    agent: Agent
    conversation: Conversation
    span: Span | None
    toolset: Toolset | None = None

    @property
    def key(self) -> str:
        return model_step_key(self.conversation.model_turns + 1)

    def run(self, at: Here) -> Record | StepResult:
        task, key, seq = at.task, at.key, at.seq
        set_step(seq)
        request = _request(task, self.agent, self.conversation, self.toolset)
        outcome = modelcall.call(task, request, kind=kinds.StepKind.MODEL, key=key, seq=seq)
        if isinstance(outcome, modelcall.Failed):
            if not isinstance(outcome.error, LlmError):
                raise outcome.error  # not an answer of the API: the task fails, the run goes on
            return task.finish(RunStatus.FAILED, error=modelcall.failure(outcome.error))
        if isinstance(outcome, modelcall.Stopped):
            return task.finish(outcome.status, error=outcome.reason)
        if isinstance(outcome, modelcall.Interrupted):
            return _interrupted(task, self.conversation, key)
        if isinstance(outcome, modelcall.Later):
            return task.schedule(
                outcome.delay_seconds,
                outcome.reason,
                model_attempts=outcome.model_attempts,
                admission=outcome.admission,
                wakeable=outcome.wakeable,
            )
        response = outcome.response
        if self.span is not None and outcome.answer is not None:
            self.span.set(
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
                    "gen_ai.usage.cache_read.input_tokens": (
                        response.usage.cache_read_input_tokens
                    ),
                }
            )
        # no tool to run and a finishing stop: what is left of this run is its end, no step
        ends = response.stop_reason in FINISHING_STOPS and not any(
            isinstance(b, dict) and b.get("type") == "tool_use" for b in response.content or ()
        )
        # every answer (a fork's replayed one too) is recorded by the advance
        assert isinstance(outcome, modelcall.Made)
        return Record([outcome.row], write=outcome.write, ends_next=ends, then=outcome.logged)


# -- tool step ------------------------------------------------------------------------------


def other_version(started_on: str | None, here: str | None) -> str:
    """Why a tool a run asked for may be missing: it started on other code (a run with no
    version, or one an operator moved without its replay check's consent)."""
    if here is None or started_on == here:
        return ""
    began = f"version {started_on}" if started_on else "a version before versions were recorded"
    return f" (the run started on {began}; this worker runs version {here})"


@dataclass(frozen=True)
class ToolCall(LoopKind):
    """A tool the model asked for, ``tool:<tool_use id>``: a Python ``@tool`` or an MCP
    server's tool, a step with an effect (:func:`runtime.pipeline.effects.run_effect`);
    its output (or error) recorded by the advance as the ``tool_result`` the model reads."""

    agent: Agent
    use: dict[str, Any]

    @property
    def key(self) -> str:
        return tool_step_key(self.use["id"])

    def run(self, at: Here) -> Record | StepResult:
        task, agent, use, key, found = at.task, self.agent, self.use, at.key, at.found
        tool_use_id: str = use["id"]
        name: str = use["name"]
        existing = found.row
        seq = at.seq
        set_step(seq)
        tool = agent.tools_by_name.get(name)
        limit = task.settings.max_tool_output_chars
        started = time.monotonic()
        toolset = mcpcall.recorded_toolset(task) if tool is None else None
        mcp_tool = toolset.get(name) if toolset is not None else None
        server = agent.servers.get(mcp_tool.server) if mcp_tool is not None else None
        if tool is None and (mcp_tool is None or server is None):
            # nothing to run, nothing in doubt: the model learns its mistake
            offered = [*agent.tools_by_name, *(t.name for t in toolset.tools)] if toolset else []
            known = ", ".join(sorted(offered or agent.tools_by_name)) or "none"
            output = f"error: unknown tool {name!r}; known tools: {known}"
            output += other_version(task.claim.run.deployment, task.store.deployment)
            if mcp_tool is not None:
                output = f"error: tool {name!r} belongs to MCP server {mcp_tool.server!r}, "
                output += "which this agent no longer declares"
            unknown = NewStep(
                seq=seq,
                step_key=key,
                kind=StepKind.TOOL,
                status=StepStatus.ERROR,
                response=output,
                error=output,
                attempt=1,
                latency_ms=0,
                tool_name=name,
                tool_use_id=tool_use_id,
            )
            return Record([unknown])
        arguments = dict(use.get("input") or {})
        attempt = (existing.attempt + 1) if existing is not None else 1
        if tool is not None:
            python_tool = tool

            def invoke(ctx: ToolContext) -> Any:
                return python_tool.invoke(arguments, ctx)

            fn: Callable[[ToolContext], Any] = invoke
            idempotent, reconcile = tool.idempotent, tool.reconcile
            timeout: float | None = tool.timeout_seconds
            label, limit_seconds = f"tool {name!r}", tool.timeout_seconds
        else:
            assert mcp_tool is not None
            assert server is not None
            call = mcpcall.prepare(task, server, mcp_tool, arguments)
            fn, idempotent, reconcile = call.fn, call.idempotent, call.reconcile
            # The MCP client keeps the time itself: it cancels the request on the server.
            timeout, label, limit_seconds = None, call.label, call.timeout_seconds
        effect = effects.Effect(
            key=key,
            kind=kinds.StepKind.TOOL if tool is not None else kinds.StepKind.MCP_TOOL,
            seq=seq,
            fn=fn,
            label=f"{label} (tool_use id {tool_use_id}, seq={seq})",
            idempotent=idempotent,
            reconcile=reconcile,
            timeout_seconds=timeout,
            attempt=attempt,
            tool_name=name,
            tool_use_id=tool_use_id,
            context_key=tool_use_id,
        )
        if existing is None:
            log.info("run=%s seq=%d TOOL %s id=%s started", task.rid, seq, name, tool_use_id)
        verdict = effects.run_effect(task, effect, found)
        stopped = effects.unsettled(task, verdict)
        if stopped is not None:
            return stopped
        status = StepStatus.ERROR if isinstance(verdict, effects.Raised) else StepStatus.DONE
        if isinstance(verdict, effects.WasReconciled):
            output = render_output(verdict.output, limit)
        elif isinstance(verdict, effects.Ran) and isinstance(verdict.value, CallResult):
            answer = verdict.value  # an MCP result: its isError decides
            status = StepStatus.ERROR if answer.is_error else StepStatus.DONE
            output = render_output(answer.text, limit)
        elif isinstance(verdict, effects.Ran):
            output = render_output(verdict.value, limit)
        else:
            assert isinstance(verdict, effects.Raised)
            e = verdict.error
            if verdict.timed_out:
                output = f"error: tool {name!r} timed out after {limit_seconds:g}s"
            elif isinstance(e, ToolInputError):
                output = f"error: {e}"
            elif tool is None:
                output = render_output(mcpcall.error_text(e), limit)
            else:  # a failing tool is information for the model
                output = render_output(f"error: {type(e).__name__}: {e}", limit)
        failed = status is StepStatus.ERROR
        result = effects.row(
            effect, verdict, status=status, response=output, error=output if failed else None
        )
        done = result.status is StepStatus.DONE

        def recorded() -> None:
            task.observe("TOOL", "ok" if done else "error", started)
            log.info(
                "run=%s seq=%d TOOL %s id=%s %s %dms",
                task.rid,
                seq,
                name,
                tool_use_id,
                "done" if done else "error",
                result.latency_ms or 0,
            )

        return Record([result], then=recorded)
