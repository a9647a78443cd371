"""Sub-agents as tools of the agent loop, on real PostgreSQL through the real SDK and the fake
Messages API: the model calls a sub-agent, which starts a child run (``parentRunId``); the
parent waits parked (no lease) and gets the child's result or error as the tool's result;
the calls of one turn start together and run side by side; a parent crash never starts the
same child twice; cancelling the parent cancels its children; the children's cost counts
against the parent's budget, which the whole tree shares: its total passes the budget by at
most one step, however many children work at once, and a call lost with its worker does not
wedge the tree."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from decimal import Decimal
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import text as sql

import api
from db.queries import QUERIES
from db.records import Dispatch, NewRun, Run, RunStatus, StepKind, StepStatus, Usage
from db.store import RunStore
from runtime.agents import Agent, AgentConfigError, AgentRegistry, Subagent
from runtime.config import Settings
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Driver, Outcome, StepResult
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import tool
from tests.fakes.messages_api import (
    FakeMessagesApi,
    Reply,
    count_input_tokens,
    error,
    message,
    text,
    tool_uses,
)
from tests.support import expire_lease, fork_over_http, submit

MODEL = "claude-test-model"
STEP_TOKENS = 300  # every model call of these tests: 250 in, 50 out


@tool(idempotent=True)
def dig(topic: str) -> str:
    """Dig further into a topic."""
    return f"more about {topic}"


def usage() -> dict[str, int]:
    return {"input_tokens": 250, "output_tokens": 50}


def responder(body: dict[str, Any]) -> Reply:
    """Each agent by its system prompt: the lead hands two tasks to researchers, then sums up;
    a researcher answers (or, as ``digger``, keeps calling a tool until stopped)."""
    system = body["system"][0]["text"] if body.get("system") else ""
    last = body["messages"][-1]
    results = [b for b in last["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]
    if system == "lead":
        if results:
            summary = " | ".join(str(r["content"]) for r in results)
            return text(f"summary: {summary}", usage=usage())
        calls = [
            ("toolu_a", "researcher", {"task": "acme"}),
            ("toolu_b", "researcher", {"task": "globex"}),
        ]
        return message(
            [{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls],
            "tool_use",
            usage=usage(),
        )
    if system == "failing":
        return error(400, "the fake refuses this sub-agent")
    if system == "digger":
        n = len(body["messages"])
        return tool_uses([(f"toolu_d{n}", "dig", {"topic": "x"})], usage=usage())
    if system == "crowd":  # four diggers at once, then a summary
        if results:
            return text("summary", usage=usage())
        calls = [(f"toolu_c{i}", "digger", {"task": f"topic {i}"}) for i in range(4)]
        return tool_uses(calls, usage=usage())
    if system == "crowd-of-loopers":  # three durable sub-agents at once, then a summary
        if results:
            return text("summary", usage=usage())
        calls = [(f"toolu_l{i}", "looper", {"task": f"topic {i}"}) for i in range(3)]
        return tool_uses(calls, usage=usage())
    if system == "looper":  # a durable function's steps.llm, slow, billed for what was sent
        time.sleep(0.15)
        real = {"input_tokens": count_input_tokens(body), "output_tokens": 50}
        return text("more", usage=real)
    if system == "slow-digger":  # overlapping calls, billed for what was sent (~4 chars/token)
        with IN_FLIGHT.lock:
            IN_FLIGHT.now += 1
            IN_FLIGHT.most = max(IN_FLIGHT.most, IN_FLIGHT.now)
        try:
            time.sleep(0.15)
        finally:
            with IN_FLIGHT.lock:
                IN_FLIGHT.now -= 1
        n = len(body["messages"])
        real = {"input_tokens": count_input_tokens(body), "output_tokens": 50}
        return tool_uses([(f"toolu_d{n}", "dig", {"topic": "x"})], usage=real)
    if system in ("top", "middle"):  # three levels: top -> middle -> researcher
        if results:
            return text(f"{system}: done", usage=usage())
        below = "middle" if system == "top" else "researcher"
        return tool_uses([(f"toolu_{system}", below, {"task": "acme"})], usage=usage())
    task = body["messages"][0]["content"]
    return text(f"{task}: 2 overdue", usage=usage())


class _InFlight:
    """How many calls the fake was answering at once (the most, for the side-by-side test)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0


IN_FLIGHT = _InFlight()


@pytest.fixture
def fake() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi(default_responder=responder) as api_:
        yield api_


def build(
    settings: Settings,
    fake: FakeMessagesApi,
    child_prompt: str = "researcher",
    extra: tuple[Agent, ...] = (),
) -> Runtime:
    s = replace(
        settings,
        anthropic_api_key="test-key",
        anthropic_base_url=fake.url,
        model_timeout_seconds=10,
        started_row_after_seconds=0,
    )
    rt = Runtime.build(s, pool_size=5)
    rt.agents.register(Agent("lead", "lead", max_tokens=100, subagents=(Subagent("researcher"),)))
    rt.agents.register(Agent("researcher", child_prompt, max_tokens=100, tools=(dig,)))
    for agent in extra:
        rt.agents.register(agent)
    rt.agents.finalize()
    return rt


@pytest.fixture
def rt(settings: Settings, fake: FakeMessagesApi) -> Iterator[Runtime]:
    runtime = build(settings, fake)
    try:
        yield runtime
    finally:
        runtime.close()


@pytest.fixture
def client(rt: Runtime) -> FlaskClient:
    app: Flask = api.create_app(runtime=rt)
    app.config["TESTING"] = True
    return app.test_client()


def drive_tree(rt: Runtime, first: Dispatch, *, limit: int = 300) -> list[uuid.UUID]:
    """Drive every run the messages reach, one step at a time, round robin (children's
    steps interleave: they run side by side), as workers would. Returns the runs driven,
    in order."""
    driver = rt.driver()
    queue = [first]
    order: list[uuid.UUID] = []
    for _ in range(limit):
        if not queue:
            return order
        d = queue.pop(0)
        result = driver.drive(d.run_id, d.token)
        order.append(d.run_id)
        if result.dispatch is not None and result.outcome is not Outcome.WAITING:
            queue.append(result.dispatch)
        queue += result.wakes
    raise AssertionError("the tree did not settle")


