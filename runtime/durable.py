"""Durable functions: a plain Python function ``fn(input, steps)`` whose non-deterministic work
goes through ``steps``. Same engine, step log, leases, guard and timeline as the agent loop.

Each task replays the function from the top: a step whose key is recorded returns its recorded
result (or raises its recorded error) without running; the first step without a result runs,
is checkpointed, and the task ends there (one step per task). The code between steps must be
deterministic: it runs again on every task and must call the same steps in the same order.

Keys are ``name:n`` at the top level (``n`` counts earlier calls with that name, so loops
work) and ``parent/name:n`` for steps called while another step runs.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import re
import time
import typing
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeVar

from db.errors import DarError, LeaseLost
from db.records import (
    Claim,
    NewStep,
    RunStatus,
    Step,
    StepKind,
    StepStatus,
    Usage,
)
from runtime.codec import decode, encode, return_type
from runtime.faults import crash_point
from runtime.guard import guard
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.retry import RetryLater
from runtime.logctx import set_step

if TYPE_CHECKING:
    from runtime.driver import Driver, StepResult
    from runtime.heartbeat import HeldLease

log = logging.getLogger(__name__)
T = TypeVar("T")

TIMEOUT_POLICIES = ("FAIL", "REJECT", "APPROVE")
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="dar-step")


# -- errors a durable function may see -----------------------------------------------------


class StepError(DarError):
    """A step failed; on replay its recorded error is raised again, as this exception."""

    def __init__(self, step_key: str, message: str) -> None:
        super().__init__(f"step {step_key} failed: {message}")
        self.step_key = step_key
        self.error = message


class StepTimeout(DarError):
    """A step ran longer than its ``steps.timeout(...)``."""


class ApprovalRejected(DarError):
    """The approver rejected the step (or its timeout policy is REJECT)."""

    def __init__(self, step_key: str, decided_by: str | None, comment: str | None) -> None:
        who = decided_by or "the timeout policy"
        super().__init__(f"{step_key} rejected by {who}" + (f": {comment}" if comment else ""))
        self.step_key = step_key
        self.decided_by = decided_by
        self.comment = comment


class ApprovalMismatch(DarError):
    """What the code would run now differs from what was approved."""


class NonDeterministicReplay(DarError):
    """The code called a different sequence of steps than the history records."""


class VersionUnsupported(DarError):
    """A run in flight recorded a version the current code no longer supports."""


class DurableConfigError(DarError):
    """A durable function is misused (an undeclared approval role, an approval inside a step)."""


class _Yield(BaseException):
    """Unwinds the user's function after this task's one step was checkpointed (or the run
    suspended or ended). A BaseException so that no ``except Exception`` can swallow it."""

    def __init__(self, result: StepResult) -> None:
        super().__init__("step checkpointed")
        self.result = result


# -- declaring ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApprovalRequest:
    """What an approval notification hook receives."""

    approval_id: uuid.UUID
    run_id: uuid.UUID
    agent: str
    step_key: str
    role: str
    payload: Any
    payload_hash: str
    timeout_seconds: float
    timeout_policy: str


@dataclass(frozen=True)
class DurableAgent:
    name: str
    fn: Callable[[Any, Steps], Any]
    approval_roles: tuple[str, ...] = ()
    """Roles that may decide this function's approvals; checked at startup against the
    configured API tokens, and at run time against ``steps.approval(role, ...)``."""
    max_steps: int | None = None
    on_approval: Callable[[ApprovalRequest], None] | None = None
    """Called (after the commit) when the function asks for an approval."""
    input_type: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.input_type is None:
            params = list(inspect.signature(self.fn).parameters)
            hints = typing.get_type_hints(self.fn)
            object.__setattr__(self, "input_type", hints.get(params[0], Any) if params else Any)


def durable_agent(
    name: str,
    *,
    approval_roles: Sequence[str] = (),
    max_steps: int | None = None,
    on_approval: Callable[[ApprovalRequest], None] | None = None,
) -> Callable[[Callable[[Any, Steps], Any]], DurableAgent]:
    """Declare ``fn(input, steps)`` a durable function called ``name``; register the result
    with ``registry.register(...)`` in your module's ``register(registry)``."""

    def wrap(fn: Callable[[Any, Steps], Any]) -> DurableAgent:
        return DurableAgent(
            name=name,
            fn=fn,
            approval_roles=tuple(approval_roles),
            max_steps=max_steps,
            on_approval=on_approval,
        )

    return wrap


