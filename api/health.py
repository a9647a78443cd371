"""Liveness and readiness."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify
from sqlalchemy import text

from api.state import state
from db.errors import MigrationsPending
from db.migrate import check_current

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz() -> Response:
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    s = state()
    problems: dict[str, str] = {}
    try:
        with s.runtime.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        check_current(s.runtime.engine)
    except MigrationsPending as e:
        problems["migrations"] = str(e)
    except Exception as e:
        problems["postgres"] = f"{type(e).__name__}: not answering"
    try:
        with s.celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
    except Exception as e:
        problems["redis"] = f"{type(e).__name__}: not answering"
    if problems:
        return jsonify({"status": "unavailable", "problems": problems}), 503
    return jsonify({"status": "ready"}), 200
