"""Durable functions, the programming model: ``fn(input, steps)`` and what ``steps`` offers.

Everything here declares; :mod:`runtime.durable.execution` executes, through the one step
executor (:mod:`runtime.pipeline.effects`, :mod:`runtime.pipeline.modelcall`,
:class:`runtime.pipeline.checkpoint.Task`).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import json
import re
import typing
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from db.records import Usage
from runtime.config import check_upgrade_policy
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.live_call import LiveCall
from runtime.mcp.servers import McpServer
from runtime.pipeline.codec import return_type
from runtime.tools import Reconciled, ToolContext, idempotency_key

T = TypeVar("T")

TIMEOUT_POLICIES = ("FAIL", "REJECT", "APPROVE")
LIVE_EVENT_NAME = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")
RESERVED_EVENTS = frozenset({"text", "run", "step", "approval"})
Reconcile = Callable[[ToolContext], Reconciled | None]


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
class Billed:
    """What the body of ``steps.model_call`` returns: the value to record (JSON) and what the
    provider billed for the call, read from the framework's own usage object."""

    value: Any
    model: str
    usage: Usage
    request_id: str | None = None
    stop_reason: str | None = None


class BilledFailure(Exception):
    """Raised by the body of ``steps.model_call`` for a call that failed after the provider
    billed it (a response that ended ``incomplete``: max output tokens, a content filter).
    The step is recorded as ``error`` (what the framework sees, then and on replay) with
    ``billed``'s tokens and cost; with ``estimated``, the usage is an upper bound (the
    framework raised before its usage could be read) counted as the run's estimated tokens."""

    def __init__(self, error: Exception, billed: Billed, *, estimated: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.billed = billed
        self.estimated = estimated


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
    mcp_servers: tuple[McpServer | str, ...] = ()
    """MCP servers ``steps.tool(server, tool, arguments)`` may call (or names of servers
    configured in ``DAR_MCP_SERVERS``)."""
    upgrade: str = "pinned"
    """How its runs move to a new version: ``"pinned"`` (by an operator) or ``"replay"``
    (automatically, after the replay check): ``runtime.agents.UPGRADE_POLICIES``."""

    def __post_init__(self) -> None:
        check_upgrade_policy(self.name, self.upgrade)
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
    mcp_servers: Sequence[McpServer | str] = (),
    upgrade: str = "pinned",
) -> Callable[[Callable[[Any, Steps], Any]], DurableAgent]:
    """Declare ``fn(input, steps)`` a durable function called ``name``; register the result
    with ``registry.register(...)`` in your module's ``register(registry)``. ``upgrade``:
    ``"replay"`` moves its runs to a new version by themselves once their version is served
    no more, after a clean replay check (``"pinned"``, the default: an operator does)."""

    def wrap(fn: Callable[[Any, Steps], Any]) -> DurableAgent:
        return DurableAgent(
            name=name,
            fn=fn,
            approval_roles=tuple(approval_roles),
            max_steps=max_steps,
            on_approval=on_approval,
            mcp_servers=tuple(mcp_servers),
            upgrade=upgrade,
        )

    return wrap


