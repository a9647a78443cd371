"""The Messages API's server-sent events, assembled into the message the non-streaming API
would have returned (so a streamed step's checkpoint, and its replay, are the same as before).

Events are kept as the JSON the API sent: unknown block types and fields pass through, and a
block's final value is its start value plus its deltas.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from db.records import Usage
from runtime.llm.base import JsonObj

ERROR_STATUSES = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


def sse_events(lines: Iterable[str]) -> Iterator[JsonObj]:
    """The JSON ``data`` of each server-sent event (events without JSON data are skipped)."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                try:
                    value = json.loads("\n".join(data))
                except ValueError:
                    value = None
                data = []
                if isinstance(value, dict):
                    yield value
            continue
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        try:
            value = json.loads("\n".join(data))
        except ValueError:
            return
        if isinstance(value, dict):
            yield value


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


class StreamAssembler:
    """Feed it events in order; :attr:`done` after ``message_stop``."""

    def __init__(self) -> None:
        self.message_fields: JsonObj = {}
        self.content: list[JsonObj] = []
        self._partial_json: dict[int, str] = {}
        self._usage: JsonObj = {}
        self.done = False
        self.error: tuple[int, str, str] | None = None
        self.streamed_chars = 0
        """Characters of content received in deltas (text, tool input, thinking)."""

    def feed(self, event: JsonObj) -> str | None:
        """Apply one event; returns the text it adds to a text block, if any."""
        kind = event.get("type")
        if kind == "message_start":
            message = dict(event.get("message") or {})
            message.pop("content", None)
            usage = message.pop("usage", None)
            self.message_fields = message
            if isinstance(usage, dict):
                self._usage.update(usage)
        elif kind == "content_block_start":
            index = _int(event.get("index"))
            block = dict(event.get("content_block") or {})
            while len(self.content) <= index:
                self.content.append({})
            self.content[index] = block
            if block.get("type") in ("tool_use", "server_tool_use"):
                self._partial_json[index] = ""
        elif kind == "content_block_delta":
            return self._delta(_int(event.get("index")), event.get("delta") or {})
        elif kind == "content_block_stop":
            index = _int(event.get("index"))
            partial = self._partial_json.pop(index, None)
            if partial:
                self.content[index]["input"] = json.loads(partial)
        elif kind == "message_delta":
            delta = event.get("delta") or {}
            for name, value in delta.items():
                self.message_fields[name] = value
            usage = event.get("usage")
            if isinstance(usage, dict):
                self._usage.update({k: v for k, v in usage.items() if v is not None})
        elif kind == "message_stop":
            self.done = True
        elif kind == "error":
            err = event.get("error") or {}
            error_type = str(err.get("type") or "api_error")
            self.error = (
                ERROR_STATUSES.get(error_type, 500),
                error_type,
                str(err.get("message") or ""),
            )
        return None

    def cut_usage(self) -> tuple[Usage, int]:
        """For a stream cut before its end (a cancel, an interrupt): the usage to count and how
        many of its tokens are an estimate. The API reports output tokens only at the end,
        yet bills those generated before the cut: they are estimated high from the content
        received (about 3 characters per token; real text averages nearer 4)."""
        reported = self.usage()
        guess = self.streamed_chars // 3 + 1 if self.streamed_chars else 0
        extra = max(0, guess - reported.output_tokens)
        usage = Usage(
            reported.input_tokens,
            reported.output_tokens + extra,
            reported.cache_creation_input_tokens,
            reported.cache_read_input_tokens,
        )
        return usage, extra

    def _delta(self, index: int, delta: JsonObj) -> str | None:
        if index >= len(self.content):
            return None
        self.streamed_chars += sum(
            len(v) for k, v in delta.items() if k != "type" and isinstance(v, str)
        )
        block = self.content[index]
        kind = delta.get("type")
        if kind == "text_delta":
            text = str(delta.get("text") or "")
            block["text"] = str(block.get("text") or "") + text
            return text
        if kind == "input_json_delta":
            self._partial_json[index] = self._partial_json.get(index, "") + str(
                delta.get("partial_json") or ""
            )
        elif kind == "thinking_delta":
            block["thinking"] = str(block.get("thinking") or "") + str(delta.get("thinking") or "")
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature")
        elif kind == "citations_delta":
            citations = block.get("citations") or []
            block["citations"] = [*citations, delta.get("citation")]
        return None

    def usage(self) -> Usage:
        """The usage reported so far (``message_start``, then ``message_delta``)."""
        u = self._usage
        return Usage(
            input_tokens=_int(u.get("input_tokens")),
            output_tokens=_int(u.get("output_tokens")),
            cache_creation_input_tokens=_int(u.get("cache_creation_input_tokens")),
            cache_read_input_tokens=_int(u.get("cache_read_input_tokens")),
        )

    def message(self) -> JsonObj:
        return {**self.message_fields, "content": self.content, "usage": dict(self._usage)}
