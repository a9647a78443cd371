"""Tools: plain Python functions the model may call.

A tool gets its input as keyword arguments and, if it declares a parameter annotated
:class:`ToolContext`, the context: the run and the ``tool_use`` id, its idempotency key.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
import types
import typing
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator

JsonObj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool (or a durable step, as ``steps.context``) knows about its call.

    ``cancelled`` is set when the call ran past its timeout (or the run was cancelled): stop
    and raise. ``remaining()`` is the time left before the timeout, for the timeouts of the
    HTTP calls the tool makes, so a call that must stop does stop.
    """

    run_id: uuid.UUID
    tool_use_id: str
    cancelled: threading.Event = field(default_factory=threading.Event, compare=False)
    deadline: float | None = field(default=None, compare=False)
    """``time.monotonic()`` at which the call times out, if it has a limit."""

    @property
    def idempotency_key(self) -> str:
        """``<run id>/<tool_use id>`` (for a durable step ``<run id>/<step key>``): the same
        for every execution of this call in this run (after a crash, a retry by an
        operator), different in every other run of the same agent or function and in a
        fork for any step the fork runs again. Pass it downstream (an ``Idempotency-Key``
        header, a unique column): a system that de-duplicates on it performs the call once
        per run."""
        return idempotency_key(self.run_id, self.tool_use_id)

    @property
    def key(self) -> str:
        """The call's key within its run: the ``tool_use`` id, or the durable step's key.
        Not unique across runs: pass :attr:`idempotency_key` downstream instead."""
        return self.tool_use_id

    def remaining(self, default: float | None = None) -> float | None:
        """Seconds left before the timeout (``default`` when the call has none); 0 once
        cancelled."""
        if self.cancelled.is_set():
            return 0.0
        if self.deadline is None:
            return default
        return max(0.0, self.deadline - time.monotonic())


def idempotency_key(run_id: uuid.UUID, step_key: str) -> str:
    """The idempotency key handed to user code and to MCP servers for one step of one run:
    unique across runs (a fork is a run of its own), stable across a step's executions."""
    return f"{run_id}/{step_key}"


StepContext = ToolContext
"""The same context, for durable steps (``steps.context``): ``key`` is the step key."""


_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _schema_for(annotation: Any) -> JsonObj:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        all_args = typing.get_args(annotation)
        args = [a for a in all_args if a is not type(None)]
        schema = (
            _schema_for(args[0]) if len(args) == 1 else {"anyOf": [_schema_for(a) for a in args]}
        )
        if len(args) < len(all_args):  # Optional: an explicit null is valid input too
            schema = _nullable(schema)
        return schema
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(annotation))}
    if origin is tuple:
        item_args = typing.get_args(annotation)
        if len(item_args) == 2 and item_args[1] is Ellipsis:
            return {"type": "array", "items": _schema_for(item_args[0])}
        return {
            "type": "array",
            "prefixItems": [_schema_for(a) for a in item_args],
            "minItems": len(item_args),
            "maxItems": len(item_args),
        }
    if origin is list:
        return {"type": "array", "items": _schema_for(typing.get_args(annotation)[0])}
    if annotation in (list, tuple):
        return {"type": "array"}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    return {}


def _nullable(schema: JsonObj) -> JsonObj:
    if isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    if not schema:
        return schema
    return {"anyOf": [schema, {"type": "null"}]}


def _model_parameter(fn: Callable[..., Any]) -> tuple[str, Any] | None:
    """``(name, model class)`` when the tool takes its whole input as one pydantic model."""
    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters if hints.get(p) is not ToolContext]
    if len(params) == 1 and hasattr(hints.get(params[0]), "model_json_schema"):
        return params[0], hints[params[0]]
    return None


def schema_from_signature(fn: Callable[..., Any]) -> JsonObj:
    """A JSON schema for a function's keyword arguments, from its type hints, or, when its
    only parameter is a pydantic model, that model's schema."""
    model = _model_parameter(fn)
    if model is not None:
        schema: JsonObj = model[1].model_json_schema()
        return schema
    hints = typing.get_type_hints(fn)
    properties: JsonObj = {}
    required: list[str] = []
    for name, param in inspect.signature(fn).parameters.items():
        annotation = hints.get(name, Any)
        if annotation is ToolContext:
            continue
        properties[name] = _schema_for(annotation)
        if param.default is inspect.Parameter.empty:
            required.append(name)
    schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


