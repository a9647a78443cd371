"""The step container: ``steps.run`` (and ``@step``), ``steps.side_effect``, ``steps.llm``,
``steps.tool`` (an MCP call), the approved action, and the model calls inside ``steps.llm``:
kinds of the one protocol (:mod:`runtime.durable.simple`), driven by the one advance.

A container's body runs through the one step executor (:func:`runtime.pipeline.effects.run_effect`:
``STARTED`` first, the in-doubt rule, its timeout); its result is a :class:`Record` the advance
commits (at the top level, ending the task) or, nested, a row recorded inside the running step
and the value given back. Steps nest: a key inside another step is ``parent/name:n``; the open
steps around a step that ends the task are recorded ``PAUSED``. A completed step registers its
compensation (:mod:`runtime.durable.compensation`) whether it ran or was replayed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, Protocol

from db.records import NewStep, StepStatus
from runtime.durable.errors import DurableConfigError, Pause, StepTimeout
from runtime.durable.simple import At, SimpleKind, recorded_error
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.mcp.client import CallResult
from runtime.mcp.errors import McpRemoteError, McpUnavailable
from runtime.mcp.servers import McpServer
from runtime.mcp.toolset import OfferedTool, idempotent, offered
from runtime.observe.logctx import error_text, set_step
from runtime.pipeline import effects, mcpcall, modelcall
from runtime.pipeline.checkpoint import Record
from runtime.pipeline.codec import decode, encode
from runtime.pipeline.guard import Stop
from runtime.pipeline.kinds import KINDS, State, StepKind
from runtime.tools import Reconcile, ToolContext

log = logging.getLogger(__name__)


class Options(Protocol):
    """How a step runs (:class:`runtime.durable.api.StepOptions`)."""

    @property
    def retries(self) -> int | None: ...

    @property
    def backoff(self) -> float: ...

    @property
    def timeout(self) -> float | None: ...

    @property
    def idempotent(self) -> bool: ...

    @property
    def reconcile(self) -> Reconcile | None: ...


@dataclass(frozen=True)
class Plain:
    """Options given as values (an MCP call's, an approved action's)."""

    retries: int | None = None
    backoff: float = 1.0
    timeout: float | None = None
    idempotent: bool = False
    reconcile: Reconcile | None = None


@dataclass
class Frame:
    """A step whose body is running."""

    key: str
    kind: StepKind
    seq: int
    attempt: int
    context: ToolContext | None = None


def type_name(e: BaseException) -> str:
    return type(e).__name__


@dataclass(frozen=True)
class RunStep(SimpleKind):
    """``steps.run(name, fn, ...)`` / a ``@step`` call: ``thunk`` run once as a step with an
    effect; its result recorded and given back on every replay (its error raised again)."""

    step_name: str
    thunk: Callable[[], Any]
    type: Any
    options: Options
    compensate: Callable[[Any], Any] | None = None
    compensation: str | None = None
    """How its row names ``compensate`` so any process finds it again."""
    kind: ClassVar[StepKind] = StepKind.STEP
    api: ClassVar[str] = "steps.run"
    nests: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return self.step_name

    def settled(self, at: At) -> bool:
        # Nested, a recorded error is run again when the step around it is.
        done = at.row is not None and at.row.status is StepStatus.DONE
        return at.found.state is State.RECORDED and (done or not at.nested)

    def replay(self, at: At) -> Any:
        assert at.row is not None
        value = decode(at.row.response, self.type)
        at.ex.compensations.completed(at.key, value, self.compensate)
        return value

    def failed(self, at: At) -> BaseException:
        assert at.row is not None
        at.ex.compensations.undo_children(at.key)  # ends the task while any is left
        return recorded_error(at.key, at.row)

    def run(self, at: At) -> Any:
        return body(
            at, self.kind, self.thunk, self.type, self.options, self.compensate, self.compensation
        )


@dataclass(frozen=True)
class SideEffect(RunStep):
    """``steps.side_effect``: a non-deterministic value recorded once."""

    kind: ClassVar[StepKind] = StepKind.SIDE_EFFECT
    api: ClassVar[str] = "steps.side_effect"


@dataclass(frozen=True)
class Llm(RunStep):
    """``steps.llm``: a body that only calls the model (its calls are :class:`LlmCall`)."""

    kind: ClassVar[StepKind] = StepKind.LLM
    api: ClassVar[str] = "steps.llm"


def body(
    at: At,
    kind: StepKind,
    thunk: Callable[[], Any],
    type: Any,
    options: Options,
    compensate: Callable[[Any], Any] | None = None,
    compensation: str | None = None,
    input_hash: str | None = None,
) -> Any:
    """RunStep a container's body as ``kind`` through the step executor; its row, to record."""
    ex, key, rec = at.ex, at.key, at.row
    if rec is None:
        seq, attempt = ex.take_seq(), 1
    elif rec.status in (StepStatus.PAUSED, StepStatus.STARTED):
        # Entered again after a pause or a crash: the same attempt, so the model calls
        # it recorded are replayed (only a failed attempt's retry calls the model afresh).
        seq, attempt = rec.seq, rec.attempt
    else:
        seq, attempt = rec.seq, rec.attempt + 1
    nested = at.nested
    if not nested:
        set_step(seq)
    frame = Frame(key, kind, seq, attempt)

    def run(context: ToolContext) -> Any:
        frame.context = context
        return thunk()

    effect = effects.Effect(
        key=key,
        kind=kind,
        seq=seq,
        fn=run,
        label=f"step {key!r} (seq={seq})",
        idempotent=options.idempotent,
        reconcile=options.reconcile,
        timeout_seconds=options.timeout,
        attempt=attempt,
        input_hash=input_hash,
        take_seq=ex.take_seq,
    )
    ex.stack.append(frame)
    try:
        with ex.engine_call():
            verdict = effects.run_effect(ex.task, effect, at.found)
    except Pause as p:
        ex.stack.pop()
        paused = NewStep(seq, key, KINDS[kind].row, StepStatus.PAUSED, attempt=attempt)
        if nested:
            p.rows.append(paused)
            raise
        _paused(at, p, [*p.rows, paused])
    finally:
        if ex.stack and ex.stack[-1] is frame:
            ex.stack.pop()
    if isinstance(verdict, effects.InDoubt | effects.StillRunning | effects.Away):
        _pause_open_steps(at)
        with ex.engine_call():
            stopped = effects.unsettled(ex.task, verdict)
        assert stopped is not None
        at.end(stopped)
    error: Exception | None = None
    timed_out = False
    if isinstance(verdict, effects.WasReconciled):
        value = verdict.output
    elif isinstance(verdict, effects.Ran):
        value = verdict.value
    else:
        error, timed_out = verdict.error, verdict.timed_out
    if error is None:
        try:
            encoded = encode(value)
            value = decode(encoded, type) if isinstance(verdict, effects.WasReconciled) else value
        except Exception as e:
            error = e
    if error is not None:
        return _failed(at, effect, verdict, error, timed_out, options)
    row = effects.row(effect, verdict, response=encoded, compensation=compensation)
    ex.compensations.completed(key, value, compensate)
    if nested:
        with ex.engine_call():
            ex.task.record_child(row)
        return value
    log.info("run=%s seq=%d %s %s done %dms", ex.task.rid, seq, row.kind, key, row.latency_ms)
    return Record([row])


