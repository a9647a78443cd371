"""Pydantic AI agents, durable on this runtime, through Pydantic AI's own durable-execution
extension point (a durability capability with a callable operation backend).

    # agents module (DAR_AGENT_MODULES)
    support = pydantic_ai.Agent("anthropic:claude-sonnet-4-5", name="support", tools=[lookup])

    def register(registry):
        registry.register(support)          # the one line

What the capability routes through a step of this runtime (``steps.run``, see
:mod:`runtime.frameworks.bridge`): every model request, every function-tool call, every MCP
listing and call. Each is recorded once and replayed afterwards; the agent's own code between
them runs again on every task, as a durable function's does.

Step names are a persistence format (pinned in ``tests/frameworks``): ``model.request``
(``model.request.<model id>`` for a model other than the agent's), ``tool.<tool>``,
``mcp.<toolset id>.<tool>``, ``mcp.<toolset id>.tools``, ``mcp.<toolset id>.instructions``,
``tools.<toolset id>`` (a dynamic toolset's listing), ``validate.<tool>``, ``event``,
``capability.<id>.<operation>``.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, assert_never

from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import DeferredToolRequests, DeferredToolResults, ToolDenied
from pydantic_ai.capabilities import CombinedCapability
from pydantic_ai.capabilities.combined import bind_capabilities_tier
from pydantic_ai.durable_exec import (
    JSON_CODEC,
    BaseDurabilityCapability,
    CallableOperationBackend,
    CapabilityOperationId,
    DurabilityEngineSpec,
    DurableOperationBackend,
    DurableOperationId,
    DurableOperationNamer,
    EventStreamHandlerId,
    ModelCancelSuspendedResponseId,
    ModelCompactMessagesId,
    ModelRequestId,
    RoleBasedOperationConfig,
    ToolsetCallToolId,
    ToolsetGetInstructionsId,
    ToolsetGetToolsId,
    ToolsetKind,
    ToolsetValidateToolArgumentsId,
    conversation_id_from_run_id,
)
from pydantic_ai.durable_exec._operation_names import DurableInvocationName
from pydantic_core import to_jsonable_python

from db.records import Usage
from runtime.durable.api import Billed, DurableAgent, Steps
from runtime.durable.errors import DurableConfigError
from runtime.frameworks.bridge import (
    APPROVAL_ROLE,
    APPROVAL_TIMEOUT_SECONDS,
    Billing,
    Bridge,
    UnitPolicy,
    ask_approval,
    check_identity,
    current_bridge,
    prompt_of,
)

Config = dict[str, Any]
"""A unit's policy as Pydantic AI resolves it: ``{"idempotent": bool}``; a tool overrides it
with ``metadata={"dar": {"idempotent": True}}``."""

MODEL: Config = {"idempotent": True}
"""A model request may repeat after a crash (at most once): it has no effect but its bill."""
READ: Config = {"idempotent": True}
"""Listings, validation, event handling: no effect outside the run."""
TOOL: Config = {"idempotent": False}
"""A tool call is not run twice unless it says it may (else the run stops for an operator)."""


class StepNamer(DurableOperationNamer):
    """The step names of a Pydantic AI agent's units: persisted, never to change."""

    def operation_name(self, operation_id: DurableOperationId) -> str:
        match operation_id:
            case ModelRequestId(model_id=model_id):
                return "model.request" + (f".{model_id}" if model_id else "")
            case ModelCancelSuspendedResponseId(model_id=model_id):
                return "model.cancel" + (f".{model_id}" if model_id else "")
            case ModelCompactMessagesId(model_id=model_id):
                return "model.compact" + (f".{model_id}" if model_id else "")
            case EventStreamHandlerId():
                return "event"
            case CapabilityOperationId(capability_id=capability_id, operation=operation):
                return f"capability.{capability_id}.{operation}"
            case ToolsetGetToolsId(toolset_kind="mcp", toolset_id=toolset_id):
                return f"mcp.{toolset_id}.tools"
            case ToolsetGetToolsId(toolset_id=toolset_id):
                return f"tools.{toolset_id}"
            case ToolsetGetInstructionsId(toolset_id=toolset_id):
                return f"mcp.{toolset_id}.instructions"
            case ToolsetValidateToolArgumentsId():
                return "validate"
            case ToolsetCallToolId(toolset_kind="mcp", toolset_id=toolset_id):
                return f"mcp.{toolset_id}"
            case ToolsetCallToolId():
                return "tool"
        assert_never(operation_id)

    def invocation_name(
        self, operation_id: DurableOperationId, *, label: str | None
    ) -> DurableInvocationName:
        name = self.operation_name(operation_id)
        if label and isinstance(operation_id, ToolsetCallToolId | ToolsetValidateToolArgumentsId):
            name = f"{name}.{label}"
        return DurableInvocationName(name.replace("/", "_"))


