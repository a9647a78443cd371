"""A run's conversation as a person reads it: the input, what the model said, each tool call
with its input and result, each durable step's result, and the errors, in step order.

Built from the step rows (their recorded responses), never from request bodies. Every value is
data to be shown as text: the console renders it with ``textContent``, never as markup.
"""

from __future__ import annotations

from typing import Any

from db.records import Run, Step, StepKind, StepStatus

JsonObj = dict[str, Any]


def _blocks(response: Any) -> list[JsonObj] | None:
    """A model response's content blocks, or ``None`` when the response is something else (a
    durable step's result)."""
    if isinstance(response, list) and all(
        isinstance(b, dict) and isinstance(b.get("type"), str) for b in response
    ):
        return response
    return None


def conversation_json(run: Run, steps: list[Step]) -> JsonObj:
    entries: list[JsonObj] = [{"type": "input", "content": run.input}]
    tool_names: dict[str, str] = {}
    for step in steps:
        base: JsonObj = {
            "seq": step.seq,
            "stepKey": step.step_key,
            "kind": str(step.kind),
            "status": str(step.status),
        }
        blocks = _blocks(step.response) if step.kind in (StepKind.MODEL, StepKind.LLM) else None
        if blocks is not None:
            for block in blocks:
                if block["type"] == "text":
                    entries.append({**base, "type": "text", "text": str(block.get("text", ""))})
                elif block["type"] == "tool_use":
                    tool_names[str(block.get("id"))] = str(block.get("name"))
                    entries.append(
                        {
                            **base,
                            "type": "tool_call",
                            "toolUseId": block.get("id"),
                            "name": block.get("name"),
                            "input": block.get("input"),
                        }
                    )
                else:  # thinking, server tools...: shown as they came
                    entries.append({**base, "type": "block", "block": block})
        elif step.kind is StepKind.MESSAGE:  # a message posted to the run: a user turn
            entries.append({**base, "type": "message", "content": step.response})
        elif step.kind is StepKind.TOOL:
            entries.append(
                {
                    **base,
                    "type": "tool_result",
                    "toolUseId": step.tool_use_id,
                    "name": step.tool_name or tool_names.get(step.tool_use_id or ""),
                    "output": step.response,
                    "isError": step.status is StepStatus.ERROR,
                    "inDoubt": step.status is StepStatus.STARTED,
                    "error": step.error,
                }
            )
            continue  # the result carries its own error
        else:
            entries.append({**base, "type": "step", "result": step.response})
        if step.error:
            entries.append({**base, "type": "error", "text": step.error})
    if run.status.terminal and run.result is not None:
        entries.append({"type": "result", "content": run.result})
    if run.error:
        entries.append({"type": "error", "text": run.error})
    return {"id": str(run.id), "status": str(run.status), "entries": entries}
