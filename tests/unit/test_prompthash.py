"""The prompt hash, incremental per run, against the whole-body hash it must equal: forks
compare it with hashes recorded before it existed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.pipeline.prompthash import PromptHashes, prompt_hash

TOOLS = [{"name": "list_tickets", "description": "Tickets ∑", "input_schema": {"type": "object"}}]


def _body(messages: list[Any], **extra: Any) -> dict[str, Any]:
    return {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "tools": TOOLS,
        "messages": messages,
        **extra,
    }


def _conversation(turns: int) -> list[list[dict[str, Any]]]:
    """The message lists of a growing run, sharing message objects as replay does; every
    third turn continues (replaces) the last assistant message."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": 'héllo "quoted" 🙂'}]
    out = [list(messages)]
    for i in range(turns):
        if i % 3 == 2:
            last = messages[-1]
            messages[-1] = {"role": "assistant", "content": [*last["content"], {"n": i}]}
        else:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": f"t{i}"}]})
            messages.append({"role": "user", "content": [{"type": "tool_result", "x": i}]})
        out.append(list(messages))
    return out


def test_every_step_of_a_growing_run_hashes_as_the_whole_body() -> None:
    hashes = PromptHashes()
    for messages in _conversation(40):
        body = _body(messages)
        assert hashes.hash("run", body) == prompt_hash(body)


def test_a_step_feeds_only_its_new_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    hashes = PromptHashes()
    lists = _conversation(60)
    for messages in lists[:-1]:
        hashes.hash("run", _body(messages))
    encoded: list[Any] = []
    real = json.dumps
    monkeypatch.setattr(json, "dumps", lambda v, **k: encoded.append(v) or real(v, **k))
    body = _body(lists[-1])
    digest = hashes.hash("run", body)
    monkeypatch.undo()
    assert digest == prompt_hash(body)
    # the body without its messages, and two or three messages: not the 100 of the run
    assert len(encoded) <= 5, f"{len(encoded)} values encoded for one step"


@pytest.mark.parametrize(
    "change",
    [
        {"max_tokens": 2048},  # before the messages in the canonical order
        {"tools": []},  # after them
        {"system": "\ufdd0dar-messages\ufdd0"},  # the placeholder itself
    ],
)
def test_a_changed_body_around_the_messages_is_hashed_afresh(change: dict[str, Any]) -> None:
    hashes = PromptHashes()
    lists = _conversation(10)
    hashes.hash("run", _body(lists[-2]))
    body = _body(lists[-1], **change)
    assert hashes.hash("run", body) == prompt_hash(body)


def test_other_shapes_and_runs() -> None:
    hashes = PromptHashes(capacity=1)
    for body in (
        _body([]),
        {"messages": "not a list"},
        {"model": "m"},
        _body(_conversation(3)[-1]),
    ):
        assert hashes.hash("a", body) == prompt_hash(body)
        assert hashes.hash("b", body) == prompt_hash(body)
    same = _conversation(5)
    hashes.hash("a", _body(same[-2]))
    assert hashes.hash("b", _body(same[-1])) == prompt_hash(_body(same[-1]))


def test_another_conversation_of_the_same_run_is_hashed_afresh() -> None:
    """A durable function's model calls in one run need not extend each other."""
    hashes = PromptHashes()
    first = _conversation(4)[-1]
    hashes.hash("run", _body(first))
    other = [{"role": "user", "content": f"q{i}"} for i in range(len(first) + 2)]
    assert hashes.hash("run", _body(other)) == prompt_hash(_body(other))
    equal_but_new = [dict(m) for m in first] + [{"role": "user", "content": "more"}]
    equal_but_new[0]["content"] = "changed in place of an equal copy"
    assert hashes.hash("run", _body(equal_but_new)) == prompt_hash(_body(equal_but_new))