def drive_side_by_side(rt: Runtime, first: Dispatch, *, workers: int = 4) -> None:
    """Drive every run the messages reach on ``workers`` threads, as a fleet would: the
    steps of different runs overlap in time. A durable timer's message is sent after its
    delay; a parked parent's fallback timer is left to the wakes."""
    local = threading.local()

    def drive(d: Dispatch) -> list[Dispatch]:
        if d.delay_seconds:
            time.sleep(d.delay_seconds)
        if not hasattr(local, "driver"):
            local.driver = rt.driver()
        result = local.driver.drive(d.run_id, d.token)
        nxt = list(result.wakes)
        if result.dispatch is not None and result.dispatch.delay_seconds <= 5:
            nxt.append(result.dispatch)
        return nxt

    deadline = time.monotonic() + 120
    with ThreadPoolExecutor(workers) as pool:
        running: set[Future[list[Dispatch]]] = {pool.submit(drive, first)}
        while running:
            assert time.monotonic() < deadline, "the tree did not settle"
            done, running = wait(running, timeout=10, return_when=FIRST_COMPLETED)
            for f in done:
                running |= {pool.submit(drive, d) for d in f.result()}


def start_two_children(rt: Runtime) -> tuple[Run, Driver, StepResult]:
    """The lead asked about two customers, driven until it has started its two sub-agents:
    the lead's run, the driver, and what the starting step returned (a wake per child)."""
    run, dispatch = submit(rt.store, "Overdue tickets of acme and globex?", agent="lead")
    driver = rt.driver()
    first = driver.drive(run.id, dispatch.token)
    assert first.dispatch is not None
    return run, driver, driver.drive(run.id, first.dispatch.token)


def holds(rt: Runtime) -> list[Any]:
    with rt.engine.connect() as conn:
        return list(conn.execute(sql("SELECT run_id, lease_epoch, tokens FROM budget_hold")))


def children(rt: Runtime, run_id: uuid.UUID) -> list[Any]:
    with rt.engine.connect() as conn:
        return list(
            conn.execute(
                sql(
                    "SELECT id, status, agent, input, token_budget, tokens_used, "
                    "unrecorded_tokens FROM run WHERE parent_run_id = :id "
                    "ORDER BY created_at, input::text"
                ),
                {"id": run_id},
            )
        )