def usage_of(response: Any) -> Usage:
    """A recorded ``ModelResponse``'s usage (Pydantic AI counts cache reads and writes inside
    ``input_tokens``; this runtime keeps them apart, as the Messages API reports them)."""
    u = (response or {}).get("usage") or {}
    cache_read = int(u.get("cache_read_tokens") or 0)
    cache_write = int(u.get("cache_write_tokens") or 0)
    return Usage(
        input_tokens=max(0, int(u.get("input_tokens") or 0) - cache_read - cache_write),
        output_tokens=int(u.get("output_tokens") or 0),
        cache_creation_input_tokens=cache_write,
        cache_read_input_tokens=cache_read,
    )


def billed(response: Any) -> Billed:
    """What the provider billed for a model request, from the recorded ``ModelResponse``."""
    response = response or {}
    return Billed(
        value=response,
        model=str(response.get("model_name") or ""),
        usage=usage_of(response),
        request_id=response.get("provider_response_id"),
        stop_reason=response.get("finish_reason"),
    )


def _without_clock(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_clock(v) for k, v in value.items() if k != "timestamp"}
    if isinstance(value, list):
        return [_without_clock(v) for v in value]
    return value


def prompt(cache_key: tuple[object, ...]) -> Any:
    """What a model request sends (messages, settings, tool definitions) as JSON, without
    the timestamps Pydantic AI stamps on every message: the same prompt hashes the same."""
    return _without_clock(to_jsonable_python(cache_key[1:4], fallback=repr))


