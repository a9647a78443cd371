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

import contextlib
import copy
import functools
import re
import sys
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.frameworks.versions import PYDANTIC_AI

PYDANTIC_AI.require()  # outside the supported range: one line naming it, before an import fails

from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import DeferredToolRequests, DeferredToolResults, RunContext, ToolDenied
from pydantic_ai.agent import EventStreamHandler
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
from pydantic_ai.messages import (
    AgentStreamEvent,
    ModelResponse,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ToolCallPart,
)
from pydantic_ai.models import Model
from pydantic_ai.models.function import FunctionModel
from pydantic_ai.usage import RunUsage
from pydantic_core import to_jsonable_python

from db.records import Usage
from runtime.durable.api import Billed, DurableAgent, Steps
from runtime.durable.errors import DurableConfigError
from runtime.frameworks.bridge import (
    APPROVAL_ROLE,
    APPROVAL_TIMEOUT_SECONDS,
    MCP_LISTING,
    Billing,
    Bridge,
    UnitPolicy,
    ask_approval,
    check_identity,
    current_bridge,
    current_live,
    idempotency_key,
    prompt_of,
    tool_executor,
)
from runtime.pipeline import usage

if TYPE_CHECKING:  # the `mcp` extra (fastmcp): an agent without MCP toolsets runs without it
    from pydantic_ai.mcp import CallToolFunc, MCPToolset

OUTPUT_CHARS = 4000
"""A tool output on the event stream is cut at this many characters (the step has it whole)."""

Config = dict[str, Any]
"""A unit's policy as Pydantic AI resolves it: ``{"idempotent": bool}``; a tool overrides it
with ``metadata={"dar": {"idempotent": True}}``."""

MODEL: Config = {"idempotent": True}
"""A model request may repeat after a crash (at most once): it has no effect but its bill."""
READ: Config = {"idempotent": True}
"""Listings, validation, event handling: no effect outside the run."""
TOOL: Config = {"idempotent": False}
"""A tool call is not run twice unless it says it may (else the run stops for an operator)."""


def named_by_type(operation_id: object) -> str:
    """A durable operation the namer below does not know (one a later Pydantic AI release
    added), named by its type and, as the model operations are, its model:
    ``ModelCountTokensId`` (what ``UsageLimits(count_tokens_before_request=True)`` asks before
    a request, from 2.7x) is ``model.count_tokens``. Stable while the type keeps its name."""
    words = re.findall(r"[A-Z][a-z0-9]*", type(operation_id).__name__.removesuffix("Id"))
    name = ".".join(filter(None, ["".join(words[:1]), "_".join(words[1:])])).lower()
    model_id = getattr(operation_id, "model_id", None)
    return (name or "operation") + (f".{model_id}" if model_id else "")


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
        return named_by_type(operation_id)

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


