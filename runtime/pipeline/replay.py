"""Rebuild the conversation from the step log.

The log is the single source of truth: continuing and resuming are the same code path.
A model step adds an assistant message with its content blocks exactly as returned. The
results of one turn's tools are gathered into one user message (tool_result blocks, in the
order the tools ran) and flushed only once every tool_use of that turn has its result, as the
Messages API requires. Tool uses without a finished result are the next work.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

from db.records import Step, StepStatus
from runtime.pipeline.kinds import Turn, turn_of, waits_for_a_run
from runtime.pipeline.lru import TakeOut

JsonObj = dict[str, Any]

FINISHING_STOPS = frozenset({"end_turn", "stop_sequence"})
CONTINUING_STOPS = frozenset({"pause_turn", "max_tokens"})
"""The model's turn is not over: the next model call continues the same assistant message."""


def model_step_key(turn: int) -> str:
    """Model steps are keyed by turn: the n-th model call of the run."""
    return f"model:{turn}"


def tool_step_key(tool_use_id: str) -> str:
    """Tool steps are keyed by the model's tool_use id."""
    return f"tool:{tool_use_id}"


@dataclass(frozen=True, slots=True)
class Conversation:
    messages: list[JsonObj]
    pending: list[JsonObj] = field(default_factory=list)
    """tool_use blocks of the last model turn that have no finished result, in order."""
    stop_reason: str | None = None
    """The last model step's stop reason; ``None`` before the first model step."""
    model_turns: int = 0
    final_text: str | None = None

    @property
    def finished(self) -> bool:
        """The model ended its turn normally and nothing is pending."""
        return not self.pending and self.stop_reason in FINISHING_STOPS

    @property
    def last_turn_has_tool_use(self) -> bool:
        last = self.messages[-1]
        return last["role"] == "assistant" and any(
            b.get("type") == "tool_use" for b in last["content"]
        )


def tool_result_block(step: Step) -> JsonObj:
    block: JsonObj = {
        "type": "tool_result",
        "tool_use_id": step.tool_use_id,
        "content": step.response if step.response is not None else "",
    }
    if step.status is StepStatus.ERROR:
        block["is_error"] = True
    return block


def _text_of(content: list[JsonObj]) -> str:
    return "".join(b.get("text", "") for b in content if b.get("type") == "text")


@dataclass(slots=True)
class _Fold:
    """The replay's state after some of a run's steps; :meth:`add` takes the next one."""

    messages: list[JsonObj]
    pending: dict[str, JsonObj] = field(default_factory=dict)
    results: list[JsonObj] = field(default_factory=list)
    stop: str | None = None
    turns: int = 0
    last_content: list[JsonObj] = field(default_factory=list)

    def add(self, step: Step) -> None:
        turn = turn_of(step)  # the kind says what its row is to the conversation
        if turn is Turn.NONE:
            return
        if turn is Turn.USER:
            self._message(step)
            return
        if turn is Turn.TOOL_RESULT:
            if waits_for_a_run(step):
                return  # a sub-agent still working: its tool_use stays pending
            if step.status is not StepStatus.STARTED:
                self.pending.pop(step.tool_use_id or "", None)
                self.results.append(tool_result_block(step))
            return
        messages = self.messages
        if self.results:
            messages.append({"role": "user", "content": self.results})
            self.results = []
        content: list[JsonObj] = step.response or []
        if messages[-1]["role"] == "assistant":
            # The previous call paused or ran out of tokens: this one continued the same
            # assistant message, so the two are one message (roles must alternate). A new
            # dict: a conversation handed out earlier keeps the message it had.
            content = [*messages[-1]["content"], *content]
            messages[-1] = {"role": "assistant", "content": content}
        else:
            messages.append({"role": "assistant", "content": content})
        self.stop = step.stop_reason
        self.turns += 1
        self.last_content = content
        # Only a turn that ended on tool_use asks for tools: a tool_use block in a response
        # cut off by max_tokens may be truncated and is never executed.
        self.pending = (
            {b["id"]: b for b in content if b.get("type") == "tool_use"}
            if self.stop == "tool_use"
            else {}
        )

    def _message(self, step: Step) -> None:
        """A message posted to the run: a user turn. The turn's tool results come first in
        the same user message (the Messages API wants them there); after a user message it
        joins that one (roles alternate)."""
        content = step.response
        blocks: list[JsonObj] = (
            [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        )
        messages = self.messages
        if self.results:
            messages.append({"role": "user", "content": [*self.results, *blocks]})
            self.results = []
        elif messages[-1]["role"] == "user":
            previous = messages[-1]["content"]
            if isinstance(previous, str):
                previous = [{"type": "text", "text": previous}]
            messages[-1] = {"role": "user", "content": [*previous, *blocks]}
        else:
            messages.append({"role": "user", "content": blocks})
        self.pending = {}
        self.stop = "message"
        self.last_content = []

    def conversation(self) -> Conversation:
        """The conversation so far, on lists of its own (the fold goes on growing)."""
        messages = list(self.messages)
        if self.results and not self.pending:
            messages.append({"role": "user", "content": list(self.results)})
        finished = not self.pending and self.stop in FINISHING_STOPS
        return Conversation(
            messages=messages,
            pending=list(self.pending.values()),
            stop_reason=self.stop,
            model_turns=self.turns,
            final_text=_text_of(self.last_content) if finished else None,
        )


def replay(run_input: Any, steps: list[Step]) -> Conversation:
    """The conversation after ``steps`` (ordered by seq) for a run started with ``run_input``."""
    fold = _Fold(messages=[{"role": "user", "content": run_input}])
    for step in steps:
        fold.add(step)
    return fold.conversation()


@dataclass(slots=True)
class _Folded:
    run_input: Any
    steps: list[Step]
    fold: _Fold


class ReplayCache:
    """A process's replays of the runs it drives, so a step replays only the rows that are
    new since this process's last step of the run, not the whole log: the cost of replay at
    step 1,000 is that of step 10.

    Exact by construction: a replay continues from a cached fold only when the steps it was
    folded from are, object for object, the first steps of the new list (the step log cache
    hands the same immutable rows back, see :mod:`db.steplog`); a log read from the database,
    or any row replaced, means a full replay. Bounded (least recently used first out);
    thread-safe (a fold in use is taken out of the cache, so two tasks never share one)."""

    def __init__(self, capacity: int = 512) -> None:
        self._folds: TakeOut[Any, _Folded] = TakeOut(capacity)
        self.hits = 0
        self.misses = 0

    def replay(self, run_id: Any, run_input: Any, steps: list[Step]) -> Conversation:
        cached = self._folds.take(run_id)
        done = len(cached.steps) if cached is not None else 0
        if (
            cached is not None
            and done <= len(steps)
            and all(map(operator.is_, cached.steps, steps))
            and cached.run_input == run_input
        ):
            self.hits += 1
            fold = cached.fold
        else:
            self.misses += 1
            done = 0
            fold = _Fold(messages=[{"role": "user", "content": run_input}])
        for step in steps[done:]:
            fold.add(step)
        conversation = fold.conversation()
        self._folds.put(run_id, _Folded(run_input, list(steps), fold))
        return conversation
