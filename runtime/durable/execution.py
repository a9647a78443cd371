"""One task's replay of a durable function.

The function runs from the top on every task. A step whose key is recorded returns its
recorded result (or raises its recorded error) without running; the first step without a
result runs through the one step executor (:mod:`runtime.pipeline.effects`: STARTED first, in-doubt
rules, timeouts), is checkpointed, and the task ends there (one step per task). Model calls
inside ``steps.llm`` are child steps recorded the moment they return
(:mod:`runtime.pipeline.modelcall`). Compensations are in :mod:`runtime.durable.compensation`.

Keys are ``name:n`` at the top level (``n`` counts earlier calls with that name, so loops
work) and ``parent/name:n`` inside another step.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from db.records import NewStep, RunStatus, Step, StepStatus, Usage
from db.records import StepKind as RowKind
from runtime.durable.api import (
    ApprovalBuilder,
    Billed,
    BilledFailure,
    DurableAgent,
    StepOptions,
    Steps,
    compensation_ref,
    reset_current_steps,
    set_current_steps,
)
from runtime.durable.compensation import Compensations
from runtime.durable.errors import (
    ApprovalMismatch,
    ApprovalRejected,
    ChildRunFailed,
    DurableConfigError,
    InfrastructureError,
    NonDeterministicReplay,
    Pause,
    SignalTimeout,
    StepError,
    StepTimeout,
    Yield,
)
from runtime.durable.notify import notify_approval
from runtime.durable.simple import At, Send, SimpleKind, Sleep, Version, WaitFor
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.live_call import LiveCall, current_live_call
from runtime.mcp.client import CallResult
from runtime.mcp.errors import McpRemoteError, McpUnavailable
from runtime.mcp.servers import McpServer, namespaced
from runtime.mcp.toolset import OfferedTool, idempotent, offered
from runtime.observe.logctx import error_text, set_step
from runtime.pipeline import effects, mcpcall, modelcall, usage
from runtime.pipeline.checkpoint import Outcome, StepResult, Task
from runtime.pipeline.codec import decode, encode
from runtime.pipeline.guard import Stop
from runtime.pipeline.kinds import KINDS, Found, State, StepKind
from runtime.tools import ToolContext

log = logging.getLogger(__name__)


def _hash(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _base_name(key: str) -> str:
    return key.rsplit(":", 1)[0]


def type_name(e: BaseException) -> str:
    return type(e).__name__


@dataclass
class Frame:
    """A step whose body is running."""

    key: str
    kind: StepKind
    seq: int
    attempt: int
    context: ToolContext | None = None


class Execution:
    """Implements ``steps`` (the :class:`~runtime.durable.api.Engine` protocol) for one task."""

    def __init__(self, task: Task, agent: DurableAgent) -> None:
        self.task = task
        self.agent = agent
        self.history = [
            s.step_key
            for s in task.steps
            if "/" not in s.step_key and s.kind is not RowKind.COMPENSATION
        ]
        self._next_seq = task.next_seq
        self._seq_lock = threading.Lock()
        self.counters: dict[tuple[str, str], int] = {}
        self.calls = 0
        self.stack: list[Frame] = []
        self.compensations = Compensations(self)
        self.yielded: Yield | None = None
        self.steps_api = Steps(self)
        self.model_diverged: bool | None = None
        """A fork replaying the model met a request that differs in this task (``None``:
        as the log says)."""

    @property
    def recorded(self) -> dict[str, Step]:
        """The run's steps by key (the task's log:
        :meth:`runtime.pipeline.checkpoint.Task.look_up`)."""
        return self.task.log

    # -- the Engine protocol's plain parts --------------------------------------------------

    @property
    def run_id(self) -> uuid.UUID:
        return self.task.run_id

    @property
    def default_model(self) -> str:
        return self.task.claim.run.model

    @property
    def default_max_tokens(self) -> int:
        return self.task.settings.max_tokens

    def current_key(self) -> str | None:
        return self.stack[-1].key if self.stack else None

    def current_context(self) -> ToolContext | None:
        return self.stack[-1].context if self.stack else None

    def live_event(self, name: str, data: dict[str, Any], once: str) -> None:
        live = self.task.services.live
        if live is None or self.yielded is not None:
            return
        try:
            text = json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=str)
            base = self.task.store.run_event_seq(self.run_id) or 0
        except Exception as e:  # best effort: never the run's failure
            log.warning("run=%s live event %s not published: %s", self.task.rid, name, e)
            return
        fields: dict[str, str | int] = {
            "type": name,
            "key": once,
            "attempt": 0,
            "base": base,
            "text": text,
        }
        live.publish_once(self.run_id, once, fields)

    # -- the whole function -----------------------------------------------------------------

    def run(self) -> StepResult:
        """The function, replayed from the top, to its next step or its end. Every early end
        (the guard, a replay that diverges, an exception, an output that cannot be recorded,
        the engine stopping the run) goes through :meth:`stop`."""
        run = self.task.claim.run
        token = set_current_steps(self.steps_api)
        try:
            try:
                argument = decode(run.input, self.agent.input_type)
                output = self.agent.fn(argument, self.steps_api)
                if self.task.stopping is not None:  # replayed to its end while stopping
                    self.stop(RunStatus.FAILED, self.task.stopping)
                result = encode(output)
            except NonDeterministicReplay as e:
                self.stop(RunStatus.FAILED, str(e))
            except Exception as e:
                self.stop(RunStatus.FAILED, f"{type_name(e)}: {e}")
        except Yield as y:
            return y.result
        finally:
            reset_current_steps(token)
        return self.task.finish(RunStatus.SUCCEEDED, result=result)

    def stop(self, status: RunStatus, reason: str) -> NoReturn:
        """The one way the function ends early: the compensations of its completed steps,
        one per task, then the end of the run with ``status`` and ``reason``. The reason
        comes back on every task until the end (the guard's condition, a deterministic
        divergence or failure, or the run's stop marker: :attr:`Task.stopping`)."""
        self.end(self.compensations.unwind(status, reason))

    # -- keys, strict replay, ending the task -----------------------------------------------

    def _key(self, name: str) -> str:
        if "/" in name or not name:
            raise DurableConfigError(f"step names must be non-empty and contain no '/': {name!r}")
        parent = self.stack[-1].key if self.stack else ""
        n = self.counters.get((parent, name), 0)
        self.counters[(parent, name)] = n + 1
        return f"{parent}/{name}:{n}" if parent else f"{name}:{n}"

    def _check_replay(self, key: str) -> None:
        position = self.calls
        self.calls += 1
        if not self.task.settings.strict_replay or position >= len(self.history):
            return
        if self.history[position] != key:
            recorded = ", ".join(_base_name(k) for k in self.history)
            raise NonDeterministicReplay(
                f"Run {self.run_id} diverged from its history at step #{position}: "
                f"recorded {_base_name(self.history[position])!r} but the code called "
                f"{_base_name(key)!r}. Recorded sequence: [{recorded}]. Either the agent code "
                "changed in an incompatible way or it is not deterministic between steps."
            )

    def take_seq(self) -> int:
        with self._seq_lock:  # a step's code may report model calls from its own thread
            seq = self._next_seq
            self._next_seq += 1
            return seq

    def end(self, result: StepResult) -> NoReturn:
        """End the task: nothing else may run in it, even if user code catches this."""
        self.yielded = Yield(result)
        raise self.yielded

    def _check_yielded(self) -> None:
        if self.yielded is not None:
            raise self.yielded

    @contextlib.contextmanager
    def engine_call(self) -> Iterator[None]:
        """Around the engine's own work inside the function: a failure there is not the
        function's (it must not be caught, compensated or recorded as a step error)."""
        try:
            yield
        except Exception as e:
            raise InfrastructureError(e) from e

    def _guard(self, kind: StepKind) -> None:
        steps_taken = len(self.history)
        with self.engine_call():
            stop = self.task.guard(
                steps_taken=steps_taken, next_is_model=KINDS[kind].guarded_as_model
            )
            run = self.task.claim.run
            if self.task.stopping is not None:  # no new step: the run is being stopped
                stop = Stop(RunStatus.FAILED, self.task.stopping)
            if stop is None and steps_taken >= run.max_steps:
                stop = Stop(
                    RunStatus.FAILED,
                    f"step cap reached: {steps_taken} steps of maxSteps {run.max_steps}",
                )
            if stop is not None:
                self.stop(stop.status, stop.reason)

    def _pause_open_steps(self) -> None:
        """Before a step inside another ends the task, record the open steps around it as
        PAUSED: they were interrupted at a known point, so they are not in doubt."""
        with self.engine_call():
            for frame in self.stack:
                self.task.record_child(
                    NewStep(
                        frame.seq,
                        frame.key,
                        KINDS[frame.kind].row,
                        StepStatus.PAUSED,
                        attempt=frame.attempt,
                    ),
                )

    # -- steps ------------------------------------------------------------------------------

    def step(
        self,
        kind: str,
        name: str,
        thunk: Callable[[], Any],
        *,
        type: Any,
        compensate: Callable[[Any], Any] | None,
        options: StepOptions,
        declared_by: str | None = None,
    ) -> Any:
        self._check_yielded()
        step_kind = StepKind(kind)
        key = self._key(name)
        if not self.stack:
            self._check_replay(key)
        found = self.task.look_up(key)
        rec = found.row
        if rec is not None and rec.status is StepStatus.DONE:
            value = decode(rec.response, type)
            self.compensations.completed(key, value, compensate)
            return value
        if rec is not None and rec.status is StepStatus.ERROR and not self.stack:
            self.compensations.undo_children(key)  # ends the task while any is left
            raise self._recorded_error(key, rec)
        if not self.stack:
            self._guard(step_kind)
        return self._run_step(step_kind, key, thunk, type, compensate, options, found, declared_by)

    @staticmethod
    def _recorded_error(key: str, rec: Step) -> StepError:
        message = rec.error or "unknown error"
        if message.startswith("StepTimeout:"):
            return StepTimeout(key, message)
        if message.startswith("SignalTimeout:"):
            return SignalTimeout(key, message)
        if message.startswith("ChildRunFailed:"):
            return ChildRunFailed(key, message)
        return StepError(key, message)

    def _run_step(
        self,
        kind: StepKind,
        key: str,
        thunk: Callable[[], Any],
        type: Any,
        compensate: Callable[[Any], Any] | None,
        options: StepOptions,
        found: Found,
        declared_by: str | None,
        input_hash: str | None = None,
    ) -> Any:
        rec = found.row
        if rec is None:
            seq, attempt = self.take_seq(), 1
        elif rec.status in (StepStatus.PAUSED, StepStatus.STARTED):
            # Entered again after a pause or a crash: the same attempt, so the model calls
            # it recorded are replayed (only a failed attempt's retry calls the model afresh).
            seq, attempt = rec.seq, rec.attempt
        else:
            seq, attempt = rec.seq, rec.attempt + 1
        nested = bool(self.stack)
        if not nested:
            set_step(seq)
        frame = Frame(key, kind, seq, attempt)

        def body(context: ToolContext) -> Any:
            frame.context = context
            return thunk()

        effect = effects.Effect(
            key=key,
            kind=kind,
            seq=seq,
            fn=body,
            label=f"step {key!r} (seq={seq})",
            idempotent=options.idempotent,
            reconcile=options.reconcile,
            timeout_seconds=options.timeout,
            attempt=attempt,
            input_hash=input_hash,
            take_seq=self.take_seq,
        )
        self.stack.append(frame)
        try:
            with self.engine_call():
                verdict = effects.run_effect(self.task, effect, found)
        except Pause as p:
            self.stack.pop()
            paused = NewStep(seq, key, KINDS[kind].row, StepStatus.PAUSED, attempt=attempt)
            if nested:
                p.rows.append(paused)
                raise
            self._paused(p, [*p.rows, paused])
        finally:
            if self.stack and self.stack[-1] is frame:
                self.stack.pop()
        if isinstance(verdict, effects.InDoubt | effects.StillRunning | effects.Away):
            self._pause_open_steps()
            with self.engine_call():
                stopped = effects.unsettled(self.task, verdict)
            assert stopped is not None
            self.end(stopped)
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
                value = (
                    decode(encoded, type) if isinstance(verdict, effects.WasReconciled) else value
                )
            except Exception as e:
                error = e
        if error is not None:
            return self._failed(effect, verdict, error, timed_out, options)
        row = effects.row(
            effect,
            verdict,
            response=encoded,
            compensation=compensation_ref(compensate, declared_by) if compensate else None,
        )
        self.compensations.completed(key, value, compensate)
        if nested:
            with self.engine_call():
                self.task.record_child(row)
            return value
        log.info("run=%s seq=%d %s %s done %dms", self.task.rid, seq, row.kind, key, row.latency_ms)
        with self.engine_call():
            self.end(self.task.checkpoint([row]))

    def _failed(
        self,
        effect: effects.Effect,
        verdict: effects.Verdict,
        error: Exception,
        timed_out: bool,
        options: StepOptions,
    ) -> Any:
        key, seq, attempt = effect.key, effect.seq, effect.attempt
        text = (
            f"StepTimeout: step ran longer than {options.timeout:g}s"
            if timed_out
            else f"{type_name(error)}: {error}"
        )
        row = effects.row(effect, verdict, status=StepStatus.ERROR, error=text)
        if self.stack:  # nested: recorded, and the parent's code sees the exception
            with self.engine_call():
                self.task.record_child(row)
            raise StepTimeout(key, text) if timed_out else error
        if options.retries and attempt < options.retries:
            delay = options.backoff * 2 ** (attempt - 1)
            log.info(
                "run=%s seq=%d %s %s attempt %d failed (%s); retry in %.1fs",
                self.task.rid,
                seq,
                row.kind,
                key,
                attempt,
                error_text(text),
                delay,
            )
            retrying = effects.row(effect, verdict, status=StepStatus.RETRYING, error=text)
            with self.engine_call():
                self.end(
                    self.task.schedule(
                        delay, f"{key} attempt {attempt} failed; retrying", rows=[retrying]
                    )
                )
        log.info(
            "run=%s seq=%d %s %s failed: %s", self.task.rid, seq, row.kind, key, error_text(text)
        )
        with self.engine_call():
            self.end(self.task.checkpoint([row]))

    def _paused(self, pause: Pause, rows: list[NewStep]) -> NoReturn:
        with self.engine_call():
            if pause.stop is not None:  # the guard stopped the run inside a step
                for row in rows:
                    self.task.record_child(row)
                self.stop(pause.stop.status, pause.stop.reason)
            assert pause.delay_seconds is not None
            self.end(
                self.task.schedule(
                    pause.delay_seconds,
                    pause.reason,
                    rows=rows,
                    model_attempts=pause.model_attempts,
                    wakeable=pause.wakeable,
                )
            )

    def compensate_last(self, fn: Callable[[Any], Any]) -> None:
        self.compensations.attach_to_last(fn)

    # -- MCP tools ----------------------------------------------------------------------------

    def mcp_tool(
        self,
        server: McpServer | str,
        tool: str,
        arguments: dict[str, Any],
        *,
        name: str | None,
        options: StepOptions,
    ) -> Any:
        """``steps.tool``: a STEP whose body is one MCP call (runtime.pipeline.mcpcall)."""
        self._check_yielded()
        declared = {s.name: s for s in self.agent.mcp_servers if isinstance(s, McpServer)}
        wanted = server if isinstance(server, str) else server.name
        found = declared.get(wanted) or (server if isinstance(server, McpServer) else None)
        if found is None:
            raise DurableConfigError(
                f"MCP server {wanted!r} is not declared: add it to "
                f"@durable_agent({self.agent.name!r}, mcp_servers=[...])"
            )
        target: McpServer = found
        step_name = name or namespaced(target.name, tool)
        parent = self.stack[-1].key if self.stack else ""
        n = self.counters.get((parent, step_name), 0)
        key = f"{parent}/{step_name}:{n}" if parent else f"{step_name}:{n}"
        settled = self.task.look_up(key).state is State.RECORDED
        timeout = options.timeout or target.timeout_seconds
        rerun, reconcile = False, None
        entry: OfferedTool | None = None
        unavailable: McpUnavailable | None = None
        if not settled:  # it will run: how it may run again comes from the live listing
            mcp = mcpcall.clients(self.task)
            try:
                listing = offered(target, mcp.tools(target), set())
            except McpUnavailable as e:
                listing, unavailable = [], e
            entry = next((t for t in listing if t.tool == tool), None)
            if entry is not None:
                policy = mcpcall.policy_for(mcp, target, tool, entry.name)
                rerun, reconcile = idempotent(entry, policy), policy.reconcile
                timeout = options.timeout or policy.timeout_seconds or target.timeout_seconds

        def call() -> Any:
            if unavailable is not None:
                raise unavailable  # not sent: a failure like any other (steps.retry applies)
            if entry is None:
                raise McpRemoteError(f"{target.where} offers no tool {tool!r}")
            mcpcall.validate(entry, arguments)
            context = self.current_context()
            assert context is not None
            result: CallResult = mcpcall.clients(self.task).call(
                target,
                tool,
                arguments,
                key=context.idempotency_key,
                run_id=self.run_id,
                timeout_seconds=timeout,
            )
            if result.is_error:
                raise mcpcall.McpToolError(result.text)
            return result.structured if result.structured is not None else result.text

        step_options = StepOptions(
            self.steps_api,
            retries=options.retries,
            backoff=options.backoff,
            timeout=None,  # the MCP client keeps the time, and cancels on the server
            idempotent=rerun,
            reconcile=reconcile,
        )
        return self.step("STEP", step_name, call, type=Any, compensate=None, options=step_options)

    # -- the one advance of a simple kind --------------------------------------------------

    def advance(self, step: SimpleKind) -> Any:
        """Advance a top-level step of a simple kind (:mod:`runtime.durable.simple`): its key,
        the strict replay of the order, the look-up; a recorded result given back (or error
        raised again); else the guard, and the kind runs (recording through the checkpoint
        and ending the task, or giving its value)."""
        self._check_yielded()
        if self.stack:
            raise DurableConfigError(f"{step.api} belongs at the top level, not inside a step")
        before = dict(self.counters)
        key = self._key(step.name)
        rec = self.task.look_up(key).row
        if rec is None and step.marker and self.calls < len(self.history):
            # The run's history went past this point before the marker existed: it started
            # on the old code and stays on the old branch. Nothing is recorded.
            self.counters = before
            return step.predates()
        self._check_replay(key)
        if rec is not None and rec.status is StepStatus.DONE:
            return step.replay(rec)
        if rec is not None and rec.status is StepStatus.ERROR:
            raise self._recorded_error(key, rec)
        self._guard(step.kind)
        return step.run(At(self, key, rec, step.kind))

    def version(self, name: str, minimum: int, maximum: int) -> int:
        value: int = self.advance(Version(name, minimum, maximum, self.run_id))
        return value

    # -- the model ----------------------------------------------------------------------------

    def model_call(self, request: LlmRequest) -> LlmResponse:
        self._check_yielded()
        if not self.stack:
            raise DurableConfigError("the model is called inside steps.llm(...)")
        parent = self.stack[-1]
        key = self._key("llm")
        rec = self.task.look_up(key).row
        if rec is not None and rec.status is StepStatus.DONE and rec.attempt == parent.attempt:
            return LlmResponse(
                rec.response or [],
                rec.stop_reason,
                rec.usage,
                rec.model or request.model,
                rec.request_id,
            )
        with self.engine_call():
            outcome = modelcall.call(
                self.task,
                request,
                kind=StepKind.LLM_CALL,
                key=key,
                seq=rec.seq if rec is not None else self.take_seq(),
                attempt=parent.attempt,
                diverged=self.model_diverged,
                guard=True,
            )
        if isinstance(outcome, modelcall.Failed):
            self.model_diverged = True
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
        if outcome.answer is not None:
            self.model_diverged = True
        return outcome.response

    # -- a framework's model call -----------------------------------------------------------

    def billed_call(
        self, name: str, fn: Callable[[LiveCall | None], Billed], prompt: Any, model: str
    ) -> Any:
        """``steps.model_call``: one billed step at the top level, recorded at once (one step
        per task); the same guard, flow control, live stream, cancel and billing as ours."""
        self._check_yielded()
        if self.stack:
            raise DurableConfigError("steps.model_call belongs at the top level, not in a step")
        key = self._key(name)
        self._check_replay(key)
        rec = self.recorded.get(key)
        if rec is not None and rec.status is StepStatus.DONE:
            return rec.response
        if rec is not None and rec.status is StepStatus.ERROR:
            raise self._recorded_error(key, rec)
        self._guard(StepKind.FRAMEWORK_MODEL)
        seq = rec.seq if rec is not None else self.take_seq()
        set_step(seq)
        task = self.task
        body = {"model": model, "prompt": prompt}
        request = LlmRequest(model=model, max_tokens=self.default_max_tokens, messages=[])

        def make() -> LlmResponse:
            billed = fn(current_live_call())
            value = encode(billed.value)
            return LlmResponse(
                value, billed.stop_reason, billed.usage, billed.model or model, billed.request_id
            )

        started = time.monotonic()
        with self.engine_call():
            outcome = modelcall.call(
                task, request, kind=StepKind.FRAMEWORK_MODEL, key=key, seq=seq, body=body, make=make
            )
        if isinstance(outcome, modelcall.Recorded):
            self.end(StepResult(Outcome.CONTINUE, dispatch=outcome.dispatch))
        if isinstance(outcome, modelcall.Later):
            with self.engine_call():
                self.end(
                    task.schedule(
                        outcome.delay_seconds,
                        outcome.reason,
                        model_attempts=outcome.model_attempts,
                        admission=outcome.admission,
                        wakeable=outcome.wakeable,
                    )
                )
        if isinstance(outcome, modelcall.Stopped):
            with self.engine_call():
                self.stop(outcome.status, outcome.reason)
        assert not isinstance(outcome, modelcall.Interrupted)  # its kind is not interruptible
        billed = outcome.error if isinstance(outcome.error, BilledFailure) else None
        error = billed.error if billed is not None else outcome.error  # billed all the same
        text = f"{type_name(error)}: {error}"
        row = NewStep(
            seq,
            key,
            KINDS[StepKind.FRAMEWORK_MODEL].row,
            StepStatus.ERROR,
            error=text,
            attempt=1,
            latency_ms=int((time.monotonic() - started) * 1000),
            model=model,
        )
        log.info("run=%s seq=%d MODEL %s failed: %s", task.rid, seq, key, error_text(text))
        if billed is not None:
            with self.engine_call():
                self.end(self._record_billed_failure(request, body, row, billed))
        with self.engine_call():
            self.end(task.checkpoint([row]))

    def _record_billed_failure(
        self, request: LlmRequest, body: dict[str, Any], row: NewStep, failure: BilledFailure
    ) -> StepResult:
        """The error row of a framework's call the provider billed, with its usage; an
        estimate (its input from the request, its output at ``max_tokens`` unless the
        framework said) when the framework raised before its usage could be read."""
        usage, model = failure.billed.usage, failure.billed.model or request.model
        if failure.estimated:
            usage = Usage(
                input_tokens=usage.input_tokens or modelcall.estimate_tokens(body),
                output_tokens=usage.output_tokens or request.max_tokens,
            )
        return modelcall.record_failed(
            self.task, request, body, row, usage, model,
            request_id=failure.billed.request_id, estimated=failure.estimated,
        )  # fmt: skip

    # -- approvals ----------------------------------------------------------------------------

    def approval(
        self,
        builder: ApprovalBuilder,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        type: Any,
        idempotent: bool,
    ) -> Any:
        self._check_yielded()
        if self.stack:
            raise DurableConfigError("an approval cannot be asked for inside another step")
        if builder.role not in self.agent.approval_roles:
            raise DurableConfigError(
                f"approval role {builder.role!r} is not declared: add it to "
                f"@durable_agent({self.agent.name!r}, approval_roles=[...])"
            )
        key = self._key(name)
        self._check_replay(key)
        payload = {"stepKey": key, "input": encode(list(args))}
        digest = _hash(payload)
        found = self.task.look_up(key)
        rec = found.row
        if rec is not None and rec.origin is not None and rec.input_hash != digest:
            # A fork copied this decision, but its edits changed what would be approved: the
            # decision was not about this payload, so the approver is asked again.
            self._guard(StepKind.APPROVAL)
            return self._suspend(builder, key, payload, digest, copied=rec)
        if rec is not None and rec.status is StepStatus.DONE:
            value = decode(rec.response, type)
            self.compensations.completed(key, value, None)
            return value
        if rec is not None and rec.status is StepStatus.REJECTED:
            approval = self._approval_record(key)
            raise ApprovalRejected(
                key,
                approval.decided_by if approval else None,
                approval.comment if approval else None,
            )
        if rec is not None and rec.status is StepStatus.ERROR:
            raise StepError(key, rec.error or "approval failed")
        approved = (StepStatus.APPROVED, StepStatus.STARTED, StepStatus.PAUSED)
        if rec is not None and rec.status in approved:
            if rec.input_hash != digest:
                raise ApprovalMismatch(
                    f"{key} was approved for input hash {rec.input_hash}, but the code would now "
                    f"run it with {digest}: what runs must be what was approved"
                )
            self._guard(StepKind.APPROVAL)
            options = StepOptions(self.steps_api, idempotent=idempotent)
            return self._run_step(
                StepKind.APPROVED_ACTION,
                key,
                functools.partial(fn, *args),
                type,
                None,
                options,
                found,
                None,
                input_hash=digest,
            )
        self._guard(StepKind.APPROVAL)
        return self._suspend(builder, key, payload, digest)

    def _suspend(
        self,
        builder: ApprovalBuilder,
        key: str,
        payload: Any,
        digest: str,
        copied: Step | None = None,
    ) -> NoReturn:
        seq = copied.seq if copied is not None else self.take_seq()
        row = NewStep(
            seq=seq,
            step_key=key,
            kind=KINDS[StepKind.APPROVAL].row,
            status=StepStatus.PENDING,
            input_hash=digest,
        )
        with self.engine_call():
            approval_id = self.task.suspend_for_approval(
                row,
                role=builder.role,
                payload=payload,
                timeout_seconds=builder.timeout_seconds,
                timeout_policy=builder.policy,
                discard_copied=copied is not None,
            )
        log.info("run=%s seq=%d APPROVAL %s waiting for %s", self.task.rid, seq, key, builder.role)
        notify_approval(self.task, self.agent, approval_id, key, builder, payload, digest)
        self.end(StepResult(Outcome.WAITING, status=RunStatus.WAITING))

    def _approval_record(self, key: str) -> Any:
        with self.engine_call():
            approvals = self.task.store.list_approvals(status=None, run_id=self.run_id)
        return next((a for a in approvals if a.step_key == key), None)

    # -- durable waits and signals --------------------------------------------------------

    def _top_level(self, what: str, name: str) -> tuple[str, Step | None]:
        self._check_yielded()
        if self.stack:
            raise DurableConfigError(f"{what} belongs at the top level, not inside a step")
        key = self._key(name)
        self._check_replay(key)
        return key, self.task.look_up(key).row

    def park(
        self, rows: list[NewStep], delay: float, reason: str, signal: str | None = None
    ) -> None:
        """Park the run on a durable timer (ending the task); returns only when ``signal`` is
        already there to consume instead."""
        with self.engine_call():
            dispatch = self.task.park(rows, delay, reason, signal=signal)
        if dispatch is None:
            return
        log.info("run=%s %s", self.task.rid, reason)
        send = delay <= self.task.settings.max_countdown_seconds
        self.end(StepResult(Outcome.WAITING, dispatch=dispatch if send else None))

    def _until_deadline(self) -> float:
        run = self.task.claim.run
        return max(0.0, (run.deadline_at - self.task.claim.db_now).total_seconds()) + 1.0

    def sleep(self, seconds: float) -> None:
        self.advance(Sleep(seconds))

    def wait_for(self, name: str, timeout: float | None) -> Any:
        return self.advance(WaitFor(name, timeout))

    def send(self, run_id: uuid.UUID, name: str, payload: Any) -> None:
        self.advance(Send(run_id, name, payload))

    # -- child runs -----------------------------------------------------------------------

    CHILD_RECHECK_SECONDS = 30.0
    """A parent waiting for its child is woken when the child ends; should that wake be
    lost, it looks again after this long."""

    def _child_recheck(self) -> float:
        """Until the fallback look, or the run's deadline if sooner (its guard ends it)."""
        return min(self.CHILD_RECHECK_SECONDS, self._until_deadline())

    def child(
        self, agent: str, value: Any, token_budget: int | None, timeout_seconds: int | None
    ) -> Any:
        key, rec = self._top_level("steps.child", f"child.{agent}")
        if rec is not None and rec.status is StepStatus.DONE:
            return rec.response
        if rec is not None and rec.status is StepStatus.ERROR:
            raise self._recorded_error(key, rec)
        self._guard(StepKind.CHILD)
        row_kind = KINDS[StepKind.CHILD].row
        task = self.task
        if rec is None or rec.status is StepStatus.RETRYING:
            # RETRYING: its child was cancelled when this run ended early, and the run was
            # resumed: a child of its own attempt, never the one cancelled (issue 35 U9)
            seq = self.take_seq() if rec is None else rec.seq
            attempt = 1 if rec is None else rec.attempt + 1
            started_as = key if attempt == 1 else f"{key}#{attempt}"
            left = task.budget_left()
            if left <= 0:
                no_budget = "ChildRunFailed: no token budget left for a child run"
                failed = NewStep(
                    seq, key, row_kind, StepStatus.ERROR, attempt=attempt, error=no_budget
                )
                with self.engine_call():
                    self.end(task.checkpoint([failed]))
            new, child_id = task.child_run(
                started_as,
                agent,
                encode(value),
                token_budget=min(token_budget or left, left),
                timeout_seconds=timeout_seconds,
            )
            pending = NewStep(seq, key, row_kind, StepStatus.PENDING, attempt=attempt,
                              response={"runId": str(child_id), "agent": agent})  # fmt: skip
            reason = f"{key} waiting for child run {str(child_id)[:8]}"
            with self.engine_call():
                [first] = task.start_children(
                    [(pending, new, child_id)], self._child_recheck(), reason
                )
            log.info("run=%s seq=%d CHILD %s started run=%s", task.rid, seq, key, str(child_id)[:8])
            self.end(StepResult(Outcome.WAITING, wakes=(first,)))
        child_id = uuid.UUID(rec.response["runId"])
        with self.engine_call():
            parked = task.park_for_child(
                child_id, self._child_recheck(), f"{key} waiting for child run {str(child_id)[:8]}"
            )
        if parked:
            self.end(StepResult(Outcome.WAITING))
        with self.engine_call():
            child = task.store.get_run(child_id)
        cost = child.cost_usd + child.unrecorded_cost_usd
        if child.status is RunStatus.SUCCEEDED:
            row = NewStep(rec.seq, key, row_kind, StepStatus.DONE, attempt=rec.attempt,
                          response=child.result, usage=child.usage, cost_usd=cost,
                          unrecorded_tokens=usage.unrecorded_in_tree(child))  # fmt: skip
        else:
            row = NewStep(rec.seq, key, row_kind, StepStatus.ERROR, attempt=rec.attempt,
                          usage=child.usage, cost_usd=cost,
                          unrecorded_tokens=usage.unrecorded_in_tree(child),
                          error=f"ChildRunFailed: child run {child_id} ended {child.status}: "
                          f"{child.error or 'no error recorded'}")  # fmt: skip
        log.info("run=%s seq=%d CHILD %s: run=%s %s", task.rid, rec.seq, key, str(child_id)[:8],
                 child.status)  # fmt: skip
        with self.engine_call():
            self.end(task.checkpoint([row]))
