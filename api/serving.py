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


def _json_reply(
    start_response: StartResponse,
    status: str,
    code: str,
    message: str,
    headers: list[tuple[str, str]] | None = None,
) -> list[bytes]:
    """An error answered by the middleware itself, outside Flask: the same JSON shape, and
    the connection closed (the body it did not read is left unread)."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    start_response(
        status,
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            *(headers or []),
        ],
    )
    return [body]


class BufferBudget:
    """Bytes of chunked bodies held in memory at once, process-wide: a request that would
    take more waits for none, it is refused (503, ``Retry-After``)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class BufferChunked:
    """WSGI middleware: a body without a Content-Length (chunked) is read here, up to the
    limit, so one over the limit is a 413 like any other, not a truncated body that then
    fails to parse (400).

    Nothing unauthenticated costs memory: when tokens are configured the request's bearer
    token is checked from its header *before* a byte of the body is read (401, connection
    closed), and the bytes held by all chunked bodies being read at once are bounded by
    ``budget`` (503). A body that does not arrive in time (:class:`BodyDeadline`) is a 408
    here too, not an error escaping the app.
    """

    def __init__(
        self,
        app: Wsgi,
        limit: int,
        *,
        authenticated: Callable[[str], bool] | None = None,
        budget: BufferBudget | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.authenticated = authenticated
        self.budget = budget or BufferBudget(64 * limit)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        # Only a chunked body (gunicorn marks every input "terminated", bodies or not). A
        # Content-Length beside "chunked" does not frame the body (RFC 9112 6.3): the chunks
        # do, and Werkzeug would read nothing, so such a body is buffered too.
        if "chunked" not in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
            return self.app(environ, start_response)
        if self.authenticated is not None and not self.authenticated(
            environ.get("HTTP_AUTHORIZATION", "")
        ):
            return _json_reply(
                start_response,
                "401 Unauthorized",
                "unauthorized",
                "send a valid API token: Authorization: Bearer <token> (a body is read only "
                "after the token is checked)",
                [("WWW-Authenticate", 'Bearer realm="dar"')],
            )
        reserved = 0
        try:
            buffer = io.BytesIO()
            size = 0
            while size <= self.limit:
                want = min(65536, self.limit + 1 - size)
                if not self.budget.take(want):
                    return _json_reply(
                        start_response,
                        "503 Service Unavailable",
                        "busy",
                        "too many request bodies are being received at once; retry",
                        [("Retry-After", "1")],
                    )
                reserved += want
                chunk = environ["wsgi.input"].read(want)
                if not chunk:
                    break
                buffer.write(chunk)
                size += len(chunk)
        except RequestTimeout as e:
            return _json_reply(
                start_response, "408 Request Timeout", "request_timeout", str(e.description)
            )
        finally:
            self.budget.give(reserved)
        if size > self.limit:
            return _json_reply(
                start_response,
                "413 Request Entity Too Large",
                "body_too_large",
                f"request body is larger than the limit of {self.limit} bytes (DAR_MAX_BODY_BYTES)",
            )
        buffer.seek(0)
        environ["wsgi.input"] = buffer
        environ["CONTENT_LENGTH"] = str(size)
        # The body is whole now, with a length: Werkzeug ignores a length beside
        # "Transfer-Encoding: chunked" (and reads nothing), so the header goes.
        environ.pop("HTTP_TRANSFER_ENCODING", None)
        environ.pop("wsgi.input_terminated", None)
        return self.app(environ, start_response)