def _failed(
    at: At,
    effect: effects.Effect,
    verdict: effects.Verdict,
    error: Exception,
    timed_out: bool,
    options: Options,
) -> Record:
    ex, key, seq, attempt = at.ex, effect.key, effect.seq, effect.attempt
    text = (
        f"StepTimeout: step ran longer than {options.timeout:g}s"
        if timed_out
        else f"{type_name(error)}: {error}"
    )
    row = effects.row(effect, verdict, status=StepStatus.ERROR, error=text)
    if at.nested:  # nested: recorded, and the parent's code sees the exception
        with ex.engine_call():
            ex.task.record_child(row)
        raise StepTimeout(key, text) if timed_out else error
    if options.retries and attempt < options.retries:
        delay = options.backoff * 2 ** (attempt - 1)
        log.info(
            "run=%s seq=%d %s %s attempt %d failed (%s); retry in %.1fs",
            ex.task.rid,
            seq,
            row.kind,
            key,
            attempt,
            error_text(text),
            delay,
        )
        retrying = effects.row(effect, verdict, status=StepStatus.RETRYING, error=text)
        reason = f"{key} attempt {attempt} failed; retrying"
        with ex.engine_call():
            at.end(ex.task.schedule(delay, reason, rows=[retrying]))
    log.info("run=%s seq=%d %s %s failed: %s", ex.task.rid, seq, row.kind, key, error_text(text))
    return Record([row])


def _paused(at: At, pause: Pause, rows: list[NewStep]) -> NoReturn:
    ex = at.ex
    with ex.engine_call():
        if pause.stop is not None:  # the guard stopped the run inside a step
            for row in rows:
                ex.task.record_child(row)
            ex.stop(pause.stop.status, pause.stop.reason)
        assert pause.delay_seconds is not None
        at.end(
            ex.task.schedule(
                pause.delay_seconds,
                pause.reason,
                rows=rows,
                model_attempts=pause.model_attempts,
                wakeable=pause.wakeable,
            )
        )


def _pause_open_steps(at: At) -> None:
    """Before a step inside another ends the task, record the open steps around it as
    PAUSED: they were interrupted at a known point, so they are not in doubt."""
    with at.ex.engine_call():
        for frame in at.ex.stack:
            row = NewStep(
                frame.seq,
                frame.key,
                KINDS[frame.kind].row,
                StepStatus.PAUSED,
                attempt=frame.attempt,
            )
            at.ex.task.record_child(row)


