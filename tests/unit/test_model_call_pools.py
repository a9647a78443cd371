"""No fixed pool stands between a worker's steps and their model calls (invariant 11): the
per-attempt time limit starts each attempt on its own thread (greenlet under gevent), and the
Anthropic client's HTTP pool has no connection cap of its own."""

from __future__ import annotations

import threading

import pytest

from runtime.llm.anthropic import AnthropicClient
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.retry import TimeLimitedLlmClient
from tests.unit.test_retry import OK, REQUEST

CALLERS = 200
"""Above the 64 threads the shared pool used to hold (``DAR_LLM_THREADS``' old default)."""


def test_time_limited_attempts_are_all_in_flight_together_without_a_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DAR_LLM_THREADS", raising=False)
    together = threading.Barrier(CALLERS, timeout=30)

    class AllAtOnce:
        def send(self, request: LlmRequest) -> LlmResponse:
            together.wait()  # broken (an error) unless every caller's attempt is in here
            return OK

    client = TimeLimitedLlmClient(AllAtOnce(), 60.0)
    results: list[object] = []

    def call() -> None:
        try:
            results.append(client.send(REQUEST))
        except Exception as e:
            results.append(e)

    callers = [threading.Thread(target=call) for _ in range(CALLERS)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(60)
    assert results == [OK] * CALLERS


def test_the_anthropic_client_opens_as_many_connections_as_it_has_calls() -> None:
    with AnthropicClient(api_key="k", base_url="http://127.0.0.1:9") as client:
        pool = client._client._client._transport._pool  # type: ignore[attr-defined]
        assert pool._max_connections > 100_000  # the SDK's default would be 1,000
    with AnthropicClient(api_key="k", base_url="http://127.0.0.1:9", max_connections=5) as capped:
        assert capped._client._client._transport._pool._max_connections == 5  # type: ignore[attr-defined]
