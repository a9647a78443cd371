"""The demo agent's tools work on the runtime's own database; that database being away (a
restart, a failover) is not an answer for the model. The long chaos campaign caught it (seed
991233): PostgreSQL restarted while ``add_comment`` and ``list_tickets`` ran, their
OperationalError was recorded as the tools' ERROR results, the model was handed "error:
OperationalError: the database system is shutting down", and the comment the model asked for
was never added. Now the tools try again on new connections for a few seconds, then raise
``DatabaseUnavailable``, which the step pipeline does not record: it takes the step up again
(runtime/pipeline/effects.py, rule 5). Through a real cut between the tools and a real
PostgreSQL (tests/netproxy.py); the runtime's own records stay on their direct connection,
so what is tested is what the pipeline does with the tool's failure."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from db.demo import SEED_TICKETS, TicketStore
from db.errors import DatabaseUnavailable
from db.records import Dispatch, RunStatus, StepStatus
from runtime.agentloop.acme import add_comment_tool, list_tickets_tool
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Outcome
from runtime.llm.scripted import ScriptedLlm
from tests.netproxy import TcpProxy
from tests.support import proxied_engine, register_agent

OVERDUE = sorted(t[0] for t in SEED_TICKETS if t[2] != "closed" and t[6] < 0)


@pytest.fixture
def proxied(database_url: str) -> Iterator[tuple[Engine, TcpProxy]]:
    """An engine on the test database through a proxy the test can cut."""
    with proxied_engine(
        database_url, pool_size=2, max_overflow=0, application_name="dar-demo-tools"
    ) as (engine, proxy):
        TicketStore(engine).seed()  # the fixture emptied every table, the tickets too
        yield engine, proxy


def restart(proxy: TcpProxy, down_seconds: float) -> threading.Timer:
    """What a PostgreSQL restart does to the tools' connections: every open one closed, new
    ones refused, until the server is back ``down_seconds`` later."""
    proxy.cut(reject=True)
    back = threading.Timer(down_seconds, proxy.heal)
    back.start()
    return back


def test_the_tools_ride_out_a_short_restart(proxied: tuple[Engine, TcpProxy]) -> None:
    engine, proxy = proxied
    tickets = TicketStore(engine)
    assert sorted(t["id"] for t in tickets.list(overdue=True)) == OVERDUE  # connections pooled
    restart(proxy, 0.6)
    assert sorted(t["id"] for t in tickets.list(overdue=True)) == OVERDUE
    restart(proxy, 0.6)
    comment_id, created = tickets.add_comment(OVERDUE[0], "reminder", idempotency_key="k-1")
    assert created
    assert tickets.add_comment(OVERDUE[0], "reminder", idempotency_key="k-1") == (
        comment_id,
        False,
    )
    assert tickets.count_comments(OVERDUE[0]) == 1


def test_a_tool_gives_up_with_database_unavailable_not_its_own_error(
    proxied: tuple[Engine, TcpProxy],
) -> None:
    engine, proxy = proxied
    tickets = TicketStore(engine, retry_seconds=0.3)
    proxy.cut(reject=True)
    with pytest.raises(DatabaseUnavailable):
        tickets.list()
    with pytest.raises(DatabaseUnavailable):
        tickets.add_comment(OVERDUE[0], "reminder", idempotency_key="k-2")
    proxy.heal()
    with pytest.raises(LookupError):  # the tool's own failure is not retried: the model's
        tickets.add_comment(999, "reminder", idempotency_key="k-3")


def _drive_one(runtime: Runtime, dispatch: Dispatch) -> tuple[Outcome, Dispatch | None]:
    runtime.store.make_due_now(dispatch.run_id)
    result = runtime.driver(worker="worker-A").drive(dispatch.run_id, dispatch.token)
    return result.outcome, result.dispatch


@pytest.mark.parametrize("tool", ["add_comment", "list_tickets"])
def test_a_tool_that_finds_the_database_away_is_taken_up_again_not_answered(
    runtime: Runtime, proxied: tuple[Engine, TcpProxy], tool: str
) -> None:
    engine, proxy = proxied
    tickets = TicketStore(engine, retry_seconds=0.3)
    register_agent(
        runtime.agents, list_tickets_tool(tickets), add_comment_tool(tickets), name="acme-away"
    )
    ticket = OVERDUE[0]
    arguments = {"ticket_id": ticket, "text": "reminder"} if tool == "add_comment" else {}
    llm = runtime.llm
    assert isinstance(llm, ScriptedLlm)
    llm.then_tool_use("toolu_away", tool, arguments).then_text("done")
    run, dispatch = runtime.submit("acme-away", "remind the owners of the overdue tickets")
    outcome, after_model = _drive_one(runtime, dispatch)  # the model asks for the tool
    assert outcome is Outcome.CONTINUE
    assert after_model is not None

    proxy.cut(reject=True)  # PostgreSQL restarting, for longer than the tool keeps trying
    outcome, later = _drive_one(runtime, after_model)
    assert outcome is Outcome.WAITING, "the task ended on a timer, as a crash would"
    rows = {s.step_key: s for s in runtime.store.steps(run.id)}
    away = rows.get("tool:toolu_away")
    assert away is None or away.status is StepStatus.STARTED, (
        f"the tool's failure was recorded as its result: {away and away.response!r}"
    )
    held = runtime.store.get_run(run.id)
    assert held.status is RunStatus.RUNNING
    assert held.locked_by is None
    assert "database is away" in (held.wait_reason or "")
    assert later is not None, "its timer's message"

    proxy.heal()  # the database is back: the timer's task runs the tool again, then the model
    current: Dispatch | None = later
    for _ in range(5):
        if current is None:
            break
        _, current = _drive_one(runtime, current)
    final = runtime.store.get_run(run.id)
    assert final.status is RunStatus.SUCCEEDED, final.error
    (done,) = [s for s in runtime.store.steps(run.id) if s.step_key == "tool:toolu_away"]
    assert done.status is StepStatus.DONE, done.response
    assert tickets.count_comments(ticket) == (1 if tool == "add_comment" else 0)
    answered = [m for m in llm.requests[-1].messages if m["role"] == "user"][-1]["content"]
    assert not any(b.get("is_error") for b in answered), answered
