"""The deployment version: which code a run belongs to (invariant 12: a run keeps its version).

A process computes its version once, from its registry, when it builds the runtime:

- ``DAR_DEPLOYMENT`` when set (a release tag, a git sha): the operator names the version;
- else a digest of what decides how a run replays: the source of each ``DAR_AGENT_MODULES``
  module (and its submodules), and each registered agent's definition: for the agent loop
  its system prompt, model, limits, tools with their JSON schemas, MCP servers and
  sub-agents; for a durable function (a framework's agent included) its code.

Two processes started from the same code and settings compute the same version, so a
single-version deployment routes every run to every worker, as before. Where each run's
version comes from (the rules, written once):

- a submitted run: the version of the process that stores it (the API, ``Runtime.submit``);
- a child run: its parent's (it is part of the parent's work; the store copies it);
- a scheduled run: the beat's (the beat loads the agents to know it);
- a fork: the current deployment's, the API's: a fork is a new run, made to try a recorded
  run again, usually on changed code; its copied history is never re-executed;
- a resumed or resolved run: its own (it is the same run); upgrade it first to resume it on
  new code.

A run with no version (stored before versions existed) is driven by any worker.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import logging
import sys
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from runtime.agents import Agent, AgentRegistry
from runtime.config import Settings

log = logging.getLogger(__name__)

DIGEST_CHARS = 12
"""Hex characters of a derived version: short enough for a queue's name and a table."""


def queue_name(base: str, deployment: str | None) -> str:
    """The Celery queue of a version's drive_run messages: ``<DAR_QUEUE>.<version>``; a run
    with no version is sent to ``DAR_QUEUE`` itself, which every worker consumes."""
    return f"{base}.{deployment}" if deployment else base


def _code_text(fn: Callable[..., Any]) -> str:
    """A function's source (its bytecode and constants when there is no source)."""
    while isinstance(fn, partial):
        inner = fn.func
        bound = [_describe_value(a) for a in fn.args]
        return _code_text(inner) + json.dumps(bound, sort_keys=True, default=str)
    target = inspect.unwrap(fn)
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        if code is None:
            return f"{type(target).__module__}.{type(target).__qualname__}"
        return str(code.co_code.hex()) + repr(code.co_consts)


def _describe_value(value: Any) -> Any:
    """A bound argument of a framework adapter: a framework agent's recorded shape (what its
    runs record and check on replay: tools, MCP servers, handoffs, output), else its class
    (objects print their address)."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    shape = _framework_shape(value)
    if shape is not None:
        return shape
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _model_name(model: Any) -> str | None:
    """A model by its name: never an object's repr, which holds its address."""
    if model is None or isinstance(model, str):
        return model
    name = getattr(model, "model_name", None)
    return name if isinstance(name, str) else f"{type(model).__module__}.{type(model).__qualname__}"


def _framework_shape(value: Any) -> dict[str, Any] | None:
    """The identity :mod:`runtime.frameworks` records in a framework agent's first step. Only
    an object of a framework already imported is looked at: nothing is imported here."""
    module = type(value).__module__ or ""
    try:
        if module.startswith("pydantic_ai"):
            from runtime.frameworks.pydantic_ai import identity as pydantic_identity

            return {
                "pydantic_ai": pydantic_identity(value),
                "model": _model_name(getattr(value, "model", None)),
            }
        if module == "runtime.frameworks.openai_agents" and type(value).__name__ == "Graph":
            from runtime.frameworks.openai_agents import identity as sdk_identity

            graph = value
            models = {n: _model_name(getattr(a, "model", None)) for n, a in graph.by_name.items()}
            return {"openai_agents": sdk_identity(graph), "models": models}
    except Exception:  # a framework's internals moved: the modules' code still counts
        return None
    return None


def agent_definition(agent: Any) -> dict[str, Any]:
    """What of ``agent`` decides how its runs replay, as JSON. The agent loop's is its
    configuration (what a run pins and an upgrade compares); a durable function's its code."""
    if isinstance(agent, Agent):
        return {
            "kind": "agent",
            "system_prompt": agent.system_prompt,
            "model": agent.model,
            "max_tokens": agent.max_tokens,
            "max_steps": agent.max_steps,
            "tools": sorted(agent.tool_definitions(), key=lambda d: str(d.get("name"))),
            "mcp_servers": sorted(s if isinstance(s, str) else s.name for s in agent.mcp_servers),
        }
    fn = getattr(agent, "fn", None)
    return {
        "kind": "durable",
        "max_steps": getattr(agent, "max_steps", None),
        "approval_roles": sorted(getattr(agent, "approval_roles", ())),
        "code_sha256": hashlib.sha256(_code_text(fn).encode()).hexdigest() if fn else None,
    }


def _module_sources(names: Iterable[str]) -> dict[str, str]:
    """The sha256 of each named module's source file and of its loaded submodules'."""
    found: dict[str, str] = {}
    wanted = list(names)
    for module_name, module in sorted(sys.modules.items()):
        if not any(module_name == n or module_name.startswith(n + ".") for n in wanted):
            continue
        path = getattr(module, "__file__", None)
        if not path:
            continue
        try:
            with open(path, "rb") as f:
                found[module_name] = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            continue
    for name in wanted:  # named but not imported (yet): its file, if it has one
        if name in found:
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and spec.origin != "built-in":
            try:
                with open(spec.origin, "rb") as f:
                    found[name] = hashlib.sha256(f.read()).hexdigest()
            except OSError:
                pass
    return found


def describe(registry: AgentRegistry, settings: Settings) -> dict[str, Any]:
    """Everything the derived version is a digest of, as JSON (``dar versions --explain``)."""
    return {
        "agents": {name: agent_definition(registry.get(name)) for name in registry.names()},
        "modules": _module_sources(settings.agent_modules),
    }


def deployment_version(registry: AgentRegistry, settings: Settings) -> str:
    """This process's version: ``DAR_DEPLOYMENT``, else a digest of :func:`describe`."""
    if settings.deployment:
        return settings.deployment
    canonical = json.dumps(
        describe(registry, settings), sort_keys=True, separators=(",", ":"), default=str
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:DIGEST_CHARS]
