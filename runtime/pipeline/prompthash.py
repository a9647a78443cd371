"""The prompt hash: SHA-256 of a request body's canonical JSON (sorted keys, no spaces).

A model step's row records it so a fork can tell a byte-identical request from a changed one
(``replayModel``). The body carries the whole conversation, so hashing it from scratch at
every step costs a run quadratic time in its length; :class:`PromptHashes` hashes only the
messages that are new since the run's last step on this process and gives the same digest.
"""

from __future__ import annotations

import hashlib
import json
import operator
from dataclasses import dataclass
from typing import Any

from runtime.pipeline.lru import TakeOut

_PLACEHOLDER = "\ufdd0dar-messages\ufdd0"  # a noncharacter: never in a real request
_QUOTED = json.dumps(_PLACEHOLDER, ensure_ascii=False)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_hash(body: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(body).encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(slots=True)
class _Prefix:
    head: str
    """The canonical body up to its ``"messages":[``."""
    messages: list[Any]
    """The messages hashed into ``state``, all but the body's last (which may be replaced:
    a continued assistant turn is a new message)."""
    state: Any
    """SHA-256 of ``head`` and of ``messages`` joined by commas."""


class PromptHashes:
    """:func:`prompt_hash`, incremental per run: the canonical JSON of a list is ``[``, its
    items' canonical JSON joined by ``,``, and ``]``, so the digest of the body is fed the
    part before the messages, each message once, and the part after. A run's hash state
    after all but its last message is kept; the next body continues from it when its first
    messages are the same objects (the replay hands the same message dicts on, see
    :class:`runtime.pipeline.replay.ReplayCache`) and the part before them is unchanged. Anything
    else starts afresh. Bounded; thread-safe."""

    def __init__(self, capacity: int = 512) -> None:
        self._prefixes: TakeOut[Any, _Prefix] = TakeOut(capacity)

    def hash(self, run_id: Any, body: dict[str, Any]) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return prompt_hash(body)
        head, sep, tail = _canonical({**body, "messages": _PLACEHOLDER}).partition(_QUOTED)
        if not sep or _PLACEHOLDER in head or _PLACEHOLDER in tail:
            return prompt_hash(body)
        cached = self._prefixes.take(run_id)
        done = len(cached.messages) if cached is not None else 0
        if (
            cached is not None
            and cached.head == head
            and done < len(messages)
            and all(map(operator.is_, cached.messages, messages))
        ):
            digest = cached.state.copy()
        else:
            done = 0
            digest = hashlib.sha256((head + "[").encode("utf-8", "surrogatepass"))
        stable = max(len(messages) - 1, 0)
        for i in range(done, stable):
            digest.update(
                ("," if i else "").encode("utf-8", "surrogatepass")
                + _canonical(messages[i]).encode("utf-8", "surrogatepass")
            )
        state = digest.copy()
        for i in range(stable, len(messages)):
            digest.update(
                ("," if i else "").encode("utf-8", "surrogatepass")
                + _canonical(messages[i]).encode("utf-8", "surrogatepass")
            )
        digest.update(("]" + tail).encode("utf-8", "surrogatepass"))
        self._prefixes.put(run_id, _Prefix(head, messages[:stable], state))
        return str(digest.hexdigest())
