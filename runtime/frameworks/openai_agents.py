"""OpenAI Agents SDK agents, durable on this runtime.

    triage = agents.Agent(name="triage", instructions="...", tools=[lookup], handoffs=[billing])

    def register(registry):
        registry.register(triage)           # the one line

The SDK has no durability extension point of its own, so the runner supplies one: the agent
graph (the agent and every agent it can hand off to) is copied once, at registration, with

- its model wrapped (a model given by name is resolved by the run's model provider, then
  wrapped): every call is a billed step ``model:n`` (``steps.model_call``: tokens, cost,
  prompt hash from the SDK's ``Usage``);
- every function tool wrapped (no decorator needed): each call is a step ``tool.<name>:n``,
  run again after a crash only when the tool says so (``runtime.frameworks.idempotent``);
- every handoff a step ``handoff.<agent>:n`` (the choice is in the recorded model answer;
  the step records where it went);
- every MCP server wrapped: its listing ``mcp.<server>.tools:n`` and each call
  ``mcp.<server>.<tool>:n`` are steps (a call runs again only when the server annotates the
  tool read-only or idempotent), with the step's idempotency key in ``_meta``.

Parallel tool calls run one at a time in the order the model listed them, so their steps
are recorded in that order whatever the event loop does. A tool that needs approval (a
``RunState`` interruption) becomes this runtime's approval: the run suspends, holding
nothing, and continues with the decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.frameworks.versions import OPENAI_AGENTS

OPENAI_AGENTS.require()  # outside the supported range: one line naming it, before an import fails

from agents import (
    Agent,
    FunctionTool,
    Handoff,
    ModelBehaviorError,
    RunConfig,
    RunHooks,
    Runner,
    handoff,
)
from agents.items import ModelResponse, TResponseOutputItem
from agents.mcp import MCPServer
from agents.models.default_models import get_default_model
from agents.models.interface import Model, ModelProvider
from agents.models.multi_provider import MultiProvider
from agents.run import AgentRunner, get_default_agent_runner, set_default_agent_runner
from agents.usage import Usage as SdkUsage
from mcp.types import CallToolResult, GetPromptResult, ListPromptsResult
from mcp.types import Tool as MCPTool
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseOutputItemDoneEvent,
    ResponseTextDeltaEvent,
)
from pydantic import TypeAdapter

from db.records import Usage
from runtime.durable.api import Billed, BilledFailure, DurableAgent, Steps
from runtime.frameworks.bridge import (
    APPROVAL_ROLE,
    APPROVAL_TIMEOUT_SECONDS,
    MCP_LISTING,
    Billing,
    Bridge,
    LiveText,
    UnitPolicy,
    ask_approval,
    check_identity,
    current_bridge,
    current_live,
    prompt_of,
)
from runtime.pipeline import usage


def idempotent(tool: FunctionTool) -> FunctionTool:
    """Mark a function tool safe to run again after a crash left it in doubt (it uses
    ``runtime.frameworks.idempotency_key()`` downstream)."""
    tool.__dar_idempotent__ = True  # type: ignore[attr-defined]
    return tool


# -- one run's state ---------------------------------------------------------------------------


class Turnstile:
    """Lets the tool calls of one model answer through one at a time, in the answer's order."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.claimed: set[int] = set()
        self.done: set[int] = set()
        self.changed = asyncio.Condition()

    def reset(self, order: list[str]) -> None:
        self.order, self.claimed, self.done = order, set(), set()

    async def enter(self, name: str) -> int | None:
        index = next(
            (i for i, n in enumerate(self.order) if n == name and i not in self.claimed), None
        )
        if index is None:  # not from the last answer (a resumed approval): no order to keep
            return None
        self.claimed.add(index)
        async with self.changed:
            await self.changed.wait_for(lambda: all(j in self.done for j in range(index)))
        return index

    async def leave(self, index: int | None) -> None:
        if index is None:
            return
        self.done.add(index)
        async with self.changed:
            self.changed.notify_all()


@dataclass
class RunState:
    turnstile: Turnstile = field(default_factory=Turnstile)


_state: contextvars.ContextVar[RunState | None] = contextvars.ContextVar(
    "dar_agents_run", default=None
)


# -- the model -----------------------------------------------------------------------------------

_OUTPUT: TypeAdapter[list[TResponseOutputItem]] = TypeAdapter(list[TResponseOutputItem])


