"""The REST API's Flask app factory: blueprints, request checks, metrics."""

from __future__ import annotations

import logging
import re

from celery import Celery
from flask import Flask, Response, g, jsonify, request
from prometheus_client import CollectorRegistry
from prometheus_flask_exporter import PrometheusMetrics

from api.auth import (
    TokenSource,
    TokenTable,
    check_approval_roles,
    check_role,
    check_token_roles,
    warn_if_open,
)
from api.errors import ApiError, register_error_handlers
from api.openapi import openapi_document
from api.schemas import check_text
from api.serving import BufferBudget, BufferChunked
from api.state import ApiState
from runtime.agents import Agent
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.observe.logctx import pop_context, push_context
from runtime.observe.metrics import FleetCollector
from tasks.celery_app import make_celery

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    *,
    runtime: Runtime | None = None,
    celery: Celery | None = None,
) -> Flask:
    settings = settings or (runtime.settings if runtime else Settings.from_env())
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    owned = runtime is None
    runtime = runtime or Runtime.build(settings, pool_size=5)
    celery = celery or make_celery(settings, register=False)
    app.extensions["dar"] = ApiState(runtime, celery)
    approval_roles = runtime.agents.approval_roles()

    def check_tokens(table: TokenTable) -> None:
        check_token_roles(table, approval_roles)
        check_approval_roles(table, approval_roles)

    source = TokenSource(settings.api_tokens, settings.api_tokens_file, check_tokens)
    app.extensions["dar_token_source"] = source
    app.extensions["dar_tokens"] = tokens = source.table
    # Chunked bodies are buffered only for a valid token, and only so many bytes at once.
    app.wsgi_app = BufferChunked(  # type: ignore[method-assign]
        app.wsgi_app,
        settings.max_body_bytes,
        authenticated=lambda header: source.current().admits(header),
        budget=BufferBudget(settings.http_buffer_bytes),
    )
    warn_if_open(tokens)
    register_error_handlers(app)

    # The query parameters each documented operation takes: any other is refused, as an
    # unknown body field is.
    document = openapi_document(settings)
    known_query = {
        (path, method.upper()): {p["name"] for p in op.get("parameters", []) if p["in"] == "query"}
        for path, item in document["paths"].items()
        for method, op in item.items()
    }

    @app.before_request
    def _safe_query() -> None:
        for name, values in request.args.lists():
            check_text(name, "query parameter")
            for value in values:
                check_text(value, name)
        rule = request.url_rule
        if rule is None:
            return
        path = re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule.rule)
        allowed = known_query.get((path, request.method))
        unknown = sorted(set(request.args) - allowed) if allowed is not None else []
        if unknown:
            raise ApiError(
                400,
                f"unknown query parameter {unknown[0]!r}; allowed: "
                f"{', '.join(sorted(allowed or ())) or 'none'}",
                code="unknown_parameter",
                field=unknown[0],
            )

    @app.before_request
    def _metrics_role() -> None:
        # Fleet-wide counts of every tenant: a token with the metrics role, unless opened.
        if request.path == "/metrics" and not settings.metrics_public:
            check_role("metrics")

    @app.before_request
    def _log_context() -> None:
        run_id = (request.view_args or {}).get("run_id")
        if run_id:
            g.dar_log_token = push_context(run_id=run_id)

    @app.teardown_request
    def _end_log_context(_: BaseException | None) -> None:
        token = g.pop("dar_log_token", None)
        if token is not None:
            pop_context(token)

    from api.approvals import bp as approvals_bp
    from api.console import bp as console_bp
    from api.events import bp as events_bp
    from api.forks import bp as forks_bp
    from api.health import bp as health_bp
    from api.messages import bp as messages_bp
    from api.runs import bp as runs_bp
    from api.schedules import bp as schedules_bp
    from api.signals import bp as signals_bp
    from api.stats import bp as stats_bp
    from api.versions import bp as versions_bp

    app.register_blueprint(runs_bp, url_prefix="/api")
    app.register_blueprint(events_bp, url_prefix="/api")
    app.register_blueprint(approvals_bp, url_prefix="/api")
    app.register_blueprint(stats_bp, url_prefix="/api")
    app.register_blueprint(forks_bp, url_prefix="/api")
    app.register_blueprint(schedules_bp, url_prefix="/api")
    app.register_blueprint(signals_bp, url_prefix="/api")
    app.register_blueprint(messages_bp, url_prefix="/api")
    app.register_blueprint(versions_bp, url_prefix="/api")
    app.register_blueprint(health_bp)
    app.register_blueprint(console_bp)

    # HTTP metrics, and the fleet-wide gauges read from PostgreSQL, on /metrics. A registry
    # per app: one process serves one app (gunicorn --workers 1 --threads N per container).
    registry = CollectorRegistry()
    registry.register(FleetCollector(runtime.store))
    PrometheusMetrics(app, registry=registry, group_by="endpoint", defaults_prefix="dar")

    @app.get("/api/openapi.json")
    def openapi() -> Response:
        names = runtime.agents.names()
        durable = any(not isinstance(runtime.agents.get(n), Agent) for n in names)
        return jsonify(
            openapi_document(settings, names, any_json_input=durable, auth=tokens.enabled)
        )

    if owned:
        import atexit

        atexit.register(runtime.close)
    return app
