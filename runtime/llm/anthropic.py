"""The Claude Messages API as an :class:`LlmClient`, over the official ``anthropic`` SDK.

The SDK's own retries are off (``max_retries=0``): retrying is :class:`RetryingLlmClient`'s
job, with classification, jitter and durable timers the SDK knows nothing about. SDK and
HTTP errors are translated into :class:`LlmError` here, once, and nowhere else.

Logging: at DEBUG the SDK logs every request's options, prompts included, on the
``anthropic`` logger. Constructing an :class:`AnthropicClient` therefore sets the
``anthropic``, ``httpx2`` and ``httpcore2`` loggers to WARNING when nobody has configured
them (their level is NOTSET) and ``ANTHROPIC_LOG`` is unset, so a process whose root logger
is at DEBUG or INFO never prints a prompt or a per-request line from the SDK. To see the
SDK's debug output on purpose, set ``ANTHROPIC_LOG=debug`` (the SDK's own switch) or give
those loggers a level before building the client.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any, cast

import anthropic
import httpx2

from db.records import Usage
from runtime.llm.base import JsonObj, LlmError, LlmRequest, LlmResponse
from runtime.llm.retry import classify

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_CONNECT_TIMEOUT_SECONDS = 10.0

RATELIMIT = "anthropic-ratelimit-"
"""Response headers kept for flow control (the API's limits, remaining and reset)."""
SDK_LOGGERS = ("anthropic", "httpx2", "httpcore2")


def quiet_sdk_loggers() -> None:
    """Keep the SDK and its HTTP stack at WARNING unless someone chose otherwise.

    Leaves a logger alone when it already has a level, and does nothing at all when
    ``ANTHROPIC_LOG`` is set (the SDK then configures them itself).
    """
    if os.environ.get("ANTHROPIC_LOG"):
        return
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """The server's requested wait in seconds: ``retry-after-ms`` (milliseconds), else
    ``retry-after`` (seconds, or an HTTP date). ``None`` when absent or unreadable."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            value = float(ms) / 1000.0
        except ValueError:
            pass
        else:
            if math.isfinite(value) and value >= 0:
                return value
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            when = parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - datetime.now(UTC)).total_seconds())
    return value if math.isfinite(value) and value >= 0 else None


def _status_error(e: anthropic.APIStatusError) -> LlmError:
    error_type = e.type
    message = e.api_message or e.message
    status = e.status_code
    retryable = classify(status, error_type, message, error_code=e.error_code)
    label = f"{status} {error_type}" if error_type else str(status)
    return LlmError(
        f"Anthropic API error {label}: {message}",
        status=status,
        retry_after=parse_retry_after(e.response.headers),
        request_id=e.request_id,
        retryable=retryable,
    )


def _cause(e: BaseException) -> str:
    cause = e.__cause__ or e.__context__
    if cause is None:
        return str(e)
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


def _tokens(usage: Mapping[str, Any], key: str) -> int:
    value = usage.get(key)
    return int(value) if isinstance(value, int | float) else 0


def _read_body(chunks: Iterable[bytes], deadline: float, timeout_seconds: float) -> bytes:
    """The whole body, or an ``LlmError`` once the call has run past its total deadline
    (the HTTP library's read timeout is per read, so a dripping body would never trip it)."""
    body = bytearray()
    for chunk in chunks:
        body += chunk
        if time.monotonic() > deadline:
            raise LlmError(f"model response still arriving after {timeout_seconds:g} s", status=-1)
    return bytes(body)


class AnthropicClient:
    """:class:`LlmClient` for the Messages API.

    ``api_key`` and ``base_url`` default, as in the SDK, to ``ANTHROPIC_API_KEY`` and
    ``ANTHROPIC_BASE_URL`` (and the SDK's other credential sources). ``timeout_seconds`` is
    this client's total limit for one HTTP call, enforced per socket operation by the HTTP
    client and as a total deadline while the body is read. Under a
    :class:`~runtime.llm.retry.TimeLimitedLlmClient` set it slightly above that step limit
    so an abandoned call ends soon after the step gave up on it.

    The response's content blocks are returned as the JSON the API sent (no SDK model in
    between), so unknown or future block types and fields survive and replay sends back
    exactly what it received.

    Missing credentials raise a non-retryable :class:`LlmError`: from the constructor when
    the SDK resolves a credential source that fails (say ``ANTHROPIC_CONFIG_DIR`` without a
    profile), from :meth:`send` when it finds none at all.
    """

    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        *,
        connect_timeout_seconds: float = DEFAULT_CONNECT_TIMEOUT_SECONDS,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be positive")
        quiet_sdk_loggers()
        self.timeout_seconds = timeout_seconds
        try:
            self._client = anthropic.Anthropic(
                api_key=api_key,
                base_url=base_url,
                max_retries=0,
                timeout=anthropic.Timeout(
                    timeout_seconds, connect=min(connect_timeout_seconds, timeout_seconds)
                ),
            )
        except anthropic.AnthropicError as e:  # e.g. a configured credentials profile is missing
            raise LlmError(f"no usable Anthropic credentials: {e}", retryable=False) from e

    @property
    def base_url(self) -> str:
        return str(self._client.base_url)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> AnthropicClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: LlmRequest) -> LlmResponse:
        body = request.to_json()
        deadline = time.monotonic() + self.timeout_seconds
        try:
            with self._client.messages.with_streaming_response.create(
                model=body["model"],
                max_tokens=body["max_tokens"],
                messages=cast(Any, body["messages"]),
                system=cast(Any, body.get("system", anthropic.omit)),
                tools=cast(Any, body.get("tools", anthropic.omit)),
            ) as raw:
                request_id = raw.headers.get("request-id")
                limits = _rate_limit_headers(raw.headers)
                payload = _read_body(raw.iter_bytes(), deadline, self.timeout_seconds)
        except anthropic.APIStatusError as e:
            raise _status_error(e) from e
        except anthropic.APITimeoutError as e:
            raise LlmError(f"model call timed out: {_cause(e)}", status=-1) from e
        except anthropic.APIConnectionError as e:
            raise LlmError(f"connection error: {_cause(e)}", status=-1) from e
        except httpx2.RequestError as e:  # raised while reading the streamed body
            raise LlmError(f"connection error: {type(e).__name__}: {e}", status=-1) from e
        except anthropic.AnthropicError as e:  # credentials, configuration: not transient
            raise LlmError(f"model call failed: {e}", status=-1, retryable=False) from e
        except TypeError as e:
            # The SDK raises a bare TypeError, at request time, when it finds no credentials.
            if "authentication" not in str(e):
                raise
            raise LlmError(f"no Anthropic credentials: {e}", status=-1, retryable=False) from e
        return replace(_response(payload, request_id, request), rate_limits=limits)


def _rate_limit_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((k.lower(), v) for k, v in headers.items() if k.lower().startswith(RATELIMIT))


def _response(payload: bytes, request_id: str | None, request: LlmRequest) -> LlmResponse:
    try:
        data = json.loads(payload)
    except ValueError as e:
        raise LlmError(
            f"malformed Messages API response (not JSON): {e}",
            status=200,
            request_id=request_id,
        ) from e
    if not isinstance(data, dict) or not isinstance(data.get("content"), list):
        raise LlmError(
            "malformed Messages API response (no content list)",
            status=200,
            request_id=request_id,
        )
    content: list[JsonObj] = data["content"]
    usage = data.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    stop_reason = data.get("stop_reason")
    model = data.get("model")
    return LlmResponse(
        content=content,
        stop_reason=stop_reason if isinstance(stop_reason, str) else None,
        usage=Usage(
            input_tokens=_tokens(usage, "input_tokens"),
            output_tokens=_tokens(usage, "output_tokens"),
            cache_creation_input_tokens=_tokens(usage, "cache_creation_input_tokens"),
            cache_read_input_tokens=_tokens(usage, "cache_read_input_tokens"),
        ),
        model=model if isinstance(model, str) and model else request.model,
        request_id=request_id,
    )