def run_usage(u: RunUsage) -> Usage:
    """A ``RunUsage`` (or a delta of one) as this runtime counts it."""
    return usage_of({"usage": to_jsonable_python(u)})


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
        if mcp_call and name in self.capability.safe_mcp_calls:  # annotated read-only or idempotent
            idempotent = True
        billing = None
        if isinstance(operation_id, ModelRequestId):
            billing = Billing(self.capability.model_name(operation_id), prompt(cache_key), billed)
        policy = UnitPolicy(idempotent=idempotent)
        match operation_id:  # read-only, and where the framework connects to the server
            case ToolsetGetToolsId(toolset_kind="mcp") | ToolsetGetInstructionsId():
                policy = MCP_LISTING
        value = await bridge.unit(name, body, policy, billing)
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
                self.capability.safe_mcp_calls.add(f"mcp.{toolset_id}.{tool}".replace("/", "_"))


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

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.safe_mcp_calls: set[str] = set()
        """MCP calls (step names) whose tool its server annotates read-only or idempotent,
        learned from the listings (fresh or recorded). Kept here, not on a backend: Pydantic AI
        asks for a backend per operation, and a listing replayed by one must inform the call
        made through another (a worker that takes the run over learns it from the log)."""

    @property
    def in_durable_context(self) -> bool:
        return current_bridge() is not None

    @property
    def has_wrap_run_event_stream(self) -> bool:
        # In a run of this runtime every model request streams (when its model can), so its
        # text reaches the run's event stream as it is produced: a reason to stream on its own,
        # as Temporal's event stream topic is.
        return super().has_wrap_run_event_stream or (
            self.in_durable_context and streams(self.agent.model if self.agent else None)
        )

    def _model_stream_event_handler(self) -> EventStreamHandler[Any] | None:
        # The extension point engines override to see the live model stream inside the model
        # request's unit (Temporal publishes it from there too): text deltas go to the run's
        # event stream, then on to the capability's own handler, if it has one.
        return functools.partial(forward_text, handler=super()._model_stream_event_handler())

    async def before_tool_execute(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: Any, args: Any
    ) -> Any:
        # the run's tool calls and results on its event stream (what Pydantic AI's
        # FunctionToolCallEvent / FunctionToolResultEvent tell), each once per run
        bridge = current_bridge()
        if bridge is not None:
            bridge.event(
                "agent.tool_called",
                {
                    "agent": self.agent.name if self.agent is not None else None,
                    "tool": call.tool_name,
                    "callId": call.tool_call_id,
                    "arguments": call.args_as_dict(),
                },
            )
        return await super().before_tool_execute(ctx, call=call, tool_def=tool_def, args=args)

    async def after_tool_execute(
        self, ctx: RunContext[Any], *, call: ToolCallPart, tool_def: Any, args: Any, result: Any
    ) -> Any:
        bridge = current_bridge()
        if bridge is not None:
            bridge.event(
                "agent.tool_output",
                {
                    "agent": self.agent.name if self.agent is not None else None,
                    "tool": call.tool_name,
                    "callId": call.tool_call_id,
                    "output": str(result)[:OUTPUT_CHARS],
                },
            )
        return await super().after_tool_execute(
            ctx, call=call, tool_def=tool_def, args=args, result=result
        )

    async def after_model_request(
        self, ctx: RunContext[Any], *, request_context: Any, response: ModelResponse
    ) -> ModelResponse:
        # A request of an agent carrying this capability that runs inside a step's code (an
        # agent a tool delegates to): not a step of its own, it counts with the step, the
        # moment it is answered, priced as the model that answered it.
        if current_bridge() is None and usage.current() is not None:
            usage.record_usage(
                response.model_name or self.model_name_of(ctx),
                usage_of(to_jsonable_python(response, fallback=repr)),
                request_id=response.provider_response_id,
            )
        return await super().after_model_request(
            ctx, request_context=request_context, response=response
        )

    @staticmethod
    def model_name_of(ctx: RunContext[Any]) -> str:
        return str(getattr(ctx.model, "model_name", "") or "")

    @contextlib.contextmanager
    def _durable_run_context_scope(self, ctx: RunContext[Any]) -> Iterator[RunContext[Any]]:
        # Inside a tool's (or an MCP call's) step: what the run's usage grew by while it ran
        # (an agent it delegated to with ``usage=ctx.usage``) counts with the step, less what
        # was reported with its model already (an agent carrying this capability, or the
        # tool's own ``record_usage``). Pydantic AI's ``RunUsage`` does not say which model:
        # that remainder is charged at the highest known rate.
        recorder = usage.current()
        with super()._durable_run_context_scope(ctx) as scoped:
            if recorder is None or current_bridge() is not None:
                yield scoped
                return
            before, reported = copy.copy(scoped.usage), recorder.recorded
            try:
                yield scoped
            finally:
                grown = run_usage(scoped.usage - before)
                now = recorder.recorded
                rest = Usage(
                    max(0, grown.input_tokens - (now.input_tokens - reported.input_tokens)),
                    max(0, grown.output_tokens - (now.output_tokens - reported.output_tokens)),
                    max(
                        0,
                        grown.cache_creation_input_tokens
                        - (now.cache_creation_input_tokens - reported.cache_creation_input_tokens),
                    ),
                    max(
                        0,
                        grown.cache_read_input_tokens
                        - (now.cache_read_input_tokens - reported.cache_read_input_tokens),
                    ),
                )
                usage.record_usage("", rest)

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


