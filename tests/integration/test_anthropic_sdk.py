"""The real ``anthropic`` SDK, through :class:`AnthropicClient`, against the fake Messages
API on loopback. No database, no Redis, no network beyond 127.0.0.1."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from runtime.llm.anthropic import AnthropicClient, parse_retry_after
from runtime.llm.base import JsonObj, LlmError, LlmRequest
from runtime.llm.retry import RetryingLlmClient, RetryLater, RetryPolicy, TimeLimitedLlmClient
from tests.fakes.messages_api import FakeMessagesApi, dumps, error, validate_request

MODEL = "claude-test-model"


class FakeSleeper:
    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def ask(messages: list[JsonObj], **kw: Any) -> LlmRequest:
    return LlmRequest(model=MODEL, max_tokens=256, messages=messages, **kw)


def user(content: str | list[JsonObj]) -> JsonObj:
    return {"role": "user", "content": content}


def assistant(content: list[JsonObj]) -> JsonObj:
    return {"role": "assistant", "content": content}


def result(tool_use_id: str, content: str) -> JsonObj:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content}


def use(tool_use_id: str, name: str = "lookup") -> JsonObj:
    return {"type": "tool_use", "id": tool_use_id, "name": name, "input": {}}


@pytest.fixture
def fake() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi(api_key="test") as server:
        yield server


@pytest.fixture
def client(fake: FakeMessagesApi) -> Iterator[AnthropicClient]:
    with AnthropicClient(base_url=fake.url, api_key="test", timeout_seconds=5.0) as c:
        yield c


def retrying(client: AnthropicClient, sleeper: FakeSleeper) -> RetryingLlmClient:
    return RetryingLlmClient(
        client, RetryPolicy(long_wait_threshold=60.0), sleeper, random.Random(5)
    )


def test_tool_use_then_end_turn(fake: FakeMessagesApi, client: AnthropicClient) -> None:
    fake.then_tool_use(
        "toolu_01",
        "lookup_ticket",
        {"id": "ACME-7"},
        preamble="Let me check.",
        usage={
            "input_tokens": 120,
            "output_tokens": 30,
            "cache_creation_input_tokens": 7,
            "cache_read_input_tokens": 100,
        },
    ).then_text("ACME-7 is overdue.")
    tools = [{"name": "lookup_ticket", "description": "d", "input_schema": {"type": "object"}}]
    system = [{"type": "text", "text": "You are terse."}]
    first = client.send(ask([user("Is ACME-7 overdue?")], tools=tools, system=system))

    assert first.stop_reason == "tool_use"
    assert first.content == [
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01", "name": "lookup_ticket", "input": {"id": "ACME-7"}},
    ]
    assert first.usage.input_tokens == 120
    assert first.usage.output_tokens == 30
    assert first.usage.cache_creation_input_tokens == 7
    assert first.usage.cache_read_input_tokens == 100
    assert first.model == MODEL
    assert first.request_id == "req_fake_0001"

    second = client.send(
        ask(
            [
                user("Is ACME-7 overdue?"),
                assistant(first.content),
                user([result("toolu_01", '{"due": "yesterday"}')]),
            ],
            tools=tools,
            system=system,
        )
    )
    assert second.stop_reason == "end_turn"
    assert second.content == [{"type": "text", "text": "ACME-7 is overdue."}]
    assert fake.calls == 2
    sent = fake.bodies()
    assert sent[0]["tools"] == tools
    assert sent[0]["system"] == system
    assert sent[0]["max_tokens"] == 256
    assert sent[1]["messages"][1]["content"] == first.content


def test_parallel_tool_uses(fake: FakeMessagesApi, client: AnthropicClient) -> None:
    calls = [("toolu_a", "lookup", {"q": "a"}), ("toolu_b", "lookup", {"q": "b"})]
    fake.then_tool_uses([*calls, ("toolu_c", "clock", {})]).then_text("all done")
    first = client.send(ask([user("go")]))
    uses = [b for b in first.content if b["type"] == "tool_use"]
    assert [u["id"] for u in uses] == ["toolu_a", "toolu_b", "toolu_c"]
    assert first.stop_reason == "tool_use"
    answers = [result(u["id"], "ok") for u in uses]
    second = client.send(ask([user("go"), assistant(first.content), user(answers)]))
    assert second.stop_reason == "end_turn"
    assert fake.requests[-1].status == 200


def test_null_usage_fields_become_zero(fake: FakeMessagesApi, client: AnthropicClient) -> None:
    fake.then_text(
        "hi",
        usage={
            "input_tokens": 5,
            "output_tokens": 2,
            "cache_creation_input_tokens": None,
            "cache_read_input_tokens": None,
        },
    )
    response = client.send(ask([user("hi")]))
    assert (response.usage.cache_creation_input_tokens, response.usage.total) == (0, 7)


def test_503_with_retry_after_is_retried_after_at_least_that_long(
    fake: FakeMessagesApi, client: AnthropicClient
) -> None:
    fake.then_error(503, "Unavailable.", retry_after=7).then_error(
        503, "Unavailable.", retry_after=7
    )
    fake.then_text("finally")
    sleeper = FakeSleeper()
    response = retrying(client, sleeper).send(ask([user("hi")]))
    assert response.content == [{"type": "text", "text": "finally"}]
    assert fake.calls == 3
    assert len(sleeper.sleeps) == 2
    assert all(s >= 7.0 for s in sleeper.sleeps)


def test_429_error_carries_status_retry_after_ms_and_request_id(
    fake: FakeMessagesApi, client: AnthropicClient
) -> None:
    fake.then_error(429, "Rate limited.", retry_after=2, retry_after_ms=1500)
    with pytest.raises(LlmError) as info:
        client.send(ask([user("hi")]))
    e = info.value
    assert (e.status, e.retry_after, e.request_id, e.retryable) == (429, 1.5, "req_fake_0001", True)
    assert "Rate limited." in str(e)


def test_spend_limit_429_is_not_retried(fake: FakeMessagesApi, client: AnthropicClient) -> None:
    fake.then_error(
        429,
        "You have reached your specified API usage limits.",
        error_code="enforced_spend_limit_reached",
        retry_after=60,
    )
    fake.then_text("never")
    with pytest.raises(LlmError) as info:
        retrying(client, FakeSleeper()).send(ask([user("hi")]))
    assert info.value.status == 429
    assert not info.value.retryable
    assert fake.calls == 1


@pytest.mark.parametrize("status", [429, 529])
def test_back_pressure_comes_back_later_with_the_limit_headers(
    fake: FakeMessagesApi, client: AnthropicClient, status: int
) -> None:
    fake.then(
        replace(
            error(status, retry_after=2),
            headers=(
                ("retry-after", "2"),
                ("anthropic-ratelimit-requests-limit", "50"),
                ("anthropic-ratelimit-requests-remaining", "0"),
            ),
        )
    )
    sleeper = FakeSleeper()
    with pytest.raises(RetryLater) as info:
        retrying(client, sleeper).send(ask([user("hi")]))
    assert (info.value.status, info.value.attempts) == (status, 0)
    assert info.value.delay_seconds >= 2.0
    assert ("anthropic-ratelimit-requests-limit", "50") in info.value.rate_limits
    assert sleeper.sleeps == []
    assert fake.calls == 1


@pytest.mark.parametrize(("status", "error_type"), [(500, "api_error"), (504, "timeout_error")])
def test_server_errors_are_retried(
    fake: FakeMessagesApi, client: AnthropicClient, status: int, error_type: str
) -> None:
    fake.then_error(status, "Internal server error")
    fake.then_text("recovered")
    sleeper = FakeSleeper()
    response = retrying(client, sleeper).send(ask([user("hi")]))
    assert response.content[0]["text"] == "recovered"
    assert fake.calls == 2
    assert len(sleeper.sleeps) == 1
    assert json.loads(fake.requests[0].response_body)["error"]["type"] == error_type


def test_400_is_not_retried_and_carries_the_api_message(
    fake: FakeMessagesApi, client: AnthropicClient
) -> None:
    fake.then_error(400, "max_tokens: 999999 > 64000, the maximum for this model")
    fake.then_text("never")
    sleeper = FakeSleeper()
    with pytest.raises(LlmError) as info:
        retrying(client, sleeper).send(ask([user("hi")]))
    e = info.value
    assert e.status == 400
    assert not e.retryable
    assert "max_tokens: 999999 > 64000" in str(e)
    assert e.request_id == "req_fake_0001"
    assert fake.calls == 1
    assert sleeper.sleeps == []


def test_a_slow_dripping_body_is_ended_by_the_time_limit(fake: FakeMessagesApi) -> None:
    fake.then_slow_text("x" * 400, chunk=4, interval=0.1)  # ~12 s to arrive in full
    with AnthropicClient(base_url=fake.url, api_key="test", timeout_seconds=1.5) as inner:
        started = time.monotonic()
        with pytest.raises(LlmError) as info:
            TimeLimitedLlmClient(inner, 0.5).send(ask([user("hi")]))
        elapsed = time.monotonic() - started
    assert info.value.status == -1
    assert info.value.retryable
    assert "exceeded 0.5 s" in str(info.value)
    assert 0.5 <= elapsed < 1.4


def test_the_http_client_ends_a_dripping_body_at_its_own_total_timeout(
    fake: FakeMessagesApi,
) -> None:
    """What frees the pool thread that TimeLimited abandoned: read timeouts alone would not,
    since every chunk arrives well within the per-read timeout."""
    fake.then_slow_text("x" * 400, chunk=4, interval=0.1)
    with AnthropicClient(base_url=fake.url, api_key="test", timeout_seconds=0.6) as inner:
        started = time.monotonic()
        with pytest.raises(LlmError) as info:
            inner.send(ask([user("hi")]))
        elapsed = time.monotonic() - started
    assert info.value.status == -1
    assert 0.6 <= elapsed < 2.0


def test_a_connection_reset_is_an_io_error_and_retried(
    fake: FakeMessagesApi, client: AnthropicClient
) -> None:
    fake.then_reset()
    with pytest.raises(LlmError) as info:
        client.send(ask([user("hi")]))
    assert info.value.status == -1
    assert info.value.retryable

    fake.then_reset().then_text("second time lucky")
    response = retrying(client, FakeSleeper()).send(ask([user("hi")]))
    assert response.content[0]["text"] == "second time lucky"
    assert fake.calls == 3


def test_content_blocks_round_trip_byte_identical(
    fake: FakeMessagesApi, client: AnthropicClient
) -> None:
    content: list[JsonObj] = [
        {"type": "thinking", "thinking": 'Hmm, ünïcode ✓ and "quotes"', "signature": "EqQB+/=="},
        {"type": "text", "text": "Looking it up…", "citations": None},
        {
            "type": "tool_use",
            "id": "toolu_01XyZ",
            "name": "search",
            "input": {"query": "héllo", "filters": {"n": 3, "tags": ["a", None], "x": 1.5}},
        },
        {"type": "future_block_type", "payload": {"nested": [1, {"deep": True}]}, "extra": None},
    ]
    fake.then_message(content, "tool_use").then_text("thanks")
    first = client.send(ask([user("search")]))
    assert first.content == content
    client.send(ask([user("search"), assistant(first.content), user([result("toolu_01XyZ", "1")])]))

    original = dumps(content)
    assert original in fake.requests[0].response_body  # what the API sent ...
    assert original in fake.requests[1].body  # ... is exactly what went back
    assert [list(b) for b in fake.bodies()[1]["messages"][1]["content"]] == [
        list(b) for b in content
    ]  # key order kept too


@pytest.mark.parametrize(
    ("messages", "complaint"),
    [
        (
            # the results of one turn split across messages
            [
                user("go"),
                assistant([use("toolu_a"), use("toolu_b")]),
                user([result("toolu_a", "1")]),
                assistant([{"type": "text", "text": "and b?"}]),
                user([result("toolu_b", "2")]),
            ],
            "without `tool_result` blocks immediately after: toolu_b",
        ),
        (
            [
                user("go"),
                assistant([use("toolu_a")]),
                user([{"type": "text", "text": "here"}, result("toolu_a", "1")]),
            ],
            "must come first",
        ),
        ([user([result("toolu_zz", "1")])], "unexpected `tool_use_id`"),
        ([assistant([{"type": "text", "text": "hi"}])], 'first message must use the "user" role'),
        ([user("a"), user("b")], "roles must alternate"),
        ([], "at least one message"),
        ([user("go"), assistant([use("toolu_a")])], "toolu_a"),
    ],
)
def test_the_fake_rejects_a_bad_conversation_with_400(
    fake: FakeMessagesApi, client: AnthropicClient, messages: list[JsonObj], complaint: str
) -> None:
    fake.then_text("never")
    with pytest.raises(LlmError) as info:
        retrying(client, FakeSleeper()).send(ask(messages))
    assert info.value.status == 400
    assert not info.value.retryable
    assert complaint in str(info.value)
    assert fake.calls == 1
    assert fake.pending == 1  # a rejected request does not consume the script


def test_the_validator_requires_model_and_max_tokens() -> None:
    assert validate_request({"max_tokens": 5, "messages": [user("x")]}) == "model: Field required"
    assert validate_request({"model": "m", "messages": [user("x")]}) == (
        "max_tokens: Field required"
    )
    assert validate_request({"model": "m", "max_tokens": 5, "messages": [user("x")]}) is None


def test_an_empty_script_fails_fast_unless_a_default_responder_is_set(
    fake: FakeMessagesApi, client: AnthropicClient
) -> None:
    with pytest.raises(LlmError, match="script exhausted"):
        client.send(ask([user("hi")]))
    with (
        FakeMessagesApi(default_responder=True) as chatty,
        AnthropicClient(base_url=chatty.url, api_key="k") as c,
    ):
        for _ in range(20):
            assert c.send(ask([user("hi")])).stop_reason == "end_turn"
        assert chatty.calls == 20


def test_env_vars_are_honoured_like_the_sdk(
    fake: FakeMessagesApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "test")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
    fake.then_text("from env")
    with AnthropicClient() as c:
        assert c.send(ask([user("hi")])).content[0]["text"] == "from env"
    assert fake.requests[0].headers.get("anthropic-version")


def test_wrong_key_is_401_and_not_retried(fake: FakeMessagesApi) -> None:
    with AnthropicClient(base_url=fake.url, api_key="wrong") as c, pytest.raises(LlmError) as info:
        retrying(c, FakeSleeper()).send(ask([user("hi")]))
    assert (info.value.status, info.value.retryable, fake.calls) == (401, False, 1)


@pytest.mark.parametrize("config_dir", [False, True])
def test_no_credentials_is_a_non_retryable_error(
    fake: FakeMessagesApi, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config_dir: bool
) -> None:
    """No key anywhere: the SDK fails at request time; an ANTHROPIC_CONFIG_DIR without a
    profile makes it fail in the constructor. Either way: one clear, final LlmError."""
    for name in (
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_AUTH_TOKEN",
        "ANTHROPIC_PROFILE",
        "ANTHROPIC_CONFIG_DIR",
        "ANTHROPIC_IDENTITY_TOKEN",
        "ANTHROPIC_IDENTITY_TOKEN_FILE",
        "ANTHROPIC_FEDERATION_RULE_ID",
        "ANTHROPIC_ORGANIZATION_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    if config_dir:
        monkeypatch.setenv("ANTHROPIC_CONFIG_DIR", str(tmp_path))
    with pytest.raises(LlmError) as info, AnthropicClient(base_url=fake.url) as c:
        c.send(ask([user("hi")]))
    assert not info.value.retryable
    assert "credentials" in str(info.value)
    assert fake.calls == 0


def test_prompts_are_not_logged_at_debug(
    fake: FakeMessagesApi, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_LOG", raising=False)
    caplog.set_level(logging.DEBUG)
    fake.then_text("ok")
    with AnthropicClient(base_url=fake.url, api_key="test") as c:
        c.send(ask([user("TOP-SECRET-PROMPT")]))
    assert "TOP-SECRET-PROMPT" not in caplog.text
    assert not [
        r for r in caplog.records if r.name.startswith(("anthropic", "httpx2", "httpcore2"))
    ]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after": "7"}, 7.0),
        ({"retry-after": "0.25"}, 0.25),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({}, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after(headers) == expected
