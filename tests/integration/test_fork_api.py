"""``POST /api/runs/{id}/fork``, ``GET /api/runs/{a}/diff/{b}``, ``dar fork`` and ``dar diff``
against the real app, PostgreSQL and Redis: roles and tenants, bad input named, copied steps
shown as copied with the original's cost apart."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient
from sqlalchemy import text
from werkzeug.serving import make_server
from werkzeug.test import TestResponse

from api import create_app
from api.auth import hash_token
from cli.main import main
from db.records import Dispatch, Run, RunStatus
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import tool
from tasks.celery_app import make_celery
from tests.support import drive_to_end, queued_count, register_agent, submit

TOKENS = {
    "alice": ("read+submit", "shop"),
    "reader": ("read", "shop"),
    "mallory": ("read+submit", "other"),
    "root": ("admin", "ops"),
}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer token-of-{name}"}


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture
def client(runtime: Runtime) -> FlaskClient:
    runtime.settings = replace(
        runtime.settings,
        api_tokens=",".join(
            f"{n}:{roles}:{hash_token(f'token-of-{n}')}:{tenant}"
            for n, (roles, tenant) in TOKENS.items()
        ),
    )
    register_agent(runtime.agents, weather)
    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    return app.test_client()


def three_steps(runtime: Runtime, llm: ScriptedLlm, tenant: str = "shop") -> Run:
    llm.then_tool_use("toolu_a", "weather", {"city": "Oslo"}, 200, 20).then_text("Sunny.", 300)
    run, dispatch = submit(runtime.store, "weather in Oslo?", tenant=tenant)
    drive_to_end(runtime.driver(), dispatch)
    return runtime.store.get_run(run.id)


def drive(runtime: Runtime, run_id: str) -> Run:
    run = runtime.store.get_run(uuid.UUID(run_id))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
    return runtime.store.get_run(run.id)


def test_fork_shows_copied_steps_and_the_original_cost_apart(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    original = three_steps(runtime, llm)
    llm.then_text("Rainy, actually.", 40, 4)
    response = client.post(
        f"/api/runs/{original.id}/fork",
        json={"fromSeq": 3, "toolResult": {"seq": 2, "output": "rain in Oslo"}},
        headers=auth("alice"),
    )
    assert response.status_code == 201, response.get_json()
    body = response.get_json()
    assert body["forkedFrom"] == {"runId": str(original.id), "seq": 3, "replayModel": False}
    assert response.headers["Location"].endswith(f"/api/runs/{body['id']}")
    done = drive(runtime, body["id"])
    assert done.status is RunStatus.SUCCEEDED
    assert done.tenant == "shop"
    assert done.submitted_by == "alice"

    run = client.get(f"/api/runs/{done.id}", headers=auth("alice")).get_json()
    assert run["forkedFrom"]["runId"] == str(original.id)
    assert run["tokensUsed"] == 44, "only its own model call"
    timeline = client.get(f"/api/runs/{done.id}/timeline", headers=auth("alice")).get_json()
    assert [(t["seq"], t["origin"], t["inputTokens"], t["originalTokens"]) for t in timeline] == [
        (1, "copied", 0, 220),
        (2, "edited", 0, 0),
        (3, None, 40, None),
    ]
    assert timeline[0]["originalCostUsd"] == float(runtime.store.steps(original.id)[0].cost_usd)
    assert timeline[0]["costUsd"] == 0
    source = client.get(f"/api/runs/{original.id}", headers=auth("alice")).get_json()
    (event,) = [e for e in source["audit"] if e["action"] != "submit"]
    assert event["action"] == "fork"
    assert event["actor"] == "alice"
    assert event["detail"] == {
        "fork": str(done.id),
        "fromSeq": 3,
        "edits": ["toolResult"],
        "replayModel": False,
    }

    diff = client.get(f"/api/runs/{original.id}/diff/{done.id}", headers=auth("reader"))
    assert diff.status_code == 200
    d = diff.get_json()
    assert d["firstDifferentSeq"] == 2
    assert d["runDifferences"] == ["result"]
    assert [(r["seq"], r["same"], r["differences"]) for r in d["steps"]] == [
        (1, True, []),
        (2, False, ["output"]),
        (3, False, ["input", "output", "tokens"]),  # (the scripted model is free)
    ]
    assert d["steps"][0]["b"]["billedTokens"] == 0
    assert d["steps"][0]["b"]["tokens"] == d["steps"][0]["a"]["tokens"] == 220
    assert d["steps"][1]["a"]["input"] == {"city": "Oslo"}


def test_fork_needs_submit_and_the_runs_tenant(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    original = three_steps(runtime, llm)
    url = f"/api/runs/{original.id}/fork"
    assert client.post(url, json={"fromSeq": 1}).status_code == 401
    refused = client.post(url, json={"fromSeq": 1}, headers=auth("reader"))
    assert refused.status_code == 403
    assert "lacks the role 'submit'" in refused.get_json()["error"]["message"]
    hidden = client.post(url, json={"fromSeq": 1}, headers=auth("mallory"))
    assert hidden.status_code == 404, "another tenant's run is no run"
    diff = client.get(f"/api/runs/{original.id}/diff/{original.id}", headers=auth("mallory"))
    assert diff.status_code == 404
    admin = client.post(url, json={"fromSeq": 4}, headers=auth("root"))
    assert admin.status_code == 201
    assert runtime.store.get_run(uuid.UUID(admin.get_json()["id"])).tenant == "shop"


@pytest.mark.parametrize(
    ("body", "status", "field", "message"),
    [
        ({}, 400, "fromSeq", "fromSeq: is required"),
        ({"fromSeq": 0}, 400, "fromSeq", "must be the seq of the first step"),
        ({"fromSeq": 9}, 400, "fromSeq", "fromSeq must be from 1 to 4 (got 9)"),
        ({"fromSeq": 3, "toolResult": {"seq": 2}}, 400, "toolResult", 'must be {"seq": k'),
        ({"fromSeq": 2, "toolResult": {"seq": 2, "output": "x"}}, 400, "toolResult", "seq 2"),
        ({"fromSeq": 3, "input": ""}, 400, "input", "input"),
        ({"fromSeq": 3, "tokenBudget": 0}, 400, "tokenBudget", "whole number"),
        ({"fromSeq": 3, "replayModel": "yes"}, 400, "replayModel", "true or false"),
        ({"fromSeq": 3, "from": 2}, 400, "from", "unknown field 'from'"),
    ],
)
def test_bad_fork_requests_name_the_field(
    client: FlaskClient,
    runtime: Runtime,
    llm: ScriptedLlm,
    body: dict[str, Any],
    status: int,
    field: str,
    message: str,
) -> None:
    original = three_steps(runtime, llm)
    response = client.post(f"/api/runs/{original.id}/fork", json=body, headers=auth("alice"))
    assert response.status_code == status, response.get_json()
    error = response.get_json()["error"]
    assert error["field"] == field
    assert message in error["message"]


def test_a_fork_after_a_step_in_flight_is_a_conflict(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    llm.then_tool_use("toolu_a", "weather", {"city": "Oslo"})
    run, dispatch = submit(runtime.store, tenant="shop")
    runtime.driver().drive(dispatch.run_id, dispatch.token)  # seq 1: the model asked
    with runtime.engine.begin() as conn:  # seq 2: the tool is running
        conn.execute(
            text(
                "INSERT INTO run_step (run_id, seq, step_key, kind, status, tool_name, "
                "tool_use_id, lease_epoch) VALUES (:id, 2, 'tool:toolu_a', 'TOOL', 'STARTED', "
                "'weather', 'toolu_a', 1)"
            ),
            {"id": run.id},
        )
    url = f"/api/runs/{run.id}/fork"
    conflict = client.post(url, json={"fromSeq": 3}, headers=auth("alice"))
    assert conflict.status_code == 409
    assert conflict.get_json()["error"]["field"] == "fromSeq"
    assert "is STARTED, not completed" in conflict.get_json()["error"]["message"]
    assert client.post(url, json={"fromSeq": 2}, headers=auth("alice")).status_code == 201
    missing = client.post(f"/api/runs/{uuid.uuid4()}/fork", json={"fromSeq": 1})
    assert missing.status_code in (401, 404)


# -- Idempotency-Key -------------------------------------------------------------------------


def fork_with_key(
    client: FlaskClient, run_id: uuid.UUID | str, body: dict[str, Any], key: str, who: str = "alice"
) -> TestResponse:
    return client.post(
        f"/api/runs/{run_id}/fork", json=body, headers={**auth(who), "Idempotency-Key": key}
    )


def forks_of(runtime: Runtime, run_id: uuid.UUID) -> list[uuid.UUID]:
    with runtime.engine.connect() as conn:
        rows = conn.execute(text("SELECT id FROM run WHERE forked_from_run = :id"), {"id": run_id})
        return [r.id for r in rows]


def test_a_retried_fork_with_the_same_key_is_the_same_fork_without_a_second_message(
    client: FlaskClient,
    runtime: Runtime,
    llm: ScriptedLlm,
    redis_client: redis.Redis,
    settings: Settings,
) -> None:
    original = three_steps(runtime, llm)
    body = {"fromSeq": 3, "toolResult": {"seq": 2, "output": "rain"}, "tokenBudget": 5000}
    first = fork_with_key(client, original.id, body, "fork-1")
    assert first.status_code == 201, first.get_json()
    fork_id = first.get_json()["id"]
    assert queued_count(redis_client, settings.queue) == 1

    reordered = {"tokenBudget": 5000, "toolResult": {"output": "rain", "seq": 2}, "fromSeq": 3}
    again = fork_with_key(client, original.id, reordered, "fork-1")
    assert again.status_code == 200, again.get_json()
    assert again.get_json() == first.get_json()
    assert again.headers["Location"] == first.headers["Location"]
    assert forks_of(runtime, original.id) == [uuid.UUID(fork_id)]
    assert queued_count(redis_client, settings.queue) == 1, "no second message"
    source = client.get(f"/api/runs/{original.id}", headers=auth("alice")).get_json()
    forks = [e["action"] for e in source["audit"] if e["action"] != "submit"]
    assert forks == ["fork"], "one fork, audited once"

    # The retry reports the fork's current status, as a submit's retry does.
    llm.then_text("Rainy.", 10, 1)
    assert drive(runtime, fork_id).status is RunStatus.SUCCEEDED
    later = fork_with_key(client, original.id, body, "fork-1")
    assert (later.status_code, later.get_json()["status"]) == (200, "SUCCEEDED")
    # Another key is another fork.
    other = fork_with_key(client, original.id, body, "fork-2")
    assert other.status_code == 201
    assert other.get_json()["id"] != fork_id
    assert queued_count(redis_client, settings.queue) == 2


@pytest.mark.parametrize("reuse", ["another body", "another run", "a submit's key"])
def test_a_fork_key_reused_for_another_request_is_422(
    client: FlaskClient,
    runtime: Runtime,
    llm: ScriptedLlm,
    redis_client: redis.Redis,
    settings: Settings,
    reuse: str,
) -> None:
    original = three_steps(runtime, llm)
    if reuse == "a submit's key":
        first = client.post(
            "/api/runs", json={"input": "q"}, headers={**auth("alice"), "Idempotency-Key": "k1"}
        )
    else:
        first = fork_with_key(client, original.id, {"fromSeq": 3}, "k1")
    assert first.status_code == 201, first.get_json()
    queued = queued_count(redis_client, settings.queue)
    if reuse == "another run":
        llm.then_text("Sunny.")
        other, dispatch = submit(runtime.store, "weather?", tenant="shop")
        drive_to_end(runtime.driver(), dispatch)
        response = fork_with_key(client, other.id, {"fromSeq": 3}, "k1")
    else:
        response = fork_with_key(client, original.id, {"fromSeq": 2}, "k1")
    assert response.status_code == 422, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "idempotency_key_reused"
    assert "'k1'" in error["message"]
    assert first.get_json()["id"] in error["message"]
    assert len(forks_of(runtime, original.id)) == (0 if reuse == "a submit's key" else 1)
    assert queued_count(redis_client, settings.queue) == queued


def test_the_openapi_document_states_the_fork_idempotency_key(client: FlaskClient) -> None:
    fork = client.get("/api/openapi.json").get_json()["paths"]["/api/runs/{run_id}/fork"]["post"]
    (header,) = [p for p in fork["parameters"] if p["in"] == "header"]
    assert header["name"] == "Idempotency-Key"
    assert header["schema"] == {"type": "string", "minLength": 1, "maxLength": 200}
    assert {"200", "201", "422"} <= fork["responses"].keys()


@pytest.mark.parametrize("key", ["", "k" * 201])
def test_a_bad_fork_idempotency_key_is_400(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm, key: str
) -> None:
    original = three_steps(runtime, llm)
    response = fork_with_key(client, original.id, {"fromSeq": 3}, key)
    assert response.status_code == 400
    assert response.get_json()["error"]["field"] == "Idempotency-Key"
    assert forks_of(runtime, original.id) == []


def test_concurrent_forks_with_one_key_make_one_fork(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    """Two submitters of one tenant (root's fork lands in the run's tenant: their quota locks
    do not serialise them) send the same fork at the same moment: the key's unique index
    does. To make the moment certain, an uncommitted run holding the key makes both wait at
    the insert, both having seen no run with it; it is rolled back, one fork is made and
    the other request finds it."""
    original = three_steps(runtime, llm)
    with runtime.engine.connect() as blocker:
        blocker.execute(
            text(
                "INSERT INTO run (id, agent, input, model, max_steps, token_budget, deadline_at,"
                " dispatch_token, tenant, idempotency_key) SELECT gen_random_uuid(), agent,"
                " input, model, max_steps, token_budget, deadline_at, gen_random_uuid(), tenant,"
                " 'together' FROM run WHERE id = :id"
            ),
            {"id": original.id},
        )

        def post(who: str) -> tuple[int, str]:
            response = fork_with_key(client, original.id, {"fromSeq": 3}, "together", who)
            return response.status_code, response.get_json().get("id")

        with ThreadPoolExecutor(2) as pool:
            results = pool.map(post, ["alice", "root"])
            deadline = time.monotonic() + 10
            while waiting_on_locks(runtime) < 2:
                assert time.monotonic() < deadline, "both requests wait at the insert"
                time.sleep(0.05)
            blocker.rollback()
            codes = sorted(results)
    assert [code for code, _ in codes] == [200, 201]
    assert codes[0][1] == codes[1][1]
    assert forks_of(runtime, original.id) == [uuid.UUID(codes[0][1])]


def waiting_on_locks(runtime: Runtime) -> int:
    with runtime.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        )


def test_a_retried_fork_gets_its_run_not_429(
    client: FlaskClient, runtime: Runtime, llm: ScriptedLlm
) -> None:
    original = three_steps(runtime, llm)
    runtime.settings = replace(runtime.settings, submit_rate_per_minute=1)
    first = fork_with_key(client, original.id, {"fromSeq": 3}, "k1")
    assert first.status_code == 201
    again = fork_with_key(client, original.id, {"fromSeq": 3}, "k1")
    assert (again.status_code, again.get_json()["id"]) == (200, first.get_json()["id"])
    assert fork_with_key(client, original.id, {"fromSeq": 3}, "k2").status_code == 429


# -- the CLI --------------------------------------------------------------------------------


@pytest.fixture
def api(runtime: Runtime) -> Iterator[str]:
    register_agent(runtime.agents, weather)
    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


def test_dar_fork_and_dar_diff(
    api: str, runtime: Runtime, llm: ScriptedLlm, capsys: pytest.CaptureFixture[str]
) -> None:
    original = three_steps(runtime, llm, tenant="")
    code = main(["fork", str(original.id)[:8], "--from-seq", "3", "--replay-model", "--api", api])
    out, err = capsys.readouterr()
    assert code == 0, err
    fork_id = out.strip()
    done = drive(runtime, fork_id)
    assert done.status is RunStatus.SUCCEEDED
    assert done.tokens_used == 0, "replayed: the request was unchanged"

    assert main(["diff", str(original.id)[:8], fork_id[:8], "--api", api]) == 0
    out = capsys.readouterr().out
    assert f"b: {fork_id} SUCCEEDED" in out
    assert f"forked from {original.id} at seq 3" in out
    assert "the steps are the same" in out
    assert "MODEL model:2 DONE (replayed) tokens=305" in out

    assert main(["timeline", fork_id, "--api", api]) == 0
    assert "DONE (copied)" in capsys.readouterr().out

    code = main(["fork", fork_id, "--from-seq", "9", "--api", api])
    assert code == 1
    assert "fromSeq: run" in capsys.readouterr().err