def dump_response(response: ModelResponse) -> dict[str, Any]:
    usage = response.usage
    return {
        "output": [item.model_dump(mode="json", exclude_none=True) for item in response.output],
        "usage": {
            "requests": usage.requests,
            "input_tokens": usage.input_tokens,
            "cached_tokens": usage.input_tokens_details.cached_tokens or 0,
            "output_tokens": usage.output_tokens,
            "reasoning_tokens": usage.output_tokens_details.reasoning_tokens or 0,
        },
        "response_id": response.response_id,
        "request_id": response.request_id,
    }


def load_response(value: dict[str, Any]) -> ModelResponse:
    items = _OUTPUT.validate_python(value["output"])
    u = value["usage"]
    usage = SdkUsage(
        requests=u["requests"],
        input_tokens=u["input_tokens"],
        output_tokens=u["output_tokens"],
        total_tokens=u["input_tokens"] + u["output_tokens"],
    )
    usage.input_tokens_details.cached_tokens = u["cached_tokens"]
    usage.output_tokens_details.reasoning_tokens = u["reasoning_tokens"]
    return ModelResponse(
        output=items,
        usage=usage,
        response_id=value.get("response_id"),
        request_id=value.get("request_id"),
    )


def billed(value: dict[str, Any], model: str) -> Billed:
    """What the provider billed, from the SDK's usage (OpenAI counts cached input inside
    ``input_tokens``; this runtime keeps cache reads apart)."""
    u = value["usage"]
    cached = int(u["cached_tokens"])
    return Billed(
        value=value,
        model=model,
        usage=Usage(
            input_tokens=max(0, int(u["input_tokens"]) - cached),
            output_tokens=int(u["output_tokens"]),
            cache_read_input_tokens=cached,
        ),
        request_id=value.get("request_id") or value.get("response_id"),
    )


def _model_name(model: Model, fallback: str) -> str:
    return str(getattr(model, "model", None) or getattr(model, "model_name", None) or fallback)


def _tool_order(response: ModelResponse, tools: list[Any]) -> list[str]:
    """The function calls of an answer that will reach a wrapped tool, in order (a tool
    waiting for approval is not run in this turn, so it holds no place)."""
    ordered = {t.name for t in tools if isinstance(t, FunctionTool) and not t.needs_approval}
    names = [getattr(item, "name", None) for item in response.output]
    return [n for n in names if isinstance(n, str) and n in ordered]


class DurableModel(Model):
    """A model whose every call is a billed step ``model:n``."""

    def __init__(self, inner: Model, name: str) -> None:
        self.inner = inner
        self.name = name

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        bridge = current_bridge()
        if bridge is None:
            return await self.inner.get_response(*args, **kwargs)

        prompt = _prompt(args, kwargs)
        name = _model_name(self.inner, self.name)

        async def body() -> dict[str, Any]:
            live = current_live()
            if live is not None:
                return dump_response(await streamed(self.inner, live, args, kwargs, name))
            try:
                return dump_response(await self.inner.get_response(*args, **kwargs))
            except ModelBehaviorError as e:
                if _INCOMPLETE not in str(e):
                    raise
                # billed, and the SDK raised before its usage could be read: an estimate,
                # its output at the call's max_tokens when the settings say
                settings = kwargs.get("model_settings", args[2] if len(args) > 2 else None)
                most = getattr(settings, "max_tokens", None) or 0
                usage = Usage(output_tokens=int(most))
                raise BilledFailure(e, Billed(None, name, usage), estimated=True) from e

        value = await bridge.unit(
            "model",
            body,
            UnitPolicy(idempotent=True),
            Billing(name, prompt, lambda v: billed(v, name)),
        )
        response = load_response(value)
        state = _state.get()
        if state is not None:
            tools = kwargs.get("tools", args[3] if len(args) > 3 else [])
            state.turnstile.reset(_tool_order(response, list(tools or [])))
        return response

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        if current_bridge() is None:
            return self.inner.stream_response(*args, **kwargs)
        raise NotImplementedError(
            "Runner.run_streamed is not durable: the runtime runs the agent with Runner.run "
            "and streams each model call's text itself (GET /api/runs/{id}/events)"
        )

    async def close(self) -> None:
        await self.inner.close()


_FAILED = ("response.failed", "response.incomplete", "error")
_INCOMPLETE = "terminal event `response.incomplete`"
"""How the SDK's error for a response that ended ``incomplete`` reads (it carries no more)."""


