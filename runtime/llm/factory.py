"""The production model client: ``Retrying(TimeLimited(Anthropic))``.

The retry loop is outside the per-attempt wall-clock limit, so a slow attempt is cut at its
deadline and retried; the HTTP client's own timeout sits a little above that limit so the
abandoned call does end.
"""

from __future__ import annotations

from runtime.config import Settings
from runtime.llm.anthropic import AnthropicClient
from runtime.llm.base import LlmClient
from runtime.llm.retry import (
    HTTP_TIMEOUT_MARGIN_SECONDS,
    RetryingLlmClient,
    RetryPolicy,
    TimeLimitedLlmClient,
)


def anthropic_client(settings: Settings) -> LlmClient:
    timeout = settings.model_timeout_seconds
    attempt = TimeLimitedLlmClient(
        AnthropicClient(
            api_key=settings.anthropic_api_key,
            base_url=settings.anthropic_base_url,
            timeout_seconds=timeout + HTTP_TIMEOUT_MARGIN_SECONDS,
        ),
        timeout,
    )
    return RetryingLlmClient(
        attempt,
        RetryPolicy(
            max_attempts=settings.retry_max_attempts,
            base=settings.retry_base_seconds,
            cap=settings.retry_cap_seconds,
            long_wait_threshold=settings.long_wait_seconds,
        ),
    )
