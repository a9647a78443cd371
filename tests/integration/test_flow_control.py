"""Flow control against real Redis: fleet-wide buckets, waits on durable timers with the
limit named in the run's wait reason, priority order among waiters, learned limits, capacity
that never leaks when a worker dies holding admission, and failing open when Redis is lost."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis
from prometheus_client import CollectorRegistry

from db.records import RunStatus
from runtime.admission.flow_control import (
    FlowConfigError,
    FlowControl,
    ModelLimit,
    Refusal,
    parse_model_limits,
)
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.anthropic import AnthropicClient
from runtime.llm.base import LlmError, LlmRequest
from runtime.llm.scripted import ScriptedLlm
from runtime.observe.metrics import Metrics
from tests.fakes.messages_api import FakeMessagesApi, RateLimit
from tests.support import drive_to_end, redis_scope, register_agent, submit

MODEL = "claude-sonnet-4-5"


@pytest.fixture
def prefix() -> str:
    return f"dar-test-flow:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def rclient(redis_url: str, prefix: str) -> Iterator[redis.Redis]:
    with redis_scope(redis_url, f"{prefix}:*") as client:
        yield client


def _flow(client: redis.Redis, prefix: str, *limits: ModelLimit, lease: float = 60) -> FlowControl:
    metrics = Metrics(CollectorRegistry())
    return FlowControl(client, limits, lease_seconds=lease, metrics=metrics, prefix=prefix)


def test_limits_parse_and_bad_config_is_named() -> None:
    limits = parse_model_limits(
        '{"claude-*": {"requestsPerMinute": 60}, "claude-sonnet-4-5": {"maxConcurrent": 2}}'
    )
    assert limits[0] == ModelLimit("claude-*", requests_per_minute=60)
    with pytest.raises(FlowConfigError, match="inputTokensPerMinut"):
        parse_model_limits('{"claude-*": {"inputTokensPerMinut": 5}}')
    with pytest.raises(FlowConfigError, match="whole number"):
        parse_model_limits('{"claude-*": {"requestsPerMinute": -1}}')


def test_input_token_bucket_admits_until_empty_then_names_the_limit(
    rclient: redis.Redis, prefix: str
) -> None:
    flow = _flow(rclient, prefix, ModelLimit("claude-*", input_tokens_per_minute=6000))
    grants = [flow.admit(MODEL, 1000, 10, waiter=f"r{i}") for i in range(6)]
    assert all(g is not None and not isinstance(g, Refusal) for g in grants)
    refused = flow.admit(MODEL, 1000, 10, waiter="r6")
    assert isinstance(refused, Refusal)
    assert refused.reason == f"rate limit: input tokens/min for {MODEL}"
    # 1000 tokens at 100/s: about ten seconds, not a blind backoff
    assert 5 < refused.delay_seconds <= 10.5
    # settling gives back what a call did not use: two calls used 100 of 1000 each
    for g in grants[:2]:
        assert g is not None
        assert not isinstance(g, Refusal)
        flow.settle(g, 100, 5)
    again = flow.admit(MODEL, 1000, 10, waiter="r6")
    assert again is not None
    assert not isinstance(again, Refusal)


def test_waiters_are_admitted_in_priority_order(rclient: redis.Redis, prefix: str) -> None:
    flow = _flow(rclient, prefix, ModelLimit("claude-*", max_concurrent=1))
    held = flow.admit(MODEL, 10, 10, waiter="holder")
    assert held is not None
    assert not isinstance(held, Refusal)
    low = flow.admit(MODEL, 10, 10, waiter="low", priority=0)
    high = flow.admit(MODEL, 10, 10, waiter="high", priority=5)
    assert isinstance(low, Refusal)
    assert isinstance(high, Refusal)
    assert low.reason == f"rate limit: concurrent calls for {MODEL}"
    flow.settle(held, 10, 10)
    time.sleep(max(low.delay_seconds, high.delay_seconds))
    # the low-priority waiter comes back first, but the high one is due and ahead of it
    assert isinstance(flow.admit(MODEL, 10, 10, waiter="low", priority=0), Refusal)
    assert not isinstance(flow.admit(MODEL, 10, 10, waiter="high", priority=5), Refusal)


def test_a_worker_killed_holding_admission_leaks_nothing(
    rclient: redis.Redis, prefix: str, redis_url: str
) -> None:
    """A real process takes admission and is SIGKILLed mid-call: its concurrency slot
    expires with its lease, and the bucket refills."""
    script = f"""
import os, signal, redis
from runtime.admission.flow_control import FlowControl, ModelLimit
flow = FlowControl(redis.Redis.from_url({redis_url!r}),
    (ModelLimit("claude-*", max_concurrent=1, requests_per_minute=600),),
    lease_seconds=1.5, prefix={prefix!r})