_current: contextvars.ContextVar[Steps | None] = contextvars.ContextVar("dar_steps", default=None)


def current_steps() -> Steps | None:
    """The ``steps`` of the durable function running on this thread, if any."""
    return _current.get()


def step(
    fn: Callable[..., T] | None = None,
    *,
    name: str | None = None,
    retry: int | None = None,
    backoff: float = 1.0,
    timeout: float | None = None,
    compensate: Callable[[Any], Any] | None = None,
) -> Any:
    """Make a plain function a recorded step whenever it is called inside a durable function
    (outside one it is just called). ``compensate(result)`` undoes it if the run fails later."""

    def wrap(f: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(f)
        def inner(*args: Any, **kwargs: Any) -> T:
            steps = current_steps()
            if steps is None:
                return f(*args, **kwargs)
            options = StepOptions(steps, retries=retry, backoff=backoff, timeout=timeout)
            result: T = options.run(
                name or f.__name__,
                functools.partial(f, *args, **kwargs),
                type=return_type(f),
                compensate=compensate,
            )
            return result

        return inner

    return wrap(fn) if fn is not None else wrap


# -- the steps API --------------------------------------------------------------------------


@dataclass
class StepOptions:
    """``steps.retry(...)`` / ``steps.timeout(...)``: options for the next ``.run``."""

    steps: Steps
    retries: int | None = None
    backoff: float = 1.0
    timeout: float | None = None

    def retry(self, attempts: int, backoff: float = 1.0) -> StepOptions:
        if attempts < 1:
            raise ValueError("retry attempts must be at least 1")
        return StepOptions(self.steps, attempts, backoff, self.timeout)

    def with_timeout(self, seconds: float) -> StepOptions:
        return StepOptions(self.steps, self.retries, self.backoff, seconds)

    def run(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        type: Any = None,
        compensate: Callable[[Any], Any] | None = None,
    ) -> T:
        result: T = self.steps._exec.step(
            StepKind.STEP,
            name,
            functools.partial(fn, *args),
            type=type if type is not None else return_type(fn),
            compensate=compensate,
            options=self,
        )
        return result


@dataclass
class ApprovalBuilder:
    steps: Steps
    role: str
    timeout_seconds: float
    policy: str

    def run(self, name: str, fn: Callable[..., T], *args: Any, type: Any = None) -> T:
        """Wait for a person with ``role`` to approve, then run ``fn(*args)`` (exactly what
        was approved: the step key and ``args`` are hashed and shown to the approver)."""
        result: T = self.steps._exec.approval(
            self, name, fn, args, type if type is not None else return_type(fn)
        )
        return result


class Model:
    """What ``steps.llm``'s function gets: the run's model client, recorded."""

    def __init__(self, execution: _Execution) -> None:
        self._exec = execution

    def send(self, request: LlmRequest) -> LlmResponse:
        return self._exec.model_call(request)

    def complete(
        self,
        prompt: str,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        model: str | None = None,
    ) -> str:
        request = LlmRequest(
            model=model or self._exec.claim.run.model,
            max_tokens=max_tokens or self._exec.driver.settings.max_tokens,
            system=[{"type": "text", "text": system}] if system else [],
            messages=[{"role": "user", "content": prompt}],
        )
        response = self.send(request)
        return "".join(b.get("text", "") for b in response.content if b.get("type") == "text")

    def complete_json(self, prompt: str, **kwargs: Any) -> Any:
        """``complete``, with the answer parsed as JSON (a ```json fence is allowed)."""
        text = self.complete(prompt, **kwargs).strip()
        fenced = re.match(r"^```(?:json)?\s*(.*?)\s*```$", text, re.DOTALL)
        return json.loads(fenced.group(1) if fenced else text)


class Steps:
    """The durable function's handle on the run. Every non-deterministic thing goes through it."""

    def __init__(self, execution: _Execution) -> None:
        self._exec = execution

    @property
    def run_id(self) -> uuid.UUID:
        return self._exec.claim.run_id

    @property
    def key(self) -> str | None:
        """The key of the step running now: pass it downstream as an idempotency key."""
        return self._exec.stack[-1] if self._exec.stack else None

    def run(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        type: Any = None,
        compensate: Callable[[Any], Any] | None = None,
    ) -> T:
        """Run ``fn(*args)`` once; its result is recorded and returned on every replay."""
        return StepOptions(self).run(name, fn, *args, type=type, compensate=compensate)

    def side_effect(self, name: str, fn: Callable[[], T], *, type: Any = None) -> T:
        """Record a non-deterministic value (a uuid, the time, a random number) once."""
        result: T = self._exec.step(
            StepKind.SIDE_EFFECT,
            name,
            fn,
            type=type if type is not None else return_type(fn),
            compensate=None,
            options=StepOptions(self),
        )
        return result

    def llm(self, name: str, fn: Callable[[Model], T], *, type: Any = None) -> T:
        """Call the model inside ``fn(model)``; model, tokens, cost, latency and a prompt
        hash are recorded, and replay returns the result without calling the model."""
        model = Model(self._exec)
        result: T = self._exec.step(
            StepKind.LLM,
            name,
            lambda: fn(model),
            type=type if type is not None else return_type(fn),
            compensate=None,
            options=StepOptions(self),
        )
        return result

    def retry(self, attempts: int, backoff: float = 1.0) -> StepOptions:
        """``steps.retry(3, 2.0).run(...)``: up to ``attempts`` attempts, waiting
        ``backoff * 2^(n-1)`` seconds between them on a durable timer; attempts persist
        across crashes."""
        return StepOptions(self).retry(attempts, backoff)

    def timeout(self, seconds: float) -> StepOptions:
        """``steps.timeout(10).run(...)``: the step fails with :class:`StepTimeout` after
        ``seconds``."""
        return StepOptions(self).with_timeout(seconds)

    def approval(
        self, role: str, timeout_seconds: float, *, policy: str = "FAIL"
    ) -> ApprovalBuilder:
        """``steps.approval("support_lead", 86400).run("apply", apply, resolution)``: the run
        suspends (no lease, no worker) until someone with the role decides. On timeout the
        policy applies: FAIL (the step fails), REJECT, or APPROVE."""
        if policy not in TIMEOUT_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(TIMEOUT_POLICIES)}")
        return ApprovalBuilder(self, role, timeout_seconds, policy)

    def version(self, name: str, minimum: int, maximum: int) -> int:
        """For changing code with runs in flight: a new run records ``maximum``; a replay
        returns what it recorded, and fails if that is below ``minimum``."""
        return self._exec.version(name, minimum, maximum)

    def compensate(self, fn: Callable[[Any], Any]) -> None:
        """Undo the step that completed last, with its result, if the run fails later."""
        self._exec.compensate_last(fn)


