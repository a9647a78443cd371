"""Engine setup. Nothing is built at import time: callers make an engine and pass it on."""

from __future__ import annotations

import os
import weakref

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url

_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


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


def make_engine(
    url: str, *, pool_size: int = 10, max_overflow: int = 10, application_name: str = "dar"
) -> Engine:
    """A pooled engine. Connections are held only for the length of a statement or a short
    transaction, never across a model or tool call, so a small pool serves many runs."""
    engine = create_engine(
        normalize_url(url),
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_pre_ping=True,
        pool_recycle=1800,
        # Statement parameters are prompts and results: never in an exception's text, so
        # never in a log line that prints one.
        hide_parameters=True,
        connect_args={"application_name": application_name, "connect_timeout": 5},
    )
    _engines.add(engine)
    return engine


def _drop_inherited_connections() -> None:
    # A forked child (gunicorn worker, Celery prefork child) must not reuse the parent's
    # sockets; close=False leaves them to the parent.
    for engine in list(_engines):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_drop_inherited_connections)