def test_sub_agents_run_as_children_side_by_side_and_answer_the_tool(
    rt: Runtime, client: FlaskClient, fake: FakeMessagesApi
) -> None:
    run, dispatch = submit(rt.store, "Overdue tickets of acme and globex?", agent="lead")
    order = drive_tree(rt, dispatch)
    done = rt.store.get_run(run.id)
    assert (done.status, done.result) == (
        RunStatus.SUCCEEDED,
        "summary: acme: 2 overdue | globex: 2 overdue",
    )
    kids = children(rt, run.id)
    assert [(k.agent, json.loads(json.dumps(k.input)), k.status) for k in kids] == [
        ("researcher", "acme", "SUCCEEDED"),
        ("researcher", "globex", "SUCCEEDED"),
    ]
    # Started together, in one step, each with half of what the lead had left.
    assert [k.token_budget for k in kids] == [(run.token_budget - STEP_TOKENS) // 2] * 2
    first_child_step = min(order.index(k.id) for k in kids)
    assert order[first_child_step + 1] in {k.id for k in kids}, "they ran side by side"
    steps = rt.store.steps(run.id)
    assert [(s.kind, s.step_key, s.status) for s in steps] == [
        (StepKind.MODEL, "model:1", StepStatus.DONE),
        (StepKind.CHILD, "tool:toolu_a", StepStatus.DONE),
        (StepKind.CHILD, "tool:toolu_b", StepStatus.DONE),
        (StepKind.MODEL, "model:2", StepStatus.DONE),
    ]
    # The children's tokens count against the lead: its own two calls and theirs.
    assert done.tokens_used == 4 * STEP_TOKENS
    assert sum(k.tokens_used for k in kids) == 2 * STEP_TOKENS
    assert fake.calls == 4
    shown = client.get(f"/api/runs/{run.id}").get_json()
    assert {c["id"] for c in shown["children"]} == {str(k.id) for k in kids}
    child = client.get(f"/api/runs/{kids[0].id}").get_json()
    assert child["parentRunId"] == str(run.id)
    timeline = client.get(f"/api/runs/{run.id}/timeline").get_json()
    linked = {t["toolUseId"]: t.get("childRunId") for t in timeline if t["kind"] == "CHILD"}
    assert linked == {"toolu_a": str(kids[0].id), "toolu_b": str(kids[1].id)}


class Crash(BaseException):
    """The worker dies (nothing in the engine catches a BaseException)."""


def test_a_parent_crash_after_starting_its_children_never_starts_them_twice(
    rt: Runtime, fake: FakeMessagesApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, dispatch = submit(rt.store, "Overdue tickets of acme and globex?", agent="lead")
    original = RunStore.start_children

    def commits_then_dies(self: RunStore, *args: Any, **kwargs: Any) -> Any:
        original(self, *args, **kwargs)  # committed: the children exist with their rows
        raise Crash()

    monkeypatch.setattr(RunStore, "start_children", commits_then_dies)
    driver = rt.driver()
    first = driver.drive(run.id, dispatch.token)
    assert first.outcome is Outcome.CONTINUE
    assert first.dispatch is not None
    with pytest.raises(Crash):  # the children's first messages are never sent
        driver.drive(run.id, first.dispatch.token)
    monkeypatch.undo()
    assert len(children(rt, run.id)) == 2
    # The parent's record is committed: it waits parked (no lease). The reaper finds the
    # children's lost first messages; each child that ends wakes the parent.
    parked = rt.store.get_run(run.id)
    assert parked.locked_by is None
    assert parked.wait_reason is not None
    assert "waiting for sub-agents" in parked.wait_reason
    expire_lease(rt.engine, run.id)
    due = rt.store.redispatch_due(redispatch_after=0)
    assert {d.run_id for d in due} == {k.id for k in children(rt, run.id)}
    for d in due:
        drive_tree(rt, d)
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert len(children(rt, run.id)) == 2, "never started twice"
    child_calls = [b for b in fake.bodies() if b["system"][0]["text"] == "researcher"]
    assert len(child_calls) == 2


def test_cancelling_the_parent_cancels_its_children(rt: Runtime, client: FlaskClient) -> None:
    run, driver, started = start_two_children(rt)
    assert started.outcome is Outcome.WAITING
    assert len(started.wakes) == 2
    parked = rt.store.get_run(run.id)
    assert parked.locked_by is None, "the parent waits holding no lease"
    assert client.post(f"/api/runs/{run.id}/cancel").status_code == 202
    assert rt.store.get_run(run.id).status is RunStatus.CANCELLED
    assert [k.status for k in children(rt, run.id)] == ["CANCELLED", "CANCELLED"]
    for wake in started.wakes:  # their first messages arrive late: nothing runs
        driver.drive(wake.run_id, wake.token)
    assert [k.tokens_used for k in children(rt, run.id)] == [0, 0]


def test_a_lead_resumed_after_timing_out_is_told_its_sub_agents_were_cancelled_by_its_end(
    rt: Runtime, client: FlaskClient
) -> None:
    """U9 (issue 35), the agent loop's side: the lead's end cancels the sub-agents it waits
    for, and their steps become the tools' results saying so, not rows a resume reads as
    "cancelled by request" from the children it cancelled itself."""
    run, driver, started = start_two_children(rt)
    assert started.outcome is Outcome.WAITING
    with rt.engine.begin() as conn:  # its deadline passes while it waits (test-only SQL)
        conn.execute(
            sql("UPDATE run SET deadline_at = now() - interval '1 second' WHERE id = :id"),
            {"id": run.id},
        )
    rt.store.make_due_now(run.id)
    [due] = [d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id == run.id]
    driver.drive(due.run_id, due.token)
    assert rt.store.get_run(run.id).status is RunStatus.TIMED_OUT
    assert [k.status for k in children(rt, run.id)] == ["CANCELLED", "CANCELLED"]
    rows = [s for s in rt.store.steps(run.id) if s.kind is StepKind.CHILD]
    assert [s.status for s in rows] == [StepStatus.ERROR, StepStatus.ERROR], "none PENDING"

    resumed = client.post(f"/api/runs/{run.id}/resume", json={"timeoutSeconds": 60})
    assert resumed.status_code == 202, resumed.get_data(as_text=True)
    drive_tree(rt, Dispatch(run.id, rt.store.get_run(run.id).dispatch_token))
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    told = str(done.result)
    assert told.count("was cancelled when this run ended early") == 2, told
    assert "cancelled by request" not in told


def test_a_failed_child_is_the_tools_error(settings: Settings, fake: FakeMessagesApi) -> None:
    rt = build(settings, fake, child_prompt="failing")
    try:
        run, dispatch = submit(rt.store, "go", agent="lead")
        drive_tree(rt, dispatch)
        done = rt.store.get_run(run.id)
        assert done.status is RunStatus.SUCCEEDED, done.error
        rows = [s for s in rt.store.steps(run.id) if s.kind is StepKind.CHILD]
        assert [r.status for r in rows] == [StepStatus.ERROR, StepStatus.ERROR]
        assert "ended FAILED" in rows[0].response
        assert done.result.startswith("summary: error: sub-agent 'researcher'")
    finally:
        rt.close()


@pytest.mark.parametrize("strict", [False, True])
def test_the_trees_total_passes_the_budget_by_at_most_one_step(
    settings: Settings, fake: FakeMessagesApi, strict: bool
) -> None:
    """A lead and two children that would call tools for ever, under one budget: the
    children split what the lead has left, and every model call of the tree is admitted
    against the tree's budget, so the tree passes it by at most one step (the one started
    alone), and with DAR_STRICT_BUDGET not at all."""
    rt = build(replace(settings, strict_budget=strict), fake, child_prompt="digger")
    budget = 2000
    try:
        run, dispatch = submit(rt.store, "go", agent="lead", token_budget=budget, max_steps=200)
        drive_tree(rt, dispatch, limit=1000)
        done = rt.store.get_run(run.id)
        kids = children(rt, run.id)
        assert [k.status for k in kids] == ["FAILED", "FAILED"]
        own = sum(s.usage.total for s in rt.store.steps(run.id) if s.kind is StepKind.MODEL)
        tree = own + done.unrecorded_tokens
        tree += sum(k.tokens_used + k.unrecorded_tokens for k in kids)
        billed = fake.billed_tokens
        print(f"strict={strict}: budget {budget}, tree {tree}, billed {billed}")
        assert tree == billed, "every billed token is counted in the tree"
        assert done.tokens_used == tree, "the lead counts its children's tokens"
        assert done.status is RunStatus.FAILED
        assert "budget" in (done.error or "")
        if strict:
            assert tree <= budget
        else:
            assert tree <= budget + STEP_TOKENS, "at most one step over"
            assert tree > budget, "the test reached the bound it checks"
        assert holds(rt) == [], "no call of the tree is held any longer"
    finally:
        rt.close()


def test_children_side_by_side_share_the_budget_and_pass_it_by_one_step_at_most(
    settings: Settings, fake: FakeMessagesApi
) -> None:
    """Four children calling tools for ever on four workers at once, their model calls
    overlapping: each call starts only when the tree's spend, the worst cases of the calls
    in flight and its own fit the lead's budget, or alone; so the tree's total passes the
    budget by at most one step. (Each child stopping at its share, as before, made it
    2,400 here.)"""
    crowd = Agent("crowd", "crowd", max_tokens=100, subagents=(Subagent("digger"),))
    digger = Agent("digger", "slow-digger", max_tokens=100, tools=(dig,))
    rt = build(settings, fake, extra=(crowd, digger))
    budget = 2000
    IN_FLIGHT.most = 0
    try:
        run, dispatch = submit(rt.store, "go", agent="crowd", token_budget=budget, max_steps=200)
        drive_side_by_side(rt, dispatch)
        done = rt.store.get_run(run.id)
        kids = children(rt, run.id)
        assert len(kids) == 4
        assert all(k.status == "FAILED" for k in kids)
        billed = fake.billed_tokens
        biggest = max(c.input_tokens + c.output_tokens for c in fake.billed)
        tree = done.tokens_used
        print(
            f"side by side: budget {budget}, tree {tree}, billed {billed}, "
            f"largest step {biggest}, calls at once {IN_FLIGHT.most}"
        )
        assert IN_FLIGHT.most >= 2, "the children's calls overlapped"
        assert tree == billed, "every billed token is counted in the tree"
        assert done.status is RunStatus.FAILED
        assert tree <= budget + biggest, "at most one step over"
        errors = [rt.store.get_run(k.id).error or "" for k in kids]
        assert any("token budget of the run tree exhausted" in e for e in errors), errors
        assert holds(rt) == []
    finally:
        rt.close()


def test_a_cost_budget_is_shared_down_the_tree_too(
    settings: Settings, fake: FakeMessagesApi
) -> None:
    """The root's costBudgetUsd is the tree's as its token budget is (children have no cost
    budget of their own): four children side by side stop when the tree's cost is spent,
    and the tree passes it by at most one step's cost."""
    crowd = Agent("crowd", "crowd", max_tokens=100, subagents=(Subagent("digger"),))
    digger = Agent("digger", "slow-digger", max_tokens=100, tools=(dig,))
    rt = build(settings, fake, extra=(crowd, digger))
    budget = Decimal("0.006")
    try:
        run, dispatch = submit(
            rt.store,
            "go",
            agent="crowd",
            token_budget=1_000_000,
            cost_budget_usd=budget,
            max_steps=200,
        )
        drive_side_by_side(rt, dispatch)
        done = rt.store.get_run(run.id)
        kids = children(rt, run.id)
        with rt.engine.connect() as conn:
            biggest = conn.execute(
                sql(
                    "SELECT max(cost_usd) FROM run_step WHERE kind = 'MODEL' AND run_id IN "
                    "(SELECT id FROM run WHERE id = :id OR parent_run_id = :id)"
                ),
                {"id": run.id},
            ).scalar_one()
        cost = done.cost_usd + done.unrecorded_cost_usd
        print(f"cost: budget ${budget}, tree ${cost:.6f}, largest step ${biggest:.6f}")
        assert done.status is RunStatus.FAILED
        assert cost <= budget + biggest, "at most one step over"
        assert cost > budget - biggest, "the tree worked up to its budget"
        errors = [rt.store.get_run(k.id).error or "" for k in kids]
        assert any("cost budget of the run tree exhausted" in e for e in errors), errors
        assert holds(rt) == []
    finally:
        rt.close()


@durable_agent("delegates")
def delegates(task: str, steps: Steps) -> Any:
    return steps.child("crowd", task)


def test_a_durable_functions_child_shares_its_budget_with_the_grandchildren(
    settings: Settings, fake: FakeMessagesApi
) -> None:
    """The budget is shared down the whole tree: a durable function hands the work to a
    child (``steps.child``) whose four sub-agents work side by side; the root's budget is
    the tree's, and the tree passes it by at most one step."""
    crowd = Agent("crowd", "crowd", max_tokens=100, subagents=(Subagent("digger"),))
    digger = Agent("digger", "slow-digger", max_tokens=100, tools=(dig,))
    rt = build(settings, fake, extra=(crowd, digger, delegates))
    budget = 2000
    try:
        root, dispatch = submit(rt.store, "go", agent="delegates", token_budget=budget)
        drive_side_by_side(rt, dispatch)
        done = rt.store.get_run(root.id)
        [child] = children(rt, root.id)
        grandchildren = children(rt, child.id)
        assert len(grandchildren) == 4
        biggest = max(c.input_tokens + c.output_tokens for c in fake.billed)
        tree = done.tokens_used
        print(f"durable root: budget {budget}, tree {tree}, billed {fake.billed_tokens}")
        assert tree == fake.billed_tokens, "every billed token reaches the root"
        assert done.status is RunStatus.FAILED, "its child failed on the budget"
        assert tree <= budget + biggest, "at most one step over"
        assert tree > budget - biggest, "the tree worked up to its budget"
        assert holds(rt) == []
    finally:
        rt.close()


@durable_agent("looper")
def looper(task: str, steps: Steps) -> str:
    answer = ""
    for i in range(100):
        prompt = f"{task} {i}: " + "context " * 110  # ~250 tokens a call
        answer = steps.llm("ask", lambda model, p=prompt: model.complete(p, system="looper"))
    return answer


def test_durable_sub_agents_side_by_side_share_the_budget(
    settings: Settings, fake: FakeMessagesApi
) -> None:
    """Sub-agents that are durable functions calling steps.llm in a loop, three at once: a
    call that must wait for the tree's calls in flight pauses its step on a durable timer
    and asks again; the tree passes its budget by at most one step."""
    crowd = Agent("crowd-of-loopers", "crowd-of-loopers", max_tokens=100,
                  subagents=(Subagent("looper"),))  # fmt: skip
    rt = build(replace(settings, max_tokens=100), fake, extra=(crowd, looper))
    budget = 2150  # shares of 616: a looper's third call (~294 tokens each) passes its own
    try:
        run, dispatch = submit(
            rt.store, "go", agent="crowd-of-loopers", token_budget=budget, max_steps=500
        )
        drive_side_by_side(rt, dispatch)
        done = rt.store.get_run(run.id)
        kids = children(rt, run.id)
        assert len(kids) == 3
        biggest = max(c.input_tokens + c.output_tokens for c in fake.billed[1:])
        tree = done.tokens_used
        print(f"durable sub-agents: budget {budget}, tree {tree}, largest step {biggest}")
        assert tree == fake.billed_tokens
        assert done.status is RunStatus.FAILED
        assert tree <= budget + biggest, "at most one step over"
        assert tree > budget - biggest, "the tree worked up to its budget"
        assert holds(rt) == []
    finally:
        rt.close()


def test_a_call_lost_with_its_worker_does_not_wedge_the_tree(
    rt: Runtime, fake: FakeMessagesApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child's worker dies in its model call (a BaseException in the client, nothing
    caught): the call's hold on the tree's budget stays, and its sibling, which does not
    fit beside it, waits on a durable timer. When the lease lapses and the child is taken
    again, the lost call counts as spent, the child calls again alone, and the tree goes
    on to its end with nothing held."""
    run, driver, started = start_two_children(rt)
    a, b = started.wakes
    real_send = rt.llm.send

    def dies(request: Any) -> Any:
        raise Crash()

    monkeypatch.setattr(rt.llm, "send", dies)
    with pytest.raises(Crash):
        driver.drive(a.run_id, a.token)
    monkeypatch.setattr(rt.llm, "send", real_send)
    [(held_run, _epoch, held)] = holds(rt)
    assert held_run == a.run_id
    # The tree's budget now fits the lead's call and one child's, not two.
    with rt.engine.begin() as conn:
        conn.execute(
            sql("UPDATE run SET token_budget = :b WHERE id = :id"),
            {"b": STEP_TOKENS + held + held // 2, "id": run.id},
        )
    waited = driver.drive(b.run_id, b.token)
    assert waited.outcome is Outcome.WAITING
    assert "run tree budget" in (rt.store.get_run(b.run_id).wait_reason or "")
    assert waited.dispatch is not None
    time.sleep(waited.dispatch.delay_seconds)  # the durable timer
    again = driver.drive(b.run_id, waited.dispatch.token)  # still held: waits again
    assert again.outcome is Outcome.WAITING
    assert fake.calls == 1, "only the lead's call was made"
    expire_lease(rt.engine, a.run_id)
    due = rt.store.redispatch_due(redispatch_after=0)
    assert a.run_id in {d.run_id for d in due}
    for d in due:
        drive_tree(rt, d)
    assert again.dispatch is not None
    time.sleep(again.dispatch.delay_seconds)
    drive_tree(rt, again.dispatch)
    done = rt.store.get_run(run.id)
    assert done.status.terminal
    kids = {k.id: k for k in children(rt, run.id)}
    assert kids[a.run_id].status == "SUCCEEDED", "the child whose worker died went on"
    assert rt.store.get_run(b.run_id).status.terminal, "its sibling was not wedged"
    assert holds(rt) == []
    print(f"lost call: budget {STEP_TOKENS + held + held // 2}, tree {done.tokens_used}")


def test_two_calls_lost_together_do_not_wedge_each_other(
    rt: Runtime, fake: FakeMessagesApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both children's worker dies in their model calls (one worker running the two side by
    side, killed): both holds stay. Once a child is taken again, its lost call's hold is no
    call in flight for its sibling (it is counted, never waited for): else each child, taken
    again, waits for the other's lost call, which only that child's own next call releases,
    and the tree waits on its timers until its deadline."""
    run, driver, started = start_two_children(rt)
    a, b = started.wakes

    def dies(request: Any) -> Any:
        raise Crash()

    monkeypatch.setattr(rt.llm, "send", dies)
    for d in (a, b):
        with pytest.raises(Crash):
            driver.drive(d.run_id, d.token)
    monkeypatch.undo()
    lost = holds(rt)
    assert {h[0] for h in lost} == {a.run_id, b.run_id}
    held = max(h[2] for h in lost)
    # Room for the lead's call, both lost calls and half a call more: neither child's next
    # call fits beside its sibling's lost one, and the tree is not spent.
    budget = STEP_TOKENS + 2 * held + held // 2
    with rt.engine.begin() as conn:
        conn.execute(
            sql("UPDATE run SET token_budget = :b WHERE id = :id"), {"b": budget, "id": run.id}
        )
    for d in (a, b):
        expire_lease(rt.engine, d.run_id)
    queue = [
        d for d in rt.store.redispatch_due(redispatch_after=0) if d.run_id in (a.run_id, b.run_id)
    ]
    assert len(queue) == 2
    for _ in range(40):
        if not queue:
            break
        d = queue.pop(0)
        time.sleep(d.delay_seconds)
        result = driver.drive(d.run_id, d.token)
        if result.dispatch is not None:
            queue.append(result.dispatch)
        queue += result.wakes
    statuses = {k.id: k.status for k in children(rt, run.id)}
    waits = {k: rt.store.get_run(k).wait_reason for k in (a.run_id, b.run_id)}
    assert all(RunStatus(s).terminal for s in statuses.values()), f"wedged: {waits}"
    assert fake.calls > 1, "a child called the model again"
    done = rt.store.get_run(run.id)
    assert done.status.terminal, done.status
    assert holds(rt) == []


def test_the_trees_spend_reads_each_childs_step_once(runtime: Runtime) -> None:
    """Every model call of a child reads its tree's spend under the tree's lock (the tree's
    admissions wait for each other): with 1,000 children working, each child's step in the
    parent is read once, by its key, not by scanning every step of the database (or of the
    parent, for each child)."""
    n = 1000
    root, _ = runtime.store.create_run(NewRun("lead", 1, "m", 10, 10**9, 60))
    other, _ = runtime.store.create_run(NewRun("lead", 1, "m", 10, 10**9, 60))
    with runtime.engine.begin() as conn:
        conn.execute(
            sql(
                "INSERT INTO run (id, agent, input, model, max_steps, token_budget, "
                "timeout_seconds, deadline_at, parent_run_id, tenant, dispatch_token, "
                "idempotency_key, tokens_used) "
                "SELECT gen_random_uuid(), 'researcher', '1', 'm', 10, "
                "1000, 60, now() + interval '1 hour', :parent, '', gen_random_uuid(), "
                "'child:' || :parent || '/tool:' || g, 7 FROM generate_series(1, :n) g"
            ),
            {"parent": root.id, "n": n},
        )
        conn.execute(
            sql(
                "INSERT INTO run_step (run_id, seq, step_key, kind, status, response, attempt, "
                "lease_epoch) SELECT :parent, row_number() OVER (ORDER BY idempotency_key), "
                "substr(idempotency_key, length('child:' || :parent || '/') + 1), 'CHILD', "
                "'PENDING', jsonb_build_object('runId', id), 1, 1 "
                "FROM run WHERE parent_run_id = :parent"
            ),
            {"parent": root.id},
        )
        # the rest of a database in use: other runs' steps (a scan of them all costs), in
        # bulk (no run events: its triggers off for this transaction)
        conn.execute(sql("SET LOCAL session_replication_role = replica"))
        conn.execute(
            sql(
                "INSERT INTO run_step (run_id, seq, step_key, kind, status, attempt, "
                "lease_epoch) SELECT :other, g, 'model:' || g, 'MODEL', 'DONE', 1, 1 "
                "FROM generate_series(1, 100000) g"
            ),
            {"other": other.id},
        )
        conn.execute(sql("SET LOCAL session_replication_role = origin"))
        conn.execute(sql("ANALYZE run"))
        conn.execute(sql("ANALYZE run_step"))
        kid = conn.execute(
            sql("SELECT id FROM run WHERE parent_run_id = :p LIMIT 1"), {"p": root.id}
        ).scalar_one()
        params = {"id": kid, "epoch": 1, "root": root.id}
        started = time.perf_counter()
        spend = conn.execute(QUERIES["tree_spend"], params).mappings().one()
        ms = (time.perf_counter() - started) * 1000
        assert spend["spent"] == 7 * n, "every child working is counted"
        query = QUERIES["tree_spend"].text
        plan = conn.execute(sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {query}"), params).scalar_one()
    plan = plan if isinstance(plan, list) else json.loads(plan)
    read: list[int] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "run_step":
            read.append(int(node["Actual Rows"]) * int(node["Actual Loops"]))
            read.append(int(node.get("Rows Removed by Filter", 0)) * int(node["Actual Loops"]))
        for sub in node.get("Plans", []):
            walk(sub)

    walk(plan[0]["Plan"])
    print(f"tree spend of {n} children working: {ms:.1f} ms, {sum(read)} step rows read")
    assert sum(read) <= 4 * n, f"run_step rows read: {sum(read)} for {n} children"


def test_a_sub_agent_must_be_registered_and_its_tool_name_free() -> None:
    registry = AgentRegistry()
    registry.register(Agent("lead", "lead", subagents=("nobody",)))
    with pytest.raises(AgentConfigError, match="sub-agent 'nobody', which is not registered"):
        registry.finalize()
    with pytest.raises(AgentConfigError, match="two tools named 'dig'"):
        Agent("lead", "lead", tools=(dig,), subagents=(Subagent("x", name="dig"),))
    assert Subagent("team/writer").tool_name == "team_writer"


def test_the_walkthroughs_team_hands_the_question_to_the_demo_agent(
    runtime: Runtime, llm: ScriptedLlm
) -> None:
    from examples.family import TEAM

    runtime.agents.register(TEAM)
    runtime.agents.finalize()
    question = "Which acme tickets are overdue?"
    llm.then_tool_use("toolu_t", "ask_acme_tickets", {"task": question})
    llm.then_text("tickets 7 and 9").then_text("The ticket agent says: tickets 7 and 9.")
    run, dispatch = runtime.submit("team", question)
    drive_tree(runtime, dispatch)
    done = runtime.store.get_run(run.id)
    assert (done.status, done.result) == (
        RunStatus.SUCCEEDED,
        "The ticket agent says: tickets 7 and 9.",
    )
    [kid] = children(runtime, run.id)
    assert (kid.agent, kid.input, kid.status) == ("acme-tickets", question, "SUCCEEDED")
    assert kid.token_budget == 20_000, "the sub-agent's own cap, below the lead's share"
    assert done.tokens_used == 3 * 15


def test_a_childs_unrecorded_tokens_count_against_the_parent(rt: Runtime) -> None:
    """A child billed for a call it could not record (a cut stream, a call lost with its
    worker) counts those tokens too: the parent's guard sees the tree's spend."""
    run, _driver, started = start_two_children(rt)
    assert len(started.wakes) == 2
    cut = started.wakes[0].run_id
    rt.store.record_unrecorded_usage(cut, Usage(input_tokens=120, output_tokens=7), Decimal(0))
    for wake in started.wakes:
        drive_tree(rt, wake)
    done = rt.store.get_run(run.id)
    assert done.status is RunStatus.SUCCEEDED, done.error
    assert rt.store.get_run(cut).unrecorded_tokens == 127
    assert done.tokens_used == 4 * STEP_TOKENS + 127
    rows = [s for s in rt.store.steps(run.id) if s.kind is StepKind.CHILD]
    assert sorted(r.usage.total for r in rows) == [STEP_TOKENS, STEP_TOKENS], "rows: recorded"


@durable_agent("handsoff")
def handsoff(task: str, steps: Steps) -> Any:
    return steps.child("middle", task)


@pytest.mark.parametrize(("root_agent", "calls"), [("top", 5), ("handsoff", 3)])
def test_a_grandchilds_unrecorded_tokens_and_cost_reach_the_root(
    settings: Settings, fake: FakeMessagesApi, root_agent: str, calls: int
) -> None:
    """Usage rolls up whole through every level of a tree: what a grandchild was billed
    without a row of its own (a cut stream, a call lost with its worker, a fenced-out
    answer) counts in the child's totals, and through them in the root's, tokens and cost:
    the root's budget sees every token its tree was billed. The root an agent loop (its
    sub-agent's result) or a durable function (``steps.child``)."""
    top = Agent("top", "top", max_tokens=100, subagents=(Subagent("middle"),))
    middle = Agent("middle", "middle", max_tokens=100, subagents=(Subagent("researcher"),))
    rt = build(settings, fake, extra=(top, middle, handsoff))
    extra, extra_cost = Usage(input_tokens=120, output_tokens=7), Decimal("0.25")
    try:
        root, dispatch = submit(rt.store, "go", agent=root_agent)
        driver = rt.driver()
        queue, cut = [dispatch], None
        for _ in range(100):
            if not queue:
                break
            d = queue.pop(0)
            result = driver.drive(d.run_id, d.token)
            if result.dispatch is not None and result.outcome is not Outcome.WAITING:
                queue.append(result.dispatch)
            queue += result.wakes
            [mid] = children(rt, root.id) or [None]
            leaves = children(rt, mid.id) if mid is not None else []
            if cut is None and leaves:  # the grandchild is billed a call it cannot record
                cut = leaves[0].id
                rt.store.record_unrecorded_usage(cut, extra, extra_cost)
        done = rt.store.get_run(root.id)
        assert done.status is RunStatus.SUCCEEDED, done.error
        assert cut is not None
        assert rt.store.get_run(cut).status is RunStatus.SUCCEEDED
        billed = fake.billed_tokens  # (top 2 calls,) middle 2, researcher 1
        assert billed == calls * STEP_TOKENS
        assert done.tokens_used + done.unrecorded_tokens == billed + extra.total
        priced = sum(
            (rt.pricing.cost(b.model, Usage(b.input_tokens, b.output_tokens)) for b in fake.billed),
            Decimal(0),
        )
        assert done.cost_usd + done.unrecorded_cost_usd == priced + extra_cost
    finally:
        rt.close()


def test_a_child_runs_on_its_own_agents_model_and_step_cap(settings: Settings) -> None:
    """A sub-agent whose agent names a model and a step cap runs with them, as if submitted
    on its own; one that names neither takes the parent's model and the default cap."""

    def lead_calls_both(body: dict[str, Any]) -> Reply:
        system = body["system"][0]["text"] if body.get("system") else ""
        if system == "lead" and len(body["messages"]) == 1:
            calls = [("toolu_a", "researcher", "acme"), ("toolu_b", "plain", "globex")]
            blocks = [
                {"type": "tool_use", "id": i, "name": n, "input": {"task": t}} for i, n, t in calls
            ]
            return message(blocks, "tool_use", usage=usage())
        return text("done", usage=usage())

    with FakeMessagesApi(default_responder=lead_calls_both) as api_:
        s = replace(settings, anthropic_api_key="test-key", anthropic_base_url=api_.url)
        rt = Runtime.build(s, pool_size=5)
        try:
            subs = (Subagent("researcher"), Subagent("plain"))
            rt.agents.register(Agent("lead", "lead", max_tokens=100, subagents=subs))
            own = Agent("researcher", "researcher", model="claude-child-model", max_steps=7)
            rt.agents.register(own)
            rt.agents.register(Agent("plain", "plain"))
            rt.agents.finalize()
            run, dispatch = submit(rt.store, "q", agent="lead")
            drive_tree(rt, dispatch)
            with rt.engine.connect() as conn:
                rows = {
                    r.agent: (r.model, r.max_steps)
                    for r in conn.execute(
                        sql("SELECT agent, model, max_steps FROM run WHERE parent_run_id = :id"),
                        {"id": run.id},
                    )
                }
            assert rt.store.get_run(run.id).status is RunStatus.SUCCEEDED
            assert rows == {
                "researcher": ("claude-child-model", 7),
                "plain": (run.model, settings.default_max_steps),
            }
            # and the child's model calls asked for its own model
            assert "claude-child-model" in {b["model"] for b in api_.bodies()}
        finally:
            rt.close()


def test_a_hold_left_by_a_worker_that_died_after_recording_its_call_is_swept(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child's worker records its call and dies before it releases the call's hold: the
    hold is not counted again beside the recorded tokens; the tree's next admission sweeps
    it (its row was written under the hold's lease)."""
    _run, driver, started = start_two_children(rt)
    a, b = started.wakes

    def dies(self: RunStore, *args: Any) -> None:
        raise Crash()

    monkeypatch.setattr(RunStore, "release_tree_budget", dies)
    with pytest.raises(Crash):
        driver.drive(a.run_id, a.token)
    monkeypatch.undo()
    [(held_run, epoch, _)] = holds(rt)
    [row] = rt.store.steps(a.run_id)
    assert (held_run, row.lease_epoch, row.step_key) == (a.run_id, epoch, "model:1")
    nxt = driver.drive(b.run_id, b.token)  # b's call is admitted: a's hold is swept
    assert nxt.outcome is Outcome.FINISHED  # its answer ended b, in the same task
    assert holds(rt) == []


def test_the_hold_of_a_call_lost_by_a_run_that_then_ended_is_swept(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child's worker dies in its model call (its hold on the tree's budget stays, a lost
    call) and the child then ends without another call (cancelled, timed out): nothing of
    that run will release the hold, so the tree's next admission sweeps it, or the tree's
    budget would shrink by it for ever."""
    _run, driver, started = start_two_children(rt)
    a, b = started.wakes

    def dies(request: Any) -> Any:
        raise Crash()

    with monkeypatch.context() as m:
        m.setattr(rt.llm, "send", dies)
        with pytest.raises(Crash):
            driver.drive(a.run_id, a.token)
    [(held_run, _epoch, _held)] = holds(rt)
    assert held_run == a.run_id
    assert rt.store.steps(a.run_id) == [], "the lost call left no row"
    with rt.engine.begin() as conn:  # the child ends (an operator's cancel, its deadline)
        conn.execute(
            sql(
                "UPDATE run SET status = 'CANCELLED', finished_at = now(), locked_by = NULL, "
                "locked_until = NULL WHERE id = :id"
            ),
            {"id": a.run_id},
        )
    driver.drive(b.run_id, b.token)  # b's call is admitted: a's hold is swept
    assert holds(rt) == []


def test_a_run_with_no_parent_asks_nothing_of_the_tree(
    rt: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared budget costs a run with no parent nothing: not a statement (its budget is
    its tree's, and it makes no model call while its children work)."""
    asked: list[uuid.UUID] = []
    hold, release = RunStore.hold_tree_budget, RunStore.release_tree_budget

    def holding(self: RunStore, claim: Any, *args: Any) -> Any:
        asked.append(claim.run_id)
        return hold(self, claim, *args)

    def releasing(self: RunStore, run_id: uuid.UUID, epoch: int) -> None:
        asked.append(run_id)
        release(self, run_id, epoch)

    monkeypatch.setattr(RunStore, "hold_tree_budget", holding)
    monkeypatch.setattr(RunStore, "release_tree_budget", releasing)
    run, dispatch = submit(rt.store, "Overdue tickets of acme and globex?", agent="lead")
    drive_tree(rt, dispatch)
    assert rt.store.get_run(run.id).status is RunStatus.SUCCEEDED
    kids = {k.id for k in children(rt, run.id)}
    assert set(asked) == kids, "the children's calls, never the lead's"
    assert len(asked) == 4, "one hold and one release per child call"


def test_a_child_continued_after_its_result_still_spends_from_the_tree(
    rt: Runtime, client: FlaskClient
) -> None:
    """A child whose result the parent recorded takes a message and continues: what it
    spends from then on is not in the parent's counters, and still counts against the
    tree's budget, which ends it once the tree is spent."""
    run, dispatch = submit(rt.store, "Overdue tickets of acme and globex?", agent="lead")
    drive_tree(rt, dispatch)
    assert rt.store.get_run(run.id).tokens_used == 4 * STEP_TOKENS
    kid = children(rt, run.id)[0].id
    with rt.engine.begin() as conn:  # the tree has room for one more step
        conn.execute(
            sql("UPDATE run SET token_budget = :b WHERE id = :id"),
            {"b": 5 * STEP_TOKENS - 50, "id": run.id},
        )

    def continue_child(text_: str) -> Any:
        sent = client.post(f"/api/runs/{kid}/messages", json={"text": text_})
        assert sent.status_code == 202, sent.get_data(as_text=True)
        drive_tree(rt, Dispatch(kid, rt.store.get_run(kid).dispatch_token))
        return rt.store.get_run(kid)

    first = continue_child("and initech?")
    assert first.status is RunStatus.SUCCEEDED, first.error
    assert first.tokens_used == 2 * STEP_TOKENS
    second = continue_child("and hooli?")
    assert second.status is RunStatus.FAILED
    assert "token budget of the run tree exhausted: 1500 of 1450" in (second.error or "")
    assert rt.store.get_run(run.id).tokens_used == 4 * STEP_TOKENS, "the parent's stay"


def test_a_fork_of_the_lead_reuses_its_completed_sub_agents(
    rt: Runtime, client: FlaskClient, fake: FakeMessagesApi
) -> None:
    """Forking a parent from after its children's results copies those results: the fork
    never starts those children again (no new child run, no model call of theirs), its
    timeline links to the children that made them, and it pays only for its own calls."""
    run, dispatch = submit(rt.store, "Overdue tickets of acme and globex?", agent="lead")
    drive_tree(rt, dispatch)
    assert rt.store.get_run(run.id).status is RunStatus.SUCCEEDED
    kids = children(rt, run.id)
    before = fake.calls
    fork_id = fork_over_http(client, run.id, 4)
    drive_tree(rt, Dispatch(fork_id, rt.store.get_run(fork_id).dispatch_token))
    fork = rt.store.get_run(fork_id)
    assert (fork.status, fork.result) == (
        RunStatus.SUCCEEDED,
        "summary: acme: 2 overdue | globex: 2 overdue",
    )
    assert children(rt, fork_id) == [], "no child started again"
    assert fake.calls == before + 1, "only the fork's own model call"
    assert fork.tokens_used == STEP_TOKENS
    timeline = client.get(f"/api/runs/{fork_id}/timeline").get_json()
    linked = {t["toolUseId"]: t.get("childRunId") for t in timeline if t["kind"] == "CHILD"}
    assert linked == {"toolu_a": str(kids[0].id), "toolu_b": str(kids[1].id)}


def test_a_fork_of_a_lead_whose_sub_agent_still_works(
    rt: Runtime, client: FlaskClient, fake: FakeMessagesApi
) -> None:
    """One child has answered (its result recorded), the other still works. A fork from
    after the working child's step is refused (409: its step has not completed, and a fork
    copies only completed steps); a fork from that step copies the answered child's result
    and starts only the other again, as a child of the fork, while the source's own child
    goes on and answers the source alone."""
    run, _driver, started = start_two_children(rt)
    a, b = started.wakes
    for wake in drive_one(rt, a):  # child a answers; the lead records its result
        drive_tree(rt, wake)
    rows = {s.step_key: s for s in rt.store.steps(run.id)}
    assert (rows["tool:toolu_a"].status, rows["tool:toolu_b"].status) == (
        StepStatus.DONE,
        StepStatus.PENDING,
    )
    pending_seq = rows["tool:toolu_b"].seq
    refused = client.post(f"/api/runs/{run.id}/fork", json={"fromSeq": pending_seq + 1})
    assert refused.status_code == 409, refused.get_data(as_text=True)
    refusal = refused.get_json()["error"]["message"]
    assert "not completed" in refusal
    assert f"waits for child run {b.run_id}" in refusal, "it says which child it waits for"
    assert rows["tool:toolu_a"].seq < pending_seq, "rows in the order the model called them"
    fork_id = fork_over_http(client, run.id, pending_seq)
    drive_tree(rt, Dispatch(fork_id, rt.store.get_run(fork_id).dispatch_token))
    fork = rt.store.get_run(fork_id)
    assert fork.status is RunStatus.SUCCEEDED, fork.error
    [again] = children(rt, fork_id)
    assert (again.input, again.status) == ("globex", "SUCCEEDED"), "only b started again"
    assert again.id != b.run_id
    assert rt.store.get_run(b.run_id).status is not RunStatus.SUCCEEDED, "the source's waits"
    drive_tree(rt, b)  # the source's own child answers the source
    source = rt.store.get_run(run.id)
    assert source.status is RunStatus.SUCCEEDED, source.error
    assert fork.result == source.result == "summary: acme: 2 overdue | globex: 2 overdue"
    researcher_calls = [x for x in fake.bodies() if x["system"][0]["text"] == "researcher"]
    assert len(researcher_calls) == 3, "a once, b in the source and b in the fork"


def drive_one(rt: Runtime, d: Dispatch) -> list[Dispatch]:
    """Drive one run to its end (or its park), one step at a time; returns the wakes."""
    driver = rt.driver()
    wakes: list[Dispatch] = []
    nxt: Dispatch | None = d
    while nxt is not None:
        result = driver.drive(nxt.run_id, nxt.token)
        wakes += result.wakes
        nxt = result.dispatch if result.outcome is Outcome.CONTINUE else None
    return wakes


def test_an_operators_fail_ends_the_sub_agents_started_in_the_same_turn(rt: Runtime) -> None:
    """U5: the parent stopped for an operator (a tool of the turn in doubt) while its
    sub-agents ran; failing it left them running and billing for a parent that had ended."""
    run, _, started = start_two_children(rt)
    assert len(started.wakes) == 2
    with rt.engine.begin() as conn:  # what a tool of the same turn left in doubt does
        conn.execute(
            sql(
                "UPDATE run SET status = 'NEEDS_ATTENTION', error = 'tool in doubt' WHERE id = :id"
            ),
            {"id": run.id},
        )
    assert rt.store.resolve(run.id, "fail", reason="not worth it") is None
    assert rt.store.get_run(run.id).status is RunStatus.FAILED
    assert [c.status for c in children(rt, run.id)] == ["CANCELLED", "CANCELLED"]
