"""Engine setup. Nothing is built at import time: callers make an engine and pass it on."""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, Literal

from sqlalchemy import Engine, create_engine, event, exc
from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

_engines: weakref.WeakSet[Engine] = weakref.WeakSet()

PrepareMode = Literal["auto", "on", "off"]
PREPARE_MODES: tuple[PrepareMode, ...] = ("auto", "on", "off")
"""``DAR_DB_PREPARE``: may psycopg prepare statements server-side (it does after five uses of
one statement on one connection)? A pooler in transaction mode (PgBouncer before 1.21, or
1.21+ without ``max_prepared_statements``) hands each transaction a different server
connection, where the prepared statement does not exist: ``InvalidSqlStatementName``.

- ``auto`` (default): off on a connection that goes through a pooler, on otherwise. The test:
  the backend pid the server announced when the connection opened (its cancel key) is not
  the pid of the backend that answers ``pg_backend_pid()``. A pooler makes up the cancel key
  it gives its clients (PgBouncer, Odyssey, pgcat do); PostgreSQL and a plain TCP proxy pass
  the real one. One round trip per new connection.
- ``on``: always (PgBouncer 1.21+ with ``max_prepared_statements`` > 0 keeps them);
- ``off``: never (``prepare_threshold=None``)."""


def normalize_url(url: str) -> str:
    """Accept the usual ``postgres://``/``postgresql://`` URLs and select psycopg 3."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    parsed = make_url(url)
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.drivername != "postgresql+psycopg":
        raise ValueError(
            f"DATABASE_URL must be a PostgreSQL URL (postgresql://...), got {parsed.drivername!r}"
        )
    return parsed.render_as_string(hide_password=False)


NETWORK_OPTIONS: dict[str, int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 15,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
"""libpq's socket settings for every connection: a connect gives up after 5 s; a connection
whose peer vanished (a partition, a failed-over host) is found dead by TCP keepalives within
~30 s when idle, and by ``tcp_user_timeout`` (30 s of unacknowledged data) when a statement
was sent into the void, instead of the kernel's ~15 minutes. A URL's own values win
(``?keepalives_idle=60``)."""

PING_AFTER_IDLE_SECONDS = 10.0
"""A pooled connection idle longer than this is pinged before use; a busy one is not (a ping
on every checkout was three of a step's thirteen round trips)."""


def make_engine(
    url: str,
    *,
    pool_size: int = 10,
    max_overflow: int = 10,
    application_name: str = "dar",
    prepare: PrepareMode = "auto",
) -> Engine:
    """A pooled engine. Connections are held only for the length of a statement or a short
    transaction, never across a model or tool call, so a small pool serves many runs.

    Liveness: a connection idle for more than :data:`PING_AFTER_IDLE_SECONDS` is pinged when
    checked out and replaced if dead (a server restart, an idle timeout on the way); one that
    breaks while in use is invalidated by SQLAlchemy and its statement fails, which the
    callers treat as a transient database error.

    ``prepare``: see :data:`PREPARE_MODES`."""
    if prepare not in PREPARE_MODES:
        raise ValueError(f"prepare must be one of {', '.join(PREPARE_MODES)}, got {prepare!r}")
    connect_args: dict[str, Any] = {
        "application_name": application_name,
        **NETWORK_OPTIONS,
    }
    if prepare == "off":
        connect_args["prepare_threshold"] = None
    normalized = normalize_url(url)
    given = make_url(normalized).query
    connect_args = {k: v for k, v in connect_args.items() if k not in given}
    engine = create_engine(
        normalized,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_recycle=1800,
        # Statement parameters are prompts and results: never in an exception's text, so
        # never in a log line that prints one.
        hide_parameters=True,
        connect_args=connect_args,
    )
    if prepare == "auto":
        event.listen(engine, "connect", _prepare_off_behind_a_pooler())
    event.listen(engine, "checkin", _checked_in)
    event.listen(engine, "checkout", _ping_if_idle)
    _engines.add(engine)
    return engine


def behind_a_pooler(dbapi_connection: Any) -> bool:
    """True when ``dbapi_connection`` (psycopg) reaches PostgreSQL through a connection
    pooler: the backend pid announced at connect is not the one answering (see
    :data:`PREPARE_MODES`). Leaves the connection as it found it (no transaction open)."""
    was = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        row = dbapi_connection.execute("SELECT pg_backend_pid()").fetchone()
    finally:
        dbapi_connection.autocommit = was
    return bool(row[0] != dbapi_connection.info.backend_pid)


def _prepare_off_behind_a_pooler() -> Any:
    """A ``connect`` listener for one engine: prepared statements off on each connection
    that goes through a pooler; said once per engine."""
    said = False

    def on_connect(dbapi_connection: Any, record: Any) -> None:
        nonlocal said
        if not behind_a_pooler(dbapi_connection):
            return
        dbapi_connection.prepare_threshold = None
        record.info["dar_pooler"] = True
        if not said:
            said = True
            log.info(
                "database connections go through a pooler: prepared statements off "
                "(DAR_DB_PREPARE=on keeps them, for PgBouncer 1.21+ with "
                "max_prepared_statements)",
                extra={"event": "db_pooler_detected"},
            )

    return on_connect


def _checked_in(dbapi_connection: Any, record: Any) -> None:
    record.info["dar_checked_in"] = time.monotonic()


def _ping_if_idle(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    since = record.info.get("dar_checked_in")
    if since is None or time.monotonic() - since < PING_AFTER_IDLE_SECONDS:
        return
    try:
        was = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        try:
            dbapi_connection.execute("SELECT 1")
        finally:
            dbapi_connection.autocommit = was
    except Exception as e:
        # The pool discards this connection and checks out (or opens) another.
        raise exc.DisconnectionError(f"pooled connection is dead: {e}") from e


def _drop_inherited_connections() -> None:
    # A forked child (gunicorn worker, Celery prefork child) must not reuse the parent's
    # sockets; close=False leaves them to the parent.
    for engine in list(_engines):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_drop_inherited_connections)
