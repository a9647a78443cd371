"""``api.serving.BufferChunked`` on its own: a chunked body is read only for a valid token,
only while the process-wide budget allows, and a body that stops arriving is a 408."""

from __future__ import annotations

import io
import json
from typing import Any

from werkzeug.exceptions import RequestTimeout

from api.serving import BufferBudget, BufferChunked, Environ


class Unreadable(io.RawIOBase):
    def read(self, *_: Any) -> bytes:  # type: ignore[override]
        raise AssertionError("the body was read")


class Stalls(io.RawIOBase):
    def read(self, *_: Any) -> bytes:  # type: ignore[override]
        raise RequestTimeout("the request body did not arrive within 3 s")


def _call(mw: BufferChunked, body: Any, auth: str = "Bearer good") -> tuple[str, dict[str, Any]]:
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    environ: Environ = {
        "HTTP_TRANSFER_ENCODING": "chunked",
        "HTTP_AUTHORIZATION": auth,
        "wsgi.input": body,
    }
    out = b"".join(mw(environ, start_response))
    return seen["status"], json.loads(out) if out.startswith(b"{") else {"app": out}


def _app(environ: Environ, start_response: Any) -> list[bytes]:
    start_response("200 OK", [])
    return [environ["wsgi.input"].read()]


def _mw(budget: BufferBudget | None = None) -> BufferChunked:
    return BufferChunked(_app, 1024, authenticated=lambda h: h == "Bearer good", budget=budget)


def test_no_byte_of_an_unauthenticated_body_is_read() -> None:
    status, body = _call(_mw(), Unreadable(), auth="Bearer bad")
    assert status.startswith("401")
    assert body["error"]["code"] == "unauthorized"


def test_a_valid_token_gets_its_body_buffered() -> None:
    status, body = _call(_mw(), io.BytesIO(b'{"input": "q"}'))
    assert (status, body) == ("200 OK", {"input": "q"})


def test_past_the_process_wide_budget_a_body_is_refused_with_retry_after() -> None:
    budget = BufferBudget(4096)
    assert budget.take(4000)  # other bodies being received
    status, body = _call(_mw(budget), io.BytesIO(b"x" * 100))
    assert status.startswith("503")
    assert body["error"]["code"] == "busy"
    budget.give(4000)
    assert _call(_mw(budget), io.BytesIO(b"x" * 100))[0] == "200 OK"
    assert budget.held == 0, "every reservation is given back"


def test_a_body_that_stops_arriving_is_a_408() -> None:
    status, body = _call(_mw(), Stalls())
    assert status.startswith("408")
    assert "did not arrive" in body["error"]["message"]
