"""The replay check: would this code continue a recorded run exactly where it is?

It replays a run's recorded history against the agents registered in this process, with no
model call and no tool effect: nothing runs but the durable function's own code between its
steps, and nothing is written.

- **A durable function** (a framework's agent included) runs from the top against a replay
  engine (strict replay, whatever ``DAR_STRICT_REPLAY`` says): each step the code asks for
  must be the next recorded top-level step, of the same kind and key, and a recorded
  approval must be for the same payload; the recorded result (or error) is returned, the
  step's body never runs. The check ends clean where the code asks for its first step past
  the history (that is the step the new code would run next), or when it returns having
  asked for every recorded step. A step asked for out of order, one of another kind, a
  recorded step never asked for, or an exception from the function's own code is the run's
  first divergence.
- **The agent loop** has no code of the user's between steps: its history replays on any
  configuration. What can break is a tool: every tool a recorded step ran, and every tool a
  recorded model answer asked for, must still be offered (a Python tool, a sub-agent, or a
  tool of an MCP server the agent still uses). The configuration (system prompt, model,
  tools and schemas, limits) is compared with the one the run's version recorded
  (``deployment_agent``): each change is reported as a configuration change, not a
  divergence: the run continues on the new configuration with its history.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from db.records import Run, Step, StepStatus
from db.records import StepKind as RowKind
from runtime.agents import Agent, AgentRegistry, UnknownAgent
from runtime.durable.api import (
    ApprovalBuilder,
    DurableAgent,
    StepOptions,
    Steps,
    reset_current_steps,
    set_current_steps,
)
from runtime.durable.container import RunStep
from runtime.durable.errors import ApprovalRejected, StepError
from runtime.engine.deployment import agent_definition
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.mcp.servers import McpServer, namespaced
from runtime.pipeline.codec import decode, encode
from runtime.pipeline.kinds import KINDS, StepKind, in_history
from runtime.tools import ToolContext


@dataclass(frozen=True)
class Divergence:
    """Where the new code first parts from the run's history."""

    seq: int | None
    """The recorded step's seq (``None``: not a step: the agent, or the function's end)."""
    recorded: str
    """What the history holds there."""
    asked: str
    """What the new code asked for instead."""

    def text(self) -> str:
        at = f"seq {self.seq}" if self.seq is not None else "the run"
        return f"{at}: recorded {self.recorded}; the new code: {self.asked}"


@dataclass(frozen=True)
class RunCheck:
    """One run's replay against this process's code."""

    run_id: uuid.UUID
    agent: str
    deployment: str | None
    divergence: Divergence | None = None
    configuration: tuple[str, ...] = ()
    """Changes of the agent loop's configuration since the run's version (not divergences)."""
    steps: int = 0
    """Recorded steps the check replayed."""

    @property
    def clean(self) -> bool:
        return self.divergence is None

    def json(self) -> dict[str, Any]:
        d = self.divergence
        return {
            "runId": str(self.run_id),
            "agent": self.agent,
            "deployment": self.deployment,
            "clean": self.clean,
            "steps": self.steps,
            "divergence": None
            if d is None
            else {"seq": d.seq, "recorded": d.recorded, "asked": d.asked},
            "configurationChanges": list(self.configuration),
        }


def check_run(
    registry: AgentRegistry,
    run: Run,
    steps: list[Step],
    recorded_definition: dict[str, Any] | None = None,
) -> RunCheck:
    """Replay ``run`` (its ``steps``) against ``registry``'s agents. ``recorded_definition``:
    the agent's definition in the run's version, when it was recorded."""
    try:
        agent = registry.get(run.agent)
    except UnknownAgent:
        return RunCheck(
            run.id,
            run.agent,
            run.deployment,
            Divergence(None, f"agent {run.agent!r}", "no agent of that name is registered"),
        )
    changes = configuration_changes(recorded_definition, agent_definition(agent))
    if isinstance(agent, Agent):
        divergence = _check_agent_loop(agent, steps)
        return RunCheck(run.id, run.agent, run.deployment, divergence, changes, len(steps))
    if isinstance(agent, DurableAgent):
        replay = ReplayEngine(run, agent, steps)
        return RunCheck(run.id, run.agent, run.deployment, replay.check(), (), replay.replayed)
    return RunCheck(run.id, run.agent, run.deployment, None, changes, len(steps))


# -- the agent loop ---------------------------------------------------------------------------


def offered_tools(agent: Agent) -> set[str]:
    return set(agent.tools_by_name) | set(agent.subagents_by_name)


