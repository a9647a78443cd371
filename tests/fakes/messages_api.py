"""A fake Anthropic Messages API on loopback, for tests. Standard library only.

    with FakeMessagesApi() as fake:
        fake.then_tool_use("toolu_1", "lookup", {"q": "x"}).then_text("done")
        client = AnthropicClient(base_url=fake.url, api_key="test")
        ...
        assert fake.calls == 2

* ``POST /v1/messages`` answers from a script (a FIFO of :class:`Reply`), one entry per
  request: message turns, error statuses with Anthropic-shaped bodies and optional
  ``retry-after`` headers, a body that drips out slowly, a connection reset.
* Every request is validated first, like the real API (see :func:`validate_request`); a
  violation is answered with 400 ``invalid_request_error`` and does NOT consume the script.
* Every request (path, headers, raw body, parsed JSON, the status answered) is logged in
  :attr:`FakeMessagesApi.requests`; :attr:`FakeMessagesApi.calls` counts model calls.
* A request with ``"stream": true`` gets a message as server-sent events, like the real API
  (``message_start``, per block ``content_block_start`` / deltas / ``content_block_stop``,
  ``message_delta`` with the final usage, ``message_stop``): text in pieces of
  ``drip_chunk`` characters (default 4), one event every ``drip_interval`` seconds (see
  :func:`slow`). A client that hangs up mid-stream is noted in :attr:`FakeMessagesApi.aborts`
  (the request number and ``time.monotonic()`` when the fake saw it).
* When the script is empty the fake answers 400 ``fake script exhausted`` (non-retryable,
  so a test that under-scripts fails at once), unless a default responder is set:
  ``default_responder=True`` answers every extra call with an ``end_turn`` text turn, or
  pass a callable ``(request_json) -> Reply`` to compute answers for long runs.

With ``rate_limits={"claude-*": RateLimit(...)}`` the fake enforces real token buckets per
model (requests, input tokens and output tokens per minute, refilled continuously): a request
that does not fit is answered 429 ``rate_limit_error`` with ``retry-after`` and the
``anthropic-ratelimit-*`` headers, and does not consume the script; every answer carries those
headers. The buckets start full, or with a share ``spent`` already. Input tokens are the
fake's count of the request (:func:`count_input_tokens`, also reported in the response's
usage); output tokens are taken at ``max_tokens`` up front and the unused part given back, as
the real API estimates them.

Billing follows the real API (:attr:`FakeMessagesApi.billed`, one :class:`Billed` per billed
call): an answer the fake generated is billed in full whether or not the client is still
there to read it (a worker killed mid-call, a client that timed out); a stream cut mid-way
(a ``cut`` reply, or a client that hung up) is billed its input and the output sent so far
(the answer's output tokens in proportion to the content events sent; at least what
``message_start`` reported). Errors, 429s and resets are not billed.

Ids are deterministic: the n-th request (1-based) gets ``msg_fake_000n`` and the
``request-id`` header ``req_fake_000n``.
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal

JsonObj = dict[str, Any]

DEFAULT_USAGE: JsonObj = {
    "input_tokens": 10,
    "output_tokens": 5,
    "cache_creation_input_tokens": 0,
    "cache_read_input_tokens": 0,
}

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def dumps(obj: object) -> bytes:
    """How the fake serialises JSON (compact, UTF-8, key order kept)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


# --- replies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """One scripted answer. Build it with the helpers below or the ``then_*`` methods."""

    kind: Literal["message", "error", "reset"]
    status: int = 200
    body: JsonObj | None = None
    headers: tuple[tuple[str, str], ...] = ()
    drip_chunk: int = 0  # > 0: send the body this many bytes at a time ...
    drip_interval: float = 0.0  # ... sleeping this long between chunks
    cut_after: int = 0  # streaming: reset the connection after this many events


def message(
    content: list[JsonObj],
    stop_reason: str | None = "end_turn",
    *,
    usage: Mapping[str, Any] | None = None,
) -> Reply:
    """An assistant turn with these content blocks, sent exactly as given."""
    body: JsonObj = {
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": dict(DEFAULT_USAGE if usage is None else usage),
    }
    return Reply("message", body=body)