assert flow.admit({MODEL!r}, 10, 10, waiter="doomed") is not None
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], check=False, timeout=30)
    assert proc.returncode == -9
    flow = _flow(rclient, prefix, ModelLimit("claude-*", max_concurrent=1, requests_per_minute=600))
    assert flow.in_flight(MODEL) == 1
    assert isinstance(flow.admit(MODEL, 10, 10, waiter="next"), Refusal)
    time.sleep(1.6)
    assert flow.in_flight(MODEL) == 0
    grant = flow.admit(MODEL, 10, 10, waiter="next")
    assert grant is not None
    assert not isinstance(grant, Refusal)


def test_limits_are_learned_from_the_api_headers(rclient: redis.Redis, prefix: str) -> None:
    flow = _flow(rclient, prefix, ModelLimit("claude-*", requests_per_minute=1000))
    grant = flow.admit(MODEL, 10, 10, waiter="a")
    assert grant is not None
    assert not isinstance(grant, Refusal)
    headers = (
        ("anthropic-ratelimit-requests-limit", "50"),
        ("anthropic-ratelimit-requests-remaining", "0"),
        ("anthropic-ratelimit-requests-reset", "2030-01-01T00:00:00Z"),
    )
    flow.settle(grant, 10, 10, headers=headers)
    refused = flow.admit(MODEL, 10, 10, waiter="b")
    assert isinstance(refused, Refusal)
    assert refused.limit == "requests"
    assert 0.5 < refused.delay_seconds <= 1.3  # one request at the API's 50/min


def test_losing_redis_fails_open_loudly(caplog: pytest.LogCaptureFixture) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    metrics = Metrics(CollectorRegistry())
    flow = FlowControl(
        dead, (ModelLimit("claude-*", requests_per_minute=1),), lease_seconds=5, metrics=metrics
    )
    with caplog.at_level(logging.ERROR, logger="runtime.admission.flow_control"):
        assert flow.admit(MODEL, 10, 10, waiter="a") is None
        assert flow.admit(MODEL, 10, 10, waiter="b") is None
    assert "flow control unavailable" in caplog.text
    assert metrics.flow_fail_open.labels("admit")._value.get() == 2


def test_the_fake_api_enforces_buckets_with_headers() -> None:
    with FakeMessagesApi(
        default_responder=True, rate_limits={"claude-*": RateLimit(requests_per_minute=2)}
    ) as fake:
        request = LlmRequest(MODEL, 50, [{"role": "user", "content": "hi"}])
        # closed on the way out: its pooled sockets are not left for the collector
        with AnthropicClient(base_url=fake.url, api_key="k", timeout_seconds=5) as client:
            first = client.send(request)
            assert ("anthropic-ratelimit-requests-limit", "2") in first.rate_limits
            client.send(request)
            with pytest.raises(LlmError) as e:
                client.send(request)
        assert e.value.status == 429
        assert e.value.retry_after is not None
        assert e.value.retry_after >= 1
        assert fake.rate_limited == 1
        assert fake.requests[-1].status == 429


# -- through the engine -----------------------------------------------------------------------


@pytest.fixture
def limited(settings: Settings, llm: ScriptedLlm, prefix: str) -> Iterator[Runtime]:
    s = replace(
        settings,
        model_limits_json=json.dumps({"claude-*": {"requestsPerMinute": 1}}),
    )
    rt = Runtime.build(s, llm=llm, pool_size=5)
    try:
        yield rt
    finally:
        rt.close()


def test_a_run_not_admitted_waits_on_a_durable_timer(
    limited: Runtime, llm: ScriptedLlm, rclient: redis.Redis
) -> None:
    register_agent(limited.agents)
    llm.then_text("done")
    driver = limited.driver(metrics=Metrics(CollectorRegistry()))
    first, d1 = submit(limited.store, model=MODEL)
    second, d2 = submit(limited.store, model=MODEL)
    assert drive_to_end(driver, d1)[-1] is Outcome.FINISHED
    result = driver.drive(d2.run_id, d2.token)
    assert result.outcome is Outcome.WAITING
    run = limited.store.get_run(second.id)
    assert run.status is RunStatus.RUNNING or run.status is RunStatus.QUEUED
    assert run.wait_reason == f"rate limit: requests/min for {MODEL}"
    assert run.locked_by is None  # holds no lease while it waits
    assert (run.run_at - limited.store.get_run(first.id).finished_at).total_seconds() > 30
    assert len(llm.requests) == 1


# -- on by default: limits learned from the API's headers (issue 26) ---------------------------


