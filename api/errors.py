"""Errors as JSON: ``{"error": {"code", "message", "field"?}}`` with the right status."""

from __future__ import annotations

import logging
import traceback
from typing import Any

from flask import Flask, Response, jsonify
from sqlalchemy.exc import DBAPIError, OperationalError, StatementError
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from db.errors import DarError, DatabaseUnavailable, ValueRefused

log = logging.getLogger(__name__)


class ApiError(DarError):
    """The request cannot be served."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str = "bad_request",
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.field = field
        self.headers = headers or {}


def invalid(field: str, message: str) -> ApiError:
    return ApiError(400, f"{field}: {message}", code="invalid_field", field=field)


def error_response(status: int, code: str, message: str, **extra: Any) -> tuple[Response, int]:
    body: dict[str, Any] = {"code": code, "message": message}
    body.update({k: v for k, v in extra.items() if v is not None})
    return jsonify({"error": body}), status


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(ApiError)
    def _api_error(e: ApiError) -> tuple[Response, int]:
        response, status = error_response(e.status, e.code, str(e), field=e.field)
        if status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="dar"'
        for name, value in e.headers.items():
            response.headers[name] = value
        return response, status

    @app.errorhandler(RequestEntityTooLarge)
    def _too_large(e: RequestEntityTooLarge) -> tuple[Response, int]:
        limit = app.config.get("MAX_CONTENT_LENGTH")
        return error_response(
            413,
            "body_too_large",
            f"request body is larger than the limit of {limit} bytes (DAR_MAX_BODY_BYTES)",
        )

    @app.errorhandler(HTTPException)
    def _http(e: HTTPException) -> tuple[Response, int]:
        status = e.code or 500
        response, _ = error_response(
            status, (e.name or "error").lower().replace(" ", "_"), e.description or ""
        )
        # Keep the exception's own headers (a 405's Allow, a 401's WWW-Authenticate).
        for name, value in e.get_headers():
            if name.lower() != "content-type":
                response.headers[name] = value
        return response, status

    @app.errorhandler(OperationalError)
    def _db_down(e: OperationalError) -> tuple[Response, int]:
        log.error("database unavailable: %s", _db_error_summary(e))
        return error_response(503, "database_unavailable", "the database is not answering; retry")

    @app.errorhandler(DatabaseUnavailable)
    def _store_down(e: DatabaseUnavailable) -> tuple[Response, int]:
        # What the store raises with the database away; the cause is the driver's error.
        cause = e.__cause__
        log.error(
            "database unavailable: %s",
            _db_error_summary(cause) if isinstance(cause, StatementError) else type(cause).__name__,
        )
        return error_response(503, "database_unavailable", "the database is not answering; retry")

    @app.errorhandler(ValueRefused)
    def _bad_value(e: ValueRefused) -> tuple[Response, int]:
        # Validation refuses what PostgreSQL cannot store; this is the net under it. The
        # store translated the driver's error (its cause); its text may quote the value.
        cause = e.__cause__
        log.warning(
            "database refused a value: %s",
            _db_error_summary(cause) if isinstance(cause, StatementError) else type(cause).__name__,
        )
        return error_response(
            400, "invalid_value", "a value in the request cannot be stored (see the API docs)"
        )

    @app.errorhandler(Exception)
    def _unexpected(e: Exception) -> tuple[Response, int]:
        if isinstance(e, StatementError):
            # The message of a database error can quote the data (a constraint's key, a JSON
            # fragment): log where and what kind, never the text.
            log.error(
                "unhandled database error: %s\n%s",
                _db_error_summary(e),
                "".join(traceback.format_tb(e.__traceback__)),
            )
        else:
            log.exception("unhandled error")
        return error_response(500, "internal_error", "internal error; see the server log")


def _db_error_summary(e: StatementError) -> str:
    """The kind of a database error and its SQLSTATE, without its message or parameters."""
    orig = e.orig if isinstance(e, DBAPIError) else None
    sqlstate = getattr(orig, "sqlstate", None)
    kind = type(orig).__name__ if orig is not None else type(e).__name__
    return f"{kind} (SQLSTATE {sqlstate})" if sqlstate else kind
