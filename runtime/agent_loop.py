"""The agent loop as a program over the step log: what is the next step of this run?

The model decides, tools run, repeat. The conversation is rebuilt from the step rows (replay);
the next step is the first pending tool of the last turn, else a model call, else the end.
A tool call is a step with an effect (:mod:`runtime.effects`), a model call goes through
:mod:`runtime.modelcall`; this module only chooses between them and records their rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from db.records import Dispatch, ModelCheckpoint, NewStep, RunStatus, StepKind, StepStatus
from runtime import effects, mcpcall, modelcall, pipeline
from runtime.agents import Agent
from runtime.llm.base import LlmError, LlmRequest
from runtime.llm.live import ModelCallCancelled
from runtime.llm.retry import RetryLater
from runtime.logctx import set_step
from runtime.mcp.client import CallResult
from runtime.mcp.toolset import Toolset
from runtime.replay import Conversation, model_step_key, replay, tool_step_key
from runtime.task import Outcome, StepResult, Task
from runtime.tools import ToolContext, ToolInputError, render_output
from runtime.tracing import Span, step_span

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
        use = conversation.pending[0]
        with step_span(
            f"execute_tool {use['name']}",
            {
                **span_attributes(task, "TOOL"),
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": use["name"],
                "gen_ai.tool.call.id": use["id"],
            },
        ):
            return _tool_step(task, agent, use)
    if conversation.finished:
        return task.finish(RunStatus.SUCCEEDED, result=conversation.final_text)
    if halt:
        return task.finish(RunStatus.FAILED, error=halt)
    toolset = mcpcall.recorded_toolset(task)
    if toolset is None and agent.servers and conversation.model_turns == 0:
        # Fixed before the first model step, once. (A run that started before its agent had
        # MCP servers keeps offering what it offered: no tool set, no MCP tools.)
        return mcpcall.record_toolset(task, list(agent.servers.values()))
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
        return _model_step(task, agent, conversation, span, toolset)


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
    if stop in (None, "tool_use", "pause_turn") or conversation.finished:
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


def _model_step(
    task: Task,
    agent: Agent,
    conversation: Conversation,
    span: Span | None,
    toolset: Toolset | None = None,
) -> StepResult:
    seq = task.next_seq
    set_step(seq)
    request = _request(task, agent, conversation, toolset)
    body = request.to_json()
    key = model_step_key(conversation.model_turns + 1)
    original = modelcall.recorded_answer(task, key, body)
    if original is not None:  # a fork replaying the model, and the request is unchanged
        row = modelcall.replayed_row(seq, key, body, original)
        dispatch = task.record_replayed(row, original, hand_over=True)
        log.info("run=%s seq=%d MODEL replayed (request unchanged; 0 tokens)", task.rid, seq)
        return StepResult(Outcome.CONTINUE, dispatch=dispatch)
    refusal = modelcall.strict_budget_refusal(task, request, body)
    if refusal:
        return task.finish(RunStatus.FAILED, error=refusal)
    wait = modelcall.admit(task, request, body)
    if wait is not None:  # flow control: a durable timer, holding nothing
        attempts = task.claim.run.model_attempts
        return task.schedule(
            wait.delay_seconds, wait.reason, model_attempts=attempts, admission=True
        )
    try:
        answer = modelcall.send(task, request, body, key=key)
    except RetryLater as e:
        return _wait(task, seq, e)
    except ModelCallCancelled:
        return task.finish(RunStatus.CANCELLED, error="cancelled by request (model call aborted)")
    except LlmError as e:
        rid = f" (request id {e.request_id})" if e.request_id else ""
        status = "I/O error or timeout" if e.status == -1 else f"HTTP {e.status}"
        return task.finish(RunStatus.FAILED, error=f"model call failed: {status}: {e}{rid}")
    response = answer.response
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
    checkpoint = ModelCheckpoint(
        seq=seq,
        step_key=key,
        model=answer.model,
        prompt_hash=modelcall.request_hash(task, body),
        request=body if task.settings.store_requests else None,
        response=response.content,
        stop_reason=response.stop_reason,
        usage=response.usage,
        cost_usd=answer.cost,
        latency_ms=answer.latency_ms,
        request_id=response.request_id,
    )
    dispatch = modelcall.record_billed(
        task,
        answer,
        lambda: task.checkpoint_model(checkpoint),
        key=checkpoint.step_key,
        # committed by a try whose answer was lost: the run carries the token it set
        committed=lambda: Dispatch(task.run_id, task.store.get_run(task.run_id).dispatch_token),
    )
    log.info(
        "run=%s seq=%d MODEL stop=%s in=%d out=%d latency=%dms",
        task.rid,
        seq,
        response.stop_reason,
        response.usage.input_tokens,
        response.usage.output_tokens,
        answer.latency_ms,
    )
    return StepResult(Outcome.CONTINUE, dispatch=dispatch)


def _wait(task: Task, seq: int, e: RetryLater) -> StepResult:
    """The model asked us to come back later: a durable timer, not a sleeping worker."""
    remaining = (task.claim.run.deadline_at - task.claim.db_now).total_seconds()
    if e.delay_seconds >= remaining:
        return task.finish(
            RunStatus.TIMED_OUT,
            error=(
                f"model call failed ({e.error}) and the retry it asks for in "
                f"{e.delay_seconds:.1f}s would pass the run's deadline"
            ),
        )
    status = "I/O error" if e.status == -1 else f"HTTP {e.status}"
    log.info(
        "run=%s seq=%d MODEL %s; waiting %.1fs on a durable timer",
        task.rid,
        seq,
        status,
        e.delay_seconds,
    )
    return task.schedule(
        e.delay_seconds,
        f"model call {status}; retrying in {e.delay_seconds:.1f}s",
        model_attempts=e.attempts,
        admission=e.back_pressure,  # the API asked us to wait: not a claim without progress
    )


# -- tool step ------------------------------------------------------------------------------


def _tool_step(task: Task, agent: Agent, use: dict[str, Any]) -> StepResult:
    tool_use_id: str = use["id"]
    name: str = use["name"]
    key = tool_step_key(tool_use_id)
    found = task.look_up(key)
    existing = found.row
    seq = existing.seq if existing is not None else task.next_seq
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
        if mcp_tool is not None:
            output = f"error: tool {name!r} belongs to MCP server {mcp_tool.server!r}, which "
            output += "this agent no longer declares"
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
        return task.checkpoint([unknown])
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
        kind=pipeline.StepKind.TOOL if tool is not None else pipeline.StepKind.MCP_TOOL,
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
    verdict = effects.execute(task, effect, found)
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
    outcome = task.checkpoint([result])
    verdict_word = "done" if result.status is StepStatus.DONE else "error"
    task.observe("TOOL", "ok" if result.status is StepStatus.DONE else "error", started)
    log.info(
        "run=%s seq=%d TOOL %s id=%s %s %dms",
        task.rid,
        seq,
        name,
        tool_use_id,
        verdict_word,
        result.latency_ms or 0,
    )
    return outcome
