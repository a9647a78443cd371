"""Serving: what the WSGI entry point wraps around the app.

The ``web`` process runs gunicorn's gevent worker: an idle or slow connection is a parked
greenlet (a socket and a little memory), never a thread, so ten or ten thousand of them
cannot starve ``/healthz`` or a submit. gunicorn's ``--keep-alive`` bounds how long a
request's header may take to arrive (the whole header, not each read); :class:`BodyDeadline`
bounds the body the same way. Without gevent (Flask's test client, another server) the body
deadline is left to that server.
"""

from __future__ import annotations

import io
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from werkzeug.exceptions import RequestTimeout

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
Wsgi = Callable[[Environ, StartResponse], Iterable[bytes]]


def gevent_patched() -> bool:
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("socket"))


class _DeadlineInput:
    """``wsgi.input`` whose reads fail with 408 once the body's deadline has passed."""

    def __init__(self, stream: Any, deadline: float, seconds: float) -> None:
        self._stream = stream
        self._deadline = deadline
        self._seconds = seconds

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        import gevent

        remaining = self._deadline - time.monotonic()
        too_slow = RequestTimeout(
            f"the request body did not arrive within {self._seconds:g} s "
            "(DAR_HTTP_BODY_TIMEOUT_SECONDS)"
        )
        if remaining <= 0:
            raise too_slow
        with gevent.Timeout(remaining, too_slow):
            return fn(*args)

    def read(self, *args: Any) -> bytes:
        data: bytes = self._call(self._stream.read, *args)
        return data

    def readline(self, *args: Any) -> bytes:
        data: bytes = self._call(self._stream.readline, *args)
        return data

    def readlines(self, *args: Any) -> list[bytes]:
        data: list[bytes] = self._call(self._stream.readlines, *args)
        return data

    def __iter__(self) -> Iterator[bytes]:
        while line := self.readline():
            yield line


class BodyDeadline:
    """WSGI middleware: the body of a request must arrive within ``seconds`` of the request
    reaching the app (under gevent; elsewhere a no-op)."""

    def __init__(self, app: Wsgi, seconds: float) -> None:
        self.app = app
        self.seconds = seconds
        self.active = gevent_patched()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if self.active and self.seconds > 0:
            environ["wsgi.input"] = _DeadlineInput(
                environ["wsgi.input"], time.monotonic() + self.seconds, self.seconds
            )
        return self.app(environ, start_response)


class BufferChunked:
    """WSGI middleware: a body without a Content-Length (chunked) is read here, up to the
    limit, so one over the limit is a 413 like any other, not a truncated body that then
    fails to parse (400)."""

    def __init__(self, app: Wsgi, limit: int) -> None:
        self.app = app
        self.limit = limit

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("CONTENT_LENGTH") or not (
            environ.get("wsgi.input_terminated")
            or "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        ):
            return self.app(environ, start_response)
        stream = environ["wsgi.input"]
        chunks: list[bytes] = []
        size = 0
        while size <= self.limit:
            chunk = stream.read(min(65536, self.limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > self.limit:
            body = json.dumps(
                {
                    "error": {
                        "code": "body_too_large",
                        "message": f"request body is larger than the limit of {self.limit} "
                        "bytes (DAR_MAX_BODY_BYTES)",
                    }
                }
            ).encode()
            start_response(
                "413 Request Entity Too Large",
                [
                    ("Content-Type", "application/json"),
                    ("Content-Length", str(len(body))),
                    ("Connection", "close"),
                ],
            )
            return [body]
        environ["wsgi.input"] = io.BytesIO(b"".join(chunks))
        environ["CONTENT_LENGTH"] = str(size)
        environ.pop("wsgi.input_terminated", None)
        return self.app(environ, start_response)
