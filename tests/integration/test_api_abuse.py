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
    runtime.settings = replace(settings, api_tokens=token_env(), **changes)
    return create_app(
        runtime=runtime, celery=make_celery(runtime.settings, register=False)
    ).test_client()


@pytest.fixture
def client(runtime: Runtime, settings: Settings) -> FlaskClient:
    runtime.tickets.seed()
    runtime.agents.register(build_refund(runtime.tickets))
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
