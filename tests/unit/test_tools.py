"""Tools: JSON schema from type hints, ToolContext injection, output rendering."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Literal, Optional

import pydantic
import pytest

from db.demo import TicketStore
from runtime.agentloop.acme import list_tickets_tool
from runtime.tools import (
    Tool,
    ToolContext,
    ToolInputError,
    render_output,
    schema_from_signature,
    tool,
)

RUN_ID = uuid.UUID("00000000-0000-4000-8000-000000000004")


def test_scalars_map_to_json_types_and_parameters_without_default_are_required() -> None:
    def f(name: str, count: int, ratio: float, flag: bool) -> None: ...

    assert schema_from_signature(f) == {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "count": {"type": "integer"},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
        },
        "required": ["name", "count", "ratio", "flag"],
    }


def test_defaults_make_a_parameter_optional() -> None:
    def f(query: str, limit: int = 20, verbose: bool = False) -> None: ...

    schema = schema_from_signature(f)
    assert schema["required"] == ["query"]
    assert set(schema["properties"]) == {"query", "limit", "verbose"}
    assert schema["properties"]["limit"] == {"type": "integer"}


def test_no_required_key_when_every_parameter_has_a_default() -> None:
    def f(a: int = 1, b: str | None = None) -> None: ...

    schema = schema_from_signature(f)
    assert "required" not in schema
    assert schema["properties"] == {
        "a": {"type": "integer"},
        "b": {"type": ["string", "null"]},
    }


def test_optional_is_the_inner_type_or_null() -> None:
    def f(
        a: Optional[int] = None,  # noqa: UP045 - the typing.Optional spelling on purpose
        b: str | None = None,
        c: float | None = None,
    ) -> None: ...

    props = schema_from_signature(f)["properties"]
    assert props == {
        "a": {"type": ["integer", "null"]},
        "b": {"type": ["string", "null"]},
        "c": {"type": ["number", "null"]},
    }


def test_a_union_of_several_types_is_any_of() -> None:
    def f(x: int | str) -> None: ...

    assert schema_from_signature(f)["properties"]["x"] == {
        "anyOf": [{"type": "integer"}, {"type": "string"}]
    }


def test_literal_is_an_enum_also_inside_optional() -> None:
    def f(
        status: Literal["open", "closed"],
        priority: Literal["low", "high"] | None = None,
        level: Literal[1, 2, 3] = 1,
    ) -> None: ...

    schema = schema_from_signature(f)
    assert schema["properties"]["status"] == {"enum": ["open", "closed"]}
    # typing caches unions by equality, and two Literals of the same values in any order are
    # equal: once any module made `Literal["high", "low"] | None`, this union is that one
    # (its values in that order). The enum's order carries no meaning; its values and the
    # null do.
    priority = schema["properties"]["priority"]
    assert list(priority) == ["enum"]
    assert priority["enum"][-1] is None
    assert sorted(priority["enum"][:-1]) == ["high", "low"]
    assert schema["properties"]["level"] == {"enum": [1, 2, 3]}
    assert schema["required"] == ["status"]


def test_lists_tuples_and_dicts() -> None:
    def f(
        ids: list[int],
        tags: list[str] | None = None,
        anything: list = [],  # noqa: B006 - never called
        pair: tuple[str, ...] = (),
        extra: dict[str, Any] | None = None,
        nested: list[list[float]] | None = None,
    ) -> None: ...

    props = schema_from_signature(f)["properties"]
    assert props["ids"] == {"type": "array", "items": {"type": "integer"}}
    assert props["tags"] == {"type": ["array", "null"], "items": {"type": "string"}}
    assert props["anything"] == {"type": "array"}
    assert props["pair"] == {"type": "array", "items": {"type": "string"}}
    assert props["extra"] == {"type": ["object", "null"]}
    assert props["nested"] == {
        "type": ["array", "null"],
        "items": {"type": "array", "items": {"type": "number"}},
    }


def test_an_unannotated_parameter_accepts_anything() -> None:
    def f(x, y: Any = None) -> None:  # type: ignore[no-untyped-def]
        ...

    schema = schema_from_signature(f)
    assert schema["properties"] == {"x": {}, "y": {}}
    assert schema["required"] == ["x"]


def test_tool_context_is_excluded_from_the_schema_whatever_its_name() -> None:
    def f(ctx: ToolContext, query: str) -> None: ...

    def g(query: str, tc: ToolContext, limit: int = 3) -> None: ...

    assert schema_from_signature(f) == {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
    }
    assert schema_from_signature(g) == {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"],
    }


def test_the_decorator_builds_a_tool_with_name_description_and_schema() -> None:
    @tool
    def lookup(q: str, ctx: ToolContext, limit: int = 5) -> str:
        """Look something up.

        Longer explanation."""
        return q

    assert isinstance(lookup, Tool)
    assert lookup.name == "lookup"
    assert lookup.description == "Look something up.\n\nLonger explanation."
    assert lookup.idempotent is False
    assert lookup.definition() == {
        "name": "lookup",
        "description": "Look something up.\n\nLonger explanation.",
        "input_schema": {
            "type": "object",
            "properties": {"q": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["q"],
        },
    }


def test_the_decorator_with_options() -> None:
    explicit = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}

    @tool(
        name="charge_card",
        description="Charge a card.",
        idempotent=True,
        timeout_seconds=3,
        input_schema=explicit,
    )
    def charge(n: int) -> str:
        return "charged"

    assert charge.name == "charge_card"
    assert charge.description == "Charge a card."
    assert charge.idempotent is True
    assert charge.timeout_seconds == 3
    assert charge.input_schema == explicit


def test_invoke_passes_the_arguments_and_injects_the_context() -> None:
    seen: list[tuple[str, int, ToolContext]] = []

    @tool
    def lookup(q: str, ctx: ToolContext, limit: int = 5) -> str:
        """Look."""
        seen.append((q, limit, ctx))
        return f"{q}:{limit}:{ctx.idempotency_key}"

    context = ToolContext(run_id=RUN_ID, tool_use_id="toolu_01Ab")
    assert lookup.invoke({"q": "x"}, context) == f"x:5:{RUN_ID}/toolu_01Ab"
    assert lookup.invoke({"q": "y", "limit": 2}, context) == f"y:2:{RUN_ID}/toolu_01Ab"
    assert seen[0][2] is context
    assert seen[0][2].run_id == RUN_ID


def test_the_model_cannot_supply_the_context() -> None:
    @tool
    def lookup(q: str, ctx: ToolContext) -> str:
        """Look."""
        return ctx.tool_use_id

    context = ToolContext(run_id=RUN_ID, tool_use_id="toolu_real")
    assert lookup.invoke({"q": "x", "ctx": "forged"}, context) == "toolu_real"


def test_invoke_does_not_mutate_the_arguments_and_works_without_a_context_parameter() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    args = {"a": 2, "b": 3}
    assert add.invoke(args, ToolContext(run_id=RUN_ID, tool_use_id="t")) == 5
    assert args == {"a": 2, "b": 3}


def test_invoke_validates_the_input_against_the_schema_before_calling() -> None:
    calls: list[dict[str, Any]] = []

    @tool
    def find(status: Literal["open", "closed"], limit: int = 5) -> str:
        """Find."""
        calls.append({"status": status, "limit": limit})
        return "found"

    context = ToolContext(run_id=RUN_ID, tool_use_id="t")
    with pytest.raises(ToolInputError, match="status") as missing:
        find.invoke({}, context)
    assert "'find'" in str(missing.value)
    with pytest.raises(ToolInputError, match="limit"):
        find.invoke({"status": "open", "limit": "five"}, context)
    with pytest.raises(ToolInputError, match="status"):
        find.invoke({"status": "pending"}, context)
    with pytest.raises(ValueError, match="invalid input"):
        find.invoke({"status": "open", "limit": True}, context)
    assert calls == [], "the function never ran on invalid input"
    assert find.invoke({"status": "closed", "limit": 2}, context) == "found"
    assert calls == [{"status": "closed", "limit": 2}]


def test_an_explicit_schema_is_the_one_validated() -> None:
    @tool(input_schema={"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}})
    def count(n: int = 1) -> int:
        return n

    context = ToolContext(run_id=RUN_ID, tool_use_id="t")
    with pytest.raises(ToolInputError, match="n"):
        count.invoke({"n": 0}, context)
    assert count.invoke({"n": 3}, context) == 3


def test_an_argument_the_function_does_not_take_raises_for_the_driver_to_report() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    with pytest.raises(TypeError):
        add.invoke({"a": 1, "b": 2, "c": 3}, ToolContext(run_id=RUN_ID, tool_use_id="t"))


def test_an_optional_parameter_accepts_an_explicit_null() -> None:
    @tool
    def find(status: Literal["open", "closed"] | None = None, who: str | None = None) -> str:
        """Find."""
        return f"{status}/{who}"

    context = ToolContext(run_id=RUN_ID, tool_use_id="t")
    assert find.invoke({"status": None, "who": None}, context) == "None/None"


def test_a_heterogeneous_tuple_accepts_its_own_shape() -> None:
    @tool
    def at(point: tuple[int, str]) -> str:
        """Point."""
        return f"{point[0]}{point[1]}"

    assert at.invoke({"point": [1, "x"]}, ToolContext(run_id=RUN_ID, tool_use_id="t")) == "1x"


def test_the_idempotency_key_is_the_run_id_and_the_tool_use_id() -> None:
    """Issue 23 defect 2: unique across runs (a downstream ledger de-duplicates on it)."""
    ctx = ToolContext(run_id=RUN_ID, tool_use_id="toolu_01Ab")
    assert ctx.idempotency_key == f"{RUN_ID}/toolu_01Ab"
    assert ctx.key == "toolu_01Ab"
    other = ToolContext(run_id=uuid.uuid4(), tool_use_id="toolu_01Ab")
    assert other.idempotency_key != ctx.idempotency_key


def test_render_output_keeps_strings_as_they_are() -> None:
    assert render_output("plain text") == "plain text"
    assert render_output("") == ""
    assert render_output('{"already": "json"}') == '{"already": "json"}'


def test_render_output_serialises_everything_else_as_json() -> None:
    value = [{"id": 101, "title": "Café crème", "overdue": True, "assignee": None}]
    out = render_output(value)
    assert json.loads(out) == value
    assert "Café" in out, "non-ASCII text is kept readable"
    assert render_output(42) == "42"
    assert render_output(None) == "null"
    assert render_output(True) == "true"


def test_render_output_falls_back_to_str_for_other_values() -> None:
    when = datetime(2025, 1, 2, 3, 4, tzinfo=UTC)
    out = json.loads(render_output({"due": when, "amount": Decimal("1.50"), "id": RUN_ID}))
    assert out == {"due": str(when), "amount": "1.50", "id": str(RUN_ID)}


def test_the_acme_list_tickets_tool_schema() -> None:
    t = list_tickets_tool(TicketStore(engine=None))  # type: ignore[arg-type]
    assert t.name == "list_tickets"
    assert t.idempotent is True
    schema = t.input_schema
    assert "required" not in schema
    assert schema["properties"]["status"] == {"enum": ["open", "in_progress", "closed", None]}
    assert schema["properties"]["priority"] == {"enum": ["low", "normal", "high", "urgent", None]}
    assert schema["properties"]["assignee"] == {"type": ["string", "null"]}
    assert schema["properties"]["overdue"] == {"type": ["boolean", "null"]}
    assert schema["properties"]["limit"] == {"type": "integer"}


def test_render_output_cuts_long_output_and_says_so() -> None:
    out = render_output("x" * 50, limit=10)
    assert out.startswith("x" * 10 + "\n")
    assert "x" * 11 not in out
    assert "50 characters" in out
    assert "first 10" in out
    assert render_output("x" * 10, limit=10) == "x" * 10, "at the limit nothing is cut"
    structured = render_output([{"id": i} for i in range(100)], limit=20)
    assert structured.startswith('[{"id": 0}, {"id": 1\n[output truncated')
    assert "truncated" in structured


class Refund(pydantic.BaseModel):
    order_id: int
    amount: float
    reason: str = "unspecified"


def test_a_pydantic_model_parameter_gives_the_schema_and_the_value() -> None:
    @tool
    def refund(request: Refund, ctx: ToolContext) -> str:
        """Refund an order."""
        return f"{request.order_id}:{request.amount}:{request.reason}:{ctx.idempotency_key}"

    schema = refund.input_schema
    assert schema["required"] == ["order_id", "amount"]
    assert schema["properties"]["amount"]["type"] == "number"
    context = ToolContext(run_id=RUN_ID, tool_use_id="toolu_9")
    assert (
        refund.invoke({"order_id": 7, "amount": 2.5}, context)
        == f"7:2.5:unspecified:{RUN_ID}/toolu_9"
    )
    with pytest.raises(ToolInputError, match="order_id"):
        refund.invoke({"amount": 2.5}, context)