@dataclass(frozen=True, slots=True)
class Reconciled:
    """A reconcile hook's answer: the effect did happen, and this is its result."""

    output: Any


class ToolInputError(ValueError):
    """The model's input does not match the tool's schema."""


class OutcomeUnknown(Exception):
    """The call was sent and its answer never came (the far side died, or did not answer in
    time): its effect may or may not have happened. A tool raises it to say so; the step is
    then in doubt exactly as if its worker had crashed there (:mod:`runtime.pipeline.effects`)."""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    fn: Callable[..., Any]
    input_schema: JsonObj = field(default_factory=dict)
    idempotent: bool = False
    """Safe to execute again with the same idempotency key after a crash."""
    timeout_seconds: float = 60.0
    reconcile: Callable[[ToolContext], Reconciled | None] | None = None
    """For a tool that is not idempotent: asked after a crash left its step STARTED whether
    the effect happened (return :class:`Reconciled` with its result) or not (``None``: the
    tool runs). Without it the run stops for a human."""

    def definition(self) -> JsonObj:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
        }

    def validate(self, arguments: JsonObj) -> None:
        """Raise :class:`ToolInputError` saying what is wrong with the model's input."""
        validator = Draft202012Validator(self.input_schema)
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(e.path))
        if errors:
            parts = []
            for e in errors[:5]:
                where = "/".join(str(p) for p in e.path) or "input"
                parts.append(f"{where}: {e.message}")
            raise ToolInputError(f"invalid input for tool {self.name!r}: " + "; ".join(parts))

    def invoke(self, arguments: JsonObj, context: ToolContext) -> Any:
        self.validate(arguments)
        hints = typing.get_type_hints(self.fn)
        model = _model_parameter(self.fn)
        kwargs = {model[0]: model[1].model_validate(arguments)} if model else dict(arguments)
        for name in inspect.signature(self.fn).parameters:
            if hints.get(name) is ToolContext:
                kwargs[name] = context
        return self.fn(**kwargs)


Reconcile = Callable[[ToolContext], Reconciled | None]


@typing.overload
def tool(
    fn: Callable[..., Any],
    *,
    name: str | None = None,
    description: str | None = None,
    input_schema: JsonObj | None = None,
    idempotent: bool = False,
    timeout_seconds: float = 60.0,
    reconcile: Reconcile | None = None,
) -> Tool: ...


@typing.overload
def tool(
    fn: None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    input_schema: JsonObj | None = None,
    idempotent: bool = False,
    timeout_seconds: float = 60.0,
    reconcile: Reconcile | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    input_schema: JsonObj | None = None,
    idempotent: bool = False,
    timeout_seconds: float = 60.0,
    reconcile: Reconcile | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Declare a tool: ``@tool`` or ``@tool(idempotent=True, ...)`` on a function.

    ``name`` defaults to the function's name, ``description`` to its docstring, and
    ``input_schema`` to a JSON schema derived from its type hints (or its one pydantic-model
    parameter). A parameter annotated :class:`ToolContext` receives the call's context.
    ``idempotent=True``: after a crash left the call in doubt it runs again with the same
    idempotency key; otherwise ``reconcile(ctx)`` is asked whether the effect happened, and
    without one the run stops ``NEEDS_ATTENTION`` for an operator. A call past
    ``timeout_seconds`` is an error result the model sees."""

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(
            name=name or f.__name__,
            description=description or inspect.getdoc(f) or "",
            fn=f,
            input_schema=input_schema or schema_from_signature(f),
            idempotent=idempotent,
            timeout_seconds=timeout_seconds,
            reconcile=reconcile,
        )

    return wrap(fn) if fn is not None else wrap


def render_output(value: Any, limit: int | None = None) -> str:
    """Tool output as the model sees it: strings as they are, anything else as JSON; above
    ``limit`` characters, cut with a marker that says so."""
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    if limit is not None and len(text) > limit:
        return (
            text[:limit] + f"\n[output truncated: {len(text)} characters, the first {limit} shown]"
        )
    return text
