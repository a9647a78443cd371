"""The Messages API's streamed events, assembled into the message the non-streaming API
returns: a streamed step's checkpoint is byte-for-byte what it was before streaming."""

from __future__ import annotations

import json

from runtime.llm.streaming import StreamAssembler, sse_events
from tests.fakes.messages_api import stream_events


def _assemble(events: list[dict[str, object]]) -> StreamAssembler:
    a = StreamAssembler()
    for event in events:
        a.feed(event)
    return a


def test_text_and_tool_use_come_back_exactly_as_the_non_streaming_body() -> None:
    body = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "text", "text": "Let me look — ünïcode ok."},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": [1, "x"]}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 34},
    }
    a = _assemble(stream_events(body, chunk=3))
    assert a.done
    assert json.dumps(a.content) == json.dumps(body["content"])
    assert a.message()["stop_reason"] == "tool_use"
    assert (a.usage().input_tokens, a.usage().output_tokens) == (12, 34)


def test_thinking_signature_and_unknown_blocks_pass_through() -> None:
    events = [
        {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 5}}},
        {"type": "content_block_start", "index": 0,
         "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "thinking_delta", "thinking": "hmm"}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "signature_delta", "signature": "sig"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "future_block", "x": 1}},
        {"type": "content_block_stop", "index": 1},
        {"type": "ping"},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": 9}},
        {"type": "message_stop"},
    ]  # fmt: skip
    a = _assemble(events)
    assert a.content == [
        {"type": "thinking", "thinking": "hmm", "signature": "sig"},
        {"type": "future_block", "x": 1},
    ]
    assert (a.usage().input_tokens, a.usage().output_tokens) == (5, 9)


def test_an_error_event_and_sse_framing() -> None:
    lines = [
        "event: error",
        'data: {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}',
        "",
        ": a comment",
        "data: not json",
        "",
    ]
    a = _assemble(list(sse_events(lines)))
    assert a.error == (529, "overloaded_error", "busy")
    assert not a.done
