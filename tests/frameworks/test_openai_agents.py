"""OpenAI Agents SDK agents on the real engine: the real ``openai-agents`` package, its
OpenAI models (Responses and Chat Completions) against the fake OpenAI API, PostgreSQL for
the step log."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("agents")

from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool
from agents.mcp import MCPServerStdio
from openai import AsyncOpenAI
from pydantic import BaseModel

from db.records import ApprovalStatus, Dispatch, RunStatus, StepStatus, Usage
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.frameworks import idempotency_key
from runtime.frameworks.bridge import on_loop
from runtime.frameworks.openai_agents import idempotent
from tests.fakes.openai_api import FakeOpenAiApi, Turn
from tests.mcp.support import COUNTING, FIRST_START_FAILS, Ledger
from tests.support import drive_to_end, events_over_http

MODEL = "gpt-test"


@pytest.fixture
def fake() -> Iterator[FakeOpenAiApi]:
    with FakeOpenAiApi() as server:
        yield server


@pytest.fixture
def client(fake: FakeOpenAiApi) -> Iterator[AsyncOpenAI]:
    c = AsyncOpenAI(base_url=fake.url, api_key="test", max_retries=0)
    yield c
    on_loop(c.close())


@pytest.fixture
def rt(runtime: Runtime) -> Runtime:
    runtime.settings = replace(runtime.settings, strict_replay=True)
    return runtime


class Answer(BaseModel):
    order: str
    status: str


CALLS: list[tuple[str, str | None]] = []


@function_tool
def lookup(order: str) -> str:
    """Look an order up."""
    CALLS.append(("lookup", idempotency_key()))
    return f"{order} shipped"


@idempotent
@function_tool
def carrier(order: str) -> str:
    """The carrier of an order."""
    CALLS.append(("carrier", idempotency_key()))
    return "DHL"


def desk(model: object, ledger: Ledger) -> Agent[None]:
    closer = Agent(name="closer", instructions="Answer.", model=model, output_type=Answer)
    notes = MCPServerStdio(
        params={"command": sys.executable, "args": [COUNTING, "--ledger", str(ledger.path)]},
        name="notes",
    )
    return Agent(
        name="desk",
        instructions="Help.",
        model=model,
        tools=[lookup, carrier],
        mcp_servers=[notes],
        handoffs=[closer],
    )


def script(fake: FakeOpenAiApi) -> None:
    fake.then_calls(("call_a", "lookup", {"order": "A-7"}), ("call_b", "carrier", {"order": "A-7"}))
    fake.then_calls(("call_c", "add_note", {"text": "asked about A-7"}))
    fake.then_calls(("call_d", "transfer_to_closer", {}))
    fake.then_text(
        json.dumps({"order": "A-7", "status": "shipped"}), input_tokens=20, cached_tokens=8
    )


def test_an_mcp_server_that_fails_to_start_once_is_tried_again_not_the_run_failed(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI, tmp_path: Path
) -> None:
    """As for Pydantic AI: the server dies at its first start, its listing (read-only, where
    the SDK connects) is tried again on a durable timer, and the run goes on."""
    ledger = Ledger(tmp_path / "ledger.jsonl")
    marker = str(tmp_path / "started")
    notes = MCPServerStdio(
        params={
            "command": sys.executable,
            "args": [FIRST_START_FAILS, marker, COUNTING, "--ledger", str(ledger.path)],
        },
        name="notes",
    )
    model = OpenAIResponsesModel(MODEL, openai_client=client)
    rt.agents.register(Agent(name="noter", instructions="Note.", model=model, mcp_servers=[notes]))
    fake.then_calls(("call_a", "add_note", {"text": "hello"}))
    fake.then_text("Noted.")
    run, dispatch = rt.submit("noter", "Note hello.")
    driver = rt.driver()
    result = driver.drive(dispatch.run_id, dispatch.token)  # agent:0
    assert result.dispatch is not None
    result = driver.drive(result.dispatch.run_id, result.dispatch.token)  # the listing
    assert result.outcome is Outcome.WAITING, rt.store.get_run(run.id).error
    assert rt.store.get_run(run.id).wait_reason == "mcp.notes.tools:0 attempt 1 failed; retrying"
    assert result.dispatch is not None
    time.sleep(result.dispatch.delay_seconds)  # the retry's durable timer
    drive_to_end(driver, result.dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "Noted."
    assert ledger.count("add_note") == 1
    first = next(s for s in rt.store.steps(run.id) if s.step_key == "mcp.notes.tools:0")
    assert (first.status, first.attempt) == (StepStatus.DONE, 2), "its second try"


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_two_tools_an_mcp_server_a_handoff_and_structured_output(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI, tmp_path: Path, api: str
) -> None:
    CALLS.clear()
    model = (
        OpenAIResponsesModel(MODEL, openai_client=client)
        if api == "responses"
        else OpenAIChatCompletionsModel(MODEL, openai_client=client)
    )
    ledger = Ledger(tmp_path / "ledger.jsonl")
    rt.agents.register(desk(model, ledger))
    script(fake)

    run, dispatch = rt.submit("desk", "Where is A-7? Note that they asked.")
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == {"order": "A-7", "status": "shipped"}
    steps = rt.store.steps(run.id)
    assert [s.step_key for s in steps] == [
        "agent:0",
        "mcp.notes.tools:0",
        "model:0",
        "tool.lookup:0",
        "tool.carrier:0",
        "mcp.notes.tools:1",
        "model:1",
        "mcp.notes.add_note:0",
        "mcp.notes.tools:2",
        "model:2",
        "handoff.closer:0",
        "model:3",
    ], "step names are a persistence format; parallel calls in the model's order"
    assert all(s.status is StepStatus.DONE for s in steps)
    assert [name for name, _ in CALLS] == ["lookup", "carrier"], "each tool ran once, in order"
    assert ledger.count("add_note") == 1, "the MCP call was made once"
    assert ledger.entries("add_note")[0]["key"] == f"{run.id}/mcp.notes.add_note:0"
    assert CALLS[0][1] == f"{run.id}/tool.lookup:0"
    assert fake.calls == 4
    calls = [s for s in steps if s.step_key.startswith("model:")]
    assert [s.usage for s in calls] == [Usage(10, 5)] * 3 + [Usage(12, 5, 0, 8)]
    assert done.tokens_used == 3 * 15 + 25
    assert done.cost_usd == sum(rt.pricing.cost(MODEL, s.usage) for s in calls)


def test_a_run_state_interruption_becomes_this_runtimes_approval(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI
) -> None:
    refunded: list[str] = []

    @function_tool(needs_approval=True)
    def refund(order: str) -> str:
        """Refund an order."""
        refunded.append(order)
        return "refunded"

    model = OpenAIResponsesModel(MODEL, openai_client=client)
    rt.agents.register(Agent(name="refunds", model=model, tools=[refund]), approval_role="lead")
    fake.then_calls(("call_r", "refund", {"order": "A-7"})).then_text("Refunded A-7.")
    run, dispatch = rt.submit("refunds", "Refund A-7")
    drive_to_end(rt.driver(), dispatch)

    assert rt.store.get_run(run.id).status is RunStatus.WAITING
    assert refunded == []
    [pending] = rt.store.list_approvals(run_id=run.id)
    assert (pending.role, pending.step_key) == ("lead", "approve.refund:0")
    resumed = rt.store.decide_approval(pending.id, ApprovalStatus.APPROVED, decided_by="ann")
    assert resumed is not None
    drive_to_end(rt.driver(), resumed)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "Refunded A-7."
    assert refunded == ["A-7"]
    assert fake.calls == 2
    assert [s.step_key for s in rt.store.steps(run.id)] == [
        "agent:0",
        "model:0",
        "approve.refund:0",
        "tool.refund:0",
        "model:1",
    ]


def test_the_example_agent_registers_with_a_model_by_name(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI
) -> None:
    from agents import OpenAIProvider

    from examples import openai_agents_agent

    provider = OpenAIProvider(openai_client=client, use_responses=True)
    rt.agents.register(openai_agents_agent.build(MODEL), model_provider=provider)
    fake.then_calls(("call_1", "lookup_order", {"order": "A-7"}))
    fake.then_calls(("call_2", "transfer_to_reply_writer", {}))
    fake.then_text("It shipped on Monday.")
    run, dispatch = rt.submit("order-desk-sdk", "Where is A-7?")
    drive_to_end(rt.driver(), dispatch)
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "It shipped on Monday."
    assert [s.step_key for s in rt.store.steps(run.id)] == [
        "agent:0",
        "model:0",
        "tool.lookup_order:0",
        "model:1",
        "handoff.reply-writer:0",
        "model:2",
    ]


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_the_model_text_streams_to_the_runs_event_stream_while_it_is_produced(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI, api: str
) -> None:
    """Live, not buffered: ``Runner.run`` in a run streams each model call (the SDK's
    ``stream_response``), its text to the run's live stream before the step is recorded;
    the recorded answer and its usage are the completed response's."""
    live = rt.live
    assert live is not None
    model = (
        OpenAIResponsesModel(MODEL, openai_client=client)
        if api == "responses"
        else OpenAIChatCompletionsModel(MODEL, openai_client=client)
    )
    rt.agents.register(Agent(name="talker", model=model))
    words = "Order A-7 left the warehouse on Monday and arrives on Thursday."
    fake.then(Turn(text=words, input_tokens=21, output_tokens=13, interval=0.1))
    run, dispatch = rt.submit("talker", "Where is A-7?")
    worker = threading.Thread(target=lambda: drive_to_end(rt.driver(), dispatch), daemon=True)
    worker.start()

    deadline = time.monotonic() + 30
    while not [e for e in live.entries(run.id) if e.type == "text.delta"]:
        assert time.monotonic() < deadline, "no text.delta while the model was answering"
        time.sleep(0.02)
    recorded_then = [s.step_key for s in rt.store.steps(run.id)]
    worker.join(timeout=60)

    assert "model:0" not in recorded_then, "the first delta came before the step ended"
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == words
    deltas = [e for e in live.entries(run.id) if e.type == "text.delta"]
    assert {(e.key, e.attempt) for e in deltas} == {("model:0", 1)}
    assert "".join(e.text for e in deltas) == words, "every piece once, in order"
    assert len(deltas) > 3
    [(_, body)] = fake.bodies
    assert body.get("stream") is True
    [step] = [s for s in rt.store.steps(run.id) if s.step_key == "model:0"]
    assert step.usage == Usage(21, 13)
    assert done.tokens_used == fake.billed_tokens == 34


