"""What the console reads, through Flask's test client on real PostgreSQL: the page shells
and their headers, ``/api/whoami``, list filters and counts, the conversation, the overview's
aggregates (``/api/stats``), and an approval looked up by run."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from celery import Celery
from flask.testing import FlaskClient
from sqlalchemy import text

from api import create_app
from api.auth import hash_token
from examples.order_refund import build as build_refund
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import make_celery
from tests.support import drive_to_end, submit

MODEL = "claude-sonnet-4-5"
HOSTILE = '<script>alert(1)</script><img src=x onerror="alert(2)">'


@pytest.fixture
def celery(settings: Settings) -> Iterator[Celery]:
    app = make_celery(settings, register=False)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def llm() -> ScriptedLlm:
    """A scripted model that answers as a priced one, so steps cost something."""
    return ScriptedLlm(model=MODEL)


@pytest.fixture
def client(runtime: Runtime, celery: Celery) -> FlaskClient:
    return create_app(runtime=runtime, celery=celery).test_client()


def _with_tokens(runtime: Runtime, celery: Celery, entries: str) -> FlaskClient:
    runtime.settings = replace(runtime.settings, api_tokens=entries)
    return create_app(runtime=runtime, celery=celery).test_client()


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _finished_run(runtime: Runtime, llm: ScriptedLlm, question: str = HOSTILE) -> uuid.UUID:
    runtime.tickets.seed()
    llm.then_tool_use("toolu_01", "list_tickets", {"overdue": True}, 800, 60).then_text(
        f"Answer to {question}", 1200, 140
    )
    run, dispatch = submit(runtime.store, question, agent="acme-tickets", model=MODEL)
    drive_to_end(runtime.driver(), dispatch)
    return run.id


# -- pages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/approvals", "/attention", "/overview", "/schedules"])
def test_pages_are_shells_with_a_strict_policy(client: FlaskClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 200
    assert response.mimetype == "text/html"
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp
    assert "unsafe-inline" not in csp
    assert response.headers["Referrer-Policy"] == "no-referrer"
    assert response.headers["X-Frame-Options"] == "DENY"
    assert "Set-Cookie" not in response.headers, "no cookies: nothing for CSRF to ride on"
    page = response.get_data(as_text=True)
    assert "/static/console/console.js" in page
    assert "<script>" not in page, "no inline script"
    assert 'id="token" name="token" type="password"' in page
    assert 'method="post"' in page, "a failed script never sends the token in a URL"
    assert "Authentication is off" in page


def test_with_tokens_the_pages_ask_for_one_and_warn_of_nothing(
    runtime: Runtime, celery: Celery
) -> None:
    client = _with_tokens(runtime, celery, f"ops:admin:{hash_token('t')}")
    page = client.get("/").get_data(as_text=True)
    assert 'data-auth="on"' in page
    assert "Authentication is off" not in page


def test_run_page_names_only_a_valid_run_id(client: FlaskClient) -> None:
    rid = uuid.uuid4()
    page = client.get(f"/runs/{rid}").get_data(as_text=True)
    assert f'data-run-id="{rid}"' in page
    assert client.get("/runs/%3Cscript%3E").status_code == 404


def test_diff_page_names_both_runs_and_is_a_shell_too(client: FlaskClient) -> None:
    a, b = uuid.uuid4(), uuid.uuid4()
    response = client.get(f"/runs/{a}/diff/{b}")
    assert response.status_code == 200
    assert "script-src 'self'" in response.headers["Content-Security-Policy"]
    page = response.get_data(as_text=True)
    assert f'data-run-a="{a}" data-run-b="{b}"' in page
    assert f'href="/runs/{b}/diff/{a}"' in page, "swap A and B"
    assert "<script>" not in page
    assert client.get(f"/runs/{a}/diff/%3Cscript%3E").status_code == 404


def test_static_files_ship_with_the_package(client: FlaskClient) -> None:
    for path in (
        "/static/console/console.js",
        "/static/console/console.css",
        "/static/vendor/uPlot.iife.min.js",
        "/static/vendor/uPlot.min.css",
    ):
        response = client.get(path)
        assert response.status_code == 200, path
        response.close()
    response = client.get("/static/console/console.js")
    script = response.get_data(as_text=True)
    response.close()
    markup_sinks = re.findall(
        r"\.(?:inner|outer)HTML\s*=|insertAdjacentHTML|document\.write", script
    )
    assert markup_sinks == [], "API data reaches the page as text only"
    assert "sessionStorage" in script
    assert "localStorage" not in script


# -- whoami ---------------------------------------------------------------------------------


def test_whoami_open(client: FlaskClient) -> None:
    me = client.get("/api/whoami").get_json()
    assert me["auth"] is False
    assert all(me["can"].values())


def test_whoami_with_tokens(runtime: Runtime, celery: Celery) -> None:
    runtime.agents.register(build_refund(runtime.tickets))  # declares the role "finance"
    client = _with_tokens(
        runtime,
        celery,
        f"viewer:read:{hash_token('r')}:team,ops:admin:{hash_token('a')}:team,"
        f"lead:read+approve+finance:{hash_token('l')}:team",
    )
    assert client.get("/api/whoami").status_code == 401
    viewer = client.get("/api/whoami", headers=_bearer("r")).get_json()
    assert viewer["auth"] is True
    assert viewer["name"] == "viewer"
    assert viewer["tenant"] == "team"
    assert not any(viewer["can"].values())
    admin = client.get("/api/whoami", headers=_bearer("a")).get_json()
    assert admin["can"] == {
        "submit": True,
        "fork": True,
        "cancel": True,
        "resume": True,
        "resolve": True,
        "approve": False,  # admin does not imply approval roles
        "versions": True,
        "upgrade": True,
    }
    assert admin["approvalRoles"] == []
    lead = client.get("/api/whoami", headers=_bearer("l")).get_json()
    assert lead["can"]["approve"] is True
    assert lead["can"]["cancel"] is False
    assert lead["approvalRoles"] == ["finance"]


# -- list filters, counts -------------------------------------------------------------------


def test_list_filters_by_agent_and_id_prefix_and_counts_steps(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    done = _finished_run(runtime, llm, "first")
    other, _ = submit(runtime.store, "second", agent="other-agent")
    items = client.get("/api/runs?agent=acme-tickets").get_json()["items"]
    assert [i["id"] for i in items] == [str(done)]
    assert items[0]["stepCount"] == 3
    prefix = str(other.id)[:8].upper()
    items = client.get(f"/api/runs?idPrefix={prefix}").get_json()["items"]
    assert [i["id"] for i in items] == [str(other.id)]
    assert items[0]["stepCount"] == 0
    assert client.get("/api/runs?idPrefix=xyz").status_code == 400
    assert client.get("/api/runs?idPrefix=%25").status_code == 400, "no LIKE wildcards"
    assert client.get("/api/runs?agent=nobody").get_json()["items"] == []


def test_counts_by_status_for_the_tenant(runtime: Runtime, celery: Celery) -> None:
    client = _with_tokens(
        runtime, celery, f"a:read:{hash_token('a')}:red,b:read:{hash_token('b')}:blue"
    )
    submit(runtime.store, "x", tenant="red")
    submit(runtime.store, "y", tenant="red", agent="other")
    submit(runtime.store, "z", tenant="blue")
    red = client.get("/api/runs/counts", headers=_bearer("a")).get_json()["counts"]
    assert red["QUEUED"] == 2
    assert red["SUCCEEDED"] == 0
    assert len(red) == 8
    only = client.get("/api/runs/counts?agent=other", headers=_bearer("a")).get_json()
    assert only["counts"]["QUEUED"] == 1
    blue = client.get("/api/runs/counts", headers=_bearer("b")).get_json()["counts"]
    assert blue["QUEUED"] == 1


# -- conversation ---------------------------------------------------------------------------


def test_conversation_reads_as_input_text_tool_call_result(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    run_id = _finished_run(runtime, llm)
    body = client.get(f"/api/runs/{run_id}/conversation").get_json()
    assert body["status"] == "SUCCEEDED"
    entries = body["entries"]
    assert [e["type"] for e in entries] == ["input", "tool_call", "tool_result", "text", "result"]
    assert entries[0]["content"] == HOSTILE, "hostile text is data, returned as is"
    assert entries[1]["name"] == "list_tickets"
    assert entries[1]["input"] == {"overdue": True}
    assert entries[2]["toolUseId"] == "toolu_01"
    assert entries[2]["name"] == "list_tickets"
    assert entries[2]["isError"] is False
    assert entries[2]["output"]
    assert entries[3]["text"] == f"Answer to {HOSTILE}"
    assert entries[3]["seq"] == 3
    assert client.get(f"/api/runs/{uuid.uuid4()}/conversation").status_code == 404


def test_conversation_shows_a_tool_error_and_the_run_error(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    # An unknown tool answers with an error result; the spent budget then stops the run (a
    # budget the first request fits: one its input alone would cross is not even sent).
    llm.then_tool_use("toolu_x", "no_such_tool", {}, 800, 60)
    run, dispatch = submit(runtime.store, "q", agent="acme-tickets", model=MODEL, token_budget=800)
    drive_to_end(runtime.driver(), dispatch)
    body = client.get(f"/api/runs/{run.id}/conversation").get_json()
    entries = body["entries"]
    assert body["status"] == "FAILED"
    assert [e["type"] for e in entries] == ["input", "tool_call", "tool_result", "error"]
    assert entries[2]["isError"] is True
    assert entries[2]["name"] == "no_such_tool"
    assert "budget" in entries[3]["text"]


# -- stats ----------------------------------------------------------------------------------


def _age_everything(runtime: Runtime, hours: float) -> None:
    """Move every run and step back in time (test-only SQL), as if they ran ``hours`` ago."""
    with runtime.engine.begin() as conn:
        shift = {"h": hours}
        conn.execute(
            text(
                "UPDATE run SET created_at = created_at - make_interval(hours => :h),"
                " finished_at = finished_at - make_interval(hours => :h)"
            ),
            shift,
        )
        conn.execute(
            text(
                "UPDATE run_step SET started_at = started_at - make_interval(hours => :h),"
                " finished_at = finished_at - make_interval(hours => :h)"
            ),
            shift,
        )


def _series(stats: dict[str, Any], name: str, key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    value = {"finished": "count", "cost": "usd", "latency": "p95Ms"}[name]
    for row in stats[name]:
        out[row[key]] = out.get(row[key], 0) + row[value]
    return out


def test_stats_over_24h_and_7d(client: FlaskClient, runtime: Runtime, llm: ScriptedLlm) -> None:
    _finished_run(runtime, llm)
    old = _finished_run(runtime, llm)
    with runtime.engine.begin() as conn:  # one run three days ago
        conn.execute(
            text("UPDATE run SET finished_at = finished_at - interval '3 days' WHERE id = :id"),
            {"id": old},
        )
        conn.execute(
            text(
                "UPDATE run_step SET finished_at = finished_at - interval '3 days',"
                " started_at = started_at - interval '3 days' WHERE run_id = :id"
            ),
            {"id": old},
        )
    cancelled, _ = submit(runtime.store, "c")
    runtime.store.cancel(cancelled.id)

    day = client.get("/api/stats").get_json()
    assert day["window"] == "24h"
    assert day["bucketSeconds"] == 3600
    assert _series(day, "finished", "status") == {"SUCCEEDED": 1, "CANCELLED": 1}
    cost = _series(day, "cost", "model")
    assert set(cost) == {MODEL}
    assert cost[MODEL] > 0
    kinds = {row["kind"] for row in day["latency"]}
    assert kinds == {"MODEL", "TOOL"}
    assert all(row["p50Ms"] <= row["p95Ms"] for row in day["latency"])
    assert all(row["at"].endswith("+00:00") and ":00:00" in row["at"] for row in day["finished"])

    week = client.get("/api/stats?window=7d").get_json()
    assert _series(week, "finished", "status") == {"SUCCEEDED": 2, "CANCELLED": 1}
    assert _series(week, "cost", "model")[MODEL] == pytest.approx(2 * cost[MODEL])
    assert len({row["at"] for row in week["finished"]}) == 2, "two different hours"

    _age_everything(runtime, 24 * 8)
    empty = client.get("/api/stats?window=7d").get_json()
    assert empty["finished"] == []
    assert empty["cost"] == []
    assert empty["latency"] == []
    assert client.get("/api/stats?window=1y").status_code == 400


def test_stats_are_scoped_to_the_tenant(runtime: Runtime, celery: Celery, llm: ScriptedLlm) -> None:
    _finished_run(runtime, llm)  # tenant ''
    client = _with_tokens(
        runtime, celery, f"a:read:{hash_token('a')}:red,root:admin:{hash_token('r')}:ops"
    )
    mine = client.get("/api/stats", headers=_bearer("a")).get_json()
    assert mine["finished"] == []
    assert mine["cost"] == []
    assert mine["latency"] == []
    everyone = client.get("/api/stats", headers=_bearer("r")).get_json()
    assert _series(everyone, "finished", "status") == {"SUCCEEDED": 1}


# -- approvals of one run -------------------------------------------------------------------


def test_approvals_filter_by_run(client: FlaskClient) -> None:
    assert client.get(f"/api/approvals?runId={uuid.uuid4()}").get_json() == {"items": []}
    assert client.get("/api/approvals?runId=nope").status_code == 400
