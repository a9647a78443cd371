"""The offline demo model, used when no ANTHROPIC_API_KEY is set, so the demo needs no key.

It is deterministic: the first turn asks for the agent's first tool, or the one whose name
best matches the question ("status" -> ``git__git_status``), with arguments read off the
question (a ``*path`` argument gets the first absolute path in it); the next turn summarises
what the tool returned. It takes ``latency_ms`` per
call, like a real model, so there is time to kill a worker in the middle of a step.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

from db.records import Usage
from runtime.config import DEMO_MODEL
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.live_call import LiveCall, ModelCallCancelled, current_live_call

MODEL_NAME = DEMO_MODEL


def _tokens(value: Any) -> int:
    return max(1, len(json.dumps(value, separators=(",", ":"))) // 4)


def _question(request: LlmRequest) -> str:
    first = request.messages[0]["content"]
    return first if isinstance(first, str) else json.dumps(first)


def _arguments(question: str, schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties", {})
    q = question.lower()
    args: dict[str, Any] = {}
    if "overdue" in props and "overdue" in q:
        args["overdue"] = True
    if "status" in props and "open" in q:
        args["status"] = "open"
    if "priority" in props:
        for level in ("urgent", "high", "low"):
            if level in q:
                args["priority"] = level
                break
    # Required parameters get a plausible value: the first number in the question for
    # numbers, the question itself for strings.
    numbers = re.findall(r"\d+", question)
    paths = re.findall(r"(?<![\w.])(/[\w.\-/]+)", question)
    for name in schema.get("required", []):
        kind = props.get(name, {}).get("type")
        if kind in ("integer", "number"):
            args[name] = int(numbers[0]) if numbers else 1
        elif kind == "string" and name.endswith("path") and paths:
            args[name] = paths[0].rstrip(".?!,")
        elif kind == "string":
            args[name] = question
        elif kind == "boolean":
            args[name] = True
    return args


def _pick(question: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The tool whose name shares the most words with the question; the first on a tie."""
    words = {w for w in re.findall(r"[a-z]+", question.lower()) if len(w) > 3}

    def score(tool: dict[str, Any]) -> int:
        return len(words & set(re.split(r"[_\-]+", tool["name"].lower())))

    best = max(tools, key=score)
    return best if score(best) > score(tools[0]) else tools[0]


def _summary(results: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    for r in results:
        content = r.get("content")
        try:
            data = json.loads(content) if isinstance(content, str) else content
        except ValueError:
            data = content
        if isinstance(data, list) and all(isinstance(t, dict) for t in data):
            if not data:
                lines.append("No matching tickets.")
                continue
            lines.append(f"{len(data)} matching ticket(s):")
            for t in data:
                due = str(t.get("due_at", ""))[:10]
                who = t.get("assignee") or "unassigned"
                lines.append(
                    f"- #{t.get('id')} {t.get('title')} ({t.get('priority')}, {who}, due {due})"
                )
        else:
            lines.append(f"The tool returned: {content}")
    return "\n".join(lines)


class DemoModel:
    def __init__(self, latency_ms: int = 3000) -> None:
        self.latency_ms = latency_ms

    def send(self, request: LlmRequest) -> LlmResponse:
        live = current_live_call()
        if live is None and self.latency_ms:
            time.sleep(self.latency_ms / 1000)
        response = self._answer(request)
        if live is not None:
            self._type(live, response)
        return response

    def _type(self, live: LiveCall, response: LlmResponse) -> None:
        """Stream the answer's text word by word over ``latency_ms`` (as a real model types),
        stopping when the run is cancelled."""
        attempt = live.begin_attempt()
        words = re.findall(
            r"\S+\s*",
            "".join(str(b.get("text", "")) for b in response.content if b.get("type") == "text"),
        )
        pause = self.latency_ms / 1000 / max(1, len(words))
        for word in words or [""]:
            if live.cancelled.wait(pause):
                raise ModelCallCancelled(
                    "run cancelled: the demo model stopped typing",
                    usage=Usage(input_tokens=response.usage.input_tokens),
                )
            if word:
                live.delta(attempt, word)

    def _answer(self, request: LlmRequest) -> LlmResponse:
        last = request.messages[-1]
        content: list[dict[str, Any]]
        results = (
            [b for b in last["content"] if b.get("type") == "tool_result"]
            if isinstance(last["content"], list)
            else []
        )
        if request.tools and not results:
            tool = _pick(_question(request), request.tools)
            digest = hashlib.sha256(
                json.dumps(request.messages, sort_keys=True).encode()
            ).hexdigest()[:24]
            content = [
                {"type": "text", "text": f"Let me look that up with {tool['name']}."},
                {
                    "type": "tool_use",
                    "id": f"toolu_demo_{digest}",
                    "name": tool["name"],
                    "input": _arguments(_question(request), tool.get("input_schema", {})),
                },
            ]
            stop = "tool_use"
        elif results:
            content = [{"type": "text", "text": _summary(results)}]
            stop = "end_turn"
        else:
            content = [{"type": "text", "text": f"(demo model) You said: {_question(request)}"}]
            stop = "end_turn"
        usage = Usage(input_tokens=_tokens(request.to_json()), output_tokens=_tokens(content))
        return LlmResponse(content, stop, usage, MODEL_NAME, request_id=None)
