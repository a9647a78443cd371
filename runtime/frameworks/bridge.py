"""The crossing between a framework's async agent and this runtime's durable functions.

A framework agent (Pydantic AI, the OpenAI Agents SDK) is async; ``steps`` is called on the
driver's thread. Each process keeps ONE event loop on a daemon thread (:func:`framework_loop`):
every framework run, model client and MCP session lives on it, so an HTTP connection pool or an
MCP session is never shared between two loops.

One task of a framework run is a :class:`Bridge`:

- the driver thread submits the agent's coroutine to the loop and then serves it: each durable
  unit the framework asks for (a model request, a tool call, an MCP call) arrives as a
  :class:`UnitCall`, and the driver runs it through the public steps API (``steps.run``), whose
  body sends the unit's coroutine back to the loop and waits for it;
- a recorded unit answers from the log without running; the first new one runs, is
  checkpointed, and the engine ends the task (a ``BaseException``): the bridge then cancels the
  agent's coroutine (its toolsets close as on any cancellation) and lets the exception through.

Units arrive one at a time (the framework runs tool calls sequentially in durable mode), so
their order, and with it their step keys, is deterministic.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import queue
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from db.records import Usage
from runtime import native
from runtime.durable.api import Billed, Steps
from runtime.durable.errors import ApprovalRejected, NonDeterministicReplay
from runtime.llm.base import LlmError
from runtime.llm.billing import bill_lost
from runtime.llm.live_call import LiveCall, ModelCallCancelled
from runtime.llm.retry import RetryLater, RetryPolicy, classify, current_prior_attempts
from runtime.pipeline import modelcall, usage

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 10.0
"""How long a task that ended waits for the agent's coroutine to unwind (toolsets closing)."""

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


class NativeExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs a framework's sync code (a sync tool's body) on a native thread of the step pool
    (:mod:`runtime.native`), with a standard future the event loop can await. Under the gevent
    pool the framework loop is a greenlet: a sync tool that blocks in C (hashing, compressing,
    a C driver) run on one of the framework's own threads, greenlets too, would stop every
    step of the worker for as long as it runs. (A ``ThreadPoolExecutor`` only by type, as
    asyncio's default executor must be; it starts no thread of its own.)"""

    def submit(
        self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[Any]:
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            if not out.set_running_or_notify_cancel():
                return
            try:
                out.set_result(fn(*args, **kwargs))
            except BaseException as e:  # the caller's to see, as with any executor
                out.set_exception(e)

        native.submit(run)
        return out


def tool_executor() -> concurrent.futures.Executor | None:
    """Where a framework runs its sync tools in this process: native threads under the gevent
    pool; the framework's own threads otherwise (``None``)."""
    return NativeExecutor() if native.gevent_patched() else None


def framework_loop() -> asyncio.AbstractEventLoop:
    """This process's event loop for framework agents (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            executor = tool_executor()
            if executor is not None:  # asyncio.to_thread (the Agents SDK's sync tools)
                loop.set_default_executor(executor)
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=serve, name="dar-framework-loop", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


def on_loop(awaitable: Awaitable[Any]) -> Any:
    """Run ``awaitable`` on the framework loop and wait for its result (from another thread)."""

    async def run() -> Any:
        return await awaitable

    return asyncio.run_coroutine_threadsafe(run(), framework_loop()).result()


class LiveText:
    """A model unit's text, out to the run's event stream as the model produces it
    (``text.delta`` events of this attempt; a new attempt of the step, after a crash or a
    retry, retracts this one's for every client)."""

    def __init__(self, call: LiveCall, attempt: int) -> None:
        self.call = call
        self.attempt = attempt
        self.chars = 0
        """Characters of text out so far (a cut call's output is estimated from them)."""

    def __call__(self, text: str) -> None:
        if text:
            self.chars += len(text)
            self.call.delta(self.attempt, text)

    @property
    def cancelled(self) -> bool:
        """The run was cancelled while this call is in flight (the unit is being aborted)."""
        return self.call.cancelled.is_set()


_live: contextvars.ContextVar[LiveText | None] = contextvars.ContextVar(
    "dar_framework_live", default=None
)


_unit_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dar_framework_unit_key", default=None
)


def idempotency_key() -> str | None:
    """Inside a tool or MCP call a framework agent makes durably: the call's idempotency key
    (unique across runs: the run id and the step key); pass it downstream."""
    return _unit_key.get()


def _keyed(
    awaitable_of: Callable[[], Awaitable[Any]], key: str | None, recorder: usage.StepUsage | None
) -> Awaitable[Any]:
    async def run() -> Any:
        _unit_key.set(key)
        _current.set(None)  # what the unit's body runs is part of the unit, not steps of its own
        with usage.carry(recorder):  # the model calls it makes count with the unit's step
            return await awaitable_of()

    return run()


def current_live() -> LiveText | None:
    """Inside a model unit's body: where its text goes as it streams (``None``: the run has
    no live stream, so the framework need not stream the call)."""
    return _live.get()


def _abort(future: concurrent.futures.Future[Any]) -> None:
    future.cancel()


def _call_live(
    body: Callable[[], Awaitable[Any]],
    live: LiveCall | None,
    estimate_input: Callable[[], int] = lambda: 0,
    model: str = "",
) -> Any:
    """Run a model unit's body on the loop, its text streamed live; a cancel of the run
    aborts it there. The provider bills an aborted call, or one whose stream was cut after
    its text began, what it read and generated, which no framework reports: it is counted
    as an estimate (``estimate_input()`` in, the text streamed so far out, each at about 3
    characters a token: an upper bound)."""
    text = LiveText(live, live.begin_attempt()) if live is not None else None

    async def run() -> Any:
        _live.set(text)
        _current.set(None)
        return await body()

    future = asyncio.run_coroutine_threadsafe(run(), framework_loop())
    unregister = live.on_cancel(lambda: _abort(future)) if live is not None else None
    try:
        return future.result()
    except concurrent.futures.CancelledError:
        out = text.chars // 3 + 1 if text is not None and text.chars else 0
        cut = Usage(input_tokens=estimate_input(), output_tokens=out)
        raise ModelCallCancelled(
            "the run was cancelled while its model call was in flight",
            usage=cut,
            estimated_tokens=cut.total,
        ) from None
    except Exception as e:
        error = http_error(e)
        if text is not None and text.chars and error is not None and error.status == -1:
            cut = Usage(input_tokens=estimate_input(), output_tokens=text.chars // 3 + 1)
            bill_lost(cut, model, "framework stream cut mid-way", estimated=True)
        raise
    finally:
        if unregister is not None:
            unregister()


async def _nothing() -> None:
    return None


POLICY = RetryPolicy()
"""How a framework's failed model request is tried again, after its own client's retries: as
the runtime's own model calls are (``runtime.llm.retry``)."""


def http_error(e: BaseException) -> LlmError | None:
    """A framework's failed model request as this runtime's :class:`LlmError`: the HTTP status
    (``status_code`` of the framework's or its SDK's error; -1 for a transport error) and the
    response's ``retry-after`` and rate-limit headers, found along the exception's chain.
    ``None``: not an HTTP or transport failure (the framework's own error)."""
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and all(cur is not seen for seen in chain):
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    status = next(
        (c.status_code for c in chain if isinstance(getattr(c, "status_code", None), int)),  # type: ignore[attr-defined]
        None,
    )
    if status is None and any(_transport_error(c) for c in chain):
        status = -1
    if status is None:
        return None
    headers: dict[str, str] = {}
    for c in chain:
        found = getattr(getattr(c, "response", None), "headers", None)
        if found is not None:
            headers = {str(k).lower(): str(v) for k, v in found.items()}
            break
    retry_after: float | None = None
    with contextlib.suppress(ValueError):
        if "retry-after-ms" in headers:
            retry_after = float(headers["retry-after-ms"]) / 1000
        elif "retry-after" in headers:
            retry_after = float(headers["retry-after"])
    message = str(e)
    return LlmError(
        message,
        status=int(status),
        retry_after=retry_after,
        request_id=headers.get("request-id") or headers.get("x-request-id"),
        retryable=classify(int(status), message=message),
        rate_limits=tuple((k, v) for k, v in headers.items() if "ratelimit" in k),
    )


def _transport_error(e: BaseException) -> bool:
    """An ``httpx`` transport error (connect, read, timeout): what both frameworks' SDKs
    raise beneath their own connection errors. (By name: the engine imports no HTTP client.)"""
    return any(
        c.__name__ == "TransportError" and c.__module__.startswith("httpx") for c in type(e).__mro__
    )


def _retried(request: Callable[[], Any]) -> Any:
    """A framework's model request with this runtime's retry rules around it: rate limited or
    overloaded (429, 529), the run waits on a durable timer (no attempt counted, the limit
    learned from the headers); a retryable failure (5xx, I/O) is tried again, a short wait in
    place and a long one on a durable timer, up to the attempts of ``POLICY`` across timers;
    anything else is the framework's error, as it raised it."""
    attempt = current_prior_attempts()
    while True:
        try:
            return request()
        except ModelCallCancelled:
            raise
        except Exception as e:
            error = http_error(e)
            if error is None or not error.retryable:
                raise
            if error.back_pressure:
                wait = max(1.0, error.retry_after or POLICY.long_wait_threshold)
                raise RetryLater(error, wait, attempts=attempt) from e
            made = attempt + 1
            if made >= POLICY.max_attempts:
                raise
            wait = random.uniform(0.0, POLICY.backoff_ceiling(attempt))
            wait = max(wait, error.retry_after or 0.0)
            if wait > POLICY.long_wait_threshold:
                raise RetryLater(error, wait, attempts=made) from e
            log.info(
                "framework model request failed (HTTP %d); retrying in %.2fs", error.status, wait
            )
            time.sleep(wait)
            attempt = made


def prompt_of(value: Any) -> str:
    """The run's input as the user prompt: a string, or ``{"prompt": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("prompt"), str):
        return str(value["prompt"])
    raise TypeError(
        'a framework agent takes its input as the user prompt: "input": "<text>" '
        '(or {"prompt": "<text>"})'
    )


APPROVAL_ROLE = "approver"
APPROVAL_TIMEOUT_SECONDS = 86400.0


def ask_approval(
    steps: Steps, *, role: str, timeout_seconds: float, tool: str, arguments: Any
) -> bool:
    """A framework's tool call that needs approval, as this runtime's content-bound approval
    ``approve.<tool>:n``: the approver sees the tool and its arguments, and what was approved
    is what runs. Waiting ends the task (the run holds nothing); the decision replays."""
    try:
        steps.approval(role, timeout_seconds).run(
            f"approve.{tool}", _approved, {"tool": tool, "arguments": arguments}
        )
    except ApprovalRejected:
        return False
    return True


def _approved(request: Any) -> bool:
    return True


def check_identity(steps: Steps, agent: str, identity: dict[str, Any]) -> None:
    """Strict replay for a framework agent, whatever ``DAR_STRICT_REPLAY`` says: its first
    step records what the agent was (its tools, MCP servers, handoffs, output); a run that
    comes back to different code fails with what changed, instead of replaying answers that
    name tools which are no longer there."""
    recorded = steps.side_effect("agent", lambda: identity)
    if recorded == identity:
        return
    changes = [
        f"{k}: recorded {recorded.get(k)!r}, now {identity.get(k)!r}"
        for k in sorted(set(recorded) | set(identity))
        if recorded.get(k) != identity.get(k)
    ]
    raise NonDeterministicReplay(
        f"run {steps.run_id} started on another version of agent {agent!r} ("
        + "; ".join(changes)
        + "): a renamed or changed tool set cannot replay this run's recorded steps. Finish "
        "runs in flight on the old code, or start new runs."
    )


@dataclass(frozen=True)
class UnitPolicy:
    """How a unit may run again after a crash left it in doubt (see docs/frameworks/pydantic-ai.md
    and docs/frameworks/openai-agents.md, "After a crash", and the crash table of
    docs/durable/after-a-crash.md)."""

    idempotent: bool = False
    attempts: int = 1
    """How many times the unit is tried when it fails, on a durable timer between attempts
    (``steps.retry``): more than one only for what is safe and worth trying again, an MCP
    server's listing (read-only, and failing mostly while its server starts)."""
    backoff: float = 1.0
    """Seconds before the second attempt, doubling after each."""


MCP_LISTING = UnitPolicy(idempotent=True, attempts=5, backoff=2.0)
"""An MCP server's listing (its tools, its instructions): read-only, and the unit in which a
framework connects to the server, so it is where a server still starting, restarting or
briefly away fails. It is tried again 4 times, 2, 4, 8 and 16 s apart, on a durable timer
(a native agent's listing waits DAR_MCP_RETRY_SECONDS between tries); then the framework
sees the error."""


@dataclass(frozen=True)
class Billing:
    """A model unit: billed, with its usage read from the framework's answer."""

    model: str
    """The model asked for (flow control admits against it; the answer's model is priced)."""
    prompt: Any
    """What was sent, as JSON: its hash is recorded with the step."""
    billed: Callable[[Any], Billed]
    """The recorded value (the unit's result) -> what the provider billed."""


@dataclass
class UnitCall:
    name: str
    body: Callable[[], Awaitable[Any]]
    policy: UnitPolicy
    billing: Billing | None = None
    on_driver: Callable[[Steps], Any] | None = None
    """Not a unit: a function of ``steps`` to call on the driver thread (an approval)."""
    answer: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class _Done:
    pass


_DONE = _Done()
_current: contextvars.ContextVar[Bridge | None] = contextvars.ContextVar(
    "dar_framework_bridge", default=None
)


def current_bridge() -> Bridge | None:
    """The bridge of the framework run this coroutine belongs to (``None``: not durable)."""
    return _current.get()


class Bridge:
    """One task's framework run: the driver thread serves its durable units."""

    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self._counts: dict[str, int] = {}
        self._requests: queue.SimpleQueue[UnitCall | _Done] = queue.SimpleQueue()

    # -- on the framework loop ----------------------------------------------------------------

    async def unit(
        self,
        name: str,
        body: Callable[[], Awaitable[Any]],
        policy: UnitPolicy,
        billing: Billing | None = None,
    ) -> Any:
        """Run ``body`` as the durable step ``name`` (recorded once; replayed afterwards); with
        ``billing``, as a billed model call (``steps.model_call``)."""
        call = UnitCall(name, body, policy, billing)
        self._requests.put(call)
        return await asyncio.wrap_future(call.answer)

    def count(self, what: str) -> int:
        """How many times ``what`` was counted before in this task (replay-stable: the
        framework's code runs the same way every task)."""
        n = self._counts.get(what, 0)
        self._counts[what] = n + 1
        return n

    def event(self, name: str, data: dict[str, Any]) -> None:
        """A framework's run event (a tool called, its output, a handoff) out to the run's
        event stream, as a live event: the n-th of the run, published the first time the
        framework's code gets there (it replays on every task)."""
        self.steps.live_event(name, data, once=f"fw.{self.count('event')}")

    async def on_driver(self, fn: Callable[[Steps], Any]) -> Any:
        """Call ``fn(steps)`` on the driver thread (``steps.approval(...)``, which may end the
        task) and return its result to the framework."""
        call = UnitCall("", _nothing, UnitPolicy(), on_driver=fn)
        self._requests.put(call)
        return await asyncio.wrap_future(call.answer)

    async def _main(self, coro: Coroutine[Any, Any, Any]) -> Any:
        token = _current.set(self)
        try:
            return await coro
        finally:
            _current.reset(token)
            self._requests.put(_DONE)

    # -- on the driver thread -----------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run the framework's coroutine to its end, serving its units; a unit that ends the
        task (the engine's ``BaseException``) cancels the coroutine and propagates."""
        main = asyncio.run_coroutine_threadsafe(self._main(coro), framework_loop())
        while True:
            item = self._requests.get()
            if isinstance(item, _Done):
                return main.result()
            try:
                value = self._serve(item)
            except Exception as e:  # a recorded failure: the framework sees it
                item.answer.set_exception(e)
            except BaseException:
                self._stop(main)
                raise
            else:
                item.answer.set_result(value)

    def _serve(self, item: UnitCall) -> Any:
        if item.on_driver is not None:
            return item.on_driver(self.steps)
        billing = item.billing
        if billing is None:
            policy = item.policy
            steps = (
                self.steps.retry(policy.attempts, policy.backoff)
                if policy.attempts > 1
                else self.steps
            )
            return steps.run(
                item.name,
                lambda: on_loop(_keyed(item.body, self.steps.key, usage.current())),
                type=Any,
                idempotent=policy.idempotent,
            )

        def estimate() -> int:  # as the engine estimates the request (its model and prompt)
            return modelcall.estimate_tokens({"model": billing.model, "prompt": billing.prompt})

        def call(live: LiveCall | None) -> Billed:
            return billing.billed(
                _retried(lambda: _call_live(item.body, live, estimate, billing.model))
            )

        return self.steps.model_call(item.name, call, prompt=billing.prompt, model=billing.model)

    def _stop(self, main: concurrent.futures.Future[Any]) -> None:
        main.cancel()
        try:
            while not isinstance(self._requests.get(timeout=STOP_GRACE_SECONDS), _Done):
                pass  # a unit asked for while unwinding is not served: the task is over
        except queue.Empty:
            log.warning("a framework run did not unwind within %.0fs", STOP_GRACE_SECONDS)