async def streamed(
    model: Model,
    live: LiveText,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    name: str = "",
) -> ModelResponse:
    """One model call, streamed: its text goes to the run's event stream as it arrives; the
    answer is the completed response, as ``get_response`` would have returned it. A response
    that ends ``incomplete`` or ``failed`` with its usage (billed) raises
    :class:`BilledFailure` with that usage, as model ``name``."""
    final: Response | None = None
    done: list[Any] = []
    stream = model.stream_response(*args, **kwargs)
    try:
        async for event in stream:
            if isinstance(event, ResponseTextDeltaEvent):
                live(event.delta)
            elif isinstance(event, ResponseOutputItemDoneEvent):
                done.append(event.item)
            elif isinstance(event, ResponseCompletedEvent):
                final = event.response
            elif getattr(event, "type", None) in _FAILED:
                error = ModelBehaviorError(f"the model's stream ended with {event.type}")
                ended = getattr(event, "response", None)
                if isinstance(ended, Response) and ended.usage is not None:
                    reason = getattr(ended.incomplete_details, "reason", None)
                    if reason:
                        error = ModelBehaviorError(f"{error} ({reason})")
                    value = dump_response(_answer(ended, done))
                    raise BilledFailure(error, billed(value, name or ended.model))
                raise error
    finally:
        closing = getattr(stream, "aclose", None)
        if closing is not None:
            await closing()
    if final is None:
        raise ModelBehaviorError("the model's stream ended without a completed response")
    return _answer(final, done)


def _answer(final: Response, done: list[Any]) -> ModelResponse:
    """A streamed response as ``get_response`` returns it (its output items, or those the
    stream delivered one by one)."""
    u = final.usage
    usage = SdkUsage(
        requests=1,
        input_tokens=u.input_tokens if u else 0,
        output_tokens=u.output_tokens if u else 0,
        total_tokens=u.total_tokens if u else 0,
    )
    if u is not None:
        usage.input_tokens_details.cached_tokens = u.input_tokens_details.cached_tokens or 0
        usage.output_tokens_details.reasoning_tokens = u.output_tokens_details.reasoning_tokens or 0
    return ModelResponse(
        output=list(final.output) or done,
        usage=usage,
        response_id=final.id,
        request_id=getattr(final, "_request_id", None),
    )


