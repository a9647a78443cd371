"""The run console: a few server-rendered page shells at ``/`` and a vanilla script that
fills them from the JSON API.

The pages carry no run data and need no token: the script reads the token from the
browser's session storage and sends it as the bearer header on every API call, so there are
no cookies (nothing for a cross-site request to ride on) and the token never appears in a
URL. Whatever the API returns is shown as text (``textContent``), never parsed as markup, and
a strict Content-Security-Policy refuses any script but our own files.

``GET /api/whoami`` tells the script who the token is and which actions it may take, so
buttons a role may not use are not shown (the API checks every action again).
"""

from __future__ import annotations

import uuid

from flask import Blueprint, Response, jsonify, render_template

from api.auth import ROLES, authenticated, current_principal, tokens_now
from api.errors import ApiError
from api.state import state
from runtime.agents import Agent

bp = Blueprint("console", __name__)

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)

PAGES = {
    "runs": "Runs",
    "run": "Run",
    "approvals": "Approvals",
    "attention": "Needs attention",
    "overview": "Overview",
    "diff": "Compare runs",
    "schedules": "Schedules",
    "versions": "Versions",
}


def _page(page: str, **context: object) -> Response:
    agents = state().runtime.agents
    tokens = tokens_now()
    html = render_template(
        f"console/{page}.html",
        page=page,
        title=PAGES[page],
        auth=tokens.enabled,
        agents=[(n, not isinstance(agents.get(n), Agent)) for n in agents.names()],
        default_agent=state().runtime.settings.default_agent,
        **context,
    )
    response = Response(html, mimetype="text/html")
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Cache-Control"] = "no-store"
    return response


@bp.get("/")
def runs_page() -> Response:
    return _page("runs")


def _run_id(raw: str) -> str:
    try:
        return str(uuid.UUID(raw))
    except ValueError:
        raise ApiError(404, f"no run with id {raw!r} (run ids are UUIDs)") from None


@bp.get("/runs/<run_id>")
def run_page(run_id: str) -> Response:
    return _page("run", run_id=_run_id(run_id))


@bp.get("/runs/<run_id>/diff/<other_id>")
def diff_page(run_id: str, other_id: str) -> Response:
    """Two runs side by side (``GET /api/runs/{a}/diff/{b}``), a fork and its original
    typically."""
    return _page("diff", run_a=_run_id(run_id), run_b=_run_id(other_id))


@bp.get("/approvals")
def approvals_page() -> Response:
    return _page("approvals")


@bp.get("/attention")
def attention_page() -> Response:
    return _page("attention")


@bp.get("/schedules")
def schedules_page() -> Response:
    return _page("schedules")


@bp.get("/versions")
def versions_page() -> Response:
    """The deployment versions, their workers and runs in flight; upgrades
    (``/api/versions``)."""
    return _page("versions")


@bp.get("/overview")
def overview_page() -> Response:
    return _page("overview")


@bp.get("/api/whoami")
@authenticated
def whoami() -> Response:
    """The token's name, tenant and roles, and what the console may offer it. With
    authentication off everything is allowed, as in the API."""
    principal = current_principal()
    declared = sorted(state().runtime.agents.approval_roles())
    if principal is None:
        return jsonify(
            {
                "auth": False,
                "name": None,
                "tenant": None,
                "roles": list(ROLES),
                "approvalRoles": declared,
                "can": {
                    a: True
                    for a in (
                        "submit",
                        "fork",
                        "cancel",
                        "resume",
                        "resolve",
                        "approve",
                        "versions",
                        "upgrade",
                    )
                },
            }
        )
    return jsonify(
        {
            "auth": True,
            "name": principal.name,
            "tenant": principal.tenant,
            "roles": sorted(principal.roles),
            "approvalRoles": [r for r in declared if principal.holds(r)],
            "can": {
                "submit": principal.has("submit"),
                "fork": principal.has("submit"),
                "cancel": principal.has("cancel"),
                "resume": principal.has("submit"),
                "resolve": principal.has("admin"),
                "approve": principal.has("approve") and any(principal.holds(r) for r in declared),
                "versions": principal.has("metrics"),
                "upgrade": principal.has("admin"),
            },
        }
    )