def idempotent(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark a compensation as safe to run again after a crash left it in doubt (it uses its
    step's key downstream). Unmarked, an in-doubt compensation stops the run for a person."""
    fn.__dar_idempotent__ = True  # type: ignore[attr-defined]
    return fn


def is_idempotent(fn: Callable[..., Any]) -> bool:
    return bool(getattr(fn, "__dar_idempotent__", False))


_DECLARED: dict[str, Callable[[Any], Any]] = {}
"""Compensations declared with ``@step(compensate=...)``, by the step function's path: found
again in any process that imported the module, even when the step is not re-entered."""


def _path(fn: Callable[..., Any]) -> str | None:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in qualname:
        return None
    return f"{module}:{qualname}"


def compensation_ref(fn: Callable[[Any], Any], declared_by: str | None = None) -> str:
    """How a step row names its compensation so any process finds it again."""
    if declared_by is not None and _DECLARED.get(declared_by) is fn:
        return f"step:{declared_by}"
    return _path(fn) or "*"


def resolve_compensation(ref: str | None) -> Callable[[Any], Any] | None:
    """The compensation a row names, when this process can find it."""
    if not ref or ref == "*":
        return None
    if ref.startswith("step:"):
        return _DECLARED.get(ref.removeprefix("step:"))
    module, _, qualname = ref.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return None
    return target if callable(target) else None


_current: contextvars.ContextVar[Steps | None] = contextvars.ContextVar("dar_steps", default=None)


def current_steps() -> Steps | None:
    """The ``steps`` of the durable function running on this thread, if any."""
    return _current.get()


def set_current_steps(steps: Steps | None) -> contextvars.Token[Steps | None]:
    return _current.set(steps)


def reset_current_steps(token: contextvars.Token[Steps | None]) -> None:
    _current.reset(token)


def step(
    fn: Callable[..., T] | None = None,
    *,
    name: str | None = None,
    retry: int | None = None,
    backoff: float = 1.0,
    timeout: float | None = None,
    compensate: Callable[[Any], Any] | None = None,
    idempotent: bool = False,
    reconcile: Reconcile | None = None,
) -> Any:
    """Make a plain function a recorded step whenever it is called inside a durable function
    (outside one it is just called). ``compensate(result)`` undoes it if the run fails later.
    ``idempotent=True``: safe to run again after a crash left it in doubt; else
    ``reconcile(ctx)`` is asked, else the run stops for an operator."""

    def wrap(f: Callable[..., T]) -> Callable[..., T]:
        # Keyed by where the step function is defined; a step defined inside a function
        # (``build()`` in an agent module) registers again whenever that function runs, as
        # it does in every worker process that registers the agent.
        path = f"{f.__module__}:{f.__qualname__}"
        if compensate is not None:
            _DECLARED[path] = compensate

        @functools.wraps(f)
        def inner(*args: Any, **kwargs: Any) -> T:
            steps = current_steps()
            if steps is None:
                return f(*args, **kwargs)
            options = StepOptions(
                steps,
                retries=retry,
                backoff=backoff,
                timeout=timeout,
                idempotent=idempotent,
                reconcile=reconcile,
            )
            result: T = options.run(
                name or f.__name__,
                functools.partial(f, *args, **kwargs),
                type=return_type(f),
                compensate=compensate,
                declared_by=path,
            )
            return result

        return inner

    return wrap(fn) if fn is not None else wrap


# -- the steps API --------------------------------------------------------------------------


class Engine(Protocol):
    """What ``steps`` needs from the execution of the function (runtime.durable.execution)."""

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
    ) -> Any: ...

    def approval(
        self,
        builder: ApprovalBuilder,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        type: Any,
        idempotent: bool,
    ) -> Any: ...

    def version(self, name: str, minimum: int, maximum: int) -> int: ...

    def billed_call(
        self, name: str, fn: Callable[[LiveCall | None], Billed], prompt: Any, model: str
    ) -> Any: ...

    def mcp_tool(
        self,
        server: McpServer | str,
        tool: str,
        arguments: dict[str, Any],
        *,
        name: str | None,
        options: StepOptions,
    ) -> Any: ...

    def compensate_last(self, fn: Callable[[Any], Any]) -> None: ...

    def sleep(self, seconds: float) -> None: ...

    def wait_for(self, name: str, timeout: float | None) -> Any: ...

    def send(self, run_id: uuid.UUID, name: str, payload: Any) -> None: ...

    def child(
        self, agent: str, value: Any, token_budget: int | None, timeout_seconds: int | None
    ) -> Any: ...

    def model_call(self, request: LlmRequest) -> LlmResponse: ...

    def current_key(self) -> str | None: ...

    def current_context(self) -> ToolContext | None: ...

    def live_event(self, name: str, data: dict[str, Any], once: str) -> None: ...

    @property
    def run_id(self) -> uuid.UUID: ...

    @property
    def default_model(self) -> str: ...

    @property
    def default_max_tokens(self) -> int: ...


@dataclass
class StepOptions:
    """``steps.retry(...)`` / ``steps.timeout(...)``: options for the next ``.run``."""

    steps: Steps
    retries: int | None = None
    backoff: float = 1.0
    timeout: float | None = None
    idempotent: bool = False
    reconcile: Reconcile | None = None

    def retry(self, attempts: int, backoff: float = 1.0) -> StepOptions:
        if attempts < 1:
            raise ValueError("retry attempts must be at least 1")
        return StepOptions(
            self.steps, attempts, backoff, self.timeout, self.idempotent, self.reconcile
        )

    def with_timeout(self, seconds: float) -> StepOptions:
        return StepOptions(
            self.steps, self.retries, self.backoff, seconds, self.idempotent, self.reconcile
        )

    def run(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        type: Any = None,
        compensate: Callable[[Any], Any] | None = None,
        idempotent: bool | None = None,
        reconcile: Reconcile | None = None,
        declared_by: str | None = None,
    ) -> T:
        options = self
        if idempotent is not None or reconcile is not None:
            options = StepOptions(
                self.steps,
                self.retries,
                self.backoff,
                self.timeout,
                self.idempotent if idempotent is None else idempotent,
                reconcile or self.reconcile,
            )
        result: T = self.steps._engine.step(
            "STEP",
            name,
            functools.partial(fn, *args),
            type=type if type is not None else return_type(fn),
            compensate=compensate,
            options=options,
            declared_by=declared_by,
        )
        return result

    def tool(
        self,
        server: McpServer | str,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        name: str | None = None,
    ) -> Any:
        """``steps.retry(3).tool(...)``, ``steps.timeout(10).tool(...)``: an MCP call with
        these options (the timeout is the call's)."""
        return self.steps._engine.mcp_tool(
            server, tool, dict(arguments or {}), name=name, options=self
        )

    def llm(self, name: str, fn: Callable[[Model], T], *, type: Any = None) -> T:
        """``steps.retry(3).llm(...)``: each attempt calls the model afresh."""
        model = Model(self.steps._engine)
        result: T = self.steps._engine.step(
            "LLM",
            name,
            lambda: fn(model),
            type=type if type is not None else return_type(fn),
            compensate=None,
            options=self,
        )
        return result


@dataclass
class ApprovalBuilder:
    steps: Steps
    role: str
    timeout_seconds: float
    policy: str

    def run(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        type: Any = None,
        idempotent: bool = False,
    ) -> T:
        """Wait for a person with ``role`` to approve, then run ``fn(*args)`` (exactly what
        was approved: the step key and ``args`` are hashed and shown to the approver)."""
        result: T = self.steps._engine.approval(
            self, name, fn, args, type if type is not None else return_type(fn), idempotent
        )
        return result


class Model:
    """What ``steps.llm``'s function gets: the run's model client; every call is recorded as
    a child step (``<step>/llm:n``) the moment it returns."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def send(self, request: LlmRequest) -> LlmResponse:
        return self._engine.model_call(request)

    def complete(
        self,
        prompt: str,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        model: str | None = None,
    ) -> str:
        request = LlmRequest(
            model=model or self._engine.default_model,
            max_tokens=max_tokens or self._engine.default_max_tokens,
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

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def run_id(self) -> uuid.UUID:
        return self._engine.run_id

    @property
    def key(self) -> str | None:
        """The idempotency key of the step running now, ``<run id>/<step key>`` (as
        ``steps.context.idempotency_key``): pass it downstream. Unique across runs, a fork's
        included; the same for every execution of the step in this run."""
        key = self._engine.current_key()
        return None if key is None else idempotency_key(self.run_id, key)

    @property
    def context(self) -> ToolContext | None:
        """The running step's context: ``cancelled`` once past its timeout, ``remaining()``
        for the timeouts of the calls it makes."""
        return self._engine.current_context()

    def live_event(self, name: str, data: dict[str, Any], *, once: str) -> None:
        """Publish the event ``name`` with ``data`` (JSON) on the run's event stream
        (``GET /api/runs/{id}/events``, next to the text deltas), at most once per run for
        each ``once`` id: the code that publishes it replays on every task, the event goes
        out the first time. Live, not durable: best effort (Redis), as text deltas are.
        ``name``: dotted lowercase words (``progress.stage``); ``text.*``, ``run.*``,
        ``step.*`` and ``approval.*`` are the runtime's own."""
        if not LIVE_EVENT_NAME.fullmatch(name) or name.split(".", 1)[0] in RESERVED_EVENTS:
            raise ValueError(
                f"live event name {name!r}: use dotted lowercase words (progress.stage), not "
                "text.*, run.*, step.* or approval.*"
            )
        if not isinstance(data, dict):
            raise TypeError("a live event's data is a dict (sent as a JSON object)")
        self._engine.live_event(name, data, str(once))

    def run(
        self,
        name: str,
        fn: Callable[..., T],
        *args: Any,
        type: Any = None,
        compensate: Callable[[Any], Any] | None = None,
        idempotent: bool = False,
        reconcile: Reconcile | None = None,
    ) -> T:
        """Run ``fn(*args)`` once; its result is recorded and returned on every replay.
        After a crash left it in doubt it runs again only if ``idempotent``; else
        ``reconcile(ctx)`` is asked; else the run stops for an operator."""
        return StepOptions(self).run(
            name,
            fn,
            *args,
            type=type,
            compensate=compensate,
            idempotent=idempotent,
            reconcile=reconcile,
        )

    def tool(
        self,
        server: McpServer | str,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        name: str | None = None,
    ) -> Any:
        """Call ``tool`` of the MCP server (declared in ``mcp_servers``) once, as a recorded
        step keyed ``<server>__<tool>:n`` (or ``name:n``); the step key is the call's
        idempotency key (``_meta``). Returns the tool's structured content when it has one,
        else its text; a result with ``isError`` fails the step (:class:`StepError`). After a
        crash left it in doubt it runs again only when its annotations say read-only or
        idempotent (or the operator's ``DAR_MCP_TOOLS`` does); else its configured
        ``reconcile`` is asked; else the run stops for an operator."""
        return StepOptions(self).tool(server, tool, arguments, name=name)

    def side_effect(self, name: str, fn: Callable[[], T], *, type: Any = None) -> T:
        """Record a non-deterministic value (a uuid, the time, a random number) once."""
        result: T = self._engine.step(
            "SIDE_EFFECT",
            name,
            fn,
            type=type if type is not None else return_type(fn),
            compensate=None,
            options=StepOptions(self, idempotent=True),
        )
        return result

    def llm(self, name: str, fn: Callable[[Model], T], *, type: Any = None) -> T:
        """Call the model inside ``fn(model)``; every call's model, tokens, cost, latency and
        prompt hash are recorded, and replay returns the result without calling the model."""
        return StepOptions(self).llm(name, fn, type=type)

    def model_call(
        self,
        name: str,
        fn: Callable[[LiveCall | None], Billed],
        *,
        prompt: Any,
        model: str,
    ) -> Any:
        """A model call made by other code than ours (a framework's model client), as one
        billed step: ``fn(live)`` makes the call and returns :class:`Billed`; its tokens and
        cost (priced by ``DAR_PRICES``, an unknown model at the highest known rate), latency
        and the hash of ``prompt`` are recorded with the value, the guard and flow control
        (for ``model``) come before it, and replay returns the value without calling. ``live``
        (when the run has a live stream) takes the call's text deltas and tells it of a
        cancel: abort and raise ``ModelCallCancelled``. After a crash it is called again (at
        most once per crash, as every model call)."""
        return self._engine.billed_call(name, fn, prompt, model)

    def retry(self, attempts: int, backoff: float = 1.0) -> StepOptions:
        """``steps.retry(3, 2.0).run(...)``: up to ``attempts`` attempts, waiting
        ``backoff * 2^(n-1)`` seconds between them on a durable timer; attempts persist
        across crashes."""
        return StepOptions(self).retry(attempts, backoff)

    def timeout(self, seconds: float) -> StepOptions:
        """``steps.timeout(10).run(...)``: the step fails with :class:`StepTimeout` after
        ``seconds`` (its context is cancelled; if it does not stop, it stays in doubt)."""
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
        """For changing code with runs in flight: a new run records ``maximum``; a run whose
        history passed this point before the call existed gets ``minimum`` (the old branch);
        a replay returns what it recorded, and fails if that is outside the range."""
        return self._engine.version(name, minimum, maximum)

    def compensate(self, fn: Callable[[Any], Any]) -> None:
        """Undo the step that completed last, with its result, if the run fails later."""
        self._engine.compensate_last(fn)

    def sleep(self, seconds: float) -> None:
        """A durable timer: the run is parked (no thread, no lease) and carries on after
        ``seconds``, on whichever worker, whatever restarted meanwhile."""
        if not seconds >= 0:
            raise ValueError("steps.sleep takes a number of seconds, 0 or more")
        self._engine.sleep(float(seconds))

    def wait_for(self, name: str, *, timeout: float | None = None) -> Any:
        """Wait (no thread, no lease) for the signal ``name`` sent to this run with ``POST
        /api/runs/{id}/signals/{name}`` or another run's ``steps.send``; returns its payload.
        Each signal is delivered to one wait, once; one sent before the wait is kept for it.
        After ``timeout`` seconds without it, raises :class:`SignalTimeout` (without a
        timeout the run's own deadline applies)."""
        if timeout is not None and not timeout > 0:
            raise ValueError("steps.wait_for's timeout is a number of seconds above 0")
        return self._engine.wait_for(name, timeout)

    def send(self, run_id: uuid.UUID | str, name: str, payload: Any = None) -> None:
        """Send the signal ``name`` with ``payload`` to another run (of this tenant): exactly
        once across crashes (the signal is written with this step's record, under its
        idempotency key). A run that does not exist or has ended fails the step."""
        self._engine.send(uuid.UUID(str(run_id)), name, payload)

    def child(
        self,
        agent: str,
        input: Any,
        *,
        token_budget: int | None = None,
        timeout_seconds: int | None = None,
    ) -> Any:
        """Run the registered agent ``agent`` on ``input`` as its own run (``parentRunId``
        is this run) and return its result; a child that ends FAILED, CANCELLED or TIMED_OUT
        raises :class:`ChildRunFailed`. This run waits parked (no thread, no lease); a crash
        never starts the same child twice. The child's budget is at most what this run has
        left (``token_budget`` lowers it) and its tokens and cost count against this run's
        budget; cancelling this run cancels the child."""
        return self._engine.child(agent, input, token_budget, timeout_seconds)
