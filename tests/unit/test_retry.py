"""The retry decorator and the per-attempt time limit, with a fake sleeper and no network."""

from __future__ import annotations

import contextvars
import random
import threading
import time
from collections.abc import Callable

import pytest

from db.records import Usage
from runtime.llm.base import LlmError, LlmRequest, LlmResponse
from runtime.llm.retry import (
    RetryingLlmClient,
    RetryLater,
    RetryPolicy,
    TimeLimitedLlmClient,
    classify,
)

REQUEST = LlmRequest(
    model="claude-test", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
)
OK = LlmResponse(
    content=[{"type": "text", "text": "ok"}],
    stop_reason="end_turn",
    usage=Usage(input_tokens=3, output_tokens=1),
    model="claude-test",
)


class FakeSleeper:
    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


class Scripted:
    """Answers each call with the next outcome: a response, or an error to raise."""

    def __init__(self, *outcomes: LlmResponse | LlmError) -> None:
        self.outcomes = list(outcomes)
        self.calls = 0

    def send(self, request: LlmRequest) -> LlmResponse:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, LlmError):
            raise outcome
        return outcome


def retrying(
    delegate: Scripted,
    sleeper: FakeSleeper,
    *,
    policy: RetryPolicy | None = None,
    seed: int = 7,
    deadline_remaining: Callable[[], float] | None = None,
) -> RetryingLlmClient:
    return RetryingLlmClient(
        delegate,
        policy or RetryPolicy(long_wait_threshold=60.0),
        sleeper,
        random.Random(seed),
        deadline_remaining=deadline_remaining,
    )


def test_two_503s_with_retry_after_then_success() -> None:
    sleeper = FakeSleeper()
    delegate = Scripted(
        LlmError("unavailable", status=503, retry_after=7.0),
        LlmError("unavailable", status=503, retry_after=7.0),
        OK,
    )
    assert retrying(delegate, sleeper).send(REQUEST) is OK
    assert delegate.calls == 3
    assert len(sleeper.sleeps) == 2
    assert all(s >= 7.0 for s in sleeper.sleeps)


@pytest.mark.parametrize(
    ("status", "retry_after"), [(429, 7.0), (429, None), (529, None), (529, 12.0)]
)
def test_back_pressure_comes_back_later_and_costs_no_attempt(
    status: int, retry_after: float | None
) -> None:
    sleeper = FakeSleeper()
    limits = (("anthropic-ratelimit-requests-remaining", "0"),)
    cause = LlmError("slow down", status=status, retry_after=retry_after, rate_limits=limits)
    delegate = Scripted(cause, OK)
    client = RetryingLlmClient(
        delegate, RetryPolicy(max_attempts=2), sleeper, random.Random(1), first_attempt=1
    )
    with pytest.raises(RetryLater) as info:
        client.send(REQUEST)
    later = info.value
    assert later.attempts == 1  # the one made before: the refusal cost none
    assert later.delay_seconds >= max(1.0, retry_after or 0)
    assert later.rate_limits == limits  # flow control learns the limit from them
    assert sleeper.sleeps == []  # a durable timer, not a sleeping worker
    assert delegate.calls == 1


def test_back_pressure_waits_are_spread() -> None:
    waits = set()
    for seed in range(20):
        delegate = Scripted(LlmError("overloaded", status=529), OK)
        client = RetryingLlmClient(delegate, RetryPolicy(), FakeSleeper(), random.Random(seed))
        with pytest.raises(RetryLater) as info:
            client.send(REQUEST)
        assert 1.0 <= info.value.delay_seconds <= 5.0
        waits.add(round(info.value.delay_seconds, 3))
    assert len(waits) > 15


def test_a_spend_limit_429_is_not_back_pressure() -> None:
    spend = LlmError("spend limit", status=429, retryable=False)
    assert not spend.back_pressure
    assert LlmError("", status=429).back_pressure
    assert LlmError("", status=529).back_pressure
    assert not LlmError("", status=503).back_pressure


def test_400_is_not_retried() -> None:
    sleeper = FakeSleeper()
    delegate = Scripted(LlmError("bad request", status=400), OK)
    with pytest.raises(LlmError) as info:
        retrying(delegate, sleeper).send(REQUEST)
    assert info.value.status == 400
    assert delegate.calls == 1
    assert sleeper.sleeps == []


@pytest.mark.parametrize("status", [401, 403, 404, 413, 422])
def test_other_client_errors_are_not_retried(status: int) -> None:
    delegate = Scripted(LlmError("no", status=status), OK)
    with pytest.raises(LlmError):
        retrying(delegate, FakeSleeper()).send(REQUEST)
    assert delegate.calls == 1


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_server_errors_are_retried(status: int) -> None:
    sleeper = FakeSleeper()
    delegate = Scripted(LlmError("busy", status=status), OK)
    assert retrying(delegate, sleeper).send(REQUEST) is OK
    assert delegate.calls == 2
    assert len(sleeper.sleeps) == 1