@dataclass(frozen=True)
class McpTool(SimpleKind):
    """``steps.tool``: a ``STEP`` whose body is one MCP call (:mod:`runtime.pipeline.mcpcall`);
    how it may run again after a crash comes from the server's live listing."""

    server: McpServer
    tool: str
    arguments: dict[str, Any]
    step_name: str
    options: Options
    kind: ClassVar[StepKind] = StepKind.STEP
    api: ClassVar[str] = "steps.tool"
    nests: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return self.step_name

    settled = RunStep.settled
    failed = RunStep.failed

    def replay(self, at: At) -> Any:
        value = at.row.response  # type: ignore[union-attr]
        at.ex.compensations.completed(at.key, value, None)
        return value

    def run(self, at: At) -> Any:
        target, options = self.server, self.options
        timeout, rerun, reconcile = options.timeout or target.timeout_seconds, False, None
        mcp = mcpcall.clients(at.task)
        entry: OfferedTool | None = None
        unavailable: McpUnavailable | None = None
        try:
            listing = offered(target, mcp.tools(target), set())
        except McpUnavailable as e:
            listing, unavailable = [], e
        entry = next((t for t in listing if t.tool == self.tool), None)
        if entry is not None:
            policy = mcpcall.policy_for(mcp, target, self.tool, entry.name)
            rerun, reconcile = idempotent(entry, policy), policy.reconcile
            timeout = options.timeout or policy.timeout_seconds or target.timeout_seconds

        def call() -> Any:
            if unavailable is not None:
                raise unavailable  # not sent: a failure like any other (steps.retry applies)
            if entry is None:
                raise McpRemoteError(f"{target.where} offers no tool {self.tool!r}")
            mcpcall.validate(entry, self.arguments)
            context = at.ex.current_context()
            assert context is not None
            result: CallResult = mcpcall.clients(at.task).call(
                target,
                self.tool,
                self.arguments,
                key=context.idempotency_key,
                run_id=at.ex.run_id,
                timeout_seconds=timeout,
            )
            if result.is_error:
                raise mcpcall.McpToolError(result.text)
            return result.structured if result.structured is not None else result.text

        # the MCP client keeps the time (no step timeout), and cancels on the server
        plain = Plain(options.retries, options.backoff, None, rerun, reconcile)
        return body(at, self.kind, call, Any, plain)


@dataclass(frozen=True)
class LlmCall(SimpleKind):
    """One model call inside ``steps.llm``: a child step ``…/llm:n`` recorded by the advance
    the moment it returns (:func:`runtime.pipeline.modelcall.call`; billed even when the fence
    refuses it), the task going on with its answer; replayed for the same attempt of its
    step, made afresh by a failed attempt's retry."""

    request: LlmRequest
    kind: ClassVar[StepKind] = StepKind.LLM_CALL
    api: ClassVar[str] = "the model"
    nests: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "llm"

    def misplaced(self, nested: bool) -> str | None:
        return None if nested else "the model is called inside steps.llm(...)"

    def settled(self, at: At) -> bool:
        rec = at.row
        parent = at.ex.stack[-1]
        return rec is not None and rec.status is StepStatus.DONE and rec.attempt == parent.attempt

    def replay(self, at: At) -> LlmResponse:
        rec = at.row
        assert rec is not None
        return LlmResponse(
            rec.response or [],
            rec.stop_reason,
            rec.usage,
            rec.model or self.request.model,
            rec.request_id,
        )

    def run(self, at: At) -> Record:
        ex, rec = at.ex, at.row
        with ex.engine_call():
            outcome = modelcall.call(
                ex.task,
                self.request,
                kind=self.kind,
                key=at.key,
                seq=rec.seq if rec is not None else ex.take_seq(),
                attempt=ex.stack[-1].attempt,
                diverged=ex.model_diverged,
                guard=True,
            )
        if isinstance(outcome, modelcall.Failed):
            ex.model_diverged = True
            raise outcome.error
        if isinstance(outcome, modelcall.Stopped):
            raise Pause(outcome.reason, stop=Stop(outcome.status, outcome.reason))
        if isinstance(outcome, modelcall.Later):
            raise Pause(
                outcome.reason,
                delay_seconds=outcome.delay_seconds,
                model_attempts=outcome.model_attempts,
                wakeable=outcome.wakeable,
            )
        assert not isinstance(outcome, modelcall.Interrupted)  # its kind is not interruptible
        assert isinstance(outcome, modelcall.Made)  # a fork's replayed answer too
        if outcome.answer is not None:  # the model was called: a fork replays no more
            ex.model_diverged = True
        return Record(
            [outcome.row],
            write=outcome.write,
            then=outcome.logged,
            goes_on=True,
            value=outcome.response,
        )


def declared_server(ex_agent: Any, server: McpServer | str) -> McpServer:
    """The MCP server ``server`` names, declared by the function's agent."""
    declared = {s.name: s for s in ex_agent.mcp_servers if isinstance(s, McpServer)}
    wanted = server if isinstance(server, str) else server.name
    found = declared.get(wanted) or (server if isinstance(server, McpServer) else None)
    if found is None:
        raise DurableConfigError(
            f"MCP server {wanted!r} is not declared: add it to "
            f"@durable_agent({ex_agent.name!r}, mcp_servers=[...])"
        )
    return found
