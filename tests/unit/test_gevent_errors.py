"""A greenlet that dies with an exception is reported by gevent's hub, outside ``logging``: its
traceback (with the exception's message, which can quote a model's or a tool's output) went to
stderr as it was. After :func:`configure_logging` it goes through the log, redacted."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import gevent
import pytest

from runtime.observe.logctx import configure_logging

MARKER = "PROMPT-3c1d-do-not-log"


@pytest.fixture
def logged() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    buffer = io.StringIO()
    configure_logging("json", "INFO", stream=buffer)
    yield buffer
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_a_dying_greenlets_traceback_is_logged_without_its_message(
    logged: io.StringIO, capsys: pytest.CaptureFixture[str]
) -> None:
    hub = gevent.get_hub()
    stderr = io.StringIO()
    saved, hub.exception_stream = hub.exception_stream, stderr

    def boom(secret: str) -> None:
        raise ValueError(f"the tool answered {secret}")

    try:
        gevent.spawn(boom, MARKER).join()
    finally:
        hub.exception_stream = saved
    out = logged.getvalue() + stderr.getvalue() + "".join(capsys.readouterr())
    assert "ValueError" in logged.getvalue(), "the failure is still reported, in the log"
    assert MARKER not in out