def test_a_cancel_aborts_the_sdks_streamed_model_call_in_flight(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI
) -> None:
    live = rt.live
    assert live is not None
    model = OpenAIResponsesModel(MODEL, openai_client=client)
    rt.agents.register(Agent(name="slowpoke", model=model))
    fake.then(Turn(text="slow " * 200, interval=0.3))  # a minute, if let run
    run, dispatch = rt.submit("slowpoke", "Talk.")
    worker = threading.Thread(target=lambda: drive_to_end(rt.driver(), dispatch), daemon=True)
    worker.start()
    deadline = time.monotonic() + 30
    while not [e for e in live.entries(run.id) if e.type == "text.delta"]:
        assert time.monotonic() < deadline, "the model call never streamed"
        time.sleep(0.05)
    asked = time.monotonic()
    assert rt.store.cancel(run.id) is not None
    live.request_cancel(run.id)
    worker.join(timeout=15)
    took = time.monotonic() - asked

    assert not worker.is_alive()
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.CANCELLED, done.error
    assert took < 10, f"the call was not aborted ({took:.1f}s)"
    assert [s.step_key for s in rt.store.steps(run.id)] == ["agent:0"], "nothing recorded"
    # billed all the same (what it read, what it generated): counted, as an upper bound
    assert fake.billed_tokens > 0
    assert done.unrecorded_tokens == done.unrecorded_estimated_tokens >= fake.billed_tokens


