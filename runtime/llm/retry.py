"""Retries and per-attempt time limits for model calls, as :class:`LlmClient` decorators.

The production stack is ``RetryingLlmClient(TimeLimitedLlmClient(AnthropicClient(...)))``:
the time limit wraps ONE attempt and sits inside the retry loop, so a hung attempt becomes a
retryable ``status=-1`` error and the next attempt gets a fresh limit.

Classification is by HTTP status (plus the API's error body for one case), never by
exception class: see :func:`classify`.

A wait longer than :attr:`RetryPolicy.long_wait_threshold` is not slept in the worker.
:class:`RetryLater` is raised instead and the engine turns it into a durable timer, so a run
that is rate limited for a minute holds no worker slot and no lease (invariant 8).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from runtime.llm.base import LlmClient, LlmError, LlmRequest, LlmResponse
from runtime.llm.billing import Meter, bill_lost, current_meter
from runtime.native import gevent_patched

log = logging.getLogger(__name__)

_prior_attempts: contextvars.ContextVar[int] = contextvars.ContextVar(
    "dar_prior_model_attempts", default=0
)


def prior_attempts(n: int) -> contextvars.Token[int]:
    """Tell the retry loop how many attempts earlier tasks already made for the model step
    in flight (persisted on the run across durable timers), so the total stays capped at
    ``max_attempts``. Reset the returned token when the call is over."""
    return _prior_attempts.set(max(0, n))


def reset_prior_attempts(token: contextvars.Token[int]) -> None:
    _prior_attempts.reset(token)


def current_prior_attempts() -> int:
    """The attempts earlier tasks made for the model step in flight (:func:`prior_attempts`)."""
    return _prior_attempts.get()


# 429 rate limited, 500/502/503/504 server side, 529 overloaded, -1 I/O error or timeout.
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504, 529, -1})

# `error.details.error_code` values (on a 429) that say a spend limit was reached: waiting
# seconds cannot help, only a person raising the limit (or the next billing period) can.
SPEND_LIMIT_ERROR_CODES = frozenset(
    {
        "contract_spend_limit_reached",
        "enforced_spend_limit_reached",
        "linked_organization_spend_limit_reached",
    }
)
# `error.details.error_code` values (on a 429) that explicitly invite a retry after the
# server's retry-after, whatever the message says.
RETRY_INVITED_ERROR_CODES = frozenset({"ramp_limit_exceeded"})
# `error.type` values that mean money, not throughput.
BILLING_ERROR_TYPES = frozenset({"billing_error"})
# Phrases (lower case) in a 429's `error.message` that name a spend, credit or billing limit.
SPEND_LIMIT_PHRASES = (
    "spend limit",
    "spending limit",
    "usage limit",
    "credit balance",
    "credit limit",
    "billing",
)


def classify(
    status: int,
    body_error_type: str | None = None,
    message: str = "",
    *,
    error_code: str | None = None,
) -> bool:
    """Whether a failed model call is worth retrying.

    The rule, by status code:

    * retryable: 429, 500, 502, 503, 504, 529, and ``-1`` (I/O error or timeout);
    * never retryable: everything else, notably 400, 401, 403, 404, 413 and 422;
    * except that a 429 is NOT retryable when its error body says a spend, credit or billing
      limit was reached: ``error.details.error_code`` is one of
      :data:`SPEND_LIMIT_ERROR_CODES`, or ``error.type`` is ``billing_error``, or
      ``error.message`` contains one of :data:`SPEND_LIMIT_PHRASES` (case-insensitive). A 429
      whose ``error_code`` explicitly invites a retry (``ramp_limit_exceeded``) is retryable
      whatever its message says.

    The message match is deliberately narrow (ordinary rate-limit messages talk about "rate
    limit" and tokens or requests per minute, never spend, credit or billing), so a plain
    rate limit is always retried and only an explicit money limit stops the loop. Retrying a
    spend limit would burn every attempt and then fail anyway, hours before the limit resets.
    """
    if status not in RETRYABLE_STATUSES:
        return False
    if status != 429:
        return True
    if error_code in RETRY_INVITED_ERROR_CODES:
        return True
    if error_code in SPEND_LIMIT_ERROR_CODES or body_error_type in BILLING_ERROR_TYPES:
        return False
    lowered = message.lower()
    return not any(phrase in lowered for phrase in SPEND_LIMIT_PHRASES)


class Sleeper(Protocol):
    """Blocks the calling thread. Tests pass a fake that records the durations."""

    def sleep(self, seconds: float) -> None: ...


class TimeSleeper:
    """The real :class:`Sleeper`: :func:`time.sleep`."""

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How hard to retry one model step.

    ``max_attempts`` counts every attempt, the first included. The wait after failed attempt
    ``n`` (0-based) is ``uniform(0, min(cap, base * 2**n))`` ("full jitter"), raised to the
    server's ``retry-after`` when it sent one. A wait above ``long_wait_threshold`` seconds is
    not slept: :class:`RetryLater` is raised instead.
    """

    max_attempts: int = 5
    base: float = 0.5
    cap: float = 30.0
    long_wait_threshold: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.base < 0 or self.cap < 0 or self.long_wait_threshold < 0:
            raise ValueError("base, cap and long_wait_threshold must not be negative")

    def backoff_ceiling(self, attempt: int) -> float:
        """The upper bound of the jitter after failed attempt ``attempt`` (0-based)."""
        return min(self.cap, self.base * 2.0 ** min(attempt, 64))


class RetryLater(LlmError):
    """The model call should be retried, but only after a wait too long to sleep in a worker.

    Raised by :class:`RetryingLlmClient` instead of sleeping ``delay_seconds``. ``error`` is
    the retryable :class:`LlmError` that caused it (also the ``__cause__``) and ``attempts``
    the number of attempts made so far in this step.

    What the engine should do: treat the model step as not done (record nothing, repeat
    nothing), set the run's ``run_at`` to now + ``delay_seconds``, release the lease and end
    the task; the reaper re-dispatches the run when the timer is due and the step is tried
    again from scratch. To keep the total attempts of one step bounded across such timers,
    persist ``attempts`` and pass it back as ``RetryingLlmClient(first_attempt=...)``;
    otherwise each timer starts a fresh round of ``max_attempts``.

    It is an :class:`LlmError` (same status, retry-after and request id as ``error``, and
    ``retryable`` true) so code that only knows ``LlmError`` still sees a failed model call
    rather than an unknown exception.
    """

    def __init__(self, error: LlmError, delay_seconds: float, *, attempts: int) -> None:
        super().__init__(
            f"retry in {delay_seconds:.1f} s after: {error}",
            status=error.status,
            retry_after=error.retry_after,
            request_id=error.request_id,
            retryable=True,
            rate_limits=error.rate_limits,
        )
        self.error = error
        self.delay_seconds = delay_seconds
        self.attempts = attempts


class RetryingLlmClient:
    """Retries retryable :class:`LlmError` s of ``delegate`` with full jitter.

    * Back-pressure (429 rate limited, 529 overloaded: :attr:`LlmError.back_pressure`) is
      never slept on and costs no attempt: :class:`RetryLater` at once, after the server's
      ``retry-after`` (at least a jittered 1 s .. ``long_wait_threshold``), with the
      attempts made so far unchanged. The engine's durable timer brings the call back through
      flow control, which has learned the limit from the refusal's headers meanwhile.
    * Non-retryable errors (``error.retryable`` false: 400, 401, 403, 404, a spend limit...)
      and the error of the last allowed attempt are raised unchanged.
    * The wait is ``max(uniform(0, min(cap, base * 2**attempt)), retry_after)``.
    * A wait above ``policy.long_wait_threshold`` raises :class:`RetryLater` (nothing slept).
    * With ``deadline_remaining`` (seconds left before the run's deadline), a wait that would
      end at or after the deadline raises the ORIGINAL error, not :class:`RetryLater`: the
      deadline guard would fail the run before the retry could happen, so the truthful
      outcome is the model error that made the step fail. This check comes first.

    ``first_attempt`` is the number of attempts already made for this step by earlier tasks
    (see :class:`RetryLater`); it counts against ``max_attempts`` and the backoff exponent.
    The engine passes the attempts it persisted on the run through :func:`prior_attempts`,
    which adds to ``first_attempt``.
    """

    def __init__(
        self,
        delegate: LlmClient,
        policy: RetryPolicy | None = None,
        sleeper: Sleeper | None = None,
        rng: random.Random | None = None,
        *,
        deadline_remaining: Callable[[], float] | None = None,
        first_attempt: int = 0,
    ) -> None:
        self.delegate = delegate
        self.policy = policy or RetryPolicy()
        self.sleeper: Sleeper = sleeper or TimeSleeper()
        self.rng = rng or random.Random()
        self.deadline_remaining = deadline_remaining
        self.first_attempt = first_attempt

    def backoff(self, attempt: int, retry_after: float | None) -> float:
        """The wait after failed attempt ``attempt`` (0-based)."""
        wait = self.rng.uniform(0.0, self.policy.backoff_ceiling(attempt))
        if retry_after is not None:
            wait = max(wait, retry_after)
        return wait

    def send(self, request: LlmRequest) -> LlmResponse:
        attempt = self.first_attempt + _prior_attempts.get()
        while True:
            try:
                return self.delegate.send(request)
            except LlmError as e:
                if e.back_pressure:
                    raise self._come_back_later(e, attempt) from e
                made = attempt + 1
                if not e.retryable or made >= self.policy.max_attempts:
                    raise
                wait = self.backoff(attempt, e.retry_after)
                if self.deadline_remaining is not None and wait >= self.deadline_remaining():
                    log.warning(
                        "model call failed (status %d) and the %.1f s retry wait would pass "
                        "the run's deadline; giving up",
                        e.status,
                        wait,
                        extra={"event": "llm.retry", "action": "deadline"},
                    )
                    raise
                if wait > self.policy.long_wait_threshold:
                    log.info(
                        "model call failed (status %d); retry in %.1f s as a durable timer",
                        e.status,
                        wait,
                        extra={"event": "llm.retry", "action": "later"},
                    )
                    raise RetryLater(e, wait, attempts=made) from e
                log.info(
                    "model call failed (status %d), attempt %d/%d; retrying in %.2f s",
                    e.status,
                    made,
                    self.policy.max_attempts,
                    wait,
                    extra={"event": "llm.retry", "action": "sleep"},
                )
                self.sleeper.sleep(wait)
                attempt += 1

    def _come_back_later(self, e: LlmError, attempt: int) -> RetryLater:
        """Back-pressure (429, 529): a durable timer that costs no attempt. The engine asks
        flow control again when it is due, which has learned the limit from the headers by
        then; only the run's deadline or budget ends the waiting."""
        wait = self.rng.uniform(1.0, max(1.0, self.policy.long_wait_threshold))
        if e.retry_after is not None:
            wait = max(wait, e.retry_after)
        log.info(
            "model call refused (status %d, back-pressure); coming back in %.1f s",
            e.status,
            wait,
            extra={"event": "llm.retry", "action": "back_pressure"},
        )
        return RetryLater(e, wait, attempts=attempt)


# --- per-attempt wall-clock limit -------------------------------------------------------

HTTP_TIMEOUT_MARGIN_SECONDS = 5.0
"""How far above a :class:`TimeLimitedLlmClient`'s limit to set the wrapped HTTP client's own
timeout: ``AnthropicClient(timeout_seconds=step + HTTP_TIMEOUT_MARGIN_SECONDS)``."""


def llm_threads() -> int:
    """``DAR_LLM_THREADS``: 0 (the default, unset or empty) runs every attempt on a thread of
    its own (a greenlet under gevent), so nothing but the worker's concurrency bounds the model
    calls in flight; a positive number shares a pool of that many threads per process
    instead, which then caps the calls in flight (keep it above the worker's concurrency)."""
    raw = os.environ.get("DAR_LLM_THREADS", "").strip()
    return max(0, int(raw)) if raw else 0


class _SharedPool:
    """The per-process pool of ``DAR_LLM_THREADS`` threads, when that is set; made on first
    use and rebuilt in a forked child (a pool inherited across ``fork`` has no threads)."""

    _lock = threading.Lock()
    _pool: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def get(cls, size: int) -> concurrent.futures.ThreadPoolExecutor:
        with cls._lock:
            if cls._pool is None:
                cls._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(1, size), thread_name_prefix="dar-llm"
                )
            return cls._pool

    @classmethod
    def _after_fork(cls) -> None:
        cls._lock = threading.Lock()
        cls._pool = None