def _offers(agent: Agent, name: str) -> bool:
    if name in offered_tools(agent):
        return True
    servers = {s if isinstance(s, str) else s.name for s in agent.mcp_servers}
    return any(name.startswith(f"{server}__") for server in servers)


def _asked_tools(step: Step) -> list[str]:
    """The tools a recorded model answer asked for."""
    response = step.response  # the answer's content blocks
    content = response.get("content") or [] if isinstance(response, dict) else response or []
    return [
        str(b.get("name"))
        for b in content
        if isinstance(b, dict) and b.get("type") == "tool_use" and b.get("name")
    ]


def _check_agent_loop(agent: Agent, steps: list[Step]) -> Divergence | None:
    now = ", ".join(sorted(offered_tools(agent))) or "none"
    for s in sorted(steps, key=lambda s: s.seq):
        needed: list[str] = []
        if s.kind is RowKind.TOOL and s.tool_name:
            needed = [s.tool_name]
        elif s.kind is RowKind.MODEL and s.status is StepStatus.DONE:
            needed = _asked_tools(s)
        for name in needed:
            if not _offers(agent, name):
                what = "ran" if s.kind is RowKind.TOOL else "the model asked for"
                recorded = f"{s.kind} {s.step_key} ({what} tool {name!r})"
                return Divergence(s.seq, recorded, f"no tool {name!r} (tools now: {now})")
    return None


def configuration_changes(before: dict[str, Any] | None, after: dict[str, Any]) -> tuple[str, ...]:
    """What changed in an agent's definition, in words (``before``: ``None`` when the run's
    version did not record it: nothing to compare)."""
    if before is None or before == after:
        return ()
    if before.get("kind") != after.get("kind"):
        return (f"kind: {before.get('kind')} -> {after.get('kind')}",)
    out: list[str] = []
    for key in ("system_prompt", "model", "max_tokens", "max_steps", "mcp_servers"):
        if before.get(key) != after.get(key):
            if key == "system_prompt":
                out.append("system prompt changed")
            else:
                out.append(f"{key}: {before.get(key)!r} -> {after.get(key)!r}")
    old = {t["name"]: t for t in before.get("tools") or []}
    new = {t["name"]: t for t in after.get("tools") or []}
    out += [f"tool {n!r} removed" for n in sorted(set(old) - set(new))]
    out += [f"tool {n!r} added" for n in sorted(set(new) - set(old))]
    for n in sorted(set(old) & set(new)):
        if old[n].get("input_schema") != new[n].get("input_schema"):
            out.append(f"tool {n!r}: input schema changed")
        elif old[n] != new[n]:
            out.append(f"tool {n!r}: description changed")
    if before.get("code_sha256") != after.get("code_sha256"):
        out.append("code changed")
    return tuple(out)


# -- durable functions ------------------------------------------------------------------------


class _Frontier(BaseException):
    """The code asked for a step past the history: the replay ends here, clean. (A
    BaseException, as the runtime's ``Yield``: user code must not swallow it.)"""


class _Diverged(BaseException):
    def __init__(self, divergence: Divergence) -> None:
        super().__init__(divergence.text())
        self.divergence = divergence


