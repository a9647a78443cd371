"""A test kit for durable functions (and agents): a fake model, crash simulation, helpers to
run, resume and approve, and fluent assertions. It drives the real engine against a real
store; only the model is scripted.

    model = FakeModel().respond_with_json(Classification("billing", "normal"))
    tester = DurableTester(runtime, model)          # the runtime's model becomes ``model``
    tester.crash_after("classify")
    crashed = tester.run(triage, ticket)
    tester.resume(crashed.run_id)
    done = tester.approve(crashed.run_id, "lead")
    assert_run(done).completed().has_steps("classify", "find_similar", "propose", "apply") \\
        .step("propose").was_approved()
    assert model.calls == 1

With pytest, ``pytest_plugins = ["runtime.testing.pytest_plugin"]`` provides these as fixtures.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from db.records import ApprovalStatus, Dispatch, RunStatus, Step, StepKind, StepStatus, Usage
from runtime.durable import DurableAgent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.pipeline.codec import encode
from runtime.pipeline.kinds import in_history, is_compensation


class SimulatedCrash(BaseException):
    """The worker process died here. Not an Exception, so nothing in the engine catches it."""


class FakeModel:
    """A scripted model: answers in order, counts calls, keeps every request."""

    def __init__(self, model: str = "fake-model") -> None:
        self.model = model
        self.requests: list[LlmRequest] = []
        self._script: deque[LlmResponse] = deque()
        self._lock = threading.Lock()

    def respond_with_text(
        self, text: str, input_tokens: int = 10, output_tokens: int = 5
    ) -> FakeModel:
        self._script.append(
            LlmResponse(
                [{"type": "text", "text": text}],
                "end_turn",
                Usage(input_tokens, output_tokens),
                self.model,
            )
        )
        return self

    def respond_with_json(
        self, value: Any, input_tokens: int = 10, output_tokens: int = 5
    ) -> FakeModel:
        """The next call answers with ``value`` as JSON text (dataclasses and pydantic models
        are encoded as a step result would be)."""
        return self.respond_with_text(json.dumps(encode(value)), input_tokens, output_tokens)

    @property
    def calls(self) -> int:
        return len(self.requests)

    def send(self, request: LlmRequest) -> LlmResponse:
        with self._lock:
            self.requests.append(copy.deepcopy(request))
            if not self._script:
                raise AssertionError(
                    f"FakeModel was called {len(self.requests)} times; only "
                    f"{len(self.requests) - 1} answers were scripted"
                )
            return self._script.popleft()


@dataclass
class RunResult:
    run_id: uuid.UUID
    status: RunStatus
    result: Any
    error: str | None
    steps: list[Step]
    crashed: bool = False


@dataclass
class DurableTester:
    runtime: Runtime
    model: FakeModel | None = None
    worker: str = "testkit"
    max_tasks: int = 500
    _crash_after: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.model is not None:
            self.runtime.llm = self.model

    # -- arranging ----------------------------------------------------------------------------

    def crash_after(self, step_name: str) -> DurableTester:
        """The "process" dies right after the step called ``step_name`` is checkpointed,
        before the next message is sent (once)."""
        self._crash_after.add(step_name)
        return self

    # -- acting -------------------------------------------------------------------------------

    def run(self, agent: DurableAgent | str, input: Any, **limits: Any) -> RunResult:
        """Submit a run and drive it until it ends, waits for a person, or crashes."""
        name = agent if isinstance(agent, str) else agent.name
        if not isinstance(agent, str) and name not in self.runtime.agents:
            self.runtime.agents.register(agent)
        _run, dispatch = self.runtime.submit(name, encode(input), **limits)
        return self._drive(dispatch)

    def resume(self, run_id: uuid.UUID) -> RunResult:
        """What the reaper does after a crash: the run gets a new message and goes on."""
        self.runtime.store.make_due_now(run_id)
        due = [
            d for d in self.runtime.store.redispatch_due(redispatch_after=0) if d.run_id == run_id
        ]
        if not due:
            return self.result(run_id)
        return self._drive(due[0])

    def approve(
        self, run_id: uuid.UUID, decider: str = "tester", comment: str | None = None
    ) -> RunResult:
        return self._decide(run_id, ApprovalStatus.APPROVED, decider, comment)

    def reject(
        self, run_id: uuid.UUID, decider: str = "tester", comment: str | None = None
    ) -> RunResult:
        return self._decide(run_id, ApprovalStatus.REJECTED, decider, comment)

    def result(self, run_id: uuid.UUID, *, crashed: bool = False) -> RunResult:
        run = self.runtime.store.get_run(run_id)
        return RunResult(
            run.id, run.status, run.result, run.error, self.runtime.store.steps(run.id), crashed
        )

    def _decide(
        self, run_id: uuid.UUID, status: ApprovalStatus, decider: str, comment: str | None
    ) -> RunResult:
        pending = self.runtime.store.list_approvals(run_id=run_id)
        if not pending:
            raise AssertionError(f"run {run_id} has no pending approval")
        dispatch = self.runtime.store.decide_approval(
            pending[0].id, status, decided_by=decider, comment=comment
        )
        if dispatch is None:
            raise AssertionError(f"the approval of run {run_id} could not be decided")
        return self._drive(dispatch)

    def _drive(self, dispatch: Dispatch) -> RunResult:
        driver = self.runtime.driver(worker=self.worker)
        current: Dispatch | None = dispatch
        for _ in range(self.max_tasks):
            if current is None:
                break
            before = {s.step_key for s in self.runtime.store.steps(current.run_id)}
            result = driver.drive(current.run_id, current.token)
            if result.outcome is Outcome.WAITING and _parked_on_a_wait(
                self.runtime.store.get_run(current.run_id).wait_reason
            ):
                break  # steps.sleep / wait_for / child: returned parked, as it waits
            if result.outcome is Outcome.WAITING and result.dispatch is not None:
                self.runtime.store.make_due_now(current.run_id)  # time flies in tests
            current = result.dispatch
            new = [s for s in self.runtime.store.steps(dispatch.run_id) if s.step_key not in before]
            done = {s.step_key.rsplit(":", 1)[0] for s in new if s.status is StepStatus.DONE}
            hit = done & self._crash_after
            if hit:
                self._crash_after -= hit
                return self.result(dispatch.run_id, crashed=True)
        else:
            raise AssertionError(f"run {dispatch.run_id} did not settle in {self.max_tasks} tasks")
        return self.result(dispatch.run_id)


_WAITS = ("sleeping until", "waiting for signal", "waiting for child run")


def _parked_on_a_wait(reason: str | None) -> bool:
    """The run waits for time to pass, a signal or a child run: driving it again now would
    only park it again."""
    return reason is not None and any(w in reason for w in _WAITS)


# -- assertions ---------------------------------------------------------------------------------


def _top_level(steps: list[Step]) -> list[Step]:
    return [s for s in steps if in_history(s)]


class RunAssert:
    def __init__(self, result: RunResult) -> None:
        self.r = result

    def _status(self, status: RunStatus) -> RunAssert:
        if self.r.status is not status:
            raise AssertionError(
                f"run {self.r.run_id} is {self.r.status}, expected {status}"
                + (f" (error: {self.r.error})" if self.r.error else "")
            )
        return self

    def completed(self) -> RunAssert:
        return self._status(RunStatus.SUCCEEDED)

    def failed(self) -> RunAssert:
        return self._status(RunStatus.FAILED)

    def waiting(self) -> RunAssert:
        return self._status(RunStatus.WAITING)

    def has_steps(self, *names: str) -> RunAssert:
        actual = [s.step_key.rsplit(":", 1)[0] for s in _top_level(self.r.steps)]
        if actual != list(names):
            raise AssertionError(f"steps were {actual}, expected {list(names)}")
        return self

    def output(self, expected: Any) -> RunAssert:
        if self.r.result != encode(expected):
            raise AssertionError(f"output was {self.r.result!r}, expected {encode(expected)!r}")
        return self

    def step(self, name: str, n: int = 0) -> StepAssert:
        key = f"{name}:{n}"
        for s in self.r.steps:
            if s.step_key == key:
                return StepAssert(self, s)
        raise AssertionError(f"run {self.r.run_id} has no step {key}")

    def compensated(self, *names: str) -> RunAssert:
        """Compensations ran for exactly these steps, in this order."""
        actual = [
            s.step_key.removeprefix("compensate:").rsplit(":", 1)[0]
            for s in self.r.steps
            if is_compensation(s) and s.status is StepStatus.DONE
        ]
        if actual != list(names):
            raise AssertionError(f"compensated {actual}, expected {list(names)}")
        return self


class StepAssert:
    def __init__(self, parent: RunAssert, step: Step) -> None:
        self.parent = parent
        self.s = step

    def was_approved(self) -> RunAssert:
        if self.s.kind is not StepKind.APPROVAL or self.s.status is not StepStatus.DONE:
            raise AssertionError(
                f"step {self.s.step_key} is {self.s.kind} {self.s.status}, not approved and done"
            )
        return self.parent

    def was_rejected(self) -> RunAssert:
        if self.s.status is not StepStatus.REJECTED:
            raise AssertionError(f"step {self.s.step_key} is {self.s.status}, not REJECTED")
        return self.parent

    def attempts(self, n: int) -> RunAssert:
        if self.s.attempt != n:
            raise AssertionError(
                f"step {self.s.step_key} took {self.s.attempt} attempts, expected {n}"
            )
        return self.parent

    def done(self) -> RunAssert:
        if self.s.status is not StepStatus.DONE:
            raise AssertionError(f"step {self.s.step_key} is {self.s.status}")
        return self.parent


def assert_run(result: RunResult) -> RunAssert:
    return RunAssert(result)