def streams(model: Any) -> bool:
    """Whether ``model`` can stream a request (a ``FunctionModel`` needs a stream function)."""
    if model is None or isinstance(model, str):
        return model is not None
    if isinstance(model, FunctionModel):
        return model.stream_function is not None
    return type(model).request_stream is not Model.request_stream


async def forward_text(
    ctx: RunContext[Any],
    events: AsyncIterable[AgentStreamEvent],
    *,
    handler: EventStreamHandler[Any] | None,
) -> None:
    """Inside a model request's unit: its text, as it streams, to the run's event stream."""
    live = current_live()

    async def tee() -> AsyncIterator[AgentStreamEvent]:
        async for event in events:
            if live is not None:
                if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
                    live(event.part.content)
                elif isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
                    live(event.delta.content_delta)
            yield event

    if handler is not None:
        await handler(ctx, tee())
    else:
        async for _ in tee():
            pass


def _annotated_safe(tool: Any) -> bool:
    """An MCP tool its server annotates read-only or idempotent: safe to call again."""
    metadata = getattr(getattr(tool, "tool_def", None), "metadata", None) or {}
    annotations = metadata.get("annotations") or {}
    return bool(annotations.get("readOnlyHint") or annotations.get("idempotentHint"))


KEY_META = "dar/idempotency_key"
"""The ``_meta`` field of an MCP call made in a run: the step's idempotency key."""


def _keyed_mcp_calls(agent: PydanticAgent[Any, Any]) -> None:
    """Every MCP toolset of ``agent`` sends the step's idempotency key in each call's
    ``_meta`` (through its public ``process_tool_call`` hook, around the user's own).

    Pydantic AI's MCP support (its ``mcp`` extra: fastmcp) is not imported here: an agent
    holding an ``MCPToolset`` was made by code that imported it, so while ``pydantic_ai.mcp``
    is not loaded the agent has no MCP toolset to key."""
    mcp = sys.modules.get("pydantic_ai.mcp")
    if mcp is None:
        return
    mcp_toolset: type[MCPToolset] = mcp.MCPToolset

    def visit(toolset: Any) -> None:
        if not isinstance(toolset, mcp_toolset) or getattr(
            toolset.process_tool_call, "__dar_keyed__", False
        ):
            return
        inner = toolset.process_tool_call

        async def process(
            ctx: RunContext[Any], call_tool: CallToolFunc, name: str, args: dict[str, Any]
        ) -> Any:
            key = idempotency_key()
            if key is not None:
                plain = call_tool

                async def keyed(
                    name: str, args: dict[str, Any], *, metadata: dict[str, Any] | None = None
                ) -> Any:
                    return await plain(name, args, metadata={**(metadata or {}), KEY_META: key})

                call_tool = keyed
            if inner is not None:
                return await inner(ctx, call_tool, name, args)
            return await call_tool(name, args)

        process.__dar_keyed__ = True  # type: ignore[attr-defined]
        toolset.process_tool_call = process

    for toolset in agent.toolsets:
        toolset.apply(visit)


def durable(agent: PydanticAgent[Any, Any]) -> PydanticAgent[Any, Any]:
    """``agent`` with :class:`DarDurability` attached: the agent itself when it already has it,
    else a copy (the user's agent object is left as it was, but for its MCP toolsets, which
    send the step's idempotency key when called in a run)."""
    _keyed_mcp_calls(agent)
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
    executor = tool_executor()
    if executor is not None:
        with PydanticAgent.using_thread_executor(executor):
            return await _agent_turns(agent, user_prompt, options, bridge)
    return await _agent_turns(agent, user_prompt, options, bridge)


async def _agent_turns(
    agent: PydanticAgent[Any, Any], user_prompt: str, options: Options, bridge: Bridge
) -> Any:
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