os.register_at_fork(after_in_child=_SharedPool._after_fork)


def _start_attempt(
    context: contextvars.Context, fn: Callable[[LlmRequest], LlmResponse], request: LlmRequest
) -> concurrent.futures.Future[LlmResponse]:
    """``fn(request)`` in ``context``, started on a greenlet of its own under gevent (what a
    model call in flight should cost: a greenlet and a socket), else on a thread of its own.
    Unbounded on purpose: the worker's concurrency already bounds the steps, and an abandoned
    attempt ends at its HTTP client's own timeout."""
    future: concurrent.futures.Future[LlmResponse] = concurrent.futures.Future()

    def attempt() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = context.run(fn, request)
        except BaseException as e:  # handed to the waiting caller, as an executor would
            future.set_exception(e)
        else:
            future.set_result(result)

    if gevent_patched():
        import gevent

        gevent.spawn(attempt)
    else:
        threading.Thread(target=attempt, name="dar-llm", daemon=False).start()
    return future


class TimeLimitedLlmClient:
    """Limits ONE call of ``delegate`` to ``timeout_seconds`` of wall-clock time.

    ``delegate.send`` runs on a greenlet of its own under gevent (the shipped worker), on a
    thread of its own otherwise, or on ``executor`` (a shared pool of ``DAR_LLM_THREADS``
    threads when that is set), and the caller waits with ``future.result(timeout)``. No
    fixed pool stands between the steps and their model calls by default, so a worker holds
    as many calls in flight as it has steps in flight. Whatever the delegate is doing
    (connecting, waiting for headers, reading a body that drips a byte a second) the caller
    gets ``LlmError("model call exceeded N s", status=-1)`` at the deadline; the error is
    retryable, so inside :class:`RetryingLlmClient` it costs one attempt.

    Python cannot kill a thread (and killing a greenlet mid-read would lose what the API
    bills): a timed-out call keeps running in the background until it ends on its own, and
    its result is discarded; its usage is not: the API bills it, so an answer that arrives
    after the limit is reported to the call's meter (:mod:`runtime.llm.billing`). That is
    why the HTTP client's own timeout must be set slightly above ``timeout_seconds``
    (``AnthropicClient`` also enforces it as a total deadline on reading the body), so the
    abandoned call does end. Its thread is an ordinary (non-daemon) thread: interpreter
    exit waits for such a call, bounded by that HTTP timeout. With a pool, the limit
    includes any time spent queued for a free pool thread. Logging context
    (``contextvars``) is carried into the attempt.
    """

    def __init__(
        self,
        delegate: LlmClient,
        timeout_seconds: float,
        *,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be positive")
        self.delegate = delegate
        self.timeout_seconds = timeout_seconds
        self._executor = executor

    def send(self, request: LlmRequest) -> LlmResponse:
        context = contextvars.copy_context()
        executor = self._executor
        if executor is None and (size := llm_threads()):
            executor = _SharedPool.get(size)
        if executor is not None:
            future = executor.submit(context.run, self.delegate.send, request)
        else:
            future = _start_attempt(context, self.delegate.send, request)
        try:
            return future.result(timeout=self.timeout_seconds)
        except concurrent.futures.TimeoutError:
            if not future.cancel():  # it started: it may yet complete, and be billed
                future.add_done_callback(_bill_when_done(request.model, current_meter()))
            raise LlmError(f"model call exceeded {self.timeout_seconds:g} s", status=-1) from None


def _bill_when_done(
    model: str, meter: Meter | None
) -> Callable[[concurrent.futures.Future[LlmResponse]], None]:
    """A done-callback for an abandoned attempt: an answer that arrives after all was billed,
    so its usage goes to the meter of the call that gave up on it (issue 23, defect 8)."""

    def done(future: concurrent.futures.Future[LlmResponse]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # failed: a cut stream reported its own usage (see runtime.llm.billing)
        response = future.result()
        bill_lost(response.usage, response.model or model, "answered after its time limit", meter)

    return done
