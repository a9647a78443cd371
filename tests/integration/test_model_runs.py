"""Runs through the real Anthropic SDK code path (Retrying(TimeLimited(Anthropic))) against
the fake Messages API on loopback, with real PostgreSQL: what each stop reason and error
does to a run, durable timers, prompt-cache-stable requests after a crash, and cost."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from decimal import Decimal

import pytest
from sqlalchemy import text

from db.records import RunStatus, StepKind, StepStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.tools import Tool, ToolContext, tool
from tests.fakes.messages_api import FakeMessagesApi
from tests.support import (
    SimulatedCrash,
    drive_to_end,
    expire_lease,
    pointed_at,
    register_agent,
    submit,
)

MODEL = "claude-test-model"
PRICES = {"claude-test": {"input": 3, "output": 15, "cache_write": 3.75, "cache_read": 0.3}}


@pytest.fixture
def fake() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi() as api:
        yield api


@pytest.fixture
def claude(settings: Settings, fake: FakeMessagesApi) -> Iterator[Runtime]:
    """A runtime whose model client is the production one, pointed at the fake."""
    s = pointed_at(
        settings,
        fake,
        model_timeout_seconds=5,
        long_wait_seconds=5,
        prices_json=json.dumps(PRICES),
    )
    rt = Runtime.build(s, pool_size=5)
    try:
        yield rt
    finally:
        rt.close()


def _echo_tool() -> Tool:
    @tool(idempotent=True)
    def lookup(q: str, ctx: ToolContext) -> dict[str, str]:
        """Look q up."""
        return {"q": q, "key": ctx.idempotency_key}

    result: Tool = lookup
    return result


def _all_valid(fake: FakeMessagesApi) -> None:
    statuses = [r.status for r in fake.requests]
    assert all(s == 200 for s in statuses), [r.response_body[:300] for r in fake.requests]


def test_tool_use_then_end_turn_through_the_sdk(claude: Runtime, fake: FakeMessagesApi) -> None:
    fake.then_tool_use(
        "toolu_a", "lookup", {"q": "x"}, usage={"input_tokens": 100, "output_tokens": 20}
    )
    fake.then_text("x is found", usage={"input_tokens": 150, "output_tokens": 5})
    register_agent(claude.agents, _echo_tool())
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)

    done = claude.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "x is found"
    _all_valid(fake)
    assert fake.calls == 2
    second = fake.bodies()[1]
    assert second["messages"][2]["content"][0]["type"] == "tool_result"
    assert json.loads(second["messages"][2]["content"][0]["content"]) == {
        "q": "x",
        "key": f"{run.id}/toolu_a",
    }
    # The cacheable prefix is marked; the SDK's own retries are off (one call per attempt).
    assert second["system"][0]["cache_control"] == {"type": "ephemeral"}
    steps = claude.store.steps(run.id)
    assert steps[0].request_id is not None
    assert steps[0].prompt_hash is not None


def test_parallel_tool_uses_are_answered_in_one_message(
    claude: Runtime, fake: FakeMessagesApi
) -> None:
    fake.then_tool_uses([("toolu_1", "lookup", {"q": "a"}), ("toolu_2", "lookup", {"q": "b"})])
    fake.then_text("both")
    register_agent(claude.agents, _echo_tool())
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    assert claude.store.get_run(run.id).status is RunStatus.SUCCEEDED
    _all_valid(fake)
    results = fake.bodies()[1]["messages"][2]["content"]
    assert [b["tool_use_id"] for b in results] == ["toolu_1", "toolu_2"]


def test_request_after_a_crash_is_byte_identical(claude: Runtime, fake: FakeMessagesApi) -> None:
    """A crash between the response and its checkpoint repeats that one call, with exactly
    the same request body, so the prompt cache still hits."""
    fake.then_tool_use("toolu_a", "lookup", {"q": "x"}).then_text("one").then_text("one")
    register_agent(claude.agents, _echo_tool())
    run, dispatch = submit(claude.store, model=MODEL)
    first = claude.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    tool_step = claude.driver(worker="worker-A").drive(run.id, first.dispatch.token)  # type: ignore[union-attr]
    assert tool_step.dispatch is not None

    class CrashAfterResponse:
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def send(self, request: LlmRequest) -> LlmResponse:
            self.inner.send(request)  # type: ignore[attr-defined]
            raise SimulatedCrash  # died before the checkpoint

    crashing = claude.driver(worker="worker-A")
    crashing.llm = CrashAfterResponse(claude.llm)
    with pytest.raises(SimulatedCrash):
        crashing.drive(run.id, tool_step.dispatch.token)
    expire_lease(claude.engine, run.id)
    (redispatch,) = claude.store.redispatch_due(redispatch_after=3600)
    drive_to_end(claude.driver(worker="worker-B"), redispatch)

    assert claude.store.get_run(run.id).status is RunStatus.SUCCEEDED
    _all_valid(fake)
    raw = [r.body for r in fake.requests]
    assert len(raw) == 3, "one repeated call: the one whose checkpoint was lost"
    assert raw[1] == raw[2], "the rebuilt request is byte-identical"


def test_rate_limit_becomes_a_durable_timer(claude: Runtime, fake: FakeMessagesApi) -> None:
    fake.then_error(429, "slow down", retry_after=30).then_text("later")
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL)
    result = claude.driver().drive(dispatch.run_id, dispatch.token)

    assert result.outcome is Outcome.WAITING
    assert result.dispatch is not None
    assert result.dispatch.delay_seconds >= 30
    parked = claude.store.get_run(run.id)
    assert parked.status is RunStatus.RUNNING
    assert parked.locked_by is None, "a waiting run holds no lease"
    assert parked.wait_reason is not None
    assert "429" in parked.wait_reason
    assert claude.store.steps(run.id) == []
    # Not due yet: the message is held back, a claim now finds nothing to do.
    assert claude.driver().drive(run.id, result.dispatch.token).outcome is Outcome.DROPPED
    assert claude.store.redispatch_due(redispatch_after=0) == []

    with claude.engine.begin() as conn:  # thirty seconds pass
        conn.execute(text("UPDATE run SET run_at = now() WHERE id = :id"), {"id": run.id})
    drive_to_end(claude.driver(), result.dispatch)
    done = claude.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED
    assert done.wait_reason is None
    assert fake.calls == 2


def test_long_waits_are_left_to_the_reaper(
    claude: Runtime, fake: FakeMessagesApi, settings: Settings
) -> None:
    claude.settings = replace(claude.settings, max_countdown_seconds=10)
    fake.then_error(529, "overloaded", retry_after=120).then_text("later")
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL)
    result = claude.driver().drive(dispatch.run_id, dispatch.token)
    assert result.outcome is Outcome.WAITING
    assert result.dispatch is None, "no Celery countdown longer than the limit"
    assert claude.store.redispatch_due(redispatch_after=0) == [], "not due"
    with claude.engine.begin() as conn:
        conn.execute(text("UPDATE run SET run_at = now() WHERE id = :id"), {"id": run.id})
    (due,) = claude.store.redispatch_due(redispatch_after=3600)
    drive_to_end(claude.driver(), due)
    assert claude.store.get_run(run.id).status is RunStatus.SUCCEEDED


def test_retry_after_beyond_the_deadline_times_the_run_out(
    claude: Runtime, fake: FakeMessagesApi
) -> None:
    fake.then_error(429, "slow down", retry_after=600)
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL, timeout_seconds=60)
    claude.driver().drive(dispatch.run_id, dispatch.token)
    ended = claude.store.get_run(run.id)
    assert ended.status is RunStatus.TIMED_OUT
    assert ended.error is not None
    assert "deadline" in ended.error


def test_short_server_errors_are_retried_in_the_worker(
    claude: Runtime, fake: FakeMessagesApi
) -> None:
    fake.then_error(502).then_error(500).then_error(503).then_text("ok")
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    assert claude.store.get_run(run.id).status is RunStatus.SUCCEEDED
    assert fake.calls == 4


def test_non_retryable_error_fails_the_run_with_message_and_request_id(
    claude: Runtime, fake: FakeMessagesApi
) -> None:
    fake.then_error(400, "messages: roles must alternate")
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL)
    claude.driver().drive(dispatch.run_id, dispatch.token)
    failed = claude.store.get_run(run.id)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None
    assert "HTTP 400" in failed.error
    assert "roles must alternate" in failed.error
    assert "request id" in failed.error
    assert fake.calls == 1


def test_truncated_tool_use_is_never_executed(claude: Runtime, fake: FakeMessagesApi) -> None:
    ran: list[str] = []

    @tool(idempotent=True)
    def lookup(q: str) -> str:
        """Look up."""
        ran.append(q)
        return "x"

    fake.then_message(
        [{"type": "tool_use", "id": "toolu_cut", "name": "lookup", "input": {"q": "x"}}],
        "max_tokens",
    )
    register_agent(claude.agents, lookup)
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    failed = claude.store.get_run(run.id)
    assert failed.status is RunStatus.FAILED
    assert failed.error is not None
    assert "max_tokens" in failed.error
    assert ran == []


def test_max_tokens_continues_when_configured(claude: Runtime, fake: FakeMessagesApi) -> None:
    claude.settings = replace(claude.settings, on_max_tokens="continue")
    fake.then_message([{"type": "text", "text": "The answer is "}], "max_tokens")
    fake.then_message([{"type": "text", "text": "42."}], "end_turn")
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    done = claude.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "The answer is 42."
    _all_valid(fake)
    assert fake.bodies()[1]["messages"][-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "The answer is "}],
    }


def test_pause_turn_sends_the_content_back(claude: Runtime, fake: FakeMessagesApi) -> None:
    paused = [{"type": "text", "text": "Searching..."}]
    fake.then_message(paused, "pause_turn").then_message(
        [{"type": "text", "text": " found it."}], "end_turn"
    )
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    assert claude.store.get_run(run.id).result == "Searching... found it."
    _all_valid(fake)
    assert fake.bodies()[1]["messages"][-1] == {"role": "assistant", "content": paused}


@pytest.mark.parametrize(
    ("stop", "reason"),
    [("refusal", "refused"), ("model_context_window_exceeded", "context window")],
)
def test_refusal_and_context_exhaustion_end_the_run(
    claude: Runtime, fake: FakeMessagesApi, stop: str, reason: str
) -> None:
    fake.then_message([{"type": "text", "text": "..."}], stop)
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    ended = claude.store.get_run(run.id)
    assert ended.status is RunStatus.FAILED
    assert ended.error is not None
    assert reason in ended.error


def test_cost_follows_the_configured_prices(claude: Runtime, fake: FakeMessagesApi) -> None:
    usage = {
        "input_tokens": 1000,
        "output_tokens": 200,
        "cache_creation_input_tokens": 4000,
        "cache_read_input_tokens": 0,
    }
    fake.then_tool_use("toolu_a", "lookup", {"q": "x"}, usage=usage)
    fake.then_text(
        "done",
        usage={
            "input_tokens": 500,
            "output_tokens": 100,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 4000,
        },
    )
    register_agent(claude.agents, _echo_tool())
    run, dispatch = submit(claude.store, model=MODEL, token_budget=100_000)
    drive_to_end(claude.driver(), dispatch)
    done = claude.store.get_run(run.id)
    # step 1: 1000*3 + 200*15 + 4000*3.75 = 21000 per million; step 2: 500*3 + 100*15 + 4000*0.3
    step1 = Decimal("0.021")
    step2 = Decimal("0.0042")
    model_steps = [s for s in claude.store.steps(run.id) if s.kind is StepKind.MODEL]
    assert [s.cost_usd for s in model_steps] == [step1, step2]
    assert done.cost_usd == step1 + step2
    assert done.usage.cache_creation_input_tokens == 4000
    assert done.usage.cache_read_input_tokens == 4000
    assert done.tokens_used == 1000 + 200 + 4000 + 500 + 100 + 4000
    assert all(s.status is StepStatus.DONE for s in claude.store.steps(run.id))


def test_cost_budget_stops_the_run(claude: Runtime, fake: FakeMessagesApi) -> None:
    fake.then_tool_use(
        "toolu_a", "lookup", {"q": "x"}, usage={"input_tokens": 10000, "output_tokens": 1000}
    )
    register_agent(claude.agents, _echo_tool())
    run, dispatch = submit(
        claude.store, model=MODEL, token_budget=1_000_000, cost_budget_usd=Decimal("0.01")
    )
    drive_to_end(claude.driver(), dispatch)
    ended = claude.store.get_run(run.id)
    assert ended.status is RunStatus.FAILED
    assert ended.error is not None
    assert "cost budget" in ended.error
    assert fake.calls == 1, "the step that crossed the budget completed; the next did not start"


def test_strict_budget_never_exceeds_the_token_budget(
    claude: Runtime, fake: FakeMessagesApi
) -> None:
    claude.settings = replace(claude.settings, strict_budget=True, max_tokens=1000)
    fake.then_text("never sent")
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL, token_budget=500)
    drive_to_end(claude.driver(), dispatch)
    ended = claude.store.get_run(run.id)
    assert ended.status is RunStatus.FAILED
    assert ended.error is not None
    assert "strict budget" in ended.error
    assert fake.calls == 0


def test_a_call_whose_input_alone_would_cross_the_budget_is_not_made(
    claude: Runtime, fake: FakeMessagesApi
) -> None:
    """Without DAR_STRICT_BUDGET too: a request whose input alone is surely more tokens than
    the budget has left (a 600,000-character input against 100,000 tokens) is refused before
    it is sent, not billed and found over the budget after."""
    fake.then_text("never sent")
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, "x " * 300_000, model=MODEL, token_budget=100_000)
    drive_to_end(claude.driver(), dispatch)
    ended = claude.store.get_run(run.id)
    assert ended.status is RunStatus.FAILED
    assert "input alone" in (ended.error or "")
    assert fake.calls == 0
    assert ended.tokens_used == 0


def test_a_model_without_a_price_is_charged_the_highest_rate_not_zero(
    claude: Runtime, fake: FakeMessagesApi, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12.2: a cost budget on a model DAR_PRICES does not know used to let a million
    tokens through at $0. Now the tokens cost the highest known rate, the budget stops the
    run, a warning names the model and a metric counts it."""
    from prometheus_client import CollectorRegistry

    from runtime.observe.metrics import Metrics

    fake.then_tool_use(
        "toolu_a", "lookup", {"q": "x"}, usage={"input_tokens": 1_000_000, "output_tokens": 10}
    )
    fake.then_text("never sent")
    register_agent(claude.agents, _echo_tool())
    registry = CollectorRegistry()
    run, dispatch = submit(
        claude.store,
        model="mystery-model-1",
        token_budget=10_000_000,
        cost_budget_usd=Decimal("0.5"),
    )
    with caplog.at_level("WARNING", logger="runtime.llm.pricing"):
        drive_to_end(claude.driver(metrics=Metrics(registry)), dispatch)
    ended = claude.store.get_run(run.id)
    assert ended.status is RunStatus.FAILED
    assert ended.error is not None
    assert "cost budget" in ended.error
    assert ended.cost_usd >= claude.pricing.fallback.input, "a million input tokens at the top rate"
    assert fake.calls == 1
    assert any("mystery-model-1" in r.getMessage() for r in caplog.records)
    assert any("DAR_PRICES" in r.getMessage() for r in caplog.records)
    lookups = registry.get_sample_value(
        "dar_unpriced_cost_lookups_total", {"model": "mystery-model-1"}
    )
    assert lookups is not None
    assert lookups >= 1
    billed = registry.get_sample_value("dar_cost_usd_total", {"model": "mystery-model-1"})
    assert billed is not None
    assert billed > 0.5, "dar_cost_usd_total does not under-report"