def _prompt(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    system, given = (*args, None, None)[:2]
    system = kwargs.get("system_instructions", system)
    given = kwargs.get("input", given)
    tools = kwargs.get("tools", args[3] if len(args) > 3 else [])
    return {
        "system": system,
        "input": json.loads(json.dumps(given, default=str)),
        "tools": sorted(getattr(t, "name", str(t)) for t in tools or []),
    }


class DurableProvider(ModelProvider):
    """Resolves a model given by name, then wraps it."""

    def __init__(self, inner: ModelProvider) -> None:
        self.inner = inner

    def get_model(self, model_name: str | None) -> Model:
        return DurableModel(self.inner.get_model(model_name), model_name or "default")


# -- tools, handoffs, MCP ------------------------------------------------------------------------


def durable_tool(tool: FunctionTool) -> FunctionTool:
    invoke = tool.on_invoke_tool
    policy = UnitPolicy(idempotent=bool(getattr(tool, "__dar_idempotent__", False)))

    async def on_invoke_tool(ctx: Any, arguments: str) -> Any:
        bridge = current_bridge()
        if bridge is None:
            return await invoke(ctx, arguments)
        state = _state.get()
        turnstile = state.turnstile if state is not None else None
        place = await turnstile.enter(tool.name) if turnstile is not None else None
        try:
            return await bridge.unit(f"tool.{tool.name}", lambda: invoke(ctx, arguments), policy)
        finally:
            if turnstile is not None:
                await turnstile.leave(place)

    return dataclasses.replace(tool, on_invoke_tool=on_invoke_tool)


class DurableMcpServer(MCPServer):
    """An MCP server whose listing and calls are steps; each step opens its own session, so
    nothing of it outlives the step."""

    def __init__(self, inner: MCPServer) -> None:
        super().__init__(use_structured_content=inner.use_structured_content)
        self.inner = inner
        self._needs_approval_policy = inner._needs_approval_policy
        self._failure_error_function = inner._failure_error_function
        self.tool_meta_resolver = inner.tool_meta_resolver
        self._safe: set[str] = set()

    @property
    def name(self) -> str:
        return self.inner.name

    async def connect(self) -> None:
        bridge = current_bridge()
        if bridge is None:
            await self.inner.connect()  # type: ignore[no-untyped-call]

    async def cleanup(self) -> None:
        if current_bridge() is None:
            await self.inner.cleanup()  # type: ignore[no-untyped-call]

    async def _session(self, work: Callable[[], Awaitable[Any]]) -> Any:
        await self.inner.connect()  # type: ignore[no-untyped-call]
        try:
            return await work()
        finally:
            await self.inner.cleanup()  # type: ignore[no-untyped-call]

    async def list_tools(self, run_context: Any = None, agent: Any = None) -> list[MCPTool]:
        bridge = current_bridge()
        if bridge is None:
            return await self.inner.list_tools(run_context, agent)

        async def body() -> list[dict[str, Any]]:
            listed = await self._session(lambda: self.inner.list_tools(run_context, agent))
            return [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in listed]

        value = await bridge.unit(f"mcp.{self.name}.tools", body, MCP_LISTING)
        tools = [MCPTool.model_validate(t) for t in value]
        self._safe = {
            t.name
            for t in tools
            if t.annotations is not None
            and (t.annotations.read_only_hint or t.annotations.idempotent_hint)
        }
        return tools

    async def call_tool(
        self, tool_name: str, arguments: dict[str, Any] | None, meta: dict[str, Any] | None = None
    ) -> CallToolResult:
        bridge = current_bridge()
        if bridge is None:
            return await self.inner.call_tool(tool_name, arguments, meta)
        from runtime.frameworks.bridge import idempotency_key

        async def body() -> dict[str, Any]:
            keyed = {**(meta or {}), "dar/idempotency_key": idempotency_key()}
            result: CallToolResult = await self._session(
                lambda: self.inner.call_tool(tool_name, arguments, keyed)
            )
            dumped: dict[str, Any] = result.model_dump(
                mode="json", by_alias=True, exclude_none=True
            )
            return dumped

        policy = UnitPolicy(idempotent=tool_name in self._safe)
        value = await bridge.unit(f"mcp.{self.name}.{tool_name}", body, policy)
        return CallToolResult.model_validate(value)

    async def list_prompts(self) -> ListPromptsResult:
        return await self.inner.list_prompts()

    async def get_prompt(
        self, name: str, arguments: dict[str, Any] | None = None
    ) -> GetPromptResult:
        return await self.inner.get_prompt(name, arguments)


class Graph:
    """The durable copies of an agent and of every agent it can hand off to, by name."""

    def __init__(self) -> None:
        self.agents: dict[int, Agent[Any]] = {}
        self.by_name: dict[str, Agent[Any]] = {}

    def copy(self, agent: Agent[Any]) -> Agent[Any]:
        if id(agent) in self.agents:
            return self.agents[id(agent)]
        model = agent.model
        wrapped = DurableModel(model, agent.name) if isinstance(model, Model) else model
        clone = agent.clone(
            model=wrapped,
            tools=[durable_tool(t) if isinstance(t, FunctionTool) else t for t in agent.tools],
            mcp_servers=[DurableMcpServer(s) for s in agent.mcp_servers],
            handoffs=[],
        )
        self.agents[id(agent)] = clone
        self.by_name.setdefault(agent.name, clone)
        clone.handoffs = [self.handoff(h) for h in agent.handoffs]
        return clone

    def handoff(self, given: Agent[Any] | Handoff[Any, Any]) -> Handoff[Any, Any]:
        if isinstance(given, Agent):
            self.copy(given)
            given = handoff(given)
        invoke = given.on_invoke_handoff
        target = given.agent_name
        graph = self

        async def on_invoke_handoff(ctx: Any, arguments: str) -> Agent[Any]:
            bridge = current_bridge()
            if bridge is None:
                return graph.copy(await invoke(ctx, arguments))

            async def body() -> str:
                chosen = await invoke(ctx, arguments)
                graph.copy(chosen)
                return str(chosen.name)

            name = await bridge.unit(f"handoff.{target}", body, UnitPolicy(idempotent=True))
            return graph.by_name[name]

        return dataclasses.replace(given, on_invoke_handoff=on_invoke_handoff)


# -- the run's events ------------------------------------------------------------------------------

OUTPUT_CHARS = 4000
"""A tool output on the event stream is cut at this many characters (the step has it whole)."""


class StreamHooks(RunHooks[Any]):
    """The run's events, as ``Runner.run_streamed``'s ``StreamEvent``s name them, out to the
    run's event stream (``GET /api/runs/{id}/events``): ``agent.updated``,
    ``agent.tool_called``, ``agent.tool_output``, ``agent.handoff``. Each once per run, the
    first time the SDK's code gets there."""

    def __init__(self, bridge: Bridge) -> None:
        self.bridge = bridge

    async def on_agent_start(self, context: Any, agent: Any) -> None:
        self.bridge.event("agent.updated", {"agent": agent.name})

    async def on_tool_start(self, context: Any, agent: Any, tool: Any) -> None:
        arguments = getattr(context, "tool_arguments", None)
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        self.bridge.event(
            "agent.tool_called",
            {
                "agent": agent.name,
                "tool": getattr(tool, "name", str(tool)),
                "callId": getattr(context, "tool_call_id", None),
                "arguments": arguments,
            },
        )

    async def on_tool_end(self, context: Any, agent: Any, tool: Any, result: object) -> None:
        self.bridge.event(
            "agent.tool_output",
            {
                "agent": agent.name,
                "tool": getattr(tool, "name", str(tool)),
                "callId": getattr(context, "tool_call_id", None),
                "output": str(result)[:OUTPUT_CHARS],
            },
        )

    async def on_handoff(self, context: Any, from_agent: Any, to_agent: Any) -> None:
        self.bridge.event("agent.handoff", {"from": from_agent.name, "to": to_agent.name})


# -- runs inside a step: counted with it ----------------------------------------------------------


def sdk_usage(u: SdkUsage) -> Usage:
    """The SDK's ``Usage`` of one response as this runtime counts it (cache reads apart)."""
    cached = int(u.input_tokens_details.cached_tokens or 0)
    return Usage(
        input_tokens=max(0, int(u.input_tokens) - cached),
        output_tokens=int(u.output_tokens),
        cache_read_input_tokens=cached,
    )


def _named(model: Any, run_config: RunConfig | None) -> str:
    if isinstance(model, DurableModel):
        return _model_name(model.inner, model.name)
    if isinstance(model, Model):
        return _model_name(model, "")
    if isinstance(model, str) and model:
        return model
    if run_config is not None and run_config.model is not None:
        return _named(run_config.model, None)
    return get_default_model()


class CountingHooks(RunHooks[Any]):
    """The hooks of a run made inside a step's code (``agent.as_tool``, a ``Runner.run`` in a
    function tool): each model response counts with the step (``runtime.record_usage``),
    priced as the model of the agent that made it; the caller's own hooks are called as
    they would be."""

    def __init__(self, inner: RunHooks[Any] | None, run_config: RunConfig | None) -> None:
        self.inner = inner
        self.run_config = run_config

    async def on_llm_start(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            await self.inner.on_llm_start(*args, **kwargs)

    async def on_llm_end(self, context: Any, agent: Any, response: ModelResponse) -> None:
        if usage.current() is not None:
            usage.record_usage(
                _named(getattr(agent, "model", None), self.run_config),
                sdk_usage(response.usage),
                request_id=response.request_id or response.response_id,
            )
        if self.inner is not None:
            await self.inner.on_llm_end(context, agent, response)

    async def on_agent_start(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            await self.inner.on_agent_start(*args, **kwargs)

    async def on_agent_end(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            await self.inner.on_agent_end(*args, **kwargs)

    async def on_handoff(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            await self.inner.on_handoff(*args, **kwargs)

    async def on_tool_start(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            await self.inner.on_tool_start(*args, **kwargs)

    async def on_tool_end(self, *args: Any, **kwargs: Any) -> None:
        if self.inner is not None:
            await self.inner.on_tool_end(*args, **kwargs)


def _nested(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A run's options, counted with the step whose code makes it (``None``: not in a step's
    code, or the run is one of ours, whose model calls are steps of their own)."""
    if current_bridge() is not None or usage.current() is None:
        return kwargs
    hooks = kwargs.get("hooks")
    if isinstance(hooks, CountingHooks):
        return kwargs
    return {**kwargs, "hooks": CountingHooks(hooks, kwargs.get("run_config"))}


class CountingRunner(AgentRunner):
    """The SDK's default runner (``Runner.run``, ``Runner.run_streamed``), which also counts
    a run made inside a step's code with that step; any other run is the given runner's."""

    def __init__(self, inner: AgentRunner) -> None:
        self.inner = inner

    async def run(self, starting_agent: Any, input: Any, **kwargs: Any) -> Any:
        return await self.inner.run(starting_agent, input, **_nested(kwargs))

    def run_streamed(self, starting_agent: Any, input: Any, **kwargs: Any) -> Any:
        return self.inner.run_streamed(starting_agent, input, **_nested(kwargs))

    def run_sync(self, starting_agent: Any, input: Any, **kwargs: Any) -> Any:
        return self.inner.run_sync(starting_agent, input, **_nested(kwargs))


def count_nested_runs() -> None:
    """Install :class:`CountingRunner` as the SDK's default runner (once per process)."""
    current = get_default_agent_runner()
    if not isinstance(current, CountingRunner):
        set_default_agent_runner(CountingRunner(current))


# -- the run ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    approval_role: str = APPROVAL_ROLE
    approval_timeout_seconds: float = APPROVAL_TIMEOUT_SECONDS
    context: Any = None
    """The run's context object, or a function that makes it (in the worker, per task)."""
    model_provider: ModelProvider | None = None
    max_turns: int = 10


def _decide(steps: Steps, *, options: Options, item: Any) -> bool:
    raw = item.raw_item
    return ask_approval(
        steps,
        role=options.approval_role,
        timeout_seconds=options.approval_timeout_seconds,
        tool=item.tool_name or getattr(raw, "name", "tool"),
        arguments=getattr(raw, "arguments", None),
    )


async def _run(agent: Agent[Any], prompt: str, options: Options, bridge: Bridge) -> Any:
    token = _state.set(RunState())
    try:
        provider = DurableProvider(options.model_provider or MultiProvider())
        config = RunConfig(model_provider=provider, tracing_disabled=True)
        context = options.context() if callable(options.context) else options.context
        given: Any = prompt
        while True:
            result = await Runner.run(
                agent,
                given,
                context=context,
                run_config=config,
                max_turns=options.max_turns,
                hooks=StreamHooks(bridge),
            )
            if not result.interruptions:
                return result.final_output
            state = result.to_state()
            for item in result.interruptions:
                approved = await bridge.on_driver(
                    functools.partial(_decide, item=item, options=options)
                )
                if approved:
                    state.approve(item)
                else:
                    state.reject(item)
            given = state
    finally:
        _state.reset(token)


def identity(graph: Graph) -> dict[str, Any]:
    """What a run depends on: each agent of the graph with its tools, handoffs, MCP servers
    and output type."""
    return {
        name: {
            "tools": sorted(getattr(t, "name", type(t).__name__) for t in a.tools),
            "handoffs": sorted(
                getattr(h, "agent_name", getattr(h, "name", "")) for h in a.handoffs
            ),
            "mcp": sorted(s.name for s in a.mcp_servers),
            "output": getattr(a.output_type, "__qualname__", None) or repr(a.output_type),
        }
        for name, a in sorted(graph.by_name.items())
    }


def _durable_fn(agent: Agent[Any], graph: Graph, options: Options, value: Any, steps: Steps) -> Any:
    check_identity(steps, agent.name, identity(graph))
    bridge = Bridge(steps)
    output = bridge.run(_run(agent, prompt_of(value), options, bridge))
    return output.model_dump(mode="json") if hasattr(output, "model_dump") else output


def adapt(agent: Agent[Any], **options: Any) -> DurableAgent:
    """The durable function that runs ``agent`` (registered under the agent's name).

    ``options``: ``approval_role`` (who decides the tools that need approval; "approver"),
    ``approval_timeout_seconds``, ``context`` (a value or a function making it, in the worker),
    ``model_provider`` (resolves models given by name; the SDK's default otherwise),
    ``max_turns``."""
    chosen = Options(**options)
    count_nested_runs()
    graph = Graph()
    durable = graph.copy(agent)
    asks = "approval_role" in options or any(
        bool(getattr(t, "needs_approval", False)) for a in graph.agents.values() for t in a.tools
    )
    asks = asks or any(
        s.inner._needs_approval_policy is not None
        for a in graph.agents.values()
        for s in a.mcp_servers
        if isinstance(s, DurableMcpServer)
    )
    return DurableAgent(
        name=agent.name,
        fn=functools.partial(_durable_fn, durable, graph, chosen),
        input_type=Any,
        approval_roles=(chosen.approval_role,) if asks else (),
    )