def text(value: str = "Done.", *, usage: Mapping[str, Any] | None = None) -> Reply:
    return message([{"type": "text", "text": value}], "end_turn", usage=usage)


def tool_uses(
    calls: Iterable[tuple[str, str, JsonObj]],
    *,
    preamble: str | None = None,
    usage: Mapping[str, Any] | None = None,
) -> Reply:
    """A ``tool_use`` turn; several calls make parallel tool uses."""
    content: list[JsonObj] = [{"type": "text", "text": preamble}] if preamble else []
    content += [
        {"type": "tool_use", "id": tool_id, "name": name, "input": tool_input}
        for tool_id, name, tool_input in calls
    ]
    return message(content, "tool_use", usage=usage)


def error(
    status: int,
    message_text: str | None = None,
    *,
    error_type: str | None = None,
    error_code: str | None = None,
    retry_after: str | float | None = None,
    retry_after_ms: str | float | None = None,
) -> Reply:
    """An error status with an Anthropic-shaped body:
    ``{"type": "error", "error": {"type", "message", "details"?}, "request_id"}``."""
    err: JsonObj = {
        "type": error_type or ERROR_TYPES.get(status, "api_error"),
        "message": message_text or f"fake error {status}",
    }
    if error_code is not None:
        err["details"] = {"error_code": error_code}
    headers: list[tuple[str, str]] = []
    if retry_after is not None:
        headers.append(("retry-after", _header_number(retry_after)))
    if retry_after_ms is not None:
        headers.append(("retry-after-ms", _header_number(retry_after_ms)))
    return Reply(
        "error", status=status, body={"type": "error", "error": err}, headers=tuple(headers)
    )


def _header_number(value: str | float) -> str:
    if isinstance(value, str):
        return value
    return str(int(value)) if float(value).is_integer() else str(value)


def slow(reply: Reply, *, chunk: int = 8, interval: float = 0.2) -> Reply:
    """``reply``, with headers at once and the body ``chunk`` bytes per ``interval``."""
    return Reply(
        reply.kind,
        status=reply.status,
        body=reply.body,
        headers=reply.headers,
        drip_chunk=chunk,
        drip_interval=interval,
    )


def cut(reply: Reply, after_events: int) -> Reply:
    """``reply`` streamed, but the connection is reset after ``after_events`` events."""
    return Reply(
        reply.kind,
        status=reply.status,
        body=reply.body,
        headers=reply.headers,
        drip_chunk=reply.drip_chunk,
        drip_interval=reply.drip_interval,
        cut_after=after_events,
    )


def reset() -> Reply:
    """Read the request, then reset the TCP connection (RST) without answering."""
    return Reply("reset")


# --- validation ---------------------------------------------------------------------------


def _blocks(msg: JsonObj) -> list[JsonObj]:
    content = msg.get("content")
    if isinstance(content, list):
        return [b for b in content if isinstance(b, dict)]
    return []


def validate_request(body: object) -> str | None:
    """The first rule ``body`` breaks, as the API would word it, or ``None`` if it is valid.

    Checked: ``model`` and ``max_tokens`` present; ``messages`` a non-empty list; the first
    message from ``user``; roles alternate; every ``tool_use`` of an assistant turn answered
    by a ``tool_result`` in the very next (user) message, all of them, before any other
    block; no ``tool_result`` whose id was not a ``tool_use`` of the previous message.
    """
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model: Field required"
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        return "max_tokens: Field required"
    if max_tokens < 1:
        return "max_tokens: Input should be greater than or equal to 1"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return "messages: Field required"
    if not messages:
        return "messages: at least one message is required"
    previous_role: str | None = None
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            return f"messages.{i}: Input should be a valid dictionary"
        role = msg.get("role")
        if role not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        content = msg.get("content")
        if not isinstance(content, str | list) or (isinstance(content, list) and not content):
            return f"messages.{i}: all messages must have non-empty content"
        if i == 0 and role != "user":
            return 'messages: first message must use the "user" role'
        if role == previous_role:
            return (
                'messages: roles must alternate between "user" and "assistant", '
                f'but found multiple "{role}" roles in a row'
            )
        previous_role = role
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            problem = _check_answered(messages, i)
        else:
            problem = _check_results(messages, i)
        if problem:
            return problem
    return None


