"""``/api/stats``: the console's overview charts, aggregated in PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from flask import Blueprint, Response, jsonify, request

from api.auth import requires, tenant_scope
from api.errors import invalid
from api.schemas import STATS_WINDOWS
from api.serialize import stats_json
from api.state import state

bp = Blueprint("stats", __name__)


@bp.get("/stats")
@requires("read")
def stats() -> Response:
    """Runs finished per hour by status, recorded cost per hour by model, and step latency
    p50/p95 per hour by kind, over the last ``window`` (24h or 7d), for the request's
    tenant."""
    window = request.args.get("window", "24h")
    if window not in STATS_WINDOWS:
        raise invalid("window", f"must be one of {', '.join(STATS_WINDOWS)}")
    seconds = STATS_WINDOWS[window]
    until = datetime.now(UTC)
    found = state().runtime.store.stats(window_seconds=seconds, tenant=tenant_scope())
    return jsonify(
        {
            "window": window,
            "bucketSeconds": 3600,
            "since": (until - timedelta(seconds=seconds)).isoformat(),
            "until": until.isoformat(),
            **stats_json(found),
        }
    )
