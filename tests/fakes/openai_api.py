"""A fake OpenAI-compatible API on loopback, for tests: the Responses API and Chat Completions,
each plain or streamed (server-sent events). Standard library only.

    with FakeOpenAiApi() as fake:
        fake.then_calls(("call_1", "lookup", {"order": "A-7"})).then_text("It shipped.")
        client = AsyncOpenAI(base_url=fake.url, api_key="test")

* ``POST /v1/responses`` and ``POST /v1/chat/completions`` answer from one script (a FIFO of
  :class:`Turn`), one entry per request, in the shape of each API. A request with
  ``"stream": true`` gets the turn as events: text in pieces of :attr:`chunk` characters.
* Every request's JSON is kept in :attr:`FakeOpenAiApi.bodies` (with its path);
  :attr:`calls` counts them. The usage each turn billed is in its answer (``usage=``), so a
  test can compare what the runtime recorded with what the fake billed.
* An empty script answers 400 ``fake script exhausted``: a test that under-scripts fails,
  unless a ``responder`` is given: ``(path, request_json) -> Turn`` answers what the script
  does not (for tests whose requests come from several processes, decided from the
  conversation alone).
* A turn with ``delay`` is held that many seconds before it is answered (a request in flight
  for a kill to land in); an answer generated is billed (:attr:`billed`) whether or not the
  client is still there to read it, as the real API bills it.

Ids are deterministic: the n-th request gets ``resp_fake_000n`` / ``chatcmpl_fake_000n``.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

JsonObj = dict[str, Any]


@dataclass(frozen=True)
class Turn:
    """One answer: text, or function calls ``(call_id, name, arguments)``."""

    text: str | None = None
    calls: tuple[tuple[str, str, JsonObj], ...] = ()
    input_tokens: int = 10
    output_tokens: int = 5
    cached_tokens: int = 0
    delay: float = 0.0
    """Seconds the fake holds the request before answering."""
    interval: float = 0.0
    """Streamed: seconds between two events (the text arrives as it is "produced")."""
    status: int = 200
    """Not 200: the request is refused with this status (a 429 with ``retry-after``), not
    billed."""
    retry_after: int = 0
    incomplete: str | None = None
    """Responses API: the response ends ``incomplete`` for this reason (``max_output_tokens``,
    ``content_filter``): status ``incomplete``, streamed as ``response.incomplete``; billed
    (its usage in it) as the real API bills it."""


def _response(turn: Turn, number: int, model: str) -> JsonObj:
    output: list[JsonObj] = []
    if turn.text is not None:
        output.append(
            {
                "type": "message",
                "id": f"msg_fake_{number:04d}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": turn.text, "annotations": []}],
            }
        )
    for call_id, name, arguments in turn.calls:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{call_id}",
                "call_id": call_id,
                "name": name,
                "arguments": json.dumps(arguments),
                "status": "completed",
            }
        )
    return {
        "id": f"resp_fake_{number:04d}",
        "object": "response",
        "created_at": 0,
        "status": "incomplete" if turn.incomplete else "completed",
        "incomplete_details": {"reason": turn.incomplete} if turn.incomplete else None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": turn.input_tokens,
            "input_tokens_details": {"cached_tokens": turn.cached_tokens},
            "output_tokens": turn.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": turn.input_tokens + turn.output_tokens,
        },
    }


def _chat_usage(turn: Turn) -> JsonObj:
    return {
        "prompt_tokens": turn.input_tokens,
        "completion_tokens": turn.output_tokens,
        "total_tokens": turn.input_tokens + turn.output_tokens,
        "prompt_tokens_details": {"cached_tokens": turn.cached_tokens},
    }


def _chat_calls(turn: Turn) -> list[JsonObj]:
    return [
        {
            "index": i,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)},
        }
        for i, (call_id, name, arguments) in enumerate(turn.calls)
    ]


def _chat(turn: Turn, number: int, model: str) -> JsonObj:
    message: JsonObj = {"role": "assistant", "content": turn.text}
    if turn.calls:
        message["tool_calls"] = [
            {k: v for k, v in c.items() if k != "index"} for c in _chat_calls(turn)
        ]
    return {
        "id": f"chatcmpl_fake_{number:04d}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if turn.calls else "stop",
            }
        ],
        "usage": _chat_usage(turn),
    }


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def response_events(turn: Turn, number: int, model: str, chunk: int) -> list[JsonObj]:
    """The Responses API's events for a turn (the ones clients act on)."""
    done = _response(turn, number, model)
    started = {**done, "status": "in_progress", "output": []}
    events: list[JsonObj] = [{"type": "response.created", "response": started}]
    for index, item in enumerate(done["output"]):
        events.append({"type": "response.output_item.added", "output_index": index, "item": item})
        if item["type"] == "message":
            for piece in _pieces(turn.text or "", chunk):
                events.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "delta": piece,
                        "logprobs": [],
                    }
                )
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    end = "response.incomplete" if turn.incomplete else "response.completed"
    events.append({"type": end, "response": done})
    return [{**e, "sequence_number": i} for i, e in enumerate(events)]