@pytest.mark.parametrize("streamed", [True, False])
def test_a_response_that_ends_incomplete_is_counted_with_what_it_billed(
    rt: Runtime,
    fake: FakeOpenAiApi,
    client: AsyncOpenAI,
    streamed: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The provider bills a response that ends ``incomplete`` (max output tokens, a content
    filter); the SDK raises on it. Its step is the error the framework sees, and its tokens
    count against the run: the usage the response reported (streamed, as the runtime calls
    the model when the run has a live stream); without a stream the SDK raises before the
    usage can be read, so the call is counted as an estimate (an upper bound)."""
    if not streamed:  # a runtime without a live stream
        monkeypatch.setattr(Runtime, "live", property(lambda self: None))
    model = OpenAIResponsesModel(MODEL, openai_client=client)
    rt.agents.register(Agent(name="cut", model=model))
    cut = Turn(text="It left on", input_tokens=40, output_tokens=16, incomplete="max_output_tokens")
    fake.then(cut)
    run, dispatch = rt.submit("cut", "Where is A-7?")
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    if not streamed and done.status is RunStatus.SUCCEEDED:
        # Releases before 0.21 (the oldest supported, 0.20) hand a non-streamed incomplete
        # response to the agent as an answer instead of raising: a step like any other, its
        # usage recorded with it.
        import agents

        assert agents.__version__.startswith("0.20"), agents.__version__
        assert (done.tokens_used, fake.billed_tokens) == (56, 56)
        return
    assert done.status is RunStatus.FAILED
    assert "incomplete" in (done.error or "")
    [step] = [s for s in rt.store.steps(run.id) if s.step_key == "model:0"]
    assert step.status is StepStatus.ERROR
    assert fake.billed_tokens == 56
    if streamed:
        assert step.usage == Usage(40, 16)
        assert step.cost_usd > 0
        assert (done.tokens_used, done.unrecorded_tokens) == (56, 0)
    else:
        assert done.unrecorded_estimated_tokens == done.unrecorded_tokens >= 56
        assert done.unrecorded_cost_usd > 0


PRICES = {
    MODEL: {"input": 2, "output": 8, "cache_write": 0, "cache_read": 0.5},
    "gpt-inner": {"input": 0.4, "output": 1.6, "cache_write": 0, "cache_read": 0.1},
    "gpt-closer": {"input": 1, "output": 4, "cache_write": 0, "cache_read": 0.25},
    "claude-opus-4": {"input": 15, "output": 75, "cache_write": 18.75, "cache_read": 1.5},
}


def test_runs_inside_tools_and_handed_off_agents_are_billed_as_their_models(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI
) -> None:
    """``agent.as_tool`` and a plain ``Runner.run`` inside a function tool: their model calls
    are the tool's work (no steps of their own) and count with the tool's step, priced as the
    nested agent's model; a handed-off agent's calls are steps of their own, priced as its
    model. The run's tokens and cost are what the fake billed."""
    rt.pricing = type(rt.pricing).from_json(json.dumps(PRICES))
    inner = OpenAIResponsesModel("gpt-inner", openai_client=client)
    researcher = Agent(name="researcher", instructions="Research.", model=inner)
    summariser = Agent(name="summariser", instructions="Summarise.", model=inner)

    @function_tool
    async def summarise(text: str) -> str:
        """Summarise a text."""
        result = await Runner.run(summariser, text)
        return str(result.final_output)

    closer = Agent(
        name="closer",
        instructions="Close.",
        model=OpenAIResponsesModel("gpt-closer", openai_client=client),
    )
    desk = Agent(
        name="research-desk",
        instructions="Help.",
        model=OpenAIResponsesModel(MODEL, openai_client=client),
        tools=[researcher.as_tool("research", "Research a topic."), summarise],
        handoffs=[closer],
    )
    rt.agents.register(desk)
    fake.then_calls(("call_r", "research", {"input": "tides"}))
    fake.then_text("Tides rise twice a day.", input_tokens=100, output_tokens=30)  # researcher
    fake.then_calls(("call_s", "summarise", {"text": "Tides rise twice a day."}))
    fake.then_text("Twice daily.", input_tokens=50, output_tokens=10, cached_tokens=20)
    fake.then_calls(("call_h", "transfer_to_closer", {}))
    fake.then_text("Tides: twice daily.", input_tokens=40, output_tokens=8)  # closer

    run, dispatch = rt.submit("research-desk", "Tell me about tides.")
    drive_to_end(rt.driver(), dispatch)

    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "Tides: twice daily."
    steps = rt.store.steps(run.id)
    assert [s.step_key for s in steps] == [
        "agent:0",
        "model:0",
        "tool.research:0",
        "tool.research:0/usage:0",
        "model:1",
        "tool.summarise:0",
        "tool.summarise:0/usage:0",
        "model:2",
        "handoff.closer:0",
        "model:3",
    ]
    rows = {s.step_key: s for s in steps}
    assert fake.calls == 6
    assert done.tokens_used == fake.billed_tokens == 15 * 3 + 130 + 60 + 48
    assert (rows["tool.research:0/usage:0"].model, rows["tool.research:0/usage:0"].usage) == (
        "gpt-inner",
        Usage(100, 30),
    )
    assert rows["tool.summarise:0/usage:0"].usage == Usage(30, 10, 0, 20), "cache reads apart"
    assert (rows["model:3"].model, rows["model:3"].usage) == ("gpt-closer", Usage(40, 8))
    billed = {k: s for k, s in rows.items() if s.usage.total}
    assert done.cost_usd == sum(rt.pricing.cost(str(s.model), s.usage) for s in billed.values())
    assert rows["model:3"].cost_usd == rt.pricing.cost("gpt-closer", Usage(40, 8))
    assert rows["tool.research:0/usage:0"].cost_usd == rt.pricing.cost("gpt-inner", Usage(100, 30))


def test_the_runs_tool_calls_outputs_and_handoffs_reach_its_event_stream(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI, tmp_path: Path
) -> None:
    """What ``Runner.run_streamed``'s ``StreamEvent``s tell (the agent changing, a tool
    called, its output, a handoff), read from ``GET /api/runs/{id}/events``: each once, in the
    order they happened, although the SDK's code replays on every task; among the steps'
    durable events (a tool's call after the model step that asked for it)."""
    model = OpenAIResponsesModel(MODEL, openai_client=client)
    rt.agents.register(desk(model, Ledger(tmp_path / "ledger.jsonl")))
    script(fake)
    run, dispatch = rt.submit("desk", "Where is A-7? Note that they asked.")
    drive_to_end(rt.driver(), dispatch)
    assert rt.store.get_run(run.id).status is RunStatus.SUCCEEDED

    events = events_over_http(rt, run.id)
    told = [
        (e.name, e.data.get("agent") or e.data.get("from"), e.data.get("tool") or e.data.get("to"))
        for e in events
        if e.name.startswith("agent.")
    ]
    assert told == [
        ("agent.updated", "desk", None),
        ("agent.tool_called", "desk", "lookup"),
        ("agent.tool_called", "desk", "carrier"),
        ("agent.tool_output", "desk", "lookup"),
        ("agent.tool_output", "desk", "carrier"),
        ("agent.tool_called", "desk", "add_note"),
        ("agent.tool_output", "desk", "add_note"),
        ("agent.handoff", "desk", "closer"),
        ("agent.updated", "closer", None),
    ], told
    called = next(e for e in events if e.name == "agent.tool_called")
    assert called.data["arguments"] == {"order": "A-7"}
    assert called.data["callId"] == "call_a"
    output = next(e for e in events if e.name == "agent.tool_output")
    assert output.data["output"] == "A-7 shipped"
    names = [e.name for e in events]
    model_done = next(
        i for i, e in enumerate(events) if e.name == "step.finished" and e.data["key"] == "model:0"
    )
    assert names.index("agent.tool_called") > model_done, "after the step that asked for it"
    assert len({e.id for e in events}) == len(events)


def test_a_429_parks_the_sdk_run_on_a_timer_and_it_goes_on_when_due(
    rt: Runtime, fake: FakeOpenAiApi, client: AsyncOpenAI
) -> None:
    """The SDK's model call is refused 429 (its client's retries off): the step is not
    recorded as failed; the run waits on a durable timer for the retry-after; when due, the
    call is made again and the run ends as if nothing happened, the refusal not billed."""
    rt.agents.register(
        Agent(
            name="patient",
            instructions="Answer.",
            model=OpenAIResponsesModel(MODEL, openai_client=client),
        )
    )
    fake.then(Turn(status=429, retry_after=2))
    fake.then_text("here you are")
    run, dispatch = rt.submit("patient", "hello")
    outcomes = drive_to_end(rt.driver(), dispatch)
    waiting = rt.store.get_run(run.id)
    assert waiting.status is RunStatus.RUNNING, waiting.error
    assert "429" in (waiting.wait_reason or ""), waiting.wait_reason
    assert [s.step_key for s in rt.store.steps(run.id)] == ["agent:0"], "nothing failed"
    assert outcomes

    time.sleep(2.5)
    due = rt.store.get_run(run.id)
    drive_to_end(rt.driver(), Dispatch(run.id, due.dispatch_token))
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.result == "here you are"
    assert fake.calls == 2
    assert done.tokens_used == fake.billed_tokens == 15, "the refusal was not billed"
