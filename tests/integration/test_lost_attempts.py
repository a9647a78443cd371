"""Model attempts the API bills but no response brings back (issue 23, defect 8): the fake
Messages API bills them as the real one does, and the run counts them as unrecorded tokens.

* an attempt abandoned at its time limit that completes later in its pool thread;
* a stream cut mid-way: billed its input (``message_start``) and the output so far.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import pytest

from db.records import RunStatus, Usage
from runtime.admission.flow_control import Grant
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.anthropic import AnthropicClient
from runtime.llm.base import LlmError, LlmRequest
from runtime.llm.billing import metering
from runtime.llm.retry import TimeLimitedLlmClient
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import tool
from tests.fakes.messages_api import (
    FakeMessagesApi,
    Reply,
    count_input_tokens,
    cut,
    error,
    slow,
    text,
    tool_uses,
    wait_until,
)
from tests.support import drive_to_end, pointed_at, register_agent, submit

MODEL = "claude-test-model"
PRICES = {"claude-test": {"input": 3, "output": 15}}
REQUEST = LlmRequest(MODEL, 64, [{"role": "user", "content": "hello"}])
USAGE = {"input_tokens": 40, "output_tokens": 20}


@pytest.fixture
def fake() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi() as api:
        yield api


def _meter() -> tuple[list[tuple[Usage, str, str]], object]:
    seen: list[tuple[Usage, str, str]] = []

    def meter(usage: Usage, model: str, why: str) -> None:
        seen.append((usage, model, why))

    return seen, meter


# -- the fake bills as the real API does -------------------------------------------------------


def test_the_fake_bills_an_answer_whose_client_has_gone(fake: FakeMessagesApi) -> None:
    fake.then(slow(text("a long answer " * 5, usage=USAGE), chunk=8, interval=0.1))
    raw = fake.url + "/v1/messages"
    with httpx2.stream("POST", raw, json=REQUEST.to_json()) as response:
        assert response.status_code == 200  # then hang up, the body unread
    assert wait_until(lambda: len(fake.billed) == 1)
    billed = fake.billed[0]
    assert billed.complete
    assert (billed.output_tokens, billed.total) == (20, billed.input_tokens + 20)


def test_the_fake_bills_a_cut_stream_its_input_and_the_output_so_far(
    fake: FakeMessagesApi,
) -> None:
    answer = "x" * 80  # 20 text deltas of 4 characters
    fake.then(cut(text(answer, usage=USAGE), 7))  # message_start, block start, 5 deltas
    with AnthropicClient(api_key="k", base_url=fake.url) as client, pytest.raises(LlmError):
        client.send(REQUEST)
    assert wait_until(lambda: len(fake.billed) == 1)
    billed = fake.billed[0]
    assert not billed.complete
    assert billed.output_tokens == 5  # 5 of 20 deltas sent: a quarter of 20 tokens
    assert billed.input_tokens > 0


def test_the_fake_bills_no_error_and_no_refusal(fake: FakeMessagesApi) -> None:
    fake.then(error(529), error(400), text(usage=USAGE))
    with AnthropicClient(api_key="k", base_url=fake.url) as client:
        for _ in range(2):
            with pytest.raises(LlmError):
                client.send(REQUEST)
        client.send(REQUEST)
    assert [b.number for b in fake.billed] == [3]


# -- the client reports what is billed and lost -------------------------------------------------


def test_a_cut_stream_reports_what_message_start_billed(fake: FakeMessagesApi) -> None:
    fake.then(cut(text("y" * 80, usage=USAGE), 7))
    seen, meter = _meter()
    with (
        AnthropicClient(api_key="k", base_url=fake.url) as client,
        metering(meter),  # type: ignore[arg-type]
        pytest.raises(LlmError),
    ):
        client.send(REQUEST)
    assert len(seen) == 1
    usage, model, why = seen[0]
    billed = fake.billed[0]
    assert (usage.input_tokens, model) == (billed.input_tokens, MODEL)
    assert "cut" in why
    # the client knows the output message_start reported (1), not the output generated:
    # what it records misses at most the answer's output tokens
    assert 0 < billed.total - usage.total <= USAGE["output_tokens"]


def test_an_attempt_abandoned_at_its_time_limit_is_reported_when_it_completes(
    fake: FakeMessagesApi,
) -> None:
    fake.then(slow(text("z" * 40, usage=USAGE), chunk=4, interval=0.1))  # ~1 s of stream
    seen, meter = _meter()
    with AnthropicClient(api_key="k", base_url=fake.url, timeout_seconds=10) as http:
        client = TimeLimitedLlmClient(http, 0.3)
        with metering(meter), pytest.raises(LlmError, match="exceeded"):  # type: ignore[arg-type]
            client.send(REQUEST)
        assert seen == []  # not yet: the attempt is still running
        assert wait_until(lambda: len(seen) == 1, timeout=15)
    usage, _, why = seen[0]
    assert wait_until(lambda: len(fake.billed) == 1)  # the fake bills after its last write
    assert usage.total == fake.billed[0].total
    assert "time limit" in why


# -- the run counts them --------------------------------------------------------------------


@pytest.fixture
def claude(settings: Settings, fake: FakeMessagesApi) -> Iterator[Runtime]:
    s = pointed_at(
        settings,
        fake,
        model_timeout_seconds=1,
        long_wait_seconds=5,
        prices_json=json.dumps(PRICES),
    )
    rt = Runtime.build(s, pool_size=5)
    try:
        yield rt
    finally:
        rt.close()


def test_a_run_counts_the_attempt_it_abandoned_and_the_stream_it_lost(
    claude: Runtime, fake: FakeMessagesApi
) -> None:
    fake.then(
        slow(text("late " * 10, usage=USAGE), chunk=4, interval=0.1),  # ~1.5 s: abandoned
        cut(text("w" * 80, usage=USAGE), 7),  # cut: its input and 5 of 20 output billed
        text("done", usage={"input_tokens": 30, "output_tokens": 3}),
    )
    register_agent(claude.agents)
    run, dispatch = submit(claude.store, model=MODEL)
    drive_to_end(claude.driver(), dispatch)
    done = claude.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error

    def counted() -> bool:
        return claude.store.get_run(run.id).unrecorded_tokens >= fake.billed_tokens - 33 - 19

    assert wait_until(counted, timeout=15), (claude.store.get_run(run.id), fake.billed)
    time.sleep(0.2)
    done = claude.store.get_run(run.id)
    billed = fake.billed_tokens
    assert done.tokens_used == 33
    # everything billed is recorded, but the cut stream's output after message_start
    missing = billed - done.tokens_used - done.unrecorded_tokens
    assert 0 <= missing <= USAGE["output_tokens"], (billed, done)
    assert done.unrecorded_cost_usd > 0


# -- a call lost with its worker is counted: an estimate, settled by the next admission --------


def _died_in_a_call(rt: Runtime, run_id: object, model: str = MODEL) -> tuple[Usage, Grant]:
    """What a worker killed mid-call leaves: its admission, never settled."""
    flow = rt.flow_control()
    assert flow is not None
    grant = flow.admit(model, 300, 64, waiter=str(run_id), run=str(run_id))
    assert isinstance(grant, Grant)
    assert grant.lost is None
    return Usage(input_tokens=300, output_tokens=64), grant


def test_a_call_lost_with_its_worker_is_counted_as_an_estimate(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    register_agent(runtime.agents)
    llm.then_text("done", 20, 2)
    run, dispatch = submit(runtime.store, model=MODEL)
    estimate, _ = _died_in_a_call(runtime, run.id)
    outcomes = drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert Outcome.WAITING not in outcomes  # within the budget: the same claim goes on
    assert (done.unrecorded_tokens, done.unrecorded_estimated_tokens) == (estimate.total,) * 2
    assert done.tokens_used == 22
    assert len(llm.requests) == 1


def test_a_budget_is_not_crossed_because_a_call_was_lost(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store, model=MODEL, token_budget=300)
    _died_in_a_call(runtime, run.id)  # 364 tokens, estimated: past the budget
    drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.FAILED
    assert "token budget exhausted" in (done.error or "")
    assert llm.requests == []  # no call made once the lost one was counted


def test_a_worker_fenced_out_mid_call_replaces_the_estimate_with_the_real_usage(
    runtime: Runtime,
) -> None:
    """Worker A's call outlived its lease; the run's next admission (worker B) counted it as
    lost; then A's answer arrives: its settle learns the estimate was charged, and A's
    refused checkpoint records the real usage in its place."""
    flow = runtime.flow_control()
    assert flow is not None
    run, _ = submit(runtime.store, model=MODEL)
    estimate, a_grant = _died_in_a_call(runtime, run.id)
    b_grant = flow.admit(MODEL, 100, 64, waiter=str(run.id), run=str(run.id))
    assert isinstance(b_grant, Grant)
    assert b_grant.lost == estimate
    assert flow.settle(a_grant, 250, 9) == estimate  # A: already counted as lost
    assert flow.settle(b_grant, 90, 5) is None
    assert flow.admit(MODEL, 100, 64, waiter=str(run.id), run=str(run.id)).lost is None  # type: ignore[union-attr]


def test_an_answer_owed_by_its_worker_keeps_the_call_record_until_it_is_written(
    runtime: Runtime,
) -> None:
    """The answered call's checkpoint could not be written (the database away past the
    lease): its usage is owed in the worker's memory, and its settle keeps the call's record
    (``keep_record``), to be erased once the usage is written. A worker killed while it owes
    leaves the record, and the run's next admission counts the call as lost: billed tokens
    are never lost with the worker."""
    flow = runtime.flow_control()
    assert flow is not None
    run, _ = submit(runtime.store, model=MODEL)
    estimate, a_grant = _died_in_a_call(runtime, run.id)
    assert flow.settle(a_grant, 250, 9, keep_record=True) is None  # A owes it, then dies
    b_grant = flow.admit(MODEL, 100, 64, waiter=str(run.id), run=str(run.id))
    assert isinstance(b_grant, Grant)
    assert b_grant.lost == estimate, "the owed call is still covered by its estimate"


def test_a_lost_call_that_brings_the_run_to_its_budget_exactly_ends_it_before_the_next(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    """A budget is exhausted at its limit, not past it: the estimate of a lost call that
    makes the run's spend equal its budget ends the run before one more call is made."""
    register_agent(runtime.agents)
    llm.then_text("done", 20, 2)
    run, dispatch = submit(runtime.store, model=MODEL, token_budget=364)
    estimate, _ = _died_in_a_call(runtime, run.id)
    assert estimate.total == 364
    drive_to_end(runtime.driver(), dispatch)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.FAILED
    assert "token budget exhausted" in (done.error or "")
    assert llm.requests == [], "no call made once the spend reached the budget"