# -- executing --------------------------------------------------------------------------------


@dataclass
class _Compensation:
    key: str
    name: str
    fn: Callable[[Any], Any]
    result: Any


def _hash(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _base_name(key: str) -> str:
    return key.rsplit(":", 1)[0]


class _Execution:
    """One task's replay of a durable function."""

    def __init__(
        self,
        driver: Driver,
        claim: Claim,
        agent: DurableAgent,
        recorded: list[Step],
        lease: HeldLease,
    ) -> None:
        self.driver = driver
        self.claim = claim
        self.agent = agent
        self.lease = lease
        self.recorded = {s.step_key: s for s in recorded}
        self.history = [
            s.step_key
            for s in recorded
            if "/" not in s.step_key and s.kind is not StepKind.COMPENSATION
        ]
        self.next_seq = max((s.seq for s in recorded), default=0) + 1
        self.counters: dict[tuple[str, str], int] = {}
        self.calls = 0
        self.stack: list[str] = []
        self.children: list[NewStep] = []
        self.compensations: list[_Compensation] = []
        self.llm_usage = Usage()
        self.llm_cost = Decimal(0)
        self.llm_model: str | None = None
        self.llm_prompt_hash: str | None = None
        self.llm_request_id: str | None = None
        self.steps_api = Steps(self)
        self.yielded: _Yield | None = None

    # -- keys and strict replay ---------------------------------------------------------------

    def _key(self, name: str) -> str:
        if "/" in name or not name:
            raise DurableConfigError(f"step names must be non-empty and contain no '/': {name!r}")
        parent = self.stack[-1] if self.stack else ""
        n = self.counters.get((parent, name), 0)
        self.counters[(parent, name)] = n + 1
        return f"{parent}/{name}:{n}" if parent else f"{name}:{n}"

    def _check_replay(self, key: str) -> None:
        if self.stack:
            return  # nested keys are recorded with their parent; only top level is ordered
        position = self.calls
        self.calls += 1
        if not self.driver.settings.strict_replay or position >= len(self.history):
            return
        if self.history[position] != key:
            recorded = ", ".join(_base_name(k) for k in self.history)
            raise NonDeterministicReplay(
                f"Run {self.claim.run_id} diverged from its history at step #{position}: "
                f"recorded {_base_name(self.history[position])!r} but the code called "
                f"{_base_name(key)!r}. Recorded sequence: [{recorded}]. Either the agent code "
                "changed in an incompatible way or it is not deterministic between steps."
            )

    def _take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq

    # -- ending the task ---------------------------------------------------------------------

    def _yield(self, rows: list[NewStep], **kwargs: Any) -> typing.NoReturn:
        from runtime.driver import Outcome, StepResult

        try:
            if self.lease.lost.is_set():
                raise LeaseLost(self.claim.run_id, "heartbeat found the lease taken over")
            dispatch = self.driver.store.record_steps(self.claim, [*self.children, *rows], **kwargs)
        except LeaseLost:
            if self.llm_usage.total:  # billed model calls: counted even though not a step
                self.driver.store.record_unrecorded_usage(
                    self.claim.run_id, self.llm_usage, self.llm_cost
                )
            raise
        self.children = []
        delayed = kwargs.get("delay_seconds") is not None
        outcome = Outcome.WAITING if delayed else Outcome.CONTINUE
        send = None if delayed and not kwargs.get("message_at_due", True) else dispatch
        self.yielded = _Yield(StepResult(outcome, dispatch=send))
        raise self.yielded

    def _check_yielded(self) -> None:
        """After this task's step was checkpointed nothing else may run, even if user code
        caught the unwinding (a ``finally`` that calls another step): unwind again."""
        if self.yielded is not None:
            raise self.yielded

    def _guard(self, kind: StepKind) -> None:
        run = self.claim.run
        steps_taken = len(self.history)
        stop = guard(
            run,
            now=self.claim.db_now,
            steps_taken=steps_taken,
            next_is_model=kind is StepKind.LLM,
        )
        if stop is None and steps_taken >= run.max_steps:
            from runtime.guard import Stop

            stop = Stop(
                RunStatus.FAILED,
                f"step cap reached: {steps_taken} steps of maxSteps {run.max_steps}",
            )
        if stop is not None:
            raise _Yield(self.driver._finish(self.claim, stop.status, error=stop.reason))

    # -- steps ---------------------------------------------------------------------------------

    def step(
        self,
        kind: StepKind,
        name: str,
        thunk: Callable[[], Any],
        *,
        type: Any,
        compensate: Callable[[Any], Any] | None,
        options: StepOptions,
    ) -> Any:
        key = self._key(name)
        self._check_replay(key)
        return self._at(kind, key, name, thunk, type=type, compensate=compensate, options=options)

    def _at(
        self,
        kind: StepKind,
        key: str,
        name: str,
        thunk: Callable[[], Any],
        *,
        type: Any,
        compensate: Callable[[Any], Any] | None,
        options: StepOptions,
    ) -> Any:
        self._check_yielded()
        rec = self.recorded.get(key)
        if rec is not None and rec.status is StepStatus.DONE:
            value = decode(rec.response, type)
            self._remember(key, name, compensate, value)
            return value
        if rec is not None and rec.status is StepStatus.ERROR and not self.stack:
            raise StepError(key, rec.error or "unknown error")
        # (a nested step that failed in an earlier attempt of its parent runs again)
        attempt = (rec.attempt if rec is not None else 0) + 1
        if self.stack:  # nested: runs inline and is recorded with its parent
            return self._run_nested(kind, key, name, thunk, compensate, options, attempt)
        self._guard(kind)
        seq = rec.seq if rec is not None else self._take_seq()
        set_step(seq)
        started = time.monotonic()
        self.stack.append(key)
        self.llm_usage, self.llm_cost = Usage(), Decimal(0)
        children_before = len(self.compensations)
        try:
            value = self._call(thunk, options.timeout)
            encoded = encode(value)
        except RetryLater as e:  # the model asks us to come back later: a durable timer
            self.stack.pop()
            self._yield(
                [],
                delay_seconds=e.delay_seconds,
                reason=f"{key}: model call rate limited; retrying in {e.delay_seconds:.1f}s",
                message_at_due=e.delay_seconds <= self.driver.settings.max_countdown_seconds,
            )
        except Exception as e:
            self.stack.pop()
            latency = int((time.monotonic() - started) * 1000)
            error = f"{type_name(e)}: {e}"
            undo = self.compensations[children_before:]  # nested steps this attempt completed
            if options.retries and attempt < options.retries:
                delay = options.backoff * 2 ** (attempt - 1)
                log.info(
                    "run=%s seq=%d %s %s attempt %d failed (%s); retry in %.1fs",
                    str(self.claim.run_id)[:8], seq, kind, key, attempt, error, delay,
                )  # fmt: skip
                row = self._row(seq, key, kind, StepStatus.RETRYING, None, error, attempt, latency)
                self._yield(
                    [row],
                    delay_seconds=delay,
                    reason=f"{key} attempt {attempt} failed; retrying",
                    message_at_due=delay <= self.driver.settings.max_countdown_seconds,
                )
            log.info(
                "run=%s seq=%d %s %s failed: %s", str(self.claim.run_id)[:8], seq, kind, key, error
            )
            failed = self._row(seq, key, kind, StepStatus.ERROR, None, error, attempt, latency)
            # Replays will not enter this step again, so its completed nested steps are undone
            # now, latest first, recorded with the failure.
            self._yield([failed, *(self._run_compensation(c) for c in reversed(undo))])
        self.stack.pop()
        latency = int((time.monotonic() - started) * 1000)
        crash_point("after_tool_effect")
        row = self._row(seq, key, kind, StepStatus.DONE, encoded, None, attempt, latency)
        log.info(
            "run=%s seq=%d %s %s done %dms", str(self.claim.run_id)[:8], seq, kind, key, latency
        )
        self.driver._observe(str(kind), "ok", started)
        self._yield([row])

    def _row(
        self,
        seq: int,
        key: str,
        kind: StepKind,
        status: StepStatus,
        response: Any,
        error: str | None,
        attempt: int,
        latency_ms: int,
    ) -> NewStep:
        llm = self.llm_usage.total > 0 or kind is StepKind.LLM  # model calls made in this step
        return NewStep(
            seq=seq,
            step_key=key,
            kind=kind,
            status=status,
            response=response,
            error=error,
            attempt=attempt,
            model=self.llm_model if llm else None,
            prompt_hash=self.llm_prompt_hash if llm else None,
            usage=self.llm_usage if llm else Usage(),
            cost_usd=self.llm_cost if llm else Decimal(0),
            latency_ms=latency_ms,
            request_id=self.llm_request_id if llm else None,
        )

    def _run_nested(
        self,
        kind: StepKind,
        key: str,
        name: str,
        thunk: Callable[[], Any],
        compensate: Callable[[Any], Any] | None,
        options: StepOptions,
        attempt: int,
    ) -> Any:
        started = time.monotonic()
        self.stack.append(key)
        try:
            value = self._call(thunk, options.timeout)
        except Exception as e:
            self.children.append(
                self._row(
                    self._take_seq(), key, kind, StepStatus.ERROR, None,
                    f"{type_name(e)}: {e}", attempt, int((time.monotonic() - started) * 1000),
                )
            )  # fmt: skip
            raise
        finally:
            self.stack.pop()
        self.children.append(
            NewStep(
                seq=self._take_seq(),
                step_key=key,
                kind=kind,
                status=StepStatus.DONE,
                response=encode(value),
                attempt=attempt,
                latency_ms=int((time.monotonic() - started) * 1000),
            )
        )
        self._remember(key, name, compensate, value)
        return value

    def _call(self, thunk: Callable[[], Any], timeout: float | None) -> Any:
        if timeout is None:
            return thunk()
        future = _pool.submit(contextvars.copy_context().run, thunk)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # if it never started, it never will
            raise StepTimeout(f"step ran longer than {timeout:g}s") from None

    def _remember(
        self, key: str, name: str, compensate: Callable[[Any], Any] | None, value: Any
    ) -> None:
        self.last_completed = (key, name, value)
        if compensate is not None:
            self.compensations.append(_Compensation(key, name, compensate, value))

    def compensate_last(self, fn: Callable[[Any], Any]) -> None:
        last = getattr(self, "last_completed", None)
        if last is None:
            raise DurableConfigError("steps.compensate() needs a completed step before it")
        key, name, value = last
        if not any(c.key == key for c in self.compensations):
            self.compensations.append(_Compensation(key, name, fn, value))

    def version(self, name: str, minimum: int, maximum: int) -> int:
        self._check_yielded()
        if self.stack:
            raise DurableConfigError("steps.version() belongs at the top level, not inside a step")
        key = self._key(name)
        self._check_replay(key)
        rec = self.recorded.get(key)
        if rec is not None and rec.status is StepStatus.DONE:
            recorded = int(rec.response)
            if not minimum <= recorded <= maximum:
                raise VersionUnsupported(
                    f"run {self.claim.run_id} recorded version {recorded} of {name!r}; this "
                    f"code supports {minimum} to {maximum}"
                )
            return recorded
        self._guard(StepKind.VERSION)
        seq = self._take_seq()
        self._yield([self._row(seq, key, StepKind.VERSION, StepStatus.DONE, maximum, None, 1, 0)])

    # -- the model -----------------------------------------------------------------------------

    def model_call(self, request: LlmRequest) -> LlmResponse:
        body = request.to_json()
        if self.llm_prompt_hash is None:
            from runtime.driver import prompt_hash

            self.llm_prompt_hash = prompt_hash(body)
        crash_point("before_model_call")
        started = time.monotonic()
        response = self.driver.llm.send(request)
        crash_point("after_model_response")
        model = response.model or request.model
        cost = self.driver.pricing.cost(model, response.usage)
        if self.driver.metrics is not None:
            self.driver.metrics.model_call(model, response.usage, cost)
            self.driver.metrics.step("MODEL", "ok", time.monotonic() - started)
        u = self.llm_usage
        r = response.usage
        self.llm_usage = Usage(
            u.input_tokens + r.input_tokens,
            u.output_tokens + r.output_tokens,
            u.cache_creation_input_tokens + r.cache_creation_input_tokens,
            u.cache_read_input_tokens + r.cache_read_input_tokens,
        )
        self.llm_cost += cost
        self.llm_model = model
        self.llm_request_id = response.request_id
        return response

    # -- approvals -----------------------------------------------------------------------------

    def approval(
        self,
        builder: ApprovalBuilder,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        type: Any,
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
        rec = self.recorded.get(key)
        if rec is not None and rec.status is StepStatus.DONE:
            value = decode(rec.response, type)
            self._remember(key, name, None, value)
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
        if rec is not None and rec.status is StepStatus.APPROVED:
            if rec.input_hash != digest:
                raise ApprovalMismatch(
                    f"{key} was approved for input hash {rec.input_hash}, but the code would now "
                    f"run it with {digest}: what runs must be what was approved"
                )
            return self._at(
                StepKind.APPROVAL,
                key,
                name,
                functools.partial(fn, *args),
                type=type,
                compensate=None,
                options=StepOptions(self.steps_api),
            )
        # First time here: suspend for a decision.
        self._guard(StepKind.APPROVAL)
        seq = self._take_seq()
        row = NewStep(
            seq=seq,
            step_key=key,
            kind=StepKind.APPROVAL,
            status=StepStatus.PENDING,
            input_hash=digest,
        )
        approval_id = self.driver.store.suspend_for_approval(
            self.claim,
            row,
            role=builder.role,
            payload=payload,
            timeout_seconds=builder.timeout_seconds,
            timeout_policy=builder.policy,
        )
        log.info(
            "run=%s seq=%d APPROVAL %s waiting for %s",
            str(self.claim.run_id)[:8], seq, key, builder.role,
        )  # fmt: skip
        self._notify(
            ApprovalRequest(
                approval_id=approval_id,
                run_id=self.claim.run_id,
                agent=self.agent.name,
                step_key=key,
                role=builder.role,
                payload=payload,
                payload_hash=digest,
                timeout_seconds=builder.timeout_seconds,
                timeout_policy=builder.policy,
            )
        )
        from runtime.driver import Outcome, StepResult

        raise _Yield(StepResult(Outcome.WAITING, status=RunStatus.WAITING))

    def _approval_record(self, key: str) -> Any:
        for a in self.driver.store.list_approvals(status=None, run_id=self.claim.run_id):
            if a.step_key == key:
                return a
        return None

    def _notify(self, request: ApprovalRequest) -> None:
        if self.agent.on_approval is not None:
            try:
                self.agent.on_approval(request)
            except Exception:
                log.exception("approval hook of %s failed", self.agent.name)
        url = self.driver.settings.approval_webhook_url
        if url:
            body = json.dumps(
                {
                    "approvalId": str(request.approval_id),
                    "runId": str(request.run_id),
                    "agent": request.agent,
                    "stepKey": request.step_key,
                    "role": request.role,
                    "payloadHash": request.payload_hash,
                    "timeoutPolicy": request.timeout_policy,
                }
            ).encode()
            req = urllib.request.Request(
                url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                urllib.request.urlopen(req, timeout=5).close()
            except Exception as e:
                log.warning("approval webhook failed: %s", e)

    # -- the whole function --------------------------------------------------------------------

    def run(self) -> StepResult:
        run = self.claim.run
        token = _current.set(self.steps_api)
        try:
            argument = decode(run.input, self.agent.input_type)
            output = self.agent.fn(argument, self.steps_api)
        except _Yield as y:
            return y.result
        except NonDeterministicReplay as e:
            return self.driver._finish(self.claim, RunStatus.FAILED, error=str(e))
        except Exception as e:
            try:
                return self._compensate_or_fail(e)
            except _Yield as y:
                return y.result
        finally:
            _current.reset(token)
        try:
            result = encode(output)
        except DarError as e:
            return self.driver._finish(self.claim, RunStatus.FAILED, error=str(e))
        return self.driver._finish(self.claim, RunStatus.SUCCEEDED, result=result)

    def _run_compensation(self, c: _Compensation) -> NewStep:
        """Run one compensation; its row (DONE or ERROR) is for the caller to record."""
        seq = self._take_seq()
        set_step(seq)
        started = time.monotonic()
        status, error = StepStatus.DONE, None
        try:
            c.fn(c.result)
        except Exception as e:
            status, error = StepStatus.ERROR, f"{type_name(e)}: {e}"
        log.info("run=%s seq=%d COMPENSATION %s %s", str(self.claim.run_id)[:8], seq, c.key, status)
        return NewStep(
            seq=seq,
            step_key=f"compensate:{c.key}",
            kind=StepKind.COMPENSATION,
            status=status,
            error=error,
            attempt=1,
            latency_ms=int((time.monotonic() - started) * 1000),
        )

    def _compensate_or_fail(self, error: Exception) -> StepResult:
        """After a failure: the compensations of completed steps, in reverse order, one per
        task and each recorded so none runs twice; then FAILED."""
        done_names = []
        failed = []
        for c in reversed(self.compensations):
            key = f"compensate:{c.key}"
            rec = self.recorded.get(key)
            if rec is not None and rec.status is StepStatus.DONE:
                done_names.append(c.name)
                continue
            if rec is not None and rec.status is StepStatus.ERROR:
                failed.append(f"{c.name}: {rec.error}")
                continue
            self._yield([self._run_compensation(c)])
        message = f"{type_name(error)}: {error}"
        if done_names:
            message += f" (compensated: {', '.join(done_names)})"
        if failed:
            message += f" (compensation failed: {'; '.join(failed)})"
        return self.driver._finish(self.claim, RunStatus.FAILED, error=message)


def type_name(e: BaseException) -> str:
    return type(e).__name__
