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

import contextlib
import json
import logging
import math
import os
import socket
import sys
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
from runtime.llm.billing import bill_lost
from runtime.llm.live_call import LiveCall, ModelCallCancelled, current_live_call
from runtime.llm.retry import classify
from runtime.llm.streaming import StreamAssembler, sse_events

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 600.0
DEFAULT_CONNECT_TIMEOUT_SECONDS = 10.0
KEEPALIVE_CONNECTIONS = 1000
"""Idle connections one client keeps for reuse (the SDK's default is 100)."""

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


class _HttpClient(anthropic.DefaultHttpxClient):
    """The SDK's default HTTP client (its keep-alive socket options) with our limits, closed
    when it is collected, as the one the SDK makes for itself is."""

    def __del__(self) -> None:
        if not self.is_closed:
            with contextlib.suppress(Exception):
                self.close()


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
        rate_limits=_rate_limit_headers(e.response.headers),
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

    ``max_connections`` caps the HTTP connections this client opens at once (``None``, the
    default: no cap, so the calls in flight are bounded by the steps in flight alone; the
    SDK's own default would be 1,000).

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
        stream: bool = True,
        max_connections: int | None = None,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be positive")
        quiet_sdk_loggers()
        self.timeout_seconds = timeout_seconds
        self.stream = stream
        """Use the streaming Messages API (text deltas to the live stream, a cancel that
        aborts the call); the response kept is the same either way."""
        # The SDK's own pool allows 1,000 connections per client: one client per worker
        # process, at a concurrency of 2,000, would hold half its steps' calls in a queue.
        # ``max_connections=None`` (the default) leaves the calls in flight to the caller.
        limits = httpx2.Limits(
            max_connections=max_connections,
            max_keepalive_connections=min(KEEPALIVE_CONNECTIONS, max_connections or sys.maxsize),
        )
        try:
            self._client = anthropic.Anthropic(
                api_key=api_key,
                base_url=base_url,
                http_client=_HttpClient(limits=limits),
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
        live = current_live_call() if self.stream else None
        attempt = live.begin_attempt() if live is not None else 0
        if live is not None and live.cancelled.is_set():
            raise ModelCallCancelled("run cancelled before the model call", usage=Usage())
        try:
            with self._client.messages.with_streaming_response.create(
                model=body["model"],
                max_tokens=body["max_tokens"],
                messages=cast(Any, body["messages"]),
                system=cast(Any, body.get("system", anthropic.omit)),
                tools=cast(Any, body.get("tools", anthropic.omit)),
                stream=self.stream,
            ) as raw:
                request_id = raw.headers.get("request-id")
                limits = _rate_limit_headers(raw.headers)
                if self.stream:
                    streamed = self._read_stream(raw, request, request_id, deadline, live, attempt)
                    return replace(streamed, rate_limits=limits)
                payload = _read_body(raw.iter_bytes(), deadline, self.timeout_seconds)
        except ModelCallCancelled:
            raise
        except anthropic.APIStatusError as e:
            raise _status_error(e) from e
        except anthropic.APITimeoutError as e:
            raise LlmError(f"model call timed out: {_cause(e)}", status=-1) from e
        except anthropic.APIConnectionError as e:
            raise LlmError(f"connection error: {_cause(e)}", status=-1) from e
        except (httpx2.RequestError, httpx2.StreamError) as e:  # while reading the body
            raise LlmError(f"connection error: {type(e).__name__}: {e}", status=-1) from e
        except anthropic.AnthropicError as e:  # credentials, configuration: not transient
            raise LlmError(f"model call failed: {e}", status=-1, retryable=False) from e
        except TypeError as e:
            # The SDK raises a bare TypeError, at request time, when it finds no credentials.
            if "authentication" not in str(e):
                raise
            raise LlmError(f"no Anthropic credentials: {e}", status=-1, retryable=False) from e
        return replace(_response(payload, request_id, request), rate_limits=limits)

    def _read_stream(
        self,
        raw: Any,
        request: LlmRequest,
        request_id: str | None,
        deadline: float,
        live: LiveCall | None,
        attempt: int,
    ) -> LlmResponse:
        """Assemble the streamed message into the response the non-streaming API would have
        returned, forwarding text to ``live``; a cancel shuts the socket down (a blocked
        read returns at once) and raises :class:`ModelCallCancelled` with the usage the
        stream had reported."""
        assembler = StreamAssembler()
        unregister = live.on_cancel(lambda: _abort(raw)) if live is not None else None
        try:
            return self._assemble(raw, assembler, request, request_id, deadline, live, attempt)
        except ModelCallCancelled:
            raise  # its usage travels with it: the engine records it
        except LlmError:
            # billed all the same: the input message_start reported, the output so far
            bill_lost(assembler.usage(), request.model, "stream cut mid-way")
            raise
        finally:
            if unregister is not None:
                unregister()

    def _assemble(
        self,
        raw: Any,
        assembler: StreamAssembler,
        request: LlmRequest,
        request_id: str | None,
        deadline: float,
        live: LiveCall | None,
        attempt: int,
    ) -> LlmResponse:
        try:
            for event in sse_events(raw.iter_lines()):
                text = assembler.feed(event)
                if live is not None and live.cancelled.is_set():
                    break
                if text and live is not None:
                    live.delta(attempt, text)
                if time.monotonic() > deadline:
                    raise LlmError(
                        f"model response still arriving after {self.timeout_seconds:g} s",
                        status=-1,
                    )
                if assembler.done:
                    break
        except (httpx2.RequestError, httpx2.StreamError, OSError) as e:
            if live is None or not live.cancelled.is_set():
                raise LlmError(f"connection error: {type(e).__name__}: {e}", status=-1) from e
        except ValueError as e:  # a tool_use block whose streamed input is not JSON
            raise LlmError(
                f"malformed Messages API stream: {e}", status=200, request_id=request_id
            ) from e
        if live is not None and live.cancelled.is_set() and not assembler.done:
            _abort(raw)
            usage, estimated = assembler.cut_usage()
            raise ModelCallCancelled(
                "run cancelled: the model call was aborted mid-stream",
                usage=usage,
                request_id=request_id,
                estimated_tokens=estimated,
            )
        if assembler.error is not None:
            status, error_type, message = assembler.error
            raise LlmError(
                f"Anthropic API error {status} {error_type}: {message} (in the stream)",
                status=status,
                request_id=request_id,
                retryable=classify(status, error_type, message),
            )
        if not assembler.done:
            raise LlmError("the model's stream ended before message_stop", status=-1)
        return _response(json.dumps(assembler.message()).encode(), request_id, request)


def _abort(raw: Any) -> None:
    """Shut the HTTP stream's socket down from any thread: a read blocked on it returns."""
    try:
        stream = raw.http_response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


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


def _rate_limit_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((k.lower(), v) for k, v in headers.items() if k.lower().startswith(RATELIMIT))
