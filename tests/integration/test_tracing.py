"""OpenTelemetry spans, one per step (gen_ai.* on model steps) and one per run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from runtime.tools import tool
from tests.support import drive_to_end, register_agent, submit

_exporter = InMemorySpanExporter()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        trace.set_tracer_provider(provider)
    _exporter.clear()
    yield _exporter
    _exporter.clear()


def test_a_span_per_step_and_one_for_the_run(
    runtime: Runtime, llm: ScriptedLlm, spans: InMemorySpanExporter
) -> None:
    @tool(idempotent=True)
    def lookup() -> str:
        """Look."""
        return "x"

    llm.then_tool_use("toolu_1", "lookup", {}, 100, 20).then_text("done", 150, 5)
    register_agent(runtime.agents, lookup)
    run, dispatch = submit(runtime.store, model="claude-test-model")
    drive_to_end(runtime.driver(), dispatch)

    finished = [
        s for s in spans.get_finished_spans() if s.attributes.get("dar.run_id") == str(run.id)
    ]
    names = [s.name for s in finished]
    assert names == [
        "chat claude-test-model",
        "execute_tool lookup",
        "chat claude-test-model",
        "dar.run",
    ]
    first = finished[0].attributes
    assert first["gen_ai.operation.name"] == "chat"
    assert first["gen_ai.request.model"] == "claude-test-model"
    assert first["gen_ai.usage.input_tokens"] == 100
    assert first["gen_ai.usage.output_tokens"] == 20
    assert tuple(first["gen_ai.response.finish_reasons"]) == ("tool_use",)
    assert finished[1].attributes["gen_ai.tool.call.id"] == "toolu_1"
    run_span = finished[-1]
    assert run_span.attributes["dar.status"] == "SUCCEEDED"
    assert run_span.start_time is not None
    assert run_span.end_time is not None
    assert run_span.start_time <= finished[0].start_time