def test_timeout_or_io_error_is_retried() -> None:
    sleeper = FakeSleeper()
    delegate = Scripted(LlmError("model call exceeded 30 s", status=-1), OK)
    assert retrying(delegate, sleeper).send(REQUEST) is OK
    assert delegate.calls == 2


def test_attempts_are_capped_and_the_last_error_raised() -> None:
    sleeper = FakeSleeper()
    errors = [LlmError(f"boom {i}", status=503) for i in range(10)]
    delegate = Scripted(*errors)
    with pytest.raises(LlmError) as info:
        retrying(delegate, sleeper, policy=RetryPolicy(max_attempts=4)).send(REQUEST)
    assert delegate.calls == 4
    assert len(sleeper.sleeps) == 3
    assert info.value is errors[3]


def test_jitter_stays_within_full_jitter_bounds() -> None:
    policy = RetryPolicy(base=0.5, cap=30.0, long_wait_threshold=1e9)
    for seed in range(200):
        client = RetryingLlmClient(Scripted(), policy, FakeSleeper(), random.Random(seed))
        for attempt in range(12):
            wait = client.backoff(attempt, None)
            assert 0.0 <= wait <= min(30.0, 0.5 * 2**attempt)


def test_jitter_of_a_real_retry_sequence_stays_within_bounds() -> None:
    policy = RetryPolicy(max_attempts=8, base=0.5, cap=4.0, long_wait_threshold=1e9)
    for seed in range(50):
        sleeper = FakeSleeper()
        delegate = Scripted(*[LlmError("busy", status=503) for _ in range(7)], OK)
        RetryingLlmClient(delegate, policy, sleeper, random.Random(seed)).send(REQUEST)
        assert len(sleeper.sleeps) == 7
        for attempt, wait in enumerate(sleeper.sleeps):
            assert 0.0 <= wait <= min(4.0, 0.5 * 2**attempt)


def test_jitter_is_spread_not_constant() -> None:
    client = RetryingLlmClient(Scripted(), RetryPolicy(), FakeSleeper(), random.Random(1))
    waits = {round(client.backoff(5, None), 6) for _ in range(50)}
    assert len(waits) > 40


def test_retry_after_is_a_floor_not_a_ceiling() -> None:
    client = RetryingLlmClient(Scripted(), RetryPolicy(), FakeSleeper(), random.Random(3))
    assert client.backoff(0, 2.0) == 2.0  # jitter at most 0.5 s: the server's wait wins
    waits = [client.backoff(6, 0.1) for _ in range(100)]  # jitter up to 30 s
    assert all(w >= 0.1 for w in waits)
    assert max(waits) > 1.0


def test_spend_limit_429_is_not_retried() -> None:
    retryable = classify(
        429,
        "rate_limit_error",
        "You have reached your specified API usage limits.",
        error_code="enforced_spend_limit_reached",
    )
    delegate = Scripted(LlmError("spend limit", status=429, retryable=retryable), OK)
    with pytest.raises(LlmError):
        retrying(delegate, FakeSleeper()).send(REQUEST)
    assert delegate.calls == 1


@pytest.mark.parametrize(
    ("status", "error_type", "message", "error_code", "expected"),
    [
        (429, "rate_limit_error", "This request would exceed the rate limit", None, True),
        (429, "rate_limit_error", "", "ramp_limit_exceeded", True),
        (429, "rate_limit_error", "", "contract_spend_limit_reached", False),
        (429, "rate_limit_error", "", "enforced_spend_limit_reached", False),
        (429, "billing_error", "", None, False),
        (429, "rate_limit_error", "Your credit balance is too low", None, False),
        (429, "rate_limit_error", "Workspace spend limit reached", None, False),
        (429, None, "You have reached your specified API usage limits", None, False),
        (529, "overloaded_error", "Overloaded", None, True),
        (500, "api_error", "Internal server error", None, True),
        (502, None, "", None, True),
        (503, None, "", None, True),
        (504, "timeout_error", "", None, True),
        (-1, None, "connection reset", None, True),
        (400, "invalid_request_error", "", None, False),
        (401, "authentication_error", "", None, False),
        (403, "permission_error", "", None, False),
        (404, "not_found_error", "", None, False),
        (413, "request_too_large", "", None, False),
        (422, None, "", None, False),
        (402, "billing_error", "", None, False),
    ],
)
def test_classify(
    status: int, error_type: str | None, message: str, error_code: str | None, expected: bool
) -> None:
    assert classify(status, error_type, message, error_code=error_code) is expected


