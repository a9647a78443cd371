"""A model API for the real-client benchmarks: the Anthropic Messages API and the OpenAI
Responses API over HTTP/1.1 on loopback, asyncio, in a process of its own (its CPU is not the
clients'), holding thousands of streamed answers open at once.

    python -m bench.fake_llm --port 0        prints "listening <port>" and serves until killed

The answer is what a model of that kind sends: ``--tokens`` tokens of text (about four
characters each) in deltas of ``--delta-tokens``, spread evenly over the call's latency after
a first event at once, the usage at the end, ``anthropic-ratelimit-*`` (or
``x-ratelimit-*``) headers on every answer, keep-alive connections (chunked transfer
encoding). Without ``"stream": true`` the whole message comes after the latency.

What a call does is read from its first user message, so runs of one benchmark carry it in
their input: ``latency_ms=10000`` (default ``--latency-ms``) and ``steps=3`` (the answer is
``pause_turn`` until the conversation has ``steps - 1`` assistant turns, then ``end_turn``).

``GET /stats`` answers ``{"open", "peak", "requests", "answered", "aborted"}``: requests
whose answer is not finished right now, the most at once since ``POST /stats/reset``, and
totals. A request counts as open from its headers to its last byte (or the client hanging up).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from typing import Any

from tests.fakes.messages_api import stream_events
from tests.fakes.openai_api import Turn, response_events

WORDS = (
    "The order was packed on Monday and handed to the carrier the same afternoon; "
    "tracking shows it in the regional depot, and delivery is expected within two "
    "working days. "
)


class Stats:
    def __init__(self) -> None:
        self.open = 0
        self.peak = 0
        self.requests = 0
        self.answered = 0
        self.aborted = 0

    def enter(self) -> None:
        self.open += 1
        self.requests += 1
        self.peak = max(self.peak, self.open)

    def leave(self, *, finished: bool) -> None:
        self.open -= 1
        if finished:
            self.answered += 1
        else:
            self.aborted += 1

    def reset(self) -> None:
        self.peak = self.open
        self.requests = self.answered = self.aborted = 0

    def as_json(self) -> dict[str, int]:
        return {
            "open": self.open,
            "peak": self.peak,
            "requests": self.requests,
            "answered": self.answered,
            "aborted": self.aborted,
        }


_NUM = re.compile(r"\b(latency_ms|steps)=(\d+)")


def _first_user_text(body: dict[str, Any]) -> str:
    if "messages" in body:  # Messages API
        first = (body.get("messages") or [{}])[0].get("content")
    else:  # Responses API: a string, or items
        first = body.get("input")
        if isinstance(first, list) and first:
            first = first[0].get("content")
    if isinstance(first, list):
        first = " ".join(str(b.get("text", "")) for b in first if isinstance(b, dict))
    return str(first or "")


class Server:
    def __init__(self, *, latency_ms: float, tokens: int, delta_tokens: int) -> None:
        self.latency_ms = latency_ms
        self.tokens = tokens
        self.delta_tokens = delta_tokens
        self.text = (WORDS * (1 + tokens * 4 // len(WORDS)))[: tokens * 4]
        self.stats = Stats()
        self.number = 0

    def plan(self, body: dict[str, Any]) -> tuple[float, int]:
        found = dict(_NUM.findall(_first_user_text(body)))
        return float(found.get("latency_ms", self.latency_ms)) / 1000, int(found.get("steps", 1))

    # -- HTTP ------------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length") or 0)
                raw = await reader.readexactly(length) if length else b""
                if not await self.route(method, path.split("?")[0], raw, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            return
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def route(self, method: str, path: str, raw: bytes, writer: asyncio.StreamWriter) -> bool:
        if method == "GET" and path == "/stats":
            return await self.plain(writer, 200, self.stats.as_json())
        if method == "POST" and path == "/stats/reset":
            self.stats.reset()
            return await self.plain(writer, 200, self.stats.as_json())
        if method != "POST" or path not in ("/v1/messages", "/v1/responses"):
            return await self.plain(writer, 404, {"error": {"message": f"no {path}"}})
        body = json.loads(raw or b"{}")
        self.number += 1
        self.stats.enter()
        finished = False
        try:
            if path == "/v1/messages":
                await self.messages(body, writer)
            else:
                await self.responses(body, writer)
            finished = True
        finally:
            self.stats.leave(finished=finished)
        return True

    async def plain(self, writer: asyncio.StreamWriter, status: int, obj: Any) -> bool:
        payload = json.dumps(obj).encode()
        writer.write(
            f"HTTP/1.1 {status} OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        return True

    def _head(self, content_type: str, extra: dict[str, str], length: int | None) -> bytes:
        lines = [
            "HTTP/1.1 200 OK",
            f"content-type: {content_type}",
            f"request-id: req_bench_{self.number:07d}",
            *(f"{k}: {v}" for k, v in extra.items()),
            f"content-length: {length}" if length is not None else "transfer-encoding: chunked",
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    async def _send_events(
        self, writer: asyncio.StreamWriter, frames: list[bytes], latency: float, head: bytes
    ) -> None:
        writer.write(head)
        # the first event at once, the rest evenly over the call's latency
        gap = latency / max(1, len(frames) - 1)
        start = time.monotonic()
        for i, frame in enumerate(frames):
            if i:
                delay = start + i * gap - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            writer.write(b"%x\r\n%s\r\n" % (len(frame), frame))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def messages(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        latency, steps = self.plan(body)
        # answers so far: one text block each (the runtime folds a pause_turn continuation
        # into one assistant message, a bare client appends a message per answer)
        turns = sum(
            len(m.get("content") or []) if isinstance(m.get("content"), list) else 1
            for m in body.get("messages") or []
            if m.get("role") == "assistant"
        )
        in_tokens = 50 + len(json.dumps(body.get("messages") or [])) // 4
        message = {
            "id": f"msg_bench_{self.number:07d}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model"),
            "content": [{"type": "text", "text": self.text}],
            "stop_reason": "end_turn" if turns + 1 >= steps else "pause_turn",
            "stop_sequence": None,
            "usage": {
                "input_tokens": in_tokens,
                "output_tokens": self.tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        limits = {
            "anthropic-ratelimit-requests-limit": "1000000",
            "anthropic-ratelimit-requests-remaining": "999000",
            "anthropic-ratelimit-requests-reset": _reset_at(),
            "anthropic-ratelimit-input-tokens-limit": "100000000",
            "anthropic-ratelimit-input-tokens-remaining": "99000000",
            "anthropic-ratelimit-input-tokens-reset": _reset_at(),
            "anthropic-ratelimit-output-tokens-limit": "100000000",
            "anthropic-ratelimit-output-tokens-remaining": "99000000",
            "anthropic-ratelimit-output-tokens-reset": _reset_at(),
        }
        if body.get("stream") is True:
            events = stream_events(message, chunk=self.delta_tokens * 4)
            frames = [
                b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
                for e in events
            ]
            head = self._head("text/event-stream", limits, None)
            await self._send_events(writer, frames, latency, head)
            return
        await asyncio.sleep(latency)
        payload = json.dumps(message).encode()
        writer.write(self._head("application/json", limits, len(payload)) + payload)
        await writer.drain()

    async def responses(self, body: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        latency, _ = self.plan(body)
        turn = Turn(text=self.text, input_tokens=60, output_tokens=self.tokens)
        model = str(body.get("model") or "gpt-4.1-mini")
        limits = {
            "x-ratelimit-limit-requests": "1000000",
            "x-ratelimit-remaining-requests": "999000",
            "x-ratelimit-reset-requests": "1s",
            "x-request-id": f"req_bench_{self.number:07d}",
        }
        events = response_events(turn, self.number, model, self.delta_tokens * 4)
        if body.get("stream") is True:
            frames = [
                b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
                for e in events
            ]
            head = self._head("text/event-stream", limits, None)
            await self._send_events(writer, frames, latency, head)
            return
        await asyncio.sleep(latency)
        payload = json.dumps(events[-1]["response"]).encode()
        writer.write(self._head("application/json", limits, len(payload)) + payload)
        await writer.drain()


def _reset_at() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 60))


async def serve(port: int, server: Server) -> None:
    srv = await asyncio.start_server(server.handle, "127.0.0.1", port, backlog=4096, limit=1 << 22)
    print(f"listening {srv.sockets[0].getsockname()[1]}", flush=True)
    async with srv:
        await srv.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fake_llm")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency-ms", type=float, default=10_000)
    ap.add_argument("--tokens", type=int, default=300, help="output tokens per answer")
    ap.add_argument("--delta-tokens", type=int, default=5, help="tokens per streamed delta")
    args = ap.parse_args(argv)
    _raise_nofile()
    server = Server(latency_ms=args.latency_ms, tokens=args.tokens, delta_tokens=args.delta_tokens)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, server))
    return 0


def _raise_nofile() -> None:
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


if __name__ == "__main__":
    sys.exit(main())
