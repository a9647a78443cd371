"""What the engine needs from a model: one call, a request in, a response out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from db.errors import DarError
from db.records import Usage

JsonObj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class LlmRequest:
    """A Messages API request, already in the API's JSON shapes."""

    model: str
    max_tokens: int
    messages: list[JsonObj]
    system: list[JsonObj] = field(default_factory=list)
    tools: list[JsonObj] = field(default_factory=list)

    def to_json(self) -> JsonObj:
        """The request body as the Messages API receives it (keys in a fixed order, so the
        same request always serialises to the same bytes)."""
        body: JsonObj = {"model": self.model, "max_tokens": self.max_tokens}
        if self.system:
            body["system"] = self.system
        if self.tools:
            body["tools"] = self.tools
        body["messages"] = self.messages
        return body


@dataclass(frozen=True, slots=True)
class LlmResponse:
    """The parts of a Messages API response the runtime keeps. ``content`` holds the
    assistant's content blocks exactly as returned: replay sends them back unchanged."""

    content: list[JsonObj]
    stop_reason: str | None
    usage: Usage
    model: str
    request_id: str | None = None
    rate_limits: tuple[tuple[str, str], ...] = ()
    """The response's ``anthropic-ratelimit-*`` headers, when the API sent them (flow control
    learns the real limits from them)."""


class LlmError(DarError):
    """The model call failed.

    ``status`` is the HTTP status, or ``-1`` for an I/O error or timeout. ``retry_after`` is
    the server's requested wait in seconds, when it sent one.
    """

    BACK_PRESSURE_STATUSES = frozenset({429, 529})
    """Rate limited or overloaded: "come back later", not a failure of the call."""

    RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504, 529, -1})

    def __init__(
        self,
        message: str,
        *,
        status: int = -1,
        retry_after: float | None = None,
        request_id: str | None = None,
        retryable: bool | None = None,
        rate_limits: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.request_id = request_id
        self._retryable = retryable
        self.rate_limits = rate_limits
        """The error response's ``anthropic-ratelimit-*`` headers (a 429 carries them)."""

    @property
    def back_pressure(self) -> bool:
        """The API asks to come back later (429 rate limit, 529 ``overloaded_error``, also
        in a stream): retryable, and no fault of the call's. A 429 for a spend limit is not
        retryable, so not back-pressure."""
        return self.retryable and self.status in self.BACK_PRESSURE_STATUSES

    @property
    def retryable(self) -> bool:
        if self._retryable is not None:
            return self._retryable
        return self.status in self.RETRYABLE_STATUSES


class LlmClient(Protocol):
    """Sends one Messages API request. Raises :class:`LlmError` on failure."""

    def send(self, request: LlmRequest) -> LlmResponse: ...
