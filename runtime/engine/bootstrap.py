"""Builds the runtime's parts from settings: one place that wires them, no singletons."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from db.demo import TicketStore
from db.deployments import DeploymentStore
from db.engine import make_engine
from db.records import Dispatch, NewRun, Run
from db.store import RunStore
from runtime.admission.concurrency_keys import KeyGate, parse_key_overrides
from runtime.admission.flow_control import LEASE_MARGIN_SECONDS, FlowControl, parse_model_limits
from runtime.agentloop.acme import acme_agent
from runtime.agents import Agent, AgentConfigError, AgentRegistry
from runtime.config import Settings
from runtime.engine.deployment import deployment_version
from runtime.engine.driver import Driver
from runtime.llm.base import LlmClient
from runtime.llm.demo import DemoModel
from runtime.llm.pricing import PriceTable
from runtime.mcp.client import McpClients
from runtime.mcp.servers import parse_servers, parse_tool_overrides
from runtime.observe.metrics import Metrics
from runtime.pipeline.heartbeat import Heartbeat

if (
    TYPE_CHECKING
):  # runtime.observe.live_channel imports redis (and ssl): not before gevent patches it
    from runtime.observe.live_channel import LiveChannel

log = logging.getLogger(__name__)


def build_llm(settings: Settings) -> LlmClient:
    """The model client: ``DAR_LLM_FACTORY`` (``module:function``, called with the settings)
    when set; else Claude when ANTHROPIC_API_KEY is set; else the offline demo model."""
    if settings.llm_factory:
        module_name, _, attr = settings.llm_factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr or "build")
        except (ImportError, AttributeError) as e:
            raise AgentConfigError(
                f"DAR_LLM_FACTORY={settings.llm_factory!r} does not name a function "
                f"(module:function): {e}"
            ) from e
        client: LlmClient = factory(settings)
        return client
    if not settings.anthropic_api_key:
        return DemoModel(latency_ms=settings.demo_latency_ms)
    from runtime.llm.factory import anthropic_client

    return anthropic_client(settings)


def load_agents(
    settings: Settings, tickets: TicketStore, engine: Engine | None = None
) -> AgentRegistry:
    """The built-in demo agent, then each module of DAR_AGENT_MODULES, whose
    ``register(registry)`` adds its agents."""
    registry = AgentRegistry(
        [acme_agent(tickets)],
        resources={"engine": engine, "tickets": tickets, "settings": settings},
    )
    for configured in parse_servers(settings.mcp_servers_json):
        registry.register_mcp_server(configured.server, configured.agents)
    for name in settings.agent_modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise AgentConfigError(
                f"DAR_AGENT_MODULES names {name!r}, which fails to import: {e}"
            ) from e
        register = getattr(module, "register", None)
        if not callable(register):
            raise AgentConfigError(
                f"agent module {name!r} has no register(registry) function to call"
            )
        register(registry)
    registry.finalize()
    if settings.default_agent not in registry:
        raise AgentConfigError(
            f"DAR_DEFAULT_AGENT is {settings.default_agent!r}, which is not registered; "
            f"known agents: {', '.join(registry.names())}"
        )
    return registry


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    store: RunStore
    tickets: TicketStore
    agents: AgentRegistry
    llm: LlmClient
    pricing: PriceTable
    mcp: McpClients | None = None
    """This process's MCP sessions; opened lazily, on the first call that needs one."""
    _deployments: DeploymentStore | None = None
    _lease_store: RunStore | None = None
    _live: LiveChannel | None = None

    @property
    def live(self) -> LiveChannel | None:
        """The live stream's Redis side (``None`` without ``REDIS_URL``); made on first use."""
        if self._live is None and self.settings.redis_url:
            from runtime.observe.live_channel import LiveChannel

            self._live = LiveChannel(
                self.settings.redis_url,
                maxlen=self.settings.live_maxlen,
                cancel_poll_seconds=self.settings.cancel_poll_seconds,
            )
        return self._live

    @classmethod
    def build(
        cls, settings: Settings, *, llm: LlmClient | None = None, pool_size: int = 10
    ) -> Runtime:
        parse_model_limits(settings.model_limits_json)  # a bad DAR_MODEL_LIMITS fails at start
        parse_key_overrides(settings.key_concurrency_overrides_json)  # and bad key limits
        # Up to 2 * pool_size - 1 connections, plus the heartbeat's one: a worker process
        # stays within 2 * pool_size (20 by default) whatever its concurrency. All of them
        # in the pool, none as overflow: under load an overflow connection is opened and
        # closed again around a single statement (4% of a gevent worker's CPU went to it).
        engine = make_engine(
            settings.require_database_url(),
            pool_size=2 * pool_size - 1,
            max_overflow=0,
            prepare=settings.db_prepare,
        )
        tickets = TicketStore(engine)
        agents = load_agents(settings, tickets, engine)
        deployment = deployment_version(agents, settings)
        return cls(
            settings=settings,
            engine=engine,
            store=RunStore(engine, deployment=deployment),
            tickets=tickets,
            agents=agents,
            llm=llm or build_llm(settings),
            pricing=PriceTable.from_json(settings.prices_json),
            mcp=McpClients(
                connect_timeout_seconds=settings.mcp_connect_timeout_seconds,
                tool_overrides=parse_tool_overrides(settings.mcp_tools_json),
            ),
        )

    @property
    def deployment(self) -> str | None:
        """The version of this process's code (runtime.engine.deployment): the runs it
        stores start on it, and its workers drive only runs of it."""
        return self.store.deployment

    @property
    def deployments(self) -> DeploymentStore:
        """The versions of the runs and of the workers."""
        if self._deployments is None:
            self._deployments = DeploymentStore(self.engine)
        return self._deployments

    def lease_store(self) -> RunStore:
        """A store on its own small pool, for the heartbeat: renewing leases must never wait
        behind tools and steps for a connection of the main pool."""
        if self._lease_store is None:
            engine = make_engine(
                self.settings.require_database_url(),
                pool_size=1,
                max_overflow=0,
                application_name="dar-heartbeat",
                prepare=self.settings.db_prepare,
            )
            self._lease_store = RunStore(engine)
        return self._lease_store

    def driver(
        self,
        *,
        worker: str | None = None,
        heartbeat: Heartbeat | None = None,
        metrics: Metrics | None = None,
    ) -> Driver:
        if metrics is not None:
            metrics.watch(self.pricing)
        flow = self.flow_control(metrics)
        return Driver(
            keys=self.key_gate(metrics),
            metrics=metrics,
            store=self.store,
            agents=self.agents,
            llm=self.llm,
            settings=self.settings,
            pricing=self.pricing,
            heartbeat=heartbeat,
            worker=worker,
            mcp=self.mcp,
            live=self.live,
            flow=flow,
        )

    def flow_control(self, metrics: Metrics | None = None) -> FlowControl | None:
        """Admission in Redis against the limits learned from the API's headers (and
        DAR_MODEL_LIMITS); ``None`` with DAR_FLOW_CONTROL=off or without Redis."""
        limits = parse_model_limits(self.settings.model_limits_json)
        if not self.settings.flow_control or not self.settings.redis_url:
            return None
        from runtime.redisconn import redis_client

        client = redis_client(
            self.settings.require_redis_url(),
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            health_check_interval=10,
            socket_keepalive=True,
        )
        if metrics is not None:
            for lim in limits:
                for name, value in (
                    ("requests", lim.requests_per_minute),
                    ("input", lim.input_tokens_per_minute),
                    ("output", lim.output_tokens_per_minute),
                ):
                    metrics.flow_limit.labels(lim.match, name).set(value)
        return FlowControl(
            client,
            limits,
            lease_seconds=self.settings.model_timeout_seconds + LEASE_MARGIN_SECONDS,
            metrics=metrics,
            prefix=self.settings.flow_prefix,
        )

    def key_gate(self, metrics: Metrics | None = None) -> KeyGate | None:
        """Concurrency-key slots in Redis (DAR_KEY_CONCURRENCY and its overrides); ``None``
        when no key has a limit."""
        overrides = parse_key_overrides(self.settings.key_concurrency_overrides_json)
        if self.settings.key_concurrency <= 0 and not any(overrides.values()):
            return None
        from runtime.redisconn import redis_client

        client = redis_client(
            self.settings.require_redis_url(),
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            health_check_interval=10,
            socket_keepalive=True,
        )
        return KeyGate(
            client,
            default_limit=self.settings.key_concurrency,
            overrides=overrides,
            lease_seconds=self.settings.lease_seconds,
            fallback_seconds=self.settings.key_recheck_seconds,
            metrics=metrics,
        )

    def submit(
        self,
        agent: str,
        input: Any,
        *,
        model: str | None = None,
        token_budget: int | None = None,
        timeout_seconds: int | None = None,
        max_steps: int | None = None,
        idempotency_key: str | None = None,
        concurrency_key: str | None = None,
        priority: int = 0,
    ) -> tuple[Run, Dispatch]:
        """Store a new run (from Python). Send the returned dispatch to start it
        (``tasks.dispatch.send_drive``), or drive it yourself with :meth:`driver`."""
        chosen = self.agents.get(agent)
        agent_model = chosen.model if isinstance(chosen, Agent) else None
        run, _ = self.store.create_run(
            NewRun(
                agent=agent,
                input=input,
                model=model or agent_model or self.settings.model_default,
                max_steps=max_steps or chosen.max_steps or self.settings.default_max_steps,
                token_budget=token_budget or self.settings.default_token_budget,
                timeout_seconds=timeout_seconds or self.settings.default_timeout_seconds,
                idempotency_key=idempotency_key,
                concurrency_key=concurrency_key,
                priority=priority,
            )
        )
        return run, Dispatch(run.id, run.dispatch_token)

    def close(self) -> None:
        if self.mcp is not None:
            self.mcp.close()
        self.engine.dispose()
        if self._lease_store is not None:
            self._lease_store.engine.dispose()
        if self._live is not None:
            self._live.close()
