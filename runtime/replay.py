"""Rebuild the conversation from the step log.

The log is the single source of truth: continuing and resuming are the same code path.
A model step adds an assistant message with its content blocks exactly as returned. The
results of one turn's tools are gathered into one user message (tool_result blocks, in the
order the tools ran) and flushed only once every tool_use of that turn has its result, as the
Messages API requires. Tool uses without a finished result are the next work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from db.records import Step, StepKind, StepStatus

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


def replay(run_input: Any, steps: list[Step]) -> Conversation:
    """The conversation after ``steps`` (ordered by seq) for a run started with ``run_input``."""
    messages: list[JsonObj] = [{"role": "user", "content": run_input}]
    pending: dict[str, JsonObj] = {}
    results: list[JsonObj] = []
    stop: str | None = None
    turns = 0
    last_content: list[JsonObj] = []
    for step in steps:
        if step.kind is StepKind.TOOLSET:
            continue  # the tools offered, not part of the conversation
        if step.kind is StepKind.MODEL:
            if results:
                messages.append({"role": "user", "content": results})
                results = []
            content: list[JsonObj] = step.response or []
            if messages[-1]["role"] == "assistant":
                # The previous call paused or ran out of tokens: this one continued the same
                # assistant message, so the two are one message (roles must alternate).
                content = [*messages[-1]["content"], *content]
                messages[-1] = {"role": "assistant", "content": content}
            else:
                messages.append({"role": "assistant", "content": content})
            stop = step.stop_reason
            turns += 1
            last_content = content
            # Only a turn that ended on tool_use asks for tools: a tool_use block in a response
            # cut off by max_tokens may be truncated and is never executed.
            pending = (
                {b["id"]: b for b in content if b.get("type") == "tool_use"}
                if stop == "tool_use"
                else {}
            )
        elif step.status is not StepStatus.STARTED:
            pending.pop(step.tool_use_id or "", None)
            results.append(tool_result_block(step))
    if results and not pending:
        messages.append({"role": "user", "content": results})
    conversation = Conversation(
        messages=messages,
        pending=list(pending.values()),
        stop_reason=stop,
        model_turns=turns,
    )
    if conversation.finished:
        return Conversation(
            messages=messages,
            pending=[],
            stop_reason=stop,
            model_turns=turns,
            final_text=_text_of(last_content),
        )
    return conversation
