"""The bare Anthropic SDK client the benchmarks compare against: the official client as a
user would configure it for many calls at once (no retries, no cap on connections), pointed
at the local fake of the Messages API. Imported lazily by its callers: a gevent baseline
must patch before ``anthropic`` and ``httpx2`` load."""

from __future__ import annotations

from typing import Any


def bare_sdk_client(url: str, latency_ms: float) -> Any:
    """``anthropic.Anthropic`` at ``url``, its timeout three times the fake's latency plus
    a minute."""
    import anthropic
    import httpx2

    return anthropic.Anthropic(
        api_key="bench",
        base_url=url,
        max_retries=0,
        http_client=anthropic.DefaultHttpxClient(
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=1000)
        ),
        timeout=anthropic.Timeout(latency_ms / 1000 * 3 + 60, connect=30),
    )