@pytest.fixture
def unset(settings: Settings) -> Iterator[tuple[Runtime, FakeMessagesApi]]:
    """The production client against an API limited to 2 requests/min; no DAR_MODEL_LIMITS."""
    with FakeMessagesApi(
        default_responder=True, rate_limits={"claude-*": RateLimit(requests_per_minute=2)}
    ) as fake:
        s = replace(settings, anthropic_api_key="k", anthropic_base_url=fake.url)
        assert s.model_limits_json is None
        rt = Runtime.build(s, pool_size=5)
        try:
            yield rt, fake
        finally:
            rt.close()


def test_with_no_settings_the_limit_is_learned_from_the_answers(
    unset: tuple[Runtime, FakeMessagesApi],
) -> None:
    rt, fake = unset
    register_agent(rt.agents)
    driver = rt.driver(metrics=Metrics(CollectorRegistry()))
    runs = [submit(rt.store, model=MODEL) for _ in range(3)]
    for _, dispatch in runs[:2]:
        assert drive_to_end(driver, dispatch)[-1] is Outcome.FINISHED
    third, dispatch = runs[2]
    assert driver.drive(dispatch.run_id, dispatch.token).outcome is Outcome.WAITING
    waiting = rt.store.get_run(third.id)
    assert waiting.wait_reason == f"rate limit: requests/min for {MODEL}"
    assert (fake.calls, fake.rate_limited) == (2, 0)  # refused here, not by the API
    assert waiting.run_at is not None
    assert (waiting.run_at - waiting.updated_at).total_seconds() > 20  # 1 request at 2/min


def test_a_429_teaches_the_limit_and_costs_the_run_no_attempt(
    unset: tuple[Runtime, FakeMessagesApi],
) -> None:
    rt, fake = unset
    request = LlmRequest(MODEL, 50, [{"role": "user", "content": "hi"}])
    with AnthropicClient(base_url=fake.url, api_key="k", timeout_seconds=5) as other:
        other.send(request)  # another client spends the API's limit: this fleet never saw it
        other.send(request)
    register_agent(rt.agents)
    driver = rt.driver()
    first, d1 = submit(rt.store, model=MODEL)
    assert driver.drive(d1.run_id, d1.token).outcome is Outcome.WAITING
    assert fake.rate_limited == 1
    run = rt.store.get_run(first.id)
    assert run.status is not RunStatus.FAILED
    assert (run.model_attempts, run.claims_without_progress) == (0, 0)
    assert "HTTP 429" in (run.wait_reason or "")
    # the 429's headers said none remain: the next run waits here, without asking the API
    second, d2 = submit(rt.store, model=MODEL)
    assert driver.drive(d2.run_id, d2.token).outcome is Outcome.WAITING
    assert rt.store.get_run(second.id).wait_reason == f"rate limit: requests/min for {MODEL}"
    assert fake.calls == 3


def test_flow_control_can_be_turned_off(settings: Settings) -> None:
    assert Settings.from_env({"DAR_FLOW_CONTROL": "off"}).flow_control is False
    assert Settings.from_env({}).flow_control is True
    rt = Runtime.build(replace(settings, flow_control=False), llm=ScriptedLlm(), pool_size=2)
    try:
        assert rt.flow_control() is None
    finally:
        rt.close()


def test_the_note_of_a_call_counted_as_lost_is_erased_in_time(
    rclient: redis.Redis, prefix: str
) -> None:
    """A run's call whose worker died is counted as lost by the run's next admission, which
    leaves a note for that call's settle (in case its worker was only fenced out). A dead
    worker never settles: the note is erased once its time is up, as the next one is made,
    not kept for as long as the model's calls keep its hash alive (a leak under load)."""
    flow = FlowControl(rclient, (), lease_seconds=60, prefix=prefix, charged_marker_seconds=1)
    calls = flow._keys(flow.limit(MODEL))[5]

    def lose_a_call(run: str) -> str:
        first = flow.admit(MODEL, 100, 50, waiter=run, run=run, step=("model:1", 1))
        assert first is not None
        assert not isinstance(first, Refusal)
        # its worker dies in the call; the run's next admission finds its record
        second = flow.admit(MODEL, 100, 50, waiter=run, run=run, step=("model:1", 2))
        assert second is not None
        assert not isinstance(second, Refusal)
        assert second.lost is not None
        assert second.lost.total == 150
        assert rclient.hexists(calls, f"charged:{first.lease}")
        return first.lease

    early = lose_a_call("run-1")
    time.sleep(1.2)
    late = lose_a_call("run-2")
    assert not rclient.hexists(calls, f"charged:{early}"), "an expired note was kept"
    assert rclient.hexists(calls, f"charged:{late}"), "a note in its time was erased"
    assert 0 < rclient.ttl(calls.replace(":calls", ":charged")) <= 61
