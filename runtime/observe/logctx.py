"""Run-scoped logging: the run, step and worker of the current code path, on every record.

The driver sets the context with :func:`log_context`; :class:`ContextFilter` copies it onto
each log record as ``run_id``, ``step_seq`` and ``worker`` (``"-"`` when not in a run).

User data never reaches a log line by default: inputs, results, comments, model and tool
output, and exception messages (which quote them: a decode error quotes the whole input) are
written as their kind, length and a hash (:func:`data`, :func:`error_text`), and exceptions
are formatted with their traceback's frames but not their message. ``DAR_LOG_DATA=1`` writes
the content for debugging, and says so loudly when logging starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import traceback
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


_log_data = [False]


def log_data() -> bool:
    """``DAR_LOG_DATA``: log lines may carry user data (debugging only)."""
    return _log_data[0]


def set_log_data(on: bool) -> None:
    _log_data[0] = on


def data(value: object) -> str:
    """What a log line says about user data: ``<str 99135 chars sha256:1f2e3d4c5b6a>``, its
    kind, length and a hash (equal values log alike, so lines can still be matched); the
    value itself only with ``DAR_LOG_DATA=1``."""
    text = value if isinstance(value, str) else repr(value)
    if _log_data[0]:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:12]
    return f"<{type(value).__name__} {len(text)} chars sha256:{digest}>"


_ERROR_PREFIX = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Rejected|Timeout|Mismatch))\b:? ?")


def error_text(text: str | None) -> str:
    """An error as a log line may show it: its exception type, if it starts with one, and
    the rest as :func:`data`."""
    if not text:
        return ""
    if _log_data[0]:
        return text
    m = _ERROR_PREFIX.match(text)
    kind, rest = (m.group(1), text[m.end() :]) if m else ("error", text)
    return f"{kind} {data(rest)}" if rest else kind


def exception_text(exc: BaseException) -> str:
    """``module.Type <str n chars sha256:…>``: an exception without its message."""
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    return f"{name}: {exc}" if _log_data[0] else f"{name} {data(str(exc))}"


class DataFilter(logging.Filter):
    """Celery's own task lines (``Task … raised unexpected: <exc>``) carry the exception's
    repr: its message, which can quote a model's or a tool's output. They keep the type."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _log_data[0] and isinstance(record.args, dict) and "exc" in record.args:
            exc = record.args["exc"]
            record.args = {**record.args, "exc": error_text(str(exc))}
        return True


def _format_exception(exc_info: Any) -> str:
    """The frames of a traceback (file, line, function, code line: no data) and the
    exception's type, its message as :func:`data`; the message itself with DAR_LOG_DATA."""
    _, value, tb = exc_info
    if _log_data[0] or value is None:
        return "".join(traceback.format_exception(*exc_info)).rstrip("\n")
    frames = "".join(traceback.format_tb(tb))
    return f"Traceback (most recent call last):\n{frames}{exception_text(value)}"


class ConsoleFormatter(logging.Formatter):
    def formatException(self, ei: Any) -> str:
        return _format_exception(ei)


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
            out["exc"] = _format_exception(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def make_handler(fmt: str = "console", *, stream: IO[str] | None = None) -> logging.Handler:
    """A handler with the context filter and the console or JSON format (``DAR_LOG_FORMAT``);
    gunicorn's logger class uses it too, so its banner and access lines match."""
    if fmt not in ("console", "json"):
        raise ValueError(f"DAR_LOG_FORMAT must be console or json, got {fmt!r}")
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.addFilter(DataFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(ConsoleFormatter(CONSOLE_FORMAT))
    return handler


QUIET_AT_INFO = ("celery.beat", "alembic")
"""Loggers held at WARNING unless DEBUG is asked for: the beat's ``Sending due task`` line
every reaper interval, Alembic's ``Context impl`` lines on every migration check."""


def configure_logging(
    fmt: str = "console", level: str = "INFO", *, stream: IO[str] | None = None
) -> None:
    """Install the context filter and a console or JSON handler on the root logger."""
    handler = make_handler(fmt, stream=stream)
    set_log_data(os.environ.get("DAR_LOG_DATA", "").lower() in ("1", "true", "yes", "on"))
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
    _log_greenlet_errors()
    if log_data():
        logging.getLogger(__name__).warning(
            "DAR_LOG_DATA IS ON: log lines carry inputs, results, comments, model and tool "
            "output and exception messages. Use it to debug, never in production."
        )


def _log_greenlet_errors() -> None:
    """gevent's hub reports a greenlet that died with an exception by printing its traceback
    (message included) and the greenlet (its arguments included) to stderr, past the log's
    redaction. Route it through the log instead: frames and the exception's type, its
    message as :func:`data`, the greenlet named by its type only."""
    try:
        from gevent.hub import Hub
    except ImportError:  # no gevent here: nothing prints past the log
        return

    def print_exception(hub: Any, context: Any, t: Any, v: Any, tb: Any) -> None:
        where = type(context).__name__ if context is not None else "the hub"
        logging.getLogger("gevent").error(
            "a greenlet (%s) died with %s",
            where,
            getattr(t, "__name__", "an exception"),
            exc_info=(t, v, tb) if v is not None else None,
        )

    Hub.print_exception = print_exception
