"""Attacks on the API with tokens for two tenants (issue 28): what an unauthenticated or
low-privilege caller can cost the server, and what one tenant can learn or take from another."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from api import create_app
from api.auth import hash_token
from api.errors import ApiError
from api.schemas import MAX_JSON_DEPTH, check_json
from examples.order_refund import build as build_refund
from runtime.bootstrap import Runtime
from runtime.config import Settings
from tasks.celery_app import make_celery

# name: (roles, token, tenant)
TOKENS = {
    "alice": ("read+submit+cancel", "tok-alice", "red"),
    "amy": ("submit", "tok-amy", "red"),
    "ann": ("read+approve+finance", "tok-ann", "red"),
    "bob": ("read+submit+cancel+approve+finance", "tok-bob", "blue"),
    "root": ("admin", "tok-root", "ops"),
}


def token_env(tokens: dict[str, tuple[str, str, str]] = TOKENS) -> str:
    return ",".join(
        f"{name}:{roles}:{hash_token(tok)}:{tenant}"
        for name, (roles, tok, tenant) in tokens.items()
    )


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][1]}"}


def make_client(runtime: Runtime, settings: Settings, **changes: Any) -> FlaskClient:
    if "order-refund" not in runtime.agents:
        runtime.tickets.seed()
        runtime.agents.register(build_refund(runtime.tickets))
    runtime.settings = replace(settings, api_tokens=token_env(), **changes)
    return create_app(
        runtime=runtime, celery=make_celery(runtime.settings, register=False)
    ).test_client()


@pytest.fixture
def client(runtime: Runtime, settings: Settings) -> FlaskClient:
    return make_client(runtime, settings)


def submit(client: FlaskClient, who: str, body: Any = None, **headers: str) -> TestResponse:
    return client.post(
        "/api/runs", json=body or {"input": "Which tickets?"}, headers={**auth(who), **headers}
    )


# -- 5. the size before anything that costs time in proportion to it ----------------------


def test_an_input_over_the_limit_is_refused_for_its_size_before_its_text_is_walked(
    client: FlaskClient, runtime: Runtime
) -> None:
    limit = runtime.settings.max_input_chars
    # Over the input limit, under the body limit, and unsafe deep inside: the size decides.
    hostile = {"a": ["x"] * (limit // 4) + ["\x00"]}
    response = client.post(
        "/api/runs",
        data=json.dumps({"agent": "order-refund", "input": hostile}),
        content_type="application/json",
        headers=auth("alice"),
    )
    assert response.status_code == 400
    error = response.get_json()["error"]
    assert error["field"] == "input"
    assert "DAR_MAX_INPUT_CHARS" in error["message"], error


def test_the_walk_names_the_place_of_unsafe_text_and_of_too_deep_nesting() -> None:
    with pytest.raises(ApiError) as nul:
        check_json({"input": {"a": [1, {"b": "ok"}, {"c": "x\x00"}]}})
    assert nul.value.field == "input.a[2].c"
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    check_json({"v": deep[0]}, text=False)  # exactly the limit
    with pytest.raises(ApiError, match="nested more than"):
        check_json({"v": deep}, text=False)
    with pytest.raises(ApiError, match="nested more than"):
        check_json({"v": deep})


def test_a_list_of_runs_carries_no_input(client: FlaskClient) -> None:
    run_id = submit(client, "alice", {"input": "secret question " * 100}).get_json()["id"]
    (item,) = client.get("/api/runs", headers=auth("alice")).get_json()["items"]
    assert item["id"] == run_id
    assert "input" not in item
    one = client.get(f"/api/runs/{run_id}", headers=auth("alice")).get_json()
    assert one["input"].startswith("secret question")


# -- 4. event streams per token and per tenant -----------------------------------------------


def test_open_event_streams_are_limited_per_token_and_per_tenant(
    runtime: Runtime, settings: Settings
) -> None:
    client = make_client(runtime, settings, events_streams_per_token=2, events_streams_per_tenant=3)
    run_id = submit(client, "alice").get_json()["id"]
    path = f"/api/runs/{run_id}/events"

    def stream(who: str) -> TestResponse:
        return client.get(path, headers=auth(who), buffered=False)

    held = [stream("alice"), stream("alice")]
    assert [r.status_code for r in held] == [200, 200]
    refused = stream("alice")
    assert refused.status_code == 429
    assert refused.headers["Retry-After"].isdigit()
    assert "DAR_EVENTS_STREAMS_PER_TOKEN" in refused.get_json()["error"]["message"]

    held.append(stream("ann"))  # the tenant's third
    assert held[-1].status_code == 200
    tenant_full = stream("ann")
    assert tenant_full.status_code == 429
    assert "DAR_EVENTS_STREAMS_PER_TENANT" in tenant_full.get_json()["error"]["message"]

    # Another tenant, and the routes that are not streams, are untouched.
    bob_run = submit(client, "bob").get_json()["id"]
    other = client.get(f"/api/runs/{bob_run}/events", headers=auth("bob"), buffered=False)
    assert other.status_code == 200
    other.close()
    assert client.get("/healthz").status_code == 200
    assert submit(client, "alice").status_code == 201

    held.pop(0).close()  # a stream ends: its slot is free again
    again = stream("alice")
    assert again.status_code == 200
    for r in [*held, again]:
        r.close()


def test_the_process_keeps_connections_for_other_routes(
    runtime: Runtime, settings: Settings
) -> None:
    client = make_client(runtime, settings, events_streams_max=2)
    run_id = submit(client, "alice").get_json()["id"]
    bob_run = submit(client, "bob").get_json()["id"]
    held = [
        client.get(f"/api/runs/{run_id}/events", headers=auth("alice"), buffered=False),
        client.get(f"/api/runs/{bob_run}/events", headers=auth("bob"), buffered=False),
    ]
    refused = client.get(f"/api/runs/{bob_run}/events", headers=auth("bob"), buffered=False)
    assert refused.status_code == 429
    assert "DAR_EVENTS_STREAMS_MAX" in refused.get_json()["error"]["message"]
    for r in held:
        r.close()


# -- 3. priority is bounded per token ---------------------------------------------------------


def test_a_token_without_admin_cannot_jump_every_queue(client: FlaskClient) -> None:
    body = {"input": "Which tickets?", "concurrencyKey": "shared"}
    assert submit(client, "alice", {**body, "priority": 10}).status_code == 201
    refused = submit(client, "alice", {**body, "priority": 1000})
    assert refused.status_code == 403
    error = refused.get_json()["error"]
    assert error["field"] == "priority"
    assert "DAR_TOKEN_MAX_PRIORITY" in error["message"]
    assert submit(client, "root", {**body, "priority": 1000}).status_code == 201