def chat_chunks(turn: Turn, number: int, model: str, chunk: int) -> list[JsonObj]:
    """Chat Completions' chunks for a turn, the usage last (``stream_options.include_usage``)."""
    base = {"id": f"chatcmpl_fake_{number:04d}", "object": "chat.completion.chunk", "created": 0}
    base["model"] = model
    chunks: list[JsonObj] = []
    if turn.text is not None:
        for piece in _pieces(turn.text, chunk):
            delta = {"role": "assistant", "content": piece}
            chunks.append({**base, "choices": [{"index": 0, "delta": delta}]})
    if turn.calls:
        delta = {"role": "assistant", "tool_calls": _chat_calls(turn)}
        chunks.append({**base, "choices": [{"index": 0, "delta": delta}]})
    finish = "tool_calls" if turn.calls else "stop"
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({**base, "choices": [], "usage": _chat_usage(turn)})
    return chunks


@dataclass
class _State:
    script: deque[Turn] = field(default_factory=deque)
    bodies: list[tuple[str, JsonObj]] = field(default_factory=list)
    billed: list[Turn] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        fake = self.server.fake
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        path = self.path.split("?")[0]
        with fake.lock:
            fake.state.bodies.append((path, body))
            number = len(fake.state.bodies)
            turn = fake.state.script.popleft() if fake.state.script else None
        if turn is None and fake.responder is not None:
            turn = fake.responder(path, body)
        if turn is None:
            error = {"error": {"message": "fake script exhausted", "type": "invalid_request"}}
            return self._json(400, error)
        if turn.delay:
            time.sleep(turn.delay)
        if turn.status != 200:
            refused = {"error": {"message": "Rate limit reached", "type": "requests"}}
            retry = {"retry-after": str(turn.retry_after)} if turn.retry_after else {}
            return self._json(turn.status, refused, retry)
        with fake.lock:
            fake.state.billed.append(turn)
        model = str(body.get("model") or "fake-model")
        streamed = bool(body.get("stream"))
        if path.endswith("/responses"):
            if streamed:
                events = response_events(turn, number, model, fake.chunk)
                return self._events(events, named=True, interval=turn.interval)
            return self._json(200, _response(turn, number, model))
        if path.endswith("/chat/completions"):
            if streamed:
                events = chat_chunks(turn, number, model, fake.chunk)
                return self._events(events, named=False, interval=turn.interval)
            return self._json(200, _chat(turn, number, model))
        return self._json(404, {"error": {"message": f"no route {path}"}})

    def _json(self, status: int, obj: JsonObj, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("x-request-id", f"req_fake_{len(self.server.fake.state.bodies):04d}")
        self.end_headers()
        self.wfile.write(data)

    def _events(self, events: list[JsonObj], *, named: bool, interval: float = 0.0) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        for event in events:
            head = f"event: {event['type']}\n" if named else ""
            self.wfile.write(f"{head}data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
            if interval:
                time.sleep(interval)
        if not named:
            self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, fake: FakeOpenAiApi) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.fake = fake


class FakeOpenAiApi:
    """The fake server; :attr:`url` is the SDK's ``base_url``."""

    def __init__(
        self, *, chunk: int = 4, responder: Callable[[str, JsonObj], Turn] | None = None
    ) -> None:
        self.chunk = chunk
        self.responder = responder
        self.lock = threading.Lock()
        self.state = _State()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FakeOpenAiApi:
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def url(self) -> str:
        assert self._server is not None, "the fake OpenAI API is not running"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def then(self, *turns: Turn) -> FakeOpenAiApi:
        with self.lock:
            self.state.script.extend(turns)
        return self

    def then_text(self, text: str, **usage: int) -> FakeOpenAiApi:
        return self.then(Turn(text=text, **usage))

    def then_calls(self, *calls: tuple[str, str, JsonObj], **usage: int) -> FakeOpenAiApi:
        return self.then(Turn(calls=tuple(calls), **usage))

    @property
    def calls(self) -> int:
        with self.lock:
            return len(self.state.bodies)

    @property
    def bodies(self) -> list[tuple[str, JsonObj]]:
        with self.lock:
            return list(self.state.bodies)

    @property
    def billed(self) -> list[Turn]:
        """The turns answered (billed), in order."""
        with self.lock:
            return list(self.state.billed)

    @property
    def billed_tokens(self) -> int:
        """Input plus output tokens of every answered turn."""
        return sum(t.input_tokens + t.output_tokens for t in self.billed)
