"""Optional OpenTelemetry spans: one per step (model steps with ``gen_ai.*`` attributes) and
one per run, emitted when the run ends with its submit time as the start.

Uses the OpenTelemetry API, which is a no-op until an SDK is configured: nothing needs an
exporter to run. ``pip install 'durable-agent-runtime[otel]'`` and ``DAR_OTEL_EXPORTER=otlp``
(standard ``OTEL_EXPORTER_OTLP_*`` variables) or ``console`` turn export on.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

log = logging.getLogger(__name__)

try:
    from opentelemetry import trace
except ImportError:  # pragma: no cover - the API comes with the anthropic SDK
    trace = None  # type: ignore[assignment]

_SCOPE = "durable-agent-runtime"


class Span:
    """The little the driver needs from a span, whether tracing is on or not."""

    def __init__(self, span: Any = None) -> None:
        self._span = span

    def set(self, attributes: Mapping[str, Any]) -> None:
        if self._span is not None:
            for key, value in attributes.items():
                if value is not None:
                    self._span.set_attribute(key, value)


def _recording() -> bool:
    """Whether an SDK tracer provider is installed (``configure_from_env``, the user's own,
    ``OTEL_PYTHON_TRACER_PROVIDER``). Until then the API's tracer records nothing, and a
    step skips making its no-op span (a context attached and detached, ~2% of a step's
    CPU)."""
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


@contextlib.contextmanager
def step_span(name: str, attributes: Mapping[str, Any]) -> Iterator[Span]:
    if not _recording():
        yield Span()
        return
    tracer = trace.get_tracer(_SCOPE)
    with tracer.start_as_current_span(name, attributes=dict(attributes)) as span:
        yield Span(span)


def run_span(run_id: str, agent: str, status: str, started: datetime, ended: datetime) -> None:
    if not _recording():
        return
    tracer = trace.get_tracer(_SCOPE)
    span = tracer.start_span(
        "dar.run",
        start_time=int(started.timestamp() * 1e9),
        attributes={"dar.run_id": run_id, "dar.agent": agent, "dar.status": status},
    )
    span.end(end_time=int(ended.timestamp() * 1e9))


def configure_from_env(env: Mapping[str, str] | None = None) -> None:
    """Install an SDK tracer provider when DAR_OTEL_EXPORTER asks for one."""
    e = os.environ if env is None else env
    exporter_name = e.get("DAR_OTEL_EXPORTER", "").strip().lower()
    if not exporter_name:
        return
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError:
        log.error("DAR_OTEL_EXPORTER is set but the otel extra is not installed")
        return
    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter,
        )

        exporter = OTLPSpanExporter()
    else:
        log.error("DAR_OTEL_EXPORTER must be otlp or console, got %r", exporter_name)
        return
    provider = TracerProvider(
        resource=Resource.create({"service.name": e.get("OTEL_SERVICE_NAME", "dar")})
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