@tool(idempotent=True)
def look(topic: str) -> str:
    """Look a topic up."""
    return f"{topic}: " + "a finding, " * 40


def test_a_lost_calls_estimate_covers_it(
    claude: Runtime, fake: FakeMessagesApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call lost with its worker (answered, billed, the worker killed before its
    checkpoint) is counted as its estimate: its input estimated high from the request, its
    output at ``max_tokens``: an upper bound of what the call was billed."""
    import runtime.pipeline.modelcall as modelcall_module
    from tests.support import SimulatedCrash, expire_lease

    def billed_as_sent(output_tokens: int) -> Callable[[dict[str, Any]], Reply]:
        def reply(body: dict[str, Any]) -> Reply:
            usage = {"input_tokens": count_input_tokens(body), "output_tokens": output_tokens}
            if len(body["messages"]) == 1:
                return tool_uses([("toolu_1", "look", {"topic": "acme"})], usage=usage)
            return text("acme: two findings, " * 8, usage=usage)

        return reply

    fake.default_responder = billed_as_sent(60)
    register_agent(claude.agents, look)
    run, dispatch = submit(claude.store, model=MODEL)
    answers = 0

    def crash(name: str) -> None:
        nonlocal answers
        if name == "after_model_response":
            answers += 1
            if answers == 2:  # the second answer arrived; the worker dies before recording it
                raise SimulatedCrash

    with monkeypatch.context() as m:
        m.setattr(modelcall_module, "crash_point", crash)
        with pytest.raises(SimulatedCrash):
            drive_to_end(claude.driver(worker="worker-A"), dispatch)
    lost = fake.billed[-1]
    expire_lease(claude.engine, run.id)
    (again,) = claude.store.redispatch_due(redispatch_after=3600)
    drive_to_end(claude.driver(worker="worker-B"), again)
    done = claude.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    estimated = done.unrecorded_estimated_tokens
    print(
        f"lost call billed {lost.input_tokens} in + {lost.output_tokens} out = {lost.total}; "
        f"estimated {estimated} ({estimated / lost.total:.1f}x)"
    )
    assert estimated >= lost.total, "the estimate covers the lost call"
    assert estimated >= claude.settings.max_tokens, "its output at max_tokens: an upper bound"
    assert done.tokens_used + done.unrecorded_tokens >= fake.billed_tokens


def test_a_worker_that_wakes_up_fenced_out_does_not_count_the_new_holders_call_as_lost(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker A is stopped (SIGSTOP, a long pause) after its claim, before its model call's
    admission; its lease lapses and worker B takes the run over and calls the model. A
    wakes up: its admission finds B's call in flight, written under a newer lease. That
    call is not lost (its worker is alive and will record it): A learns it was taken over
    and stops, counting no estimate and making no call of its own."""
    import threading

    import runtime.pipeline.modelcall as modelcall_module
    from db.errors import LeaseLost
    from runtime.llm.base import LlmResponse
    from tests.support import expire_lease

    register_agent(runtime.agents)
    run, dispatch = submit(runtime.store, model=MODEL)
    b_calling, b_go = threading.Event(), threading.Event()
    answered: list[str] = []

    class TwoWorkers:
        def send(self, request: LlmRequest) -> LlmResponse:
            who = threading.current_thread().name
            if who == "worker-B":
                b_calling.set()
                assert b_go.wait(10)
            answered.append(who)
            usage = Usage(20, 2) if who == "worker-B" else Usage(30, 3)
            return LlmResponse([{"type": "text", "text": f"from {who}"}], "end_turn", usage, MODEL)

    monkeypatch.setattr(runtime, "llm", TwoWorkers())
    real = modelcall_module.share_tree_budget
    b_thread: list[threading.Thread] = []

    def a_stops_here(task: Any, *args: Any) -> Any:
        monkeypatch.setattr(modelcall_module, "share_tree_budget", real)  # A's call only
        expire_lease(runtime.engine, run.id)
        (again,) = runtime.store.redispatch_due(redispatch_after=3600)
        worker_b = runtime.driver(worker="worker-B")
        t = threading.Thread(
            target=lambda: worker_b.drive(again.run_id, again.token), name="worker-B"
        )
        t.start()
        b_thread.append(t)
        assert b_calling.wait(10), "B's call is in flight"
        return real(task, *args)

    monkeypatch.setattr(modelcall_module, "share_tree_budget", a_stops_here)
    with pytest.raises(LeaseLost):
        runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    b_go.set()
    b_thread[0].join(10)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    billed = sum(22 if who == "worker-B" else 33 for who in answered)
    assert done.unrecorded_estimated_tokens == 0, "B's call was not lost"
    assert done.tokens_used + done.unrecorded_tokens == billed
    assert answered == ["worker-B"], "A, taken over, made no call"


def test_a_worker_dying_between_the_answer_and_its_checkpoint_leaves_its_estimate(
    runtime: Runtime, llm: ScriptedLlm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer arrived and its admission was settled, but the worker died before the
    checkpoint: the call record stays until the answer is recorded, so the next admission
    counts the call (the window a kill -9 after the response hits)."""
    import runtime.pipeline.modelcall as modelcall_module
    from tests.support import SimulatedCrash, expire_lease

    register_agent(runtime.agents)
    llm.then_text("lost", 20, 2).then_text("done", 20, 2)
    run, dispatch = submit(runtime.store, model=MODEL)

    def crash(name: str) -> None:
        if name == "after_model_response":
            raise SimulatedCrash

    with monkeypatch.context() as m:
        m.setattr(modelcall_module, "crash_point", crash)
        with pytest.raises(SimulatedCrash):
            runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    expire_lease(runtime.engine, run.id)
    (again,) = runtime.store.redispatch_due(redispatch_after=3600)
    drive_to_end(runtime.driver(worker="worker-B"), again)
    done = runtime.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert done.unrecorded_estimated_tokens > 0
    assert done.unrecorded_tokens == done.unrecorded_estimated_tokens >= 22  # covers the lost
    assert done.tokens_used == 22