def _digest(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class ReplayEngine:
    """The :class:`runtime.durable.api.Engine` of a replay check: answers from the history,
    runs nothing, writes nothing."""

    run: Run
    agent: DurableAgent
    steps: list[Step]
    counters: dict[str, int] = field(default_factory=dict)
    position: int = 0

    def __post_init__(self) -> None:
        self.history = [s for s in sorted(self.steps, key=lambda s: s.seq) if in_history(s)]

    @property
    def replayed(self) -> int:
        return self.position

    def check(self) -> Divergence | None:
        token = set_current_steps(Steps(self))
        try:
            self.agent.fn(decode(self.run.input, self.agent.input_type), Steps(self))
        except _Frontier:
            return None
        except _Diverged as e:
            return e.divergence
        except (StepError, ApprovalRejected) as e:
            if self.position >= len(self.history):
                return None  # it ended with the error its history ends with: as recorded
            at = self.history[self.position - 1] if self.position else None
            return Divergence(
                at.seq if at is not None else None,
                f"{at.kind} {at.step_key}" if at is not None else "the start of the run",
                f"the code ended with {type(e).__name__}: {e} before the recorded steps after it",
            )
        except Exception as e:
            at = self.history[self.position - 1] if self.position else None
            return Divergence(
                at.seq if at is not None else None,
                f"{at.kind} {at.step_key}" if at is not None else "the start of the run",
                f"the code raised {type(e).__name__}: {e}",
            )
        finally:
            reset_current_steps(token)
        if self.position < len(self.history):
            left = self.history[self.position]
            return Divergence(left.seq, f"{left.kind} {left.step_key}", "the function returned")
        return None

    # -- matching one step --------------------------------------------------------------------

    def _key(self, name: str) -> str:
        n = self.counters.get(name, 0)
        self.counters[name] = n + 1
        return f"{name}:{n}"

    def _next(self, kind: StepKind, name: str) -> Step:
        """The recorded step the code's next step must be; the frontier past the history."""
        key = self._key(name)
        row = KINDS[kind].row
        if self.position >= len(self.history):
            raise _Frontier
        rec = self.history[self.position]
        if rec.step_key != key or rec.kind is not row:
            raise _Diverged(Divergence(rec.seq, f"{rec.kind} {rec.step_key}", f"{row} {key}"))
        self.position += 1
        return rec

    @staticmethod
    def _settled(rec: Step, type_: Any = Any) -> Any:
        if rec.status is StepStatus.DONE:
            return decode(rec.response, type_)
        if rec.status is StepStatus.ERROR:
            raise StepError(rec.step_key, rec.error or "unknown error")
        if rec.status is StepStatus.REJECTED:
            raise ApprovalRejected(rec.step_key, None, None)
        raise _Frontier  # in flight (started, pending, waiting): the new code takes it on

    # -- the Engine protocol ------------------------------------------------------------------

    def advance(self, step: RunStep) -> Any:
        return self._settled(self._next(step.kind, step.name), step.type)

    def approval(
        self,
        builder: ApprovalBuilder,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        type: Any,
        idempotent: bool,
    ) -> Any:
        position = self.position
        counters = dict(self.counters)
        rec = self._next(StepKind.APPROVAL, name)
        digest = _digest({"stepKey": rec.step_key, "input": encode(list(args))})
        if rec.input_hash is not None and rec.input_hash != digest:
            self.position, self.counters = position, counters
            raise _Diverged(
                Divergence(
                    rec.seq,
                    f"approval {rec.step_key} of input hash {rec.input_hash[:12]}",
                    f"approval {rec.step_key} of input hash {digest[:12]}: another payload",
                )
            )
        return self._settled(rec, type)

    def version(self, name: str, minimum: int, maximum: int) -> int:
        if self.position < len(self.history):
            rec = self.history[self.position]
            key = f"{name}:{self.counters.get(name, 0)}"
            if rec.step_key != key:  # a marker newer than the run: the old branch
                return minimum
        rec = self._next(StepKind.VERSION, name)
        recorded = int(rec.response)
        if not minimum <= recorded <= maximum:
            raise _Diverged(
                Divergence(
                    rec.seq,
                    f"version {recorded} of {name!r}",
                    f"versions {minimum} to {maximum} of {name!r}",
                )
            )
        return recorded

    def billed_call(self, name: str, fn: Callable[..., Any], prompt: Any, model: str) -> Any:
        rec = self._next(StepKind.FRAMEWORK_MODEL, name)
        if rec.status is StepStatus.DONE:
            return rec.response
        return self._settled(rec)

    def mcp_tool(
        self,
        server: McpServer | str,
        tool: str,
        arguments: dict[str, Any],
        *,
        name: str | None,
        options: StepOptions,
    ) -> Any:
        wanted = server if isinstance(server, str) else server.name
        return self._settled(self._next(StepKind.STEP, name or namespaced(wanted, tool)))

    def compensate_last(self, fn: Callable[[Any], Any]) -> None:
        return None

    def sleep(self, seconds: float) -> None:
        self._settled(self._next(StepKind.SLEEP, "sleep"))

    def wait_for(self, name: str, timeout: float | None) -> Any:
        return self._settled(self._next(StepKind.SIGNAL_WAIT, f"signal.{name}"))

    def send(self, run_id: uuid.UUID, name: str, payload: Any) -> None:
        self._settled(self._next(StepKind.SEND, f"send.{name}"))

    def child(
        self, agent: str, value: Any, token_budget: int | None, timeout_seconds: int | None
    ) -> Any:
        return self._settled(self._next(StepKind.CHILD, f"child.{agent}"))

    def model_call(self, request: LlmRequest) -> LlmResponse:
        self._never("a model call outside a recorded step")

    @staticmethod
    def _never(what: str) -> NoReturn:
        raise _Diverged(Divergence(None, "no such call", what))

    def current_key(self) -> str | None:
        return None

    def current_context(self) -> ToolContext | None:
        return None

    def live_event(self, name: str, data: dict[str, Any], once: str) -> None:
        return None

    @property
    def run_id(self) -> uuid.UUID:
        return self.run.id

    @property
    def default_model(self) -> str:
        return self.run.model

    @property
    def default_max_tokens(self) -> int:
        return 1024