class StepBackend(CallableOperationBackend[Config]):
    """Runs each unit as one step of the run (``steps.run``, a model request as
    ``steps.model_call``), across the bridge."""

    def __init__(self, capability: DarDurability, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.capability = capability
        self.safe_mcp_calls: set[str] = set()

    async def execute(
        self,
        *,
        operation_id: DurableOperationId,
        name: str,
        body: Callable[[], Awaitable[object]],
        cache_key: tuple[object, ...],
        config: Config,
    ) -> object:
        bridge = current_bridge()
        if bridge is None:  # outside a run of this runtime: the agent behaves as without us
            return await body()
        idempotent = bool((config or {}).get("idempotent", False))
        mcp_call = (
            isinstance(operation_id, ToolsetCallToolId) and operation_id.toolset_kind == "mcp"
        )
        if mcp_call and name in self.safe_mcp_calls:  # annotated read-only or idempotent
            idempotent = True
        billing = None
        if isinstance(operation_id, ModelRequestId):
            billing = Billing(self.capability.model_name(operation_id), prompt(cache_key), billed)
        value = await bridge.unit(name, body, UnitPolicy(idempotent=idempotent), billing)
        if isinstance(operation_id, ToolsetGetToolsId) and operation_id.toolset_kind == "mcp":
            self._learn_annotations(operation_id.toolset_id, value)
        return value

    def _learn_annotations(self, toolset_id: str, listing: Any) -> None:
        """From an MCP listing (recorded or fresh): which of its tools may be called again."""
        if not isinstance(listing, dict):
            return
        for tool, definition in listing.items():
            metadata = (definition or {}).get("metadata") or {}
            hints = metadata.get("annotations") or {}
            if hints.get("readOnlyHint") or hints.get("idempotentHint"):
                self.safe_mcp_calls.add(f"mcp.{toolset_id}.{tool}".replace("/", "_"))


class DarDurability(BaseDurabilityCapability[Any]):
    """The durability capability: add it to an agent yourself, or let
    ``registry.register(agent)`` add it."""

    engine_spec = DurabilityEngineSpec(
        engine_name="Durable Agent Runtime",
        durable_unit_noun="step",
        durable_container_noun="run",
        codec=JSON_CODEC,
        unsupported_runtime_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        wrapped_toolset_kinds=frozenset({"function", "mcp", "dynamic"}),
        toolset_lifecycles={
            "function": "enter-always",
            "mcp": "enter-in-durable-unit",
            "dynamic": "enter-never",
        },
        journal_discovery=True,
        sequential_tools_in_durable_context=True,
        tool_config_key="dar",
    )

    @property
    def in_durable_context(self) -> bool:
        return current_bridge() is not None

    def get_default_run_id(self) -> str | None:
        bridge = current_bridge()
        if bridge is None:
            return None
        n = bridge.count("agent.run")  # each agent.run of one of our runs gets its own
        return str(bridge.steps.run_id) if n == 0 else f"{bridge.steps.run_id}:{n}"

    def get_default_conversation_id(self, run_id: str) -> str | None:
        return conversation_id_from_run_id(run_id) if self.in_durable_context else None

    def model_name(self, operation_id: ModelRequestId) -> str:
        """The model a request goes to, as far as it is known before the answer names it."""
        model = self.agent.model if self.agent is not None else None
        if operation_id.model_id:
            return operation_id.model_id
        if isinstance(model, str):
            return model.partition(":")[2] or model
        return str(getattr(model, "model_name", "") or operation_id.model_name)

    def get_durable_operation_backend(self) -> DurableOperationBackend[Config]:
        return StepBackend(
            self,
            namer=StepNamer(),
            config=RoleBasedOperationConfig(
                model=MODEL,
                event=READ,
                capability=READ,
                tool=TOOL,
                resolve_tool=self._resolve_tool,
            ),
        )

    def _resolve_tool(self, operation_id: DurableOperationId, tool: Any, tool_name: str) -> Any:
        if isinstance(operation_id, ToolsetValidateToolArgumentsId):
            return READ
        assert isinstance(operation_id, ToolsetCallToolId)
        return self._build_resolve_tool_config(
            self._toolset_base_config(operation_id.toolset_kind)
        )(tool, tool_name)

    def _toolset_base_config(self, kind: ToolsetKind) -> Any:
        return TOOL


def _annotated_safe(tool: Any) -> bool:
    """An MCP tool its server annotates read-only or idempotent: safe to call again."""
    metadata = getattr(getattr(tool, "tool_def", None), "metadata", None) or {}
    annotations = metadata.get("annotations") or {}
    return bool(annotations.get("readOnlyHint") or annotations.get("idempotentHint"))


def durable(agent: PydanticAgent[Any, Any]) -> PydanticAgent[Any, Any]:
    """``agent`` with :class:`DarDurability` attached: the agent itself when it already has it,
    else a copy (the user's agent object is left as it was)."""
    if DarDurability.from_agent(agent) is not None:
        return agent
    twin = copy.copy(agent)
    root = CombinedCapability([*agent.root_capability.capabilities, DarDurability()])
    twin._root_capability = bind_capabilities_tier(root, twin, innermost=True)
    return twin


def identity(agent: PydanticAgent[Any, Any]) -> dict[str, Any]:
    """What a run of ``agent`` depends on: its tools (by toolset), MCP servers, output."""
    toolsets: dict[str, list[str]] = {}

    def visit(ts: Any) -> None:
        tools = getattr(ts, "tools", None)
        key = str(getattr(ts, "id", None) or type(ts).__name__)
        toolsets[key] = sorted(tools) if isinstance(tools, dict) else []

    for toolset in agent.toolsets:
        toolset.apply(visit)
    output = agent.output_type
    return {
        "toolsets": toolsets,
        "output": getattr(output, "__qualname__", None) or repr(output),
    }


@dataclass(frozen=True)
class Options:
    deps: Any = None
    """The run's dependencies, or a function that makes them (in the worker, per task)."""
    approval_role: str = APPROVAL_ROLE
    approval_timeout_seconds: float = APPROVAL_TIMEOUT_SECONDS


async def _agent_run(
    agent: PydanticAgent[Any, Any], user_prompt: str, options: Options, bridge: Bridge
) -> Any:
    """The agent's run; a tool that needs approval asks this runtime's approvers, and the
    run goes on with their decisions (Pydantic AI's deferred tool results)."""
    deps = options.deps() if callable(options.deps) else options.deps
    output_type = [agent.output_type, DeferredToolRequests]
    result: Any = await agent.run(user_prompt, deps=deps, output_type=output_type)
    while isinstance(result.output, DeferredToolRequests):
        requests = result.output
        if requests.calls:
            names = ", ".join(c.tool_name for c in requests.calls)
            raise DurableConfigError(
                f"agent {agent.name!r} deferred tool calls ({names}) to its caller: only tools "
                "that need approval can be deferred here (they become approvals)"
            )
        decisions: dict[str, Any] = {}
        for call in requests.approvals:
            approved = await bridge.on_driver(
                functools.partial(
                    ask_approval,
                    role=options.approval_role,
                    timeout_seconds=options.approval_timeout_seconds,
                    tool=call.tool_name,
                    arguments=call.args_as_dict(),
                )
            )
            decisions[call.tool_call_id] = True if approved else ToolDenied("rejected by approver")
        result = await agent.run(
            deps=deps,
            message_history=result.all_messages(),
            deferred_tool_results=DeferredToolResults(approvals=decisions),
            output_type=output_type,
        )
    return result.output


def _run(agent: PydanticAgent[Any, Any], options: Options, value: Any, steps: Steps) -> Any:
    check_identity(steps, str(agent.name), identity(agent))
    bridge = Bridge(steps)
    return bridge.run(_agent_run(agent, prompt_of(value), options, bridge))


def _asks_approval(agent: PydanticAgent[Any, Any]) -> bool:
    found = False

    def visit(ts: Any) -> None:
        nonlocal found
        tools = getattr(ts, "tools", None)
        if isinstance(tools, dict):
            found = found or any(getattr(t, "requires_approval", False) for t in tools.values())

    for toolset in agent.toolsets:
        toolset.apply(visit)
    return found


def adapt(agent: PydanticAgent[Any, Any], **options: Any) -> DurableAgent:
    """The durable function that runs ``agent`` (registered under the agent's name).

    ``options``: ``deps`` (the run's dependencies, or a function that makes them; made in the
    worker for every task, never written into a step), ``approval_role`` (who decides tools
    that need approval; "approver"), ``approval_timeout_seconds``."""
    if not agent.name:
        raise ValueError(
            "a Pydantic AI agent needs a name to be registered: Agent(..., name='support')"
        )
    chosen = Options(**options)
    asks = "approval_role" in options or _asks_approval(agent)
    return DurableAgent(
        name=agent.name,
        fn=functools.partial(_run, durable(agent), chosen),
        input_type=Any,
        approval_roles=(chosen.approval_role,) if asks else (),
    )
