"""Run-scoped logging: the run, step and worker of the current code path, on every record.

The driver sets the context with :func:`log_context`; :class:`ContextFilter` copies it onto
each log record as ``run_id``, ``step_seq`` and ``worker`` (``"-"`` when not in a run).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from contextvars import ContextVar, Token
from typing import IO, Any

_context: ContextVar[dict[str, Any] | None] = ContextVar("dar_log_context", default=None)

FIELDS = ("run_id", "step_seq", "worker")


_process_defaults: dict[str, Any] = {}


def set_process_worker(name: str) -> None:
    """The worker id every line of this process carries when no run context sets one."""
    _process_defaults["worker"] = name


def push_context(**values: Any) -> Token[dict[str, Any] | None]:
    return _context.set({**(_context.get() or {}), **values})


def pop_context(token: Token[dict[str, Any] | None]) -> None:
    _context.reset(token)


@contextlib.contextmanager
def log_context(**values: Any) -> Iterator[None]:
    token = push_context(**values)
    try:
        yield
    finally:
        pop_context(token)


def set_step(seq: int) -> None:
    current = _context.get()
    if current is not None:
        current["step_seq"] = seq


class ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _context.get() or {}
        for name in FIELDS:
            if not hasattr(record, name):
                setattr(record, name, ctx.get(name, _process_defaults.get(name, "-")))
        return True


CONSOLE_FORMAT = "%(asctime)s %(levelname)-5s %(worker)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line with the run context and any ``event`` extra."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S%z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in (*FIELDS, "event"):
            value = getattr(record, name, None)
            if value not in (None, "-"):
                out[name] = str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def make_handler(fmt: str = "console", *, stream: IO[str] | None = None) -> logging.Handler:
    """A handler with the context filter and the console or JSON format (``DAR_LOG_FORMAT``);
    gunicorn's logger class uses it too, so its banner and access lines match."""
    if fmt not in ("console", "json"):
        raise ValueError(f"DAR_LOG_FORMAT must be console or json, got {fmt!r}")
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(CONSOLE_FORMAT))
    return handler


QUIET_AT_INFO = ("celery.beat", "alembic")
"""Loggers held at WARNING unless DEBUG is asked for: the beat's ``Sending due task`` line
every reaper interval, Alembic's ``Context impl`` lines on every migration check."""


def configure_logging(
    fmt: str = "console", level: str = "INFO", *, stream: IO[str] | None = None
) -> None:
    """Install the context filter and a console or JSON handler on the root logger."""
    handler = make_handler(fmt, stream=stream)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Libraries that would print request bodies or headers at DEBUG stay at WARNING.
    for noisy in ("anthropic", "httpx", "httpx2", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Celery's "Task received" / "Task succeeded" lines, two per step, cost ~10% of a
    # worker's throughput and repeat what the runtime's own step lines say.
    for per_task in ("celery.app.trace", "celery.worker.strategy"):
        logging.getLogger(per_task).setLevel(logging.WARNING)
    for chatty in QUIET_AT_INFO:
        logging.getLogger(chatty).setLevel(
            logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING
        )
