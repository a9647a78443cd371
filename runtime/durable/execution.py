"""One task's replay of a durable function.

The function runs from the top on every task. Every step, whatever its kind, goes through the
one advance (:meth:`runtime.pipeline.checkpoint.Program.advance`, the agent loop's too), as
:meth:`Execution.locate` places it: its key (``name:n`` at the top level, where ``n`` counts
earlier calls with that name, so loops work; ``parent/name:n`` inside another step), the
strict replay of the order, the look-up in the step log; a recorded answer given back (or its
error raised again) without running; else the guard, and the kind runs; what it gives to
record is checkpointed, and the task ends there (one step per task). What differs per kind is
its object: :mod:`runtime.durable.simple` (the protocol, and sleep, send, version, wait_for),
:mod:`runtime.durable.container` (``steps.run``, ``side_effect``, ``llm`` and its model calls,
``tool``: bodies run through the one step executor, :mod:`runtime.pipeline.effects`),
:mod:`runtime.durable.approval`, :mod:`runtime.durable.billed` (``steps.model_call``),
:mod:`runtime.durable.child`. Compensations are in :mod:`runtime.durable.compensation`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from db.records import NewStep, RunStatus, Step
from runtime.durable.api import (
    ApprovalBuilder,
    Billed,
    DurableAgent,
    StepOptions,
    Steps,
    reset_current_steps,
    set_current_steps,
)
from runtime.durable.approval import Approval
from runtime.durable.billed import BilledCall
from runtime.durable.child import Child
from runtime.durable.compensation import Compensations
from runtime.durable.container import (
    Frame,
    LlmCall,
    McpTool,
    declared_server,
    type_name,
)
from runtime.durable.errors import (
    DurableConfigError,
    InfrastructureError,
    NonDeterministicReplay,
    Yield,
)
from runtime.durable.simple import At, Send, SimpleKind, Sleep, Version, WaitFor
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.live_call import LiveCall
from runtime.mcp.servers import McpServer, namespaced
from runtime.pipeline.checkpoint import Outcome, Program, StepResult, Task
from runtime.pipeline.codec import decode, encode
from runtime.pipeline.guard import Stop
from runtime.pipeline.kinds import KINDS, StepKind, in_history
from runtime.tools import ToolContext

log = logging.getLogger(__name__)


def _base_name(key: str) -> str:
    return key.rsplit(":", 1)[0]


class Execution(Program[At]):
    """Implements ``steps`` (the :class:`~runtime.durable.api.Engine` protocol) for one task;
    its steps go through the one advance (:meth:`Program.advance`)."""

    def __init__(self, task: Task, agent: DurableAgent) -> None:
        self.task = task
        self.agent = agent
        self.history = [s.step_key for s in task.steps if in_history(s)]
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

    # -- the one advance (runtime.pipeline.checkpoint.Program.advance): how a function places
    # and guards its steps

    def locate(self, step: SimpleKind) -> At | None:
        """The step's key (``name:n``, ``parent/name:n``), the strict replay of the order (at
        the top level) and the look-up; ``None`` for a marker the run's history predates."""
        self._check_yielded()
        misplaced = step.misplaced(bool(self.stack))
        if misplaced is not None:
            raise DurableConfigError(misplaced)
        before = dict(self.counters)
        key = self._key(step.name)
        at = At(self, key, self.task.look_up(key), step.kind)
        if at.row is None and step.marker and self.calls < len(self.history):
            # The run's history went past this point before the marker existed: it started
            # on the old code and stays on the old branch. Nothing is recorded.
            self.counters = before
            return None
        if not self.stack:
            self._check_replay(key)
        return at

    def guard_step(self, step: SimpleKind, at: At) -> None:
        if not self.stack:
            self._guard(step.kind)

    # -- the kinds, each through the one advance -----------------------------------------------

    def model_call(self, request: LlmRequest) -> LlmResponse:
        response: LlmResponse = self.advance(LlmCall(request))
        return response

    def billed_call(
        self, name: str, fn: Callable[[LiveCall | None], Billed], prompt: Any, model: str
    ) -> Any:
        """``steps.model_call``: one billed step at the top level, recorded at once (one step
        per task); the same guard, flow control, live stream, cancel and billing as ours."""
        return self.advance(BilledCall(name, fn, prompt, model))

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
        if not self.stack and builder.role not in self.agent.approval_roles:
            raise DurableConfigError(
                f"approval role {builder.role!r} is not declared: add it to "
                f"@durable_agent({self.agent.name!r}, approval_roles=[...])"
            )
        return self.advance(Approval(builder, name, fn, args, type, idempotent))

    def compensate_last(self, fn: Callable[[Any], Any]) -> None:
        self.compensations.attach_to_last(fn)

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
        target = declared_server(self.agent, server)
        step_name = name or namespaced(target.name, tool)
        return self.advance(McpTool(target, tool, arguments, step_name, options))

    def child(
        self, agent: str, value: Any, token_budget: int | None, timeout_seconds: int | None
    ) -> Any:
        return self.advance(Child(agent, value, token_budget, timeout_seconds))

    def version(self, name: str, minimum: int, maximum: int) -> int:
        value: int = self.advance(Version(name, minimum, maximum, self.run_id))
        return value

    # -- durable waits and signals --------------------------------------------------------

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

    def sleep(self, seconds: float) -> None:
        self.advance(Sleep(seconds))

    def wait_for(self, name: str, timeout: float | None) -> Any:
        return self.advance(WaitFor(name, timeout))

    def send(self, run_id: uuid.UUID, name: str, payload: Any) -> None:
        self.advance(Send(run_id, name, payload))