def _tool_use_ids(msg: JsonObj) -> list[str]:
    return [str(b.get("id")) for b in _blocks(msg) if b.get("type") == "tool_use"]


def _check_answered(messages: list[JsonObj], i: int) -> str | None:
    uses = _tool_use_ids(messages[i])
    if not uses:
        return None
    if len(set(uses)) != len(uses):
        return f"messages.{i}.content: `tool_use` ids must be unique"
    following = _blocks(messages[i + 1]) if i + 1 < len(messages) else []
    answered = {str(b.get("tool_use_id")) for b in following if b.get("type") == "tool_result"}
    missing = [u for u in uses if u not in answered]
    if missing:
        return (
            f"messages.{i + 1}: `tool_use` ids were found without `tool_result` blocks "
            f"immediately after: {', '.join(missing)}. Each `tool_use` block must have a "
            "corresponding `tool_result` block in the next message."
        )
    return None


def _check_results(messages: list[JsonObj], i: int) -> str | None:
    blocks = _blocks(messages[i])
    uses = set(_tool_use_ids(messages[i - 1])) if i > 0 else set()
    seen_other = False
    for j, block in enumerate(blocks):
        if block.get("type") != "tool_result":
            seen_other = True
            continue
        tool_use_id = str(block.get("tool_use_id"))
        if tool_use_id not in uses:
            return (
                f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` "
                f"blocks: {tool_use_id}. Each `tool_result` block must have a corresponding "
                "`tool_use` block in the previous message."
            )
        if seen_other:
            return (
                f"messages.{i}.content.{j}: `tool_result` blocks must come first in the "
                "user message that answers `tool_use` blocks"
            )
    return None


# --- rate limits -------------------------------------------------------------------------


def count_input_tokens(body: JsonObj) -> int:
    """The fake's input-token count of a request: about 4 characters per token."""
    parts = {k: body[k] for k in ("system", "tools", "messages") if k in body}
    return max(1, len(dumps(parts)) // 4)


@dataclass(frozen=True)
class RateLimit:
    """Per-minute limits of one model (``0``: none). ``spent``: the share of each bucket
    already used at the model's first request (another client of the same key was just
    there); ``0`` starts them full."""

    requests_per_minute: int = 0
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    spent: float = 0.0


class _Buckets:
    """The token buckets of one model: full at the limit, refilled at limit/60 per second."""

    NAMES = ("requests", "input-tokens", "output-tokens")

    def __init__(self, limit: RateLimit) -> None:
        self.caps = (
            limit.requests_per_minute,
            limit.input_tokens_per_minute,
            limit.output_tokens_per_minute,
        )
        self.levels = [c * (1.0 - limit.spent) for c in self.caps]
        self.at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        for i, cap in enumerate(self.caps):
            if cap:
                self.levels[i] = min(cap, self.levels[i] + (now - self.at) * cap / 60)
        self.at = now

    def take(self, costs: tuple[int, int, int]) -> float:
        """Take ``costs``, or nothing and return the seconds until they would fit."""
        self._refill()
        wait = 0.0
        for i, cap in enumerate(self.caps):
            if cap and self.levels[i] < min(costs[i], cap):
                wait = max(wait, (min(costs[i], cap) - self.levels[i]) / (cap / 60))
        if wait > 0:
            return wait
        for i, cap in enumerate(self.caps):
            if cap:
                self.levels[i] -= costs[i]
        return 0.0

    def give_back(self, output_tokens: int) -> None:
        self._refill()
        if self.caps[2]:
            self.levels[2] = min(self.caps[2], self.levels[2] + output_tokens)

    def headers(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for name, cap, level in zip(self.NAMES, self.caps, self.levels, strict=True):
            if not cap:
                continue
            reset = time.time() + max(0.0, cap - level) / (cap / 60)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(reset))
            out += [
                (f"anthropic-ratelimit-{name}-limit", str(cap)),
                (f"anthropic-ratelimit-{name}-remaining", str(max(0, int(level)))),
                (f"anthropic-ratelimit-{name}-reset", stamp),
            ]
        return out


# --- the server ---------------------------------------------------------------------------


@dataclass
class RecordedRequest:
    """One request as received, and the status it was answered with (``0`` for a reset)."""

    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes
    json: Any
    status: int = 0
    response_body: bytes = b""
    at: float = field(default_factory=time.monotonic)
    """When the request arrived (``time.monotonic()``)."""


@dataclass(frozen=True)
class Billed:
    """One billed model call, as the API's invoice would count it."""

    number: int
    """The request number (1-based); its ``request-id`` is ``req_fake_{number:04d}``."""
    model: str
    input_tokens: int
    """Input tokens, cache writes and reads included."""
    output_tokens: int
    complete: bool
    """The whole answer was generated (``False``: a stream cut mid-way)."""

    @property
    def request_id(self) -> str:
        return f"req_fake_{self.number:04d}"

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens


def _input_tokens(usage: Mapping[str, Any]) -> int:
    return sum(
        int(usage.get(k) or 0)
        for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    )


@dataclass
class _State:
    script: deque[Reply] = field(default_factory=deque)
    requests: list[RecordedRequest] = field(default_factory=list)
    billed: list[Billed] = field(default_factory=list)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    request_queue_size = 1024  # hundreds of clients connecting at once are not turned away

    def __init__(self, fake: FakeMessagesApi) -> None:
        self.fake = fake
        self.to_reset: set[socket.socket] = set()
        super().__init__(("127.0.0.1", 0), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            return  # a client that hung up mid-answer (a timeout) is expected: stay quiet
        super().handle_error(request, client_address)  # a bug in the fake: print it

    def shutdown_request(self, request: Any) -> None:
        if request in self.to_reset:
            # Skip the SHUT_WR (a FIN) of the default: with SO_LINGER 0 the close sends RST.
            self.to_reset.discard(request)
            self.close_request(request)
            return
        super().shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms stalls
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def do_GET(self) -> None:
        self._answer_error(404, "not_found_error", f"Not found: {self.path}", None, 0)

    def do_POST(self) -> None:
        fake = self.server.fake
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError:
            parsed = None
        record = RecordedRequest(
            method="POST",
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=raw,
            json=parsed,
        )
        number = fake._record(record)
        if self.path.split("?")[0] != "/v1/messages":
            self._answer_error(404, "not_found_error", f"Not found: {self.path}", record, number)
            return
        if fake.api_key is not None and fake.api_key not in (
            record.headers.get("x-api-key"),
            # SDK 2.x sends the API key as a bearer token.
            (record.headers.get("authorization") or "").removeprefix("Bearer "),
        ):
            self._answer_error(401, "authentication_error", "invalid x-api-key", record, number)
            return
        problem = validate_request(parsed) if parsed is not None else "invalid JSON body"
        if problem:
            self._answer_error(400, "invalid_request_error", problem, record, number)
            return
        buckets = fake._buckets_for(str(parsed.get("model")))
        counted = count_input_tokens(parsed)
        if buckets is not None:
            with fake._lock:
                wait = buckets.take((1, counted, int(parsed.get("max_tokens") or 0)))
                limit_headers = buckets.headers()
            if wait > 0:
                fake.rate_limited += 1
                limited = error(
                    429,
                    f"This request would exceed the rate limit for {parsed.get('model')}",
                    retry_after=max(1, math.ceil(wait)),
                )
                self._send(
                    429,
                    {**(limited.body or {}), "request_id": f"req_fake_{number:04d}"},
                    replace(limited, headers=limited.headers + tuple(limit_headers)),
                    record,
                    number,
                )
                return
        reply = fake._next_reply(parsed)
        if buckets is not None and reply is not None and reply.kind == "message":
            usage = dict((reply.body or {}).get("usage") or DEFAULT_USAGE)
            usage["input_tokens"] = counted
            out = min(int(usage.get("output_tokens") or 0), int(parsed.get("max_tokens") or 0))
            usage["output_tokens"] = out
            with fake._lock:
                buckets.give_back(int(parsed.get("max_tokens") or 0) - out)
                limit_headers = buckets.headers()
            reply = replace(
                reply,
                body={**(reply.body or {}), "usage": usage},
                headers=reply.headers + tuple(limit_headers),
            )
        if reply is None:
            self._answer_error(
                400, "invalid_request_error", "fake script exhausted: no reply left", record, number
            )
            return
        if reply.kind == "reset":
            self._reset()
            return
        body = dict(reply.body or {})
        if reply.kind == "message":
            body = {
                "id": f"msg_fake_{number:04d}",
                "type": "message",
                "role": "assistant",
                "model": parsed.get("model"),
                **body,
            }
            if parsed.get("stream") is True:
                self._stream(body, reply, record, number)
                return
            usage = body.get("usage") or {}
            # generated: billed now, whether or not the client is still there to read it
            fake._bill(number, str(body.get("model")), _input_tokens(usage), usage, 1.0)
        else:
            body["request_id"] = f"req_fake_{number:04d}"
        self._send(reply.status, body, reply, record, number)

    def _answer_error(
        self,
        status: int,
        error_type: str,
        text: str,
        record: RecordedRequest | None,
        number: int,
    ) -> None:
        reply = error(status, text, error_type=error_type)
        body = dict(reply.body or {})
        body["request_id"] = f"req_fake_{number:04d}"
        self._send(status, body, reply, record, number)

    def _send(
        self,
        status: int,
        body: JsonObj,
        reply: Reply,
        record: RecordedRequest | None,
        number: int,
    ) -> None:
        payload = dumps(body)
        if record is not None:
            record.status = status
            record.response_body = payload
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.send_header("request-id", f"req_fake_{number:04d}")
        for name, value in reply.headers:
            self.send_header(name, value)
        self.end_headers()
        if reply.drip_chunk <= 0:
            self.wfile.write(payload)
            return
        closing = self.server.fake._closing
        try:
            for start in range(0, len(payload), reply.drip_chunk):
                if closing.is_set():
                    self.close_connection = True
                    return
                self.wfile.write(payload[start : start + reply.drip_chunk])
                self.wfile.flush()
                if closing.wait(reply.drip_interval):
                    self.close_connection = True
                    return
        except OSError:  # the client gave up (timeout) and closed the connection
            self.close_connection = True

    def _stream(self, body: JsonObj, reply: Reply, record: RecordedRequest, number: int) -> None:
        record.status = 200
        record.response_body = dumps(body)
        fake = self.server.fake
        events = stream_events(body, reply.drip_chunk or 4)
        deltas = sum(1 for e in events if e["type"] == "content_block_delta")
        sent = 0  # content deltas sent: the output generated so far
        try:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("cache-control", "no-cache")
            self.send_header("request-id", f"req_fake_{number:04d}")
            self.send_header("connection", "close")
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.close_connection = True
            for i, event in enumerate(events):
                if fake._closing.is_set():
                    return
                if reply.cut_after and i == reply.cut_after:
                    self._reset()
                    return
                data = dumps(event)
                self.wfile.write(b"event: " + str(event["type"]).encode() + b"\ndata: " + data)
                self.wfile.write(b"\n\n")
                self.wfile.flush()
                if event["type"] == "content_block_delta":
                    sent += 1
                elif event["type"] == "message_delta":
                    sent = deltas
                if reply.drip_interval and self._hung_up(reply.drip_interval):
                    fake._aborted(number)
                    return
        except OSError:
            fake._aborted(number)
        finally:
            usage = body.get("usage") or {}
            share = 1.0 if deltas == 0 else sent / deltas
            fake._bill(number, str(body.get("model")), _input_tokens(usage), usage, share)

    def _hung_up(self, wait: float) -> bool:
        """Wait ``wait`` seconds, watching for the client closing the connection."""
        readable, _, _ = select.select([self.connection], [], [], wait)
        if not readable:
            return False
        try:
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _reset(self) -> None:
        sock = self.connection
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.server.to_reset.add(sock)
        self.close_connection = True


def stream_events(body: JsonObj, chunk: int = 4) -> list[JsonObj]:
    """The server-sent events of the message ``body``, as the streaming API sends them."""
    usage = dict(body.get("usage") or {})
    start_usage = {**usage, "output_tokens": min(1, int(usage.get("output_tokens") or 0))}
    head = {k: v for k, v in body.items() if k not in ("content", "usage")}
    head.update({"content": [], "stop_reason": None, "stop_sequence": None})
    events: list[JsonObj] = [{"type": "message_start", "message": {**head, "usage": start_usage}}]
    for index, block in enumerate(body.get("content") or []):
        if block.get("type") == "text":
            start = {**block, "text": ""}
            events.append({"type": "content_block_start", "index": index, "content_block": start})
            value = str(block.get("text") or "")
            for i in range(0, len(value), chunk):
                delta = {"type": "text_delta", "text": value[i : i + chunk]}
                events.append({"type": "content_block_delta", "index": index, "delta": delta})
        elif block.get("type") == "tool_use":
            start = {**block, "input": {}}
            events.append({"type": "content_block_start", "index": index, "content_block": start})
            raw = dumps(block.get("input") or {}).decode()
            for i in range(0, len(raw), chunk * 4):
                delta = {"type": "input_json_delta", "partial_json": raw[i : i + chunk * 4]}
                events.append({"type": "content_block_delta", "index": index, "delta": delta})
        else:
            events.append({"type": "content_block_start", "index": index, "content_block": block})
        events.append({"type": "content_block_stop", "index": index})
    events.append(
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": body.get("stop_reason"),
                "stop_sequence": body.get("stop_sequence"),
            },
            "usage": {"output_tokens": usage.get("output_tokens", 0)},
        }
    )
    events.append({"type": "message_stop"})
    return events


class FakeMessagesApi:
    """The fake server. Use as a context manager; :attr:`url` is the SDK's ``base_url``.

    ``default_responder``: ``False`` (an empty script answers 400), ``True`` (an empty script
    answers an ``end_turn`` text turn), or a callable ``(request_json) -> Reply``.
    ``api_key``: when set, requests that carry this key neither as ``x-api-key`` nor as
    ``Authorization: Bearer`` get 401.
    """

    def __init__(
        self,
        *,
        default_responder: bool | Callable[[JsonObj], Reply] = False,
        api_key: str | None = None,
        rate_limits: Mapping[str, RateLimit] | None = None,
    ) -> None:
        self.default_responder = default_responder
        self.api_key = api_key
        self.rate_limits = dict(rate_limits or {})
        """Model (or ``prefix*``) -> its limits; see the module docstring."""
        self._buckets: dict[str, _Buckets] = {}
        self.rate_limited = 0
        """How many requests were answered 429 by :attr:`rate_limits`."""
        self._lock = threading.Lock()
        self._state = _State()
        self._closing = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.aborts: list[tuple[int, float]] = []
        """Streams the client hung up on: (request number, ``time.monotonic()`` seen)."""

    def _bill(
        self, number: int, model: str, input_tokens: int, usage: Mapping[str, Any], share: float
    ) -> None:
        """Bill request ``number``: its input, and ``share`` of its answer's output tokens
        (at least the one token a stream's ``message_start`` reports)."""
        output = int(usage.get("output_tokens") or 0)
        generated = output if share >= 1.0 else min(output, max(1, math.ceil(output * share)))
        billed = Billed(number, model, input_tokens, generated, share >= 1.0)
        with self._lock:
            self._state.billed.append(billed)

    @property
    def billed(self) -> list[Billed]:
        """Every billed call, in the order billed (a copy); see the module docstring."""
        with self._lock:
            return list(self._state.billed)

    @property
    def billed_tokens(self) -> int:
        """All tokens billed so far."""
        return sum(b.total for b in self.billed)

    def _aborted(self, number: int) -> None:
        with self._lock:
            self.aborts.append((number, time.monotonic()))

    # lifecycle

    def start(self) -> FakeMessagesApi:
        if self._server is not None:
            return self
        self._closing.clear()
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="fake-messages-api",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> FakeMessagesApi:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the fake Messages API is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # script

    def then(self, *replies: Reply) -> FakeMessagesApi:
        with self._lock:
            self._state.script.extend(replies)
        return self

    def then_text(
        self, value: str = "Done.", *, usage: Mapping[str, Any] | None = None
    ) -> FakeMessagesApi:
        return self.then(text(value, usage=usage))

    def then_tool_use(
        self,
        tool_id: str,
        name: str,
        tool_input: JsonObj,
        *,
        preamble: str | None = None,
        usage: Mapping[str, Any] | None = None,
    ) -> FakeMessagesApi:
        return self.then(tool_uses([(tool_id, name, tool_input)], preamble=preamble, usage=usage))

    def then_tool_uses(
        self,
        calls: Iterable[tuple[str, str, JsonObj]],
        *,
        preamble: str | None = None,
        usage: Mapping[str, Any] | None = None,
    ) -> FakeMessagesApi:
        return self.then(tool_uses(calls, preamble=preamble, usage=usage))

    def then_message(
        self,
        content: list[JsonObj],
        stop_reason: str | None = "end_turn",
        *,
        usage: Mapping[str, Any] | None = None,
    ) -> FakeMessagesApi:
        return self.then(message(content, stop_reason, usage=usage))

    def then_error(
        self,
        status: int,
        message_text: str | None = None,
        *,
        error_type: str | None = None,
        error_code: str | None = None,
        retry_after: str | float | None = None,
        retry_after_ms: str | float | None = None,
    ) -> FakeMessagesApi:
        return self.then(
            error(
                status,
                message_text,
                error_type=error_type,
                error_code=error_code,
                retry_after=retry_after,
                retry_after_ms=retry_after_ms,
            )
        )

    def then_slow_text(
        self, value: str = "Done.", *, chunk: int = 8, interval: float = 0.2
    ) -> FakeMessagesApi:
        return self.then(slow(text(value), chunk=chunk, interval=interval))

    def then_reset(self) -> FakeMessagesApi:
        return self.then(reset())

    @property
    def pending(self) -> int:
        """Scripted replies not yet used."""
        with self._lock:
            return len(self._state.script)

    # request log

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received, in order (a copy of the log)."""
        with self._lock:
            return list(self._state.requests)

    @property
    def calls(self) -> int:
        """Model calls received: ``POST /v1/messages`` requests, rejected ones included."""
        return sum(1 for r in self.requests if r.path.split("?")[0] == "/v1/messages")

    def bodies(self) -> list[Any]:
        """The parsed JSON body of every model call, in order."""
        return [r.json for r in self.requests if r.path.split("?")[0] == "/v1/messages"]

    # handler side

    def _record(self, record: RecordedRequest) -> int:
        with self._lock:
            self._state.requests.append(record)
            return len(self._state.requests)

    def _buckets_for(self, model: str) -> _Buckets | None:
        for match, limit in self.rate_limits.items():
            if model == match or (match.endswith("*") and model.startswith(match[:-1])):
                with self._lock:
                    if match not in self._buckets:
                        self._buckets[match] = _Buckets(limit)
                    return self._buckets[match]
        return None

    def _next_reply(self, request_json: JsonObj) -> Reply | None:
        with self._lock:
            if self._state.script:
                return self._state.script.popleft()
        if self.default_responder is True:
            return text("Done.")
        if callable(self.default_responder):
            return self.default_responder(request_json)
        return None


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
