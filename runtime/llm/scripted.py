"""A scripted model for tests: answers from a queue and remembers every request."""

from __future__ import annotations

import copy
import threading
from collections import deque
from typing import Any

from db.records import Usage
from runtime.llm.base import LlmError, LlmRequest, LlmResponse


class ScriptExhausted(AssertionError):
    """The scripted model was called more often than scripted."""


class ScriptedLlm:
    def __init__(self, model: str = "scripted") -> None:
        self.model = model
        self.requests: list[LlmRequest] = []
        self._script: deque[LlmResponse | BaseException] = deque()
        self._lock = threading.Lock()

    def then_tool_use(
        self,
        tool_use_id: str,
        name: str,
        tool_input: dict[str, Any] | None = None,
        input_tokens: int = 10,
        output_tokens: int = 5,
        *more: tuple[str, str, dict[str, Any]],
    ) -> ScriptedLlm:
        """A turn that asks for one tool (or several: pass ``(id, name, input)`` tuples)."""
        uses = [(tool_use_id, name, tool_input or {}), *more]
        content = [{"type": "tool_use", "id": i, "name": n, "input": inp} for i, n, inp in uses]
        self._script.append(
            LlmResponse(content, "tool_use", Usage(input_tokens, output_tokens), self.model)
        )
        return self

    def then_text(self, text: str, input_tokens: int = 10, output_tokens: int = 5) -> ScriptedLlm:
        content = [{"type": "text", "text": text}]
        self._script.append(
            LlmResponse(content, "end_turn", Usage(input_tokens, output_tokens), self.model)
        )
        return self

    def then_response(self, response: LlmResponse) -> ScriptedLlm:
        self._script.append(response)
        return self

    def then_fail(self, error: BaseException | None = None) -> ScriptedLlm:
        self._script.append(error or LlmError("scripted failure", status=500))
        return self

    @property
    def remaining(self) -> int:
        return len(self._script)

    def send(self, request: LlmRequest) -> LlmResponse:
        with self._lock:
            self.requests.append(copy.deepcopy(request))
            if not self._script:
                raise ScriptExhausted(f"model called {len(self.requests)} times, script ran out")
            nxt = self._script.popleft()
        if isinstance(nxt, BaseException):
            raise nxt
        return nxt