def test_a_wait_above_the_threshold_raises_retry_later_without_sleeping() -> None:
    sleeper = FakeSleeper()
    cause = LlmError("unavailable", status=503, retry_after=30.0, request_id="req_1")
    delegate = Scripted(cause, OK)
    client = retrying(delegate, sleeper, policy=RetryPolicy(long_wait_threshold=5.0))
    with pytest.raises(RetryLater) as info:
        client.send(REQUEST)
    later = info.value
    assert later.delay_seconds >= 30.0
    assert later.error is cause
    assert later.__cause__ is cause
    assert later.attempts == 1
    assert (later.status, later.request_id, later.retryable) == (503, "req_1", True)
    assert isinstance(later, LlmError)
    assert sleeper.sleeps == []
    assert delegate.calls == 1


def test_a_short_wait_is_slept_not_deferred() -> None:
    sleeper = FakeSleeper()
    delegate = Scripted(LlmError("unavailable", status=503, retry_after=2.0), OK)
    client = retrying(delegate, sleeper, policy=RetryPolicy(long_wait_threshold=5.0))
    assert client.send(REQUEST) is OK
    assert sleeper.sleeps == [2.0]


def test_the_last_attempt_raises_the_error_not_retry_later() -> None:
    delegate = Scripted(LlmError("unavailable", status=503, retry_after=30.0))
    client = retrying(delegate, FakeSleeper(), policy=RetryPolicy(max_attempts=1))
    with pytest.raises(LlmError) as info:
        client.send(REQUEST)
    assert not isinstance(info.value, RetryLater)


def test_first_attempt_carries_over_attempts_made_before_a_timer() -> None:
    delegate = Scripted(LlmError("busy", status=503), OK)
    client = RetryingLlmClient(
        delegate, RetryPolicy(max_attempts=3), FakeSleeper(), random.Random(1), first_attempt=2
    )
    with pytest.raises(LlmError):
        client.send(REQUEST)
    assert delegate.calls == 1


def test_a_wait_past_the_deadline_raises_the_original_error() -> None:
    sleeper = FakeSleeper()
    cause = LlmError("unavailable", status=503, retry_after=10.0)
    delegate = Scripted(cause, OK)
    client = retrying(delegate, sleeper, deadline_remaining=lambda: 3.0)
    with pytest.raises(LlmError) as info:
        client.send(REQUEST)
    assert info.value is cause
    assert sleeper.sleeps == []
    assert delegate.calls == 1


def test_a_wait_within_the_deadline_is_slept() -> None:
    sleeper = FakeSleeper()
    delegate = Scripted(LlmError("unavailable", status=503, retry_after=1.0), OK)
    client = retrying(delegate, sleeper, deadline_remaining=lambda: 100.0)
    assert client.send(REQUEST) is OK
    assert sleeper.sleeps == [1.0]


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


# --- TimeLimitedLlmClient -----------------------------------------------------------------


class Slow:
    """A delegate that blocks until released (or for ``seconds``), like a dripping body."""

    def __init__(self, seconds: float = 30.0) -> None:
        self.seconds = seconds
        self.release = threading.Event()
        self.finished = threading.Event()

    def send(self, request: LlmRequest) -> LlmResponse:
        try:
            self.release.wait(self.seconds)
            return OK
        finally:
            self.finished.set()


def test_time_limited_ends_a_slow_delegate_at_its_deadline() -> None:
    slow = Slow()
    started = time.monotonic()
    try:
        with pytest.raises(LlmError) as info:
            TimeLimitedLlmClient(slow, 0.3).send(REQUEST)
        elapsed = time.monotonic() - started
    finally:
        slow.release.set()
    assert info.value.status == -1
    assert info.value.retryable
    assert "exceeded 0.3 s" in str(info.value)
    assert 0.3 <= elapsed < 2.0
    assert slow.finished.wait(5)  # the abandoned call finishes in the background


def test_time_limited_inside_the_retry_loop_gives_each_attempt_a_fresh_limit() -> None:
    slow = Slow()
    sleeper = FakeSleeper()
    try:
        client = RetryingLlmClient(
            TimeLimitedLlmClient(slow, 0.1),
            RetryPolicy(max_attempts=3),
            sleeper,
            random.Random(0),
        )
        with pytest.raises(LlmError) as info:
            client.send(REQUEST)
    finally:
        slow.release.set()
    assert info.value.status == -1
    assert len(sleeper.sleeps) == 2


def test_time_limited_passes_results_and_errors_through() -> None:
    assert TimeLimitedLlmClient(Scripted(OK), 5.0).send(REQUEST) is OK
    cause = LlmError("bad", status=400)
    with pytest.raises(LlmError) as info:
        TimeLimitedLlmClient(Scripted(cause), 5.0).send(REQUEST)
    assert info.value is cause


def test_time_limited_carries_context_variables_into_the_pool_thread() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("run", default="-")
    seen: list[str] = []

    class Peek:
        def send(self, request: LlmRequest) -> LlmResponse:
            seen.append(var.get())
            return OK

    token = var.set("run-42")
    try:
        TimeLimitedLlmClient(Peek(), 5.0).send(REQUEST)
    finally:
        var.reset(token)
    assert seen == ["run-42"]
