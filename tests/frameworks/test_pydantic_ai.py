"""Pydantic AI agents on the real engine: the real ``pydantic-ai-slim`` package, its Anthropic
model against the fake Messages API, PostgreSQL for the step log."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

pytest.importorskip("pydantic_ai")

from anthropic import AsyncAnthropic
from pydantic import BaseModel
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import RunContext
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.providers.anthropic import AnthropicProvider

import api
from db.records import ApprovalStatus, Dispatch, RunStatus, StepStatus, Usage
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.engine.fork import ForkRequest, fork_run
from runtime.frameworks import adapt, idempotency_key
from runtime.frameworks.bridge import on_loop
from runtime.frameworks.pydantic_ai import DarDurability
from runtime.llm.scripted import ScriptedLlm
from runtime.observe.metrics import Metrics
from runtime.testing.testkit import SimulatedCrash
from tasks.celery_app import make_celery
from tests.fakes.messages_api import FakeMessagesApi, RateLimit, cut, slow, text, wait_until
from tests.mcp.support import COUNTING, FIRST_START_FAILS, Ledger
from tests.support import drive_to_end, events_over_http, expire_lease

MODEL = "claude-test-model"


def needs_mcp_extra() -> tuple[Any, Any]:
    """``(MCPToolset, StdioTransport)``, or the test skips: an install without Pydantic AI's
    ``mcp`` extra (fastmcp; CI's oldest-version venv) has no MCP toolsets, and an agent that
    uses none runs without them."""
    try:
        from fastmcp.client.transports import StdioTransport
        from pydantic_ai.mcp import MCPToolset
    except ImportError as e:
        pytest.skip(f"Pydantic AI's MCP support is not installed (pydantic-ai-slim[mcp]): {e}")
    return MCPToolset, StdioTransport


@pytest.fixture
def fake() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi(api_key="test") as server:
        yield server


@pytest.fixture
def model(fake: FakeMessagesApi) -> Iterator[AnthropicModel]:
    """Pydantic AI's Anthropic model against the fake; its client is closed on the framework
    loop it was used on (a pooled socket collected later would fail another test)."""
    provider = AnthropicProvider(base_url=fake.url, api_key="test")
    yield AnthropicModel(MODEL, provider=provider)
    on_loop(provider.client.close())


@pytest.fixture
def rt(runtime: Runtime) -> Runtime:
    runtime.settings = replace(runtime.settings, strict_replay=True)
    return runtime


def test_a_registered_agent_runs_with_a_function_tool(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    looked_up: list[str] = []
    agent = PydanticAgent(model, name="support", instructions="Be terse.")

    @agent.tool_plain
    def lookup(order: str) -> str:
        """Look an order up."""
        looked_up.append(order)
        return f"{order} shipped"

    rt.agents.register(agent)
    fake.then_tool_use("toolu_1", "lookup", {"order": "A-7"}).then_text("A-7 has shipped.")

    run, dispatch = rt.submit("support", "Where is A-7?")
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "A-7 has shipped."
    assert looked_up == ["A-7"], "the tool ran once"
    assert fake.calls == 2, "each model request was made once"
    steps = rt.store.steps(run.id)
    assert [s.step_key for s in steps] == [
        "agent:0",
        "model.request:0",
        "tool.lookup:0",
        "model.request:1",
    ]
    assert all(s.status is StepStatus.DONE for s in steps)
    calls = [s for s in steps if s.step_key.startswith("model.request")]
    assert [s.model for s in calls] == [MODEL, MODEL]
    assert [s.request_id for s in calls] == ["msg_fake_0001", "msg_fake_0002"]
    assert all(s.prompt_hash for s in calls)
    assert calls[0].prompt_hash != calls[1].prompt_hash
    billed = Usage(input_tokens=10, output_tokens=5)
    assert [s.usage for s in calls] == [billed, billed], "as the fake billed"
    assert [s.cost_usd for s in calls] == [rt.pricing.cost(MODEL, billed)] * 2
    assert done.tokens_used == 30
    assert done.cost_usd == 2 * rt.pricing.cost(MODEL, billed)


def test_the_api_submits_a_pydantic_ai_agent_by_name(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    rt.agents.register(PydanticAgent(model, name="echo"))
    fake.then_text("hello back")
    celery = make_celery(rt.settings, register=False)
    try:
        client = api.create_app(runtime=rt, celery=celery).test_client()
        created = client.post("/api/runs", json={"agent": "echo", "input": "hello"})
        assert created.status_code == 201, created.get_data(as_text=True)
        run = rt.store.get_run(created.get_json()["id"])
        drive_to_end(rt.driver(), Dispatch(run.id, run.dispatch_token))
        body = client.get(f"/api/runs/{run.id}").get_json()
    finally:
        celery.close()
    assert body["status"] == "SUCCEEDED", body
    assert body["result"] == "hello back"
    assert fake.bodies()[0]["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "hello"}]}
    ]


class Answer(BaseModel):
    order: str
    status: str
    notes: int


@dataclass
class Desk:
    prefix: str


def desk_agent(model: AnthropicModel, ledger: Ledger) -> PydanticAgent[Desk, Answer]:
    """Two function tools (one using deps), an MCP server, structured output."""
    MCPToolset, StdioTransport = needs_mcp_extra()
    notes = MCPToolset(
        StdioTransport(sys.executable, [COUNTING, "--ledger", str(ledger.path)]), id="notes"
    )
    agent = PydanticAgent(model, name="desk", deps_type=Desk, output_type=Answer, toolsets=[notes])

    @agent.tool
    def lookup(ctx: RunContext[Desk], order: str) -> str:
        """Look an order up."""
        CALLS.append(("lookup", idempotency_key()))
        return f"{ctx.deps.prefix}{order} shipped"

    @agent.tool_plain(metadata={"dar": {"idempotent": True}})
    def carrier(order: str) -> str:
        """The carrier of an order."""
        CALLS.append(("carrier", idempotency_key()))
        return "DHL"

    return agent


CALLS: list[tuple[str, str | None]] = []


def script_desk(fake: FakeMessagesApi) -> None:
    fake.then_tool_use("toolu_1", "lookup", {"order": "A-7"})
    fake.then_tool_use("toolu_2", "carrier", {"order": "A-7"})
    fake.then_tool_use("toolu_3", "add_note", {"text": "asked about A-7"})
    fake.then_tool_use("toolu_4", "final_result", {"order": "A-7", "status": "shipped", "notes": 1})


def test_two_tools_an_mcp_server_structured_output_and_deps(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel, tmp_path: Path
) -> None:
    CALLS.clear()
    ledger = Ledger(tmp_path / "ledger.jsonl")
    rt.agents.register(desk_agent(model, ledger), deps=lambda: Desk("order "))
    script_desk(fake)

    run, dispatch = rt.submit("desk", "Where is A-7? Note that they asked.")
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == {"order": "A-7", "status": "shipped", "notes": 1}
    steps = rt.store.steps(run.id)
    assert [s.step_key for s in steps] == [
        "agent:0",
        "mcp.notes.tools:0",
        "model.request:0",
        "tool.lookup:0",
        "model.request:1",
        "tool.carrier:0",
        "model.request:2",
        "mcp.notes.add_note:0",
        "model.request:3",
    ], "step names are a persistence format: changing them strands runs in flight"
    assert [name for name, _ in CALLS] == ["lookup", "carrier"], "each tool ran once"
    assert CALLS[0][1] == f"{run.id}/tool.lookup:0", "the tool's idempotency key"
    assert ledger.count("add_note") == 1, "the MCP call was made once"
    assert ledger.entries("add_note")[0]["key"] == f"{run.id}/mcp.notes.add_note:0", "in _meta"
    assert fake.calls == 4
    lookup = next(s for s in steps if s.step_key == "tool.lookup:0")
    assert "order A-7 shipped" in json.dumps(lookup.response), "deps reached the tool"
    assert done.tokens_used == 4 * 15


def test_an_mcp_server_that_fails_to_start_once_is_tried_again_not_the_run_failed(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel, tmp_path: Path
) -> None:
    """The MCP server dies at its first start (as one still starting, or restarting, would
    look): its listing is read-only, so the step is tried again on a durable timer and the
    run goes on, as a native agent's MCP listing does, instead of failing at its first step."""
    MCPToolset, StdioTransport = needs_mcp_extra()
    ledger = Ledger(tmp_path / "ledger.jsonl")
    notes = MCPToolset(
        StdioTransport(
            sys.executable,
            [FIRST_START_FAILS, str(tmp_path / "started"), COUNTING, "--ledger", str(ledger.path)],
        ),
        id="notes",
    )
    rt.agents.register(PydanticAgent(model, name="noter", toolsets=[notes]))
    fake.then_tool_use("toolu_1", "add_note", {"text": "hello"}).then_text("Noted.")
    run, dispatch = rt.submit("noter", "Note hello.")
    driver = rt.driver()
    result = driver.drive(dispatch.run_id, dispatch.token)  # agent:0
    assert result.dispatch is not None
    result = driver.drive(result.dispatch.run_id, result.dispatch.token)  # the listing
    assert result.outcome is Outcome.WAITING
    waiting = rt.store.get_run(run.id)
    assert waiting.status is RunStatus.RUNNING, waiting.error
    assert waiting.wait_reason == "mcp.notes.tools:0 attempt 1 failed; retrying"
    assert result.dispatch is not None
    assert result.dispatch.delay_seconds == 2.0
    time.sleep(result.dispatch.delay_seconds)  # the retry's durable timer
    drive_to_end(driver, result.dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "Noted."
    assert (tmp_path / "started").exists(), "the first start failed"
    assert ledger.count("add_note") == 1
    listing = [s for s in rt.store.steps(run.id) if s.step_key == "mcp.notes.tools:0"]
    assert [(s.status, s.attempt) for s in listing] == [(StepStatus.DONE, 2)], "its second try"
    assert fake.calls == 2


def test_a_renamed_tool_fails_a_run_in_flight_with_what_changed(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    rt.settings = replace(rt.settings, strict_replay=False)  # framework runs are strict anyway
    ran: list[str] = []

    def build(tool_name: str) -> PydanticAgent[None, str]:
        agent = PydanticAgent(model, name="support")

        def tool(order: str) -> str:
            ran.append(tool_name)
            return "shipped"

        agent.tool_plain(name=tool_name)(tool)
        return agent

    rt.agents.register(build("lookup"))
    fake.then_tool_use("toolu_1", "lookup", {"order": "A-7"}).then_text("shipped")
    run, dispatch = rt.submit("support", "Where is A-7?")
    driver = rt.driver()
    result = driver.drive(dispatch.run_id, dispatch.token)  # agent:0
    assert result.dispatch is not None
    result = driver.drive(result.dispatch.run_id, result.dispatch.token)  # model.request:0
    assert result.dispatch is not None

    rt.agents.replace(adapt(build("find_order")))  # deployed with the tool renamed
    drive_to_end(rt.driver(), result.dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.FAILED
    assert done.error is not None
    assert "another version of agent 'support'" in done.error
    assert "recorded {'<agent>': ['lookup']}, now {'<agent>': ['find_order']}" in done.error
    assert ran == [], "nothing ran on the changed code"
    assert fake.calls == 1, "and the model was not asked again"


def test_a_tool_that_needs_approval_waits_for_this_runtimes_approver(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    refunded: list[str] = []
    agent = PydanticAgent(model, name="refunds")

    @agent.tool_plain(requires_approval=True)
    def refund(order: str) -> str:
        """Refund an order."""
        refunded.append(order)
        return "refunded"

    rt.agents.register(agent, approval_role="lead")
    assert rt.agents.approval_roles() >= {"lead"}
    fake.then_tool_use("toolu_1", "refund", {"order": "A-7"}).then_text("Refunded A-7.")
    run, dispatch = rt.submit("refunds", "Refund A-7")
    drive_to_end(rt.driver(), dispatch)

    waiting = rt.store.get_run(run.id)
    assert waiting.status is RunStatus.WAITING, waiting.error
    assert refunded == [], "nothing runs before the decision"
    [pending] = rt.store.list_approvals(run_id=run.id)
    assert pending.role == "lead"
    assert pending.step_key == "approve.refund:0"
    assert pending.payload["input"] == [{"tool": "refund", "arguments": {"order": "A-7"}}]
    resumed = rt.store.decide_approval(pending.id, ApprovalStatus.APPROVED, decided_by="ann")
    assert resumed is not None
    drive_to_end(rt.driver(), resumed)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "Refunded A-7."
    assert refunded == ["A-7"], "the approved call ran once"
    assert fake.calls == 2, "no model request was repeated across the wait"
    assert [s.step_key for s in rt.store.steps(run.id)] == [
        "agent:0",
        "model.request:0",
        "approve.refund:0",
        "tool.refund:0",
        "model.request:1",
    ]


def test_the_example_agent_runs_offline(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    from examples import pydantic_ai_agent

    pydantic_ai_agent.register(rt.agents)
    run, dispatch = rt.submit("order-desk", "Where is order B-2?")
    drive_to_end(rt.driver(), dispatch)
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "Order status: waiting for stock."
    live = rt.live
    assert live is not None
    deltas = [e for e in live.entries(run.id) if e.type == "text.delta"]
    assert [e.key for e in deltas] == ["model.request:1"] * 5, "streamed a word at a time"
    assert "".join(e.text for e in deltas) == done.result


@pytest.mark.parametrize("stop_reason", ["max_tokens", "refusal"])
def test_an_answer_cut_at_max_tokens_or_refused_is_counted_as_billed(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel, stop_reason: str
) -> None:
    """Pydantic AI returns an answer that ended at ``max_tokens`` or was refused (a content
    filter) as an answer, and raises only afterwards, if at all: its model request is
    recorded with the usage the provider billed, whatever the run makes of it."""
    rt.agents.register(PydanticAgent(model, name="cut"))
    cut = [{"type": "text", "text": "It left on"}]
    fake.then_message(cut, stop_reason, usage={"input_tokens": 40, "output_tokens": 16})
    fake.then_text("It left on Monday.")  # if the run goes on
    run, dispatch = rt.submit("cut", "Where is A-7?")
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status.terminal
    [first, *_] = [s for s in rt.store.steps(run.id) if s.step_key.startswith("model.request")]
    assert first.usage == Usage(40, 16)
    assert done.tokens_used + done.unrecorded_tokens == fake.billed_tokens


def test_a_stream_cut_after_its_text_began_is_counted_and_the_request_made_again(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """The connection drops mid-answer: the provider billed the input and the text so far,
    which the framework does not report; it is counted as an estimate (an upper bound), and
    the request is made again."""
    rt.agents.register(PydanticAgent(model, name="cut"))
    fake.then(cut(text("It left the warehouse on Monday " * 4), 9))  # reset mid-text
    fake.then_text("It left on Monday.")
    run, dispatch = rt.submit("cut", "Where is A-7?")
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert wait_until(lambda: len(fake.billed) == 2, timeout=5)
    assert not fake.billed[0].complete, "the first answer was cut"
    assert done.tokens_used == fake.billed[1].total, "the answer made again is recorded"
    assert done.unrecorded_tokens == done.unrecorded_estimated_tokens >= fake.billed[0].total


def test_a_cancel_aborts_the_frameworks_model_request_in_flight(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    rt.agents.register(PydanticAgent(model, name="slowpoke"))
    fake.then(slow(text("slow " * 200), chunk=5, interval=0.3))  # a minute, if let run
    run, dispatch = rt.submit("slowpoke", "Talk.")
    worker = threading.Thread(target=lambda: drive_to_end(rt.driver(), dispatch), daemon=True)
    worker.start()
    deadline = time.monotonic() + 30
    while fake.calls < 1:
        assert time.monotonic() < deadline, "the model request never started"
        time.sleep(0.05)
    time.sleep(0.5)
    asked = time.monotonic()
    assert rt.store.cancel(run.id) is not None
    live = rt.live
    assert live is not None
    live.request_cancel(run.id)
    worker.join(timeout=15)
    took = time.monotonic() - asked

    assert not worker.is_alive()
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.CANCELLED, done.error
    assert took < 10, f"the request was not aborted ({took:.1f}s)"
    assert [s.step_key for s in rt.store.steps(run.id)] == ["agent:0"], "nothing recorded"
    # billed all the same (its input, the output so far): counted, as an upper bound
    assert wait_until(lambda: len(fake.billed) == 1, timeout=5)
    assert done.unrecorded_tokens == done.unrecorded_estimated_tokens >= fake.billed_tokens > 0


def test_the_model_text_streams_to_the_runs_event_stream_while_it_is_produced(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """Live, not buffered: the text of a model request reaches the run's live stream
    (``text.delta`` of the step ``model.request:0``) before the step is recorded."""
    live = rt.live
    assert live is not None
    rt.agents.register(PydanticAgent(model, name="talker"))
    words = "Order A-7 left the warehouse on Monday and arrives on Thursday."
    fake.then(slow(text(words), chunk=6, interval=0.15))
    run, dispatch = rt.submit("talker", "Where is A-7?")
    worker = threading.Thread(target=lambda: drive_to_end(rt.driver(), dispatch), daemon=True)
    worker.start()

    deadline = time.monotonic() + 30
    while not [e for e in live.entries(run.id) if e.type == "text.delta"]:
        assert time.monotonic() < deadline, "no text.delta while the model was answering"
        time.sleep(0.02)
    recorded_then = [s.step_key for s in rt.store.steps(run.id)]
    worker.join(timeout=60)

    assert "model.request:0" not in recorded_then, "the first delta came before the step ended"
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == words
    deltas = [e for e in live.entries(run.id) if e.type == "text.delta"]
    assert {(e.key, e.attempt) for e in deltas} == {("model.request:0", 1)}
    assert "".join(e.text for e in deltas) == words, "every piece once, in order"
    assert len(deltas) > 3, "in pieces, as produced"
    [body] = [r.json for r in fake.requests if r.json is not None]
    assert body.get("stream") is True


def test_a_token_budget_stops_a_framework_run_before_its_next_model_request(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """The guard holds for framework steps as for ours: the request that crossed the budget
    is recorded (billed), no further model request is made."""
    agent = PydanticAgent(model, name="spender")

    @agent.tool_plain
    def lookup(order: str) -> str:
        """Look an order up."""
        return f"{order} shipped"

    rt.agents.register(agent)
    usage = {"input_tokens": 4000, "output_tokens": 1000}
    fake.then_tool_use("toolu_1", "lookup", {"order": "A-7"}, usage=usage)
    fake.then_text("never asked")
    run, dispatch = rt.submit("spender", "Where is A-7?", token_budget=3000)
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.FAILED, done.status
    assert done.error is not None
    assert "budget" in done.error, done.error
    assert fake.calls == 1, "the next model request was not made"
    assert done.tokens_used == 5000, "the crossing request is counted"
    assert "model.request:1" not in [s.step_key for s in rt.store.steps(run.id)]


def test_a_fork_of_a_framework_run_replays_the_copied_steps_and_asks_the_model_anew(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """Fork from the last model request: the agent, the first request and the tool are the
    original's (copied, not run again), the last request is made again for the fork."""
    looked_up: list[str] = []
    agent = PydanticAgent(model, name="forked")

    @agent.tool_plain
    def lookup(order: str) -> str:
        """Look an order up."""
        looked_up.append(order)
        return f"{order} shipped"

    rt.agents.register(agent)
    fake.then_tool_use("toolu_1", "lookup", {"order": "A-7"}).then_text("A-7 has shipped.")
    run, dispatch = rt.submit("forked", "Where is A-7?")
    drive_to_end(rt.driver(), dispatch)
    assert rt.store.get_run(run.id).status is RunStatus.SUCCEEDED
    last = next(s for s in rt.store.steps(run.id) if s.step_key == "model.request:1")

    fake.then_text("A-7 shipped on Monday.")
    fork, _ = fork_run(rt.store, rt.agents, rt.settings, run.id, ForkRequest(last.seq))
    drive_to_end(rt.driver(), Dispatch(fork.id, fork.dispatch_token))

    done = rt.store.get_run(fork.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "A-7 shipped on Monday."
    assert looked_up == ["A-7"], "the copied tool step was not run again"
    assert fake.calls == 3, "only the forked request was made again"
    steps = rt.store.steps(fork.id)
    assert [s.step_key for s in steps] == [
        "agent:0",
        "model.request:0",
        "tool.lookup:0",
        "model.request:1",
    ]
    assert done.tokens_used == 15, "the fork pays for its own request only"


PRICES = {
    MODEL: {"input": 3, "output": 15, "cache_write": 3.75, "cache_read": 0.3},
    "claude-opus-4": {"input": 15, "output": 75, "cache_write": 18.75, "cache_read": 1.5},
}


def _writer(model: AnthropicModel, *, durable: bool) -> PydanticAgent[None, str]:
    """An agent a tool delegates to: a plain one, or one carrying this runtime's capability
    (each of its requests is then reported with its own model)."""
    capabilities = [DarDurability()] if durable else []
    return PydanticAgent(model, name="writer", capabilities=capabilities)


def _delegating(
    model: AnthropicModel, writer: PydanticAgent[None, str], *, crash_once: bool = False
) -> tuple[PydanticAgent[None, str], list[str]]:
    drafted: list[str] = []
    agent = PydanticAgent(model, name="editor")

    @agent.tool(metadata={"dar": {"idempotent": True}})
    async def draft(ctx: RunContext[None], topic: str) -> str:
        """Have the writer draft a paragraph."""
        result = await writer.run(f"Draft a paragraph on {topic}.", usage=ctx.usage)
        drafted.append(result.output)
        if crash_once and len(drafted) == 1:
            raise SimulatedCrash("the worker dies after the writer answered")
        return result.output

    return agent, drafted


def _usage_rows(rt: Runtime, run_id: object) -> list[Any]:
    return [s for s in rt.store.steps(run_id) if "/usage:" in s.step_key]  # type: ignore[arg-type]


@pytest.mark.parametrize("durable", [False, True], ids=["plain-writer", "writer-with-capability"])
def test_a_tool_that_delegates_to_another_agent_counts_its_requests_with_the_tool_step(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel, durable: bool
) -> None:
    """Agent delegation (``writer.run(..., usage=ctx.usage)`` in a tool): the writer's request
    is not a step of its own (it is the tool's work) but it is billed; it counts with the
    tool's step, so the run's tokens are what the fake billed."""
    rt.pricing = type(rt.pricing).from_json(json.dumps(PRICES))
    agent, drafted = _delegating(model, _writer(model, durable=durable))
    rt.agents.register(agent)
    inner = {"input_tokens": 200, "output_tokens": 60}
    fake.then_tool_use("toolu_1", "draft", {"topic": "tides"})
    fake.then_text("Tides rise twice a day.", usage=inner)
    fake.then_text("Here is the draft.")
    run, dispatch = rt.submit("editor", "Write about tides.")
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert drafted == ["Tides rise twice a day."]
    assert fake.calls == 3
    assert done.tokens_used == fake.billed_tokens == 15 + 260 + 15
    [row] = _usage_rows(rt, run.id)
    assert row.step_key == "tool.draft:0/usage:0"
    assert row.usage == Usage(input_tokens=200, output_tokens=60)
    outer = rt.pricing.cost(MODEL, Usage(input_tokens=10, output_tokens=5))
    if durable:  # reported with the model that answered: priced as it
        assert (row.model, row.request_id) == (MODEL, "msg_fake_0002")
        assert row.cost_usd == rt.pricing.cost(MODEL, row.usage)
    else:  # a RunUsage says no model: charged at the highest known rate
        assert row.model is None
        assert row.cost_usd == rt.pricing.cost("", row.usage) > rt.pricing.cost(MODEL, row.usage)
    assert done.cost_usd == 2 * outer + row.cost_usd


def test_a_delegating_tool_run_again_after_a_crash_counts_both_writer_requests(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """The worker dies inside the tool after the writer answered (billed): that request was
    counted the moment it was answered; the idempotent tool runs again, its second request
    counts too; the first model request is not made again."""
    rt.pricing = type(rt.pricing).from_json(json.dumps(PRICES))
    agent, drafted = _delegating(model, _writer(model, durable=True), crash_once=True)
    rt.agents.register(agent)
    fake.then_tool_use("toolu_1", "draft", {"topic": "tides"})
    fake.then_text("First draft.", usage={"input_tokens": 200, "output_tokens": 60})
    fake.then_text("Second draft.", usage={"input_tokens": 210, "output_tokens": 70})
    fake.then_text("Here is the draft.")
    run, dispatch = rt.submit("editor", "Write about tides.")
    with pytest.raises(SimulatedCrash):  # agent:0, model.request:0, then inside tool.draft:0
        drive_to_end(rt.driver(), dispatch)
    assert rt.store.get_run(run.id).tokens_used == 15 + 260, "counted before the crash"
    expire_lease(rt.engine, run.id)
    again = rt.store.get_run(run.id)
    drive_to_end(rt.driver(), Dispatch(run.id, again.dispatch_token))

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert drafted == ["First draft.", "Second draft."]
    assert fake.calls == 4, "the first model request was not made again"
    assert done.tokens_used == fake.billed_tokens == 15 + 260 + 280 + 15
    assert [(r.step_key, r.usage.total) for r in _usage_rows(rt, run.id)] == [
        ("tool.draft:0/usage:0", 260),
        ("tool.draft:0/usage:1", 280),
    ]
    assert done.cost_usd == sum(
        (rt.pricing.cost(MODEL, Usage(b.input_tokens, b.output_tokens)) for b in fake.billed),
        Decimal(0),
    )


# -- flow control, concurrency keys, deadline, metrics: as for any step ------------------------


def _built(settings: Settings, llm: ScriptedLlm, **changes: Any) -> Iterator[Runtime]:
    rt = Runtime.build(replace(settings, strict_replay=True, **changes), llm=llm, pool_size=5)
    try:
        yield rt
    finally:
        rt.close()


def test_a_framework_model_request_not_admitted_waits_on_a_durable_timer(
    settings: Settings, llm: ScriptedLlm, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """DAR_MODEL_LIMITS admits a framework's model request as it admits ours: the second
    run's request is not made; the run waits holding nothing, the limit named."""
    limits = json.dumps({"claude-*": {"requestsPerMinute": 1}})
    for rt in _built(settings, llm, model_limits_json=limits):
        rt.agents.register(PydanticAgent(model, name="limited"))
        fake.then_text("first").then_text("second")
        first, d1 = rt.submit("limited", "one")
        second, d2 = rt.submit("limited", "two")
        drive_to_end(rt.driver(), d1)
        assert rt.store.get_run(first.id).status is RunStatus.SUCCEEDED
        outcomes = drive_to_end(rt.driver(), d2)

        assert Outcome.WAITING in outcomes
        waiting = rt.store.get_run(second.id)
        assert waiting.wait_reason == f"rate limit: requests/min for {MODEL}"
        assert waiting.locked_by is None, "it holds no lease while it waits"
        assert fake.calls == 1, "the request was not made"
        assert [s.step_key for s in rt.store.steps(second.id)] == ["agent:0"]


def test_a_429_from_the_api_parks_the_framework_run_on_a_timer_instead_of_failing_it(
    settings: Settings, llm: ScriptedLlm
) -> None:
    """The framework's client gets a 429 (its own retries off): the model request is not
    recorded as failed, the run waits on a durable timer as for our own calls, and flow
    control has learned the limit from the answer's headers."""
    limited = {"claude-*": RateLimit(requests_per_minute=1)}
    with FakeMessagesApi(api_key="test", rate_limits=limited, default_responder=True) as fake:
        client = AsyncAnthropic(base_url=fake.url, api_key="test", max_retries=0)
        model = AnthropicModel(MODEL, provider=AnthropicProvider(anthropic_client=client))
        try:
            for rt in _built(settings, llm):
                rt.agents.register(PydanticAgent(model, name="throttled"))
                first, d1 = rt.submit("throttled", "one")
                second, d2 = rt.submit("throttled", "two")
                drive_to_end(rt.driver(), d1)
                assert rt.store.get_run(first.id).status is RunStatus.SUCCEEDED
                outcomes = drive_to_end(rt.driver(), d2)

                assert Outcome.WAITING in outcomes
                waiting = rt.store.get_run(second.id)
                assert waiting.status is RunStatus.RUNNING, waiting.error
                assert "429" in (waiting.wait_reason or ""), waiting.wait_reason
                assert (waiting.model_attempts, waiting.claims_without_progress) == (0, 0)
                assert fake.rate_limited == 1
                assert [s.step_key for s in rt.store.steps(second.id)] == ["agent:0"]
                third, d3 = rt.submit("throttled", "three")
                assert Outcome.WAITING in drive_to_end(rt.driver(), d3)
                assert rt.store.get_run(third.id).wait_reason == (
                    f"rate limit: requests/min for {MODEL}"
                ), "learned from the 429's headers: not asked again"
                assert fake.rate_limited == 1
        finally:
            on_loop(client.close())


def test_a_concurrency_key_holds_framework_runs_out_of_their_steps(
    settings: Settings, llm: ScriptedLlm, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """With one run of a key in a step at a time, a second run of the key waits (holding
    nothing) while the first is inside its model request, then goes on."""
    for rt in _built(settings, llm, key_concurrency=1, key_recheck_seconds=30):
        rt.agents.register(PydanticAgent(model, name="keyed"))
        fake.then(slow(text("slow answer"), chunk=4, interval=0.3)).then_text("quick answer")
        first, d1 = rt.submit("keyed", "one", concurrency_key="acme")
        second, d2 = rt.submit("keyed", "two", concurrency_key="acme")
        step = rt.driver().drive(d1.run_id, d1.token)  # agent:0
        assert step.dispatch is not None
        worker = threading.Thread(
            target=drive_to_end, args=(rt.driver(), step.dispatch), daemon=True
        )
        worker.start()
        deadline = time.monotonic() + 30
        while fake.calls < 1:
            assert time.monotonic() < deadline, "the first run's request never started"
            time.sleep(0.05)
        held = rt.driver().drive(d2.run_id, d2.token)
        assert held.outcome is Outcome.WAITING
        waiting = rt.store.get_run(second.id)
        assert waiting.wait_reason == "concurrency key acme: 1 of 1 in steps", waiting.wait_reason
        assert rt.store.steps(second.id) == []
        worker.join(timeout=60)
        assert rt.store.get_run(first.id).status is RunStatus.SUCCEEDED
        again = rt.store.get_run(second.id)
        drive_to_end(rt.driver(), Dispatch(again.id, again.dispatch_token))
        assert rt.store.get_run(second.id).status is RunStatus.SUCCEEDED
        assert fake.calls == 2


def test_a_framework_run_past_its_deadline_makes_no_further_request(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    rt.agents.register(PydanticAgent(model, name="late"))
    fake.then_text("never asked")
    run, dispatch = rt.submit("late", "hello", timeout_seconds=1)
    step = rt.driver().drive(run.id, dispatch.token)  # agent:0
    assert step.dispatch is not None
    time.sleep(1.5)
    drive_to_end(rt.driver(), step.dispatch)
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.TIMED_OUT, (done.status, done.error)
    assert fake.calls == 0


def test_a_framework_runs_tokens_and_cost_reach_the_metrics_by_model(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """The Prometheus counters count a framework's requests, and a delegate's inside a tool,
    by model, as the run's counters do."""
    rt.pricing = type(rt.pricing).from_json(json.dumps(PRICES))
    agent, _ = _delegating(model, _writer(model, durable=True))
    rt.agents.register(agent)
    fake.then_tool_use("toolu_1", "draft", {"topic": "tides"})
    fake.then_text("Tides rise twice a day.", usage={"input_tokens": 200, "output_tokens": 60})
    fake.then_text("Here is the draft.")
    metrics = Metrics(CollectorRegistry())
    run, dispatch = rt.submit("editor", "Write about tides.")
    drive_to_end(rt.driver(metrics=metrics), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert metrics.tokens.labels(MODEL, "input")._value.get() == 10 + 200 + 10
    assert metrics.tokens.labels(MODEL, "output")._value.get() == 5 + 60 + 5
    assert metrics.cost.labels(MODEL)._value.get() == pytest.approx(float(done.cost_usd))


def test_the_runs_tool_calls_and_results_reach_its_event_stream(
    rt: Runtime, fake: FakeMessagesApi, model: AnthropicModel
) -> None:
    """What Pydantic AI's FunctionToolCallEvent / FunctionToolResultEvent tell, read from
    ``GET /api/runs/{id}/events``: each once (the agent's code replays on every task), after
    the model step that asked for the tool."""
    agent = PydanticAgent(model, name="teller")

    @agent.tool_plain
    def lookup(order: str) -> str:
        """Look an order up."""
        return f"{order} shipped"

    @agent.tool_plain
    def carrier(order: str) -> str:
        """The carrier of an order."""
        return "DHL"

    rt.agents.register(agent)
    fake.then_tool_use("toolu_1", "lookup", {"order": "A-7"})
    fake.then_tool_use("toolu_2", "carrier", {"order": "A-7"})
    fake.then_text("A-7 shipped with DHL.")
    run, dispatch = rt.submit("teller", "Where is A-7?")
    drive_to_end(rt.driver(), dispatch)
    assert rt.store.get_run(run.id).status is RunStatus.SUCCEEDED

    events = events_over_http(rt, run.id)
    told = [(e.name, e.data["tool"]) for e in events if e.name.startswith("agent.")]
    assert told == [
        ("agent.tool_called", "lookup"),
        ("agent.tool_output", "lookup"),
        ("agent.tool_called", "carrier"),
        ("agent.tool_output", "carrier"),
    ]
    called = next(e for e in events if e.name == "agent.tool_called")
    assert called.data == {
        "agent": "teller",
        "tool": "lookup",
        "callId": "toolu_1",
        "arguments": {"order": "A-7"},
    }
    assert next(e for e in events if e.name == "agent.tool_output").data["output"] == "A-7 shipped"
    asked = next(
        i
        for i, e in enumerate(events)
        if e.name == "step.finished" and e.data["key"] == "model.request:0"
    )
    assert [e.name for e in events].index("agent.tool_called") > asked
