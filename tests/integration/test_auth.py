"""Tokens and roles on every route; runs remember who submitted them; submit rate limit."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import replace

import pytest
from flask.testing import FlaskClient
from werkzeug.test import TestResponse

from api import create_app
from api.auth import ROLES, TokenTable, hash_token
from runtime.config import ConfigError, Settings
from runtime.engine.bootstrap import Runtime
from tasks.celery_app import make_celery
from tests.support import submit

TOKENS = {role: f"dar_token_for_{role}" for role in ROLES}
TEAM = "team"
"""The tenant every token of these tests belongs to (tenancy itself: test_tenants.py)."""


def _tokens_env(**extra: str) -> str:
    entries = [f"{role}-user:{role}:{hash_token(tok)}:{TEAM}" for role, tok in TOKENS.items()]
    entries += [f"{name}:{roles}:{hash_token(tok)}" for name, (roles, tok) in extra.items()]
    return ",".join(entries)


def _client(runtime: Runtime, settings: Settings) -> FlaskClient:
    runtime.settings = settings
    app = create_app(runtime=runtime, celery=make_celery(settings, register=False))
    return app.test_client()


@pytest.fixture
def client(runtime: Runtime, settings: Settings) -> FlaskClient:
    return _client(runtime, replace(settings, api_tokens=_tokens_env()))


def _auth(role: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[role]}"} if role else {}


Call = Callable[[FlaskClient, dict[str, str], str], TestResponse]

ROUTES: list[tuple[str, str, Call]] = [
    (
        "submit",
        "submit",
        lambda c, h, rid: c.post("/api/runs", json={"input": "hi"}, headers=h),
    ),
    ("list", "read", lambda c, h, rid: c.get("/api/runs", headers=h)),
    ("get", "read", lambda c, h, rid: c.get(f"/api/runs/{rid}", headers=h)),
    ("timeline", "read", lambda c, h, rid: c.get(f"/api/runs/{rid}/timeline", headers=h)),
    (
        "conversation",
        "read",
        lambda c, h, rid: c.get(f"/api/runs/{rid}/conversation", headers=h),
    ),
    ("counts", "read", lambda c, h, rid: c.get("/api/runs/counts", headers=h)),
    ("stats", "read", lambda c, h, rid: c.get("/api/stats?window=7d", headers=h)),
    ("cancel", "cancel", lambda c, h, rid: c.post(f"/api/runs/{rid}/cancel", headers=h)),
    (
        "resolve",
        "admin",
        lambda c, h, rid: c.post(f"/api/runs/{rid}/resolve", json={"action": "fail"}, headers=h),
    ),
]


@pytest.mark.parametrize(("route", "role", "call"), ROUTES, ids=[r[0] for r in ROUTES])
def test_every_route_demands_its_role(
    client: FlaskClient, runtime: Runtime, route: str, role: str, call: Call
) -> None:
    def fresh_run() -> str:
        return str(submit(runtime.store, agent="acme-tickets", tenant=TEAM)[0].id)

    missing = call(client, {}, fresh_run())
    assert missing.status_code == 401
    assert missing.get_json()["error"]["code"] == "unauthorized"
    assert missing.headers["WWW-Authenticate"].startswith("Bearer")
    assert call(client, {"Authorization": "Bearer wrong"}, fresh_run()).status_code == 401
    assert call(client, {"Authorization": f"Basic {TOKENS[role]}"}, fresh_run()).status_code == 401
    for other in ROLES:
        response = call(client, _auth(other), fresh_run())
        if other in (role, "admin"):
            # resolve answers 409 on a run that does not need attention: auth passed
            assert response.status_code in (200, 201, 202, 409), (other, response.get_json())
        else:
            assert response.status_code == 403, other
            assert f"lacks the role '{role}'" in response.get_json()["error"]["message"]


def test_open_routes_stay_open(client: FlaskClient) -> None:
    for path in ("/healthz", "/readyz", "/api/openapi.json"):
        assert client.get(path).status_code == 200, path
    assert client.get("/metrics").status_code == 401, "every tenant's counts: a token"
    assert client.get("/metrics", headers=_auth("metrics")).status_code == 200


def test_runs_remember_who_submitted_them(client: FlaskClient) -> None:
    created = client.post("/api/runs", json={"input": "hi"}, headers=_auth("submit"))
    run = client.get(created.headers["Location"], headers=_auth("read")).get_json()
    assert run["submittedBy"] == "submit-user"


def test_with_no_tokens_the_api_is_open_and_says_so(
    runtime: Runtime, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        c = _client(runtime, replace(settings, api_tokens=None))
    assert "API AUTHENTICATION IS OFF" in caplog.text
    created = c.post("/api/runs", json={"input": "hi"})
    assert created.status_code == 201
    assert c.get(created.headers["Location"]).get_json()["submittedBy"] is None


def test_submit_rate_limit_per_token(runtime: Runtime, settings: Settings) -> None:
    c = _client(runtime, replace(settings, api_tokens=_tokens_env(), submit_rate_per_minute=2))
    for _ in range(2):
        assert c.post("/api/runs", json={"input": "x"}, headers=_auth("submit")).status_code == 201
    limited = c.post("/api/runs", json={"input": "x"}, headers=_auth("submit"))
    assert limited.status_code == 429
    assert "DAR_SUBMIT_RATE_PER_MINUTE" in limited.get_json()["error"]["message"]
    assert 1 <= int(limited.headers["Retry-After"]) <= 61
    # Another token has its own allowance.
    assert c.post("/api/runs", json={"input": "x"}, headers=_auth("admin")).status_code == 201


def test_page_size_limit_is_configurable(runtime: Runtime, settings: Settings) -> None:
    c = _client(runtime, replace(settings, max_page_size=5))
    bad = c.get("/api/runs?limit=6")
    assert bad.status_code == 400
    assert "DAR_MAX_PAGE_SIZE" in bad.get_json()["error"]["message"]
    assert c.get("/api/runs?limit=5").status_code == 200


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("ci:read", "must be name:role\\+role:sha256hex"),
        ("ci:read+bad/role:" + "a" * 64, "not a role: bad/role"),
        ("ci:read:dar_plaintext_token", "SHA-256 as 64 hex digits, never the token itself"),
        (f"ci:read:{'a' * 64},ci:submit:{'b' * 64}", "names 'ci' twice"),
    ],
)
def test_bad_token_configuration_fails_at_startup(raw: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TokenTable.parse(raw)


def test_tokens_are_kept_as_hashes_only() -> None:
    table = TokenTable.parse(f"ci:read:{hash_token('s3cret')}")
    assert "s3cret" not in repr(table)
    principal = table.authenticate("s3cret")
    assert principal is not None
    assert principal.name == "ci"
    assert table.authenticate("s3cre") is None
    assert table.authenticate(str(uuid.uuid4())) is None
