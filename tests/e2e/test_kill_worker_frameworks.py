"""End to end, real processes, the shipped worker pool (gevent, tool bodies on native
threads): the workers of Pydantic AI and OpenAI Agents SDK agents are SIGKILLed in the middle
of a model call, a function tool, an MCP call (over stdio, a real server) and an approval
wait. Each time another worker goes on from the last recorded step: a cut model
request is made again once (it was never recorded), an idempotent or read-only call runs
again with the same key, nothing that completed is repeated, and every token the fake billed
is counted (recorded, or estimated for a call lost with its worker)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import pytest
from sqlalchemy import Engine
from sqlalchemy import text as sql

pytest.importorskip("pydantic_ai")
pytest.importorskip("agents")

from cli.devstack import DevStack, RestartPolicy
from cli.embedded import free_port
from db.engine import make_engine
from db.records import Run, RunStatus, StepStatus
from db.schema import metadata
from db.store import RunStore
from runtime.config import WORKER_POOL
from runtime.observe.live_channel import LiveChannel
from tests.e2e.stack import settle
from tests.fakes.messages_api import Billed, FakeMessagesApi, Reply, slow, text, tool_uses
from tests.fakes.openai_api import FakeOpenAiApi, Turn
from tests.mcp.support import Ledger

# The first test's time includes the file's stack start (~30 s under load, up to 120 s).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

ENDED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.NEEDS_ATTENTION, RunStatus.CANCELLED)


def _results(body: dict[str, Any]) -> set[str]:
    return {
        str(b.get("tool_use_id"))
        for m in body["messages"]
        if m["role"] == "user" and isinstance(m["content"], list)
        for b in m["content"]
        if b.get("type") == "tool_result"
    }


PREAMBLE = "Packing order A-7 now; this takes a moment."


def answer(body: dict[str, Any]) -> Reply:
    """Decided from the conversation alone (any worker gets the same answer), per agent by
    the tools it offers. A first request of ``fw-e2e`` drips out slowly, so a worker can be
    killed while it is in flight."""
    tools = {t["name"] for t in body.get("tools") or []}
    done = _results(body)
    if "pack" in tools:
        if not done:
            first = tool_uses([("toolu_pack", "pack", {"order": "A-7"})], preamble=PREAMBLE)
            return slow(first, chunk=16, interval=0.4)
        return text("done")
    if "add_note" in tools:
        if not done:  # two calls of one answer: a function tool, then an MCP tool
            return tool_uses(
                [
                    ("toolu_lookup", "lookup", {"order": "A-7"}),
                    ("toolu_add", "add_note", {"text": "A-7"}),
                ]
            )
        if "toolu_count" not in done:
            return tool_uses([("toolu_count", "count_notes", {"delay": 4})])
        return text("noted")
    if "refund" in tools:
        return (
            tool_uses([("toolu_refund", "refund", {"order": "A-7"})])
            if not done
            else text("refunded")
        )
    if "draft" in tools:
        if not done:
            return tool_uses([("toolu_draft", "draft", {"topic": "tides"})])
        return text("filed")
    if not tools:  # the writer a tool delegates to
        return text("Tides rise twice a day.", usage={"input_tokens": 120, "output_tokens": 30})
    return text("?")


def sdk_answer(path: str, body: dict[str, Any]) -> Turn:
    """The Agents SDK run: pack (the first answer streams out over ~3 s), count the notes,
    done."""
    outputs = {
        str(i.get("call_id"))
        for i in body.get("input") or []
        if isinstance(i, dict) and i.get("type") == "function_call_output"
    }
    tools = {t.get("name") for t in body.get("tools") or []}
    if not tools:  # the writer a tool delegates to
        return Turn(text="Tides rise twice a day.", input_tokens=90, output_tokens=25)
    if "draft" in tools:
        if "call_draft" not in outputs:
            return Turn(calls=(("call_draft", "draft", {"topic": "tides"}),))
        return Turn(text="filed", input_tokens=40)
    if "refund" in tools:
        if "call_refund" not in outputs:
            return Turn(calls=(("call_refund", "refund", {"order": "A-7"}),))
        return Turn(text="refunded", input_tokens=20)
    if "call_pack" not in outputs:
        return Turn(PREAMBLE, (("call_pack", "pack", {"order": "A-7"}),), interval=0.25)
    if "call_count" not in outputs:
        return Turn(calls=(("call_count", "count_notes", {"delay": 4}),), input_tokens=30)
    return Turn(text="packed and counted", input_tokens=50, output_tokens=7)


# One stack per file, shared by its tests: a stack start (gunicorn, two gevent workers loading
# both frameworks, beat) took 17-36 s and its stop ~7 s per test under CI's load, most of these
# files' time. A test kills workers; the stack's supervisor restarts them, and the ``stack``
# fixture waits until every process is back and ready before the next test starts. The fakes
# and the ledgers are shared too: each test counts what happened since it began (``Tally``,
# ``NewRows``).
LEASE_SECONDS = 20
"""Not the 3 s of the threads-pool tests, nor the 6 s these tests had: on a loaded CI host a
gevent worker's heartbeat (a greenlet) waited 12 s for the CPU behind a framework run, the
lease lapsed, and the reaper re-dispatched the run mid-call (handled by the fence, but a model
call was made again: a count these tests assert). No test here needs a tight lease, nor waits
one out: after a kill the test lapses the dead holder's lease itself (``Watch.lapse_dead_lease``),
as the passing of time would."""


@pytest.fixture(scope="module")
def messages_api() -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi(default_responder=answer) as server:
        yield server


@pytest.fixture(scope="module")
def openai_api() -> Iterator[FakeOpenAiApi]:
    with FakeOpenAiApi(responder=sdk_answer) as server:
        yield server


@dataclass(frozen=True)
class SharedStack:
    """The file's stack and the files its tests read: the tools' ledger (a slow tool marks
    itself in ``<ledger>.calling``), the counting MCP server's (``mcp.calling``), and the
    stack's output."""

    stack: DevStack
    tool_ledger: Path
    mcp_ledger: Path
    log: Path

    @property
    def tool_marker(self) -> Path:
        return Path(f"{self.tool_ledger}.calling")

    @property
    def mcp_marker(self) -> Path:
        return self.mcp_ledger.with_suffix(".calling")


# The agents this file's stack registers (tests/e2e/framework_agent.py): Pydantic AI's only,
# so its processes do not import the Agents SDK too. The SDK's file sets its own.
FRAMEWORKS = "pydantic_ai"


@pytest.fixture(scope="module")
def shared_stack(
    request: pytest.FixtureRequest,
    test_db: str,
    _truncator: Engine,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    messages_api: FakeMessagesApi,
    openai_api: FakeOpenAiApi,
) -> Iterator[SharedStack]:
    # The session's database as an earlier file of this process left it (the per-test
    # ``database_url`` empties it for each test, but not after the last one): emptied once.
    tables = ", ".join(f'"{t.name}"' for t in reversed(metadata.sorted_tables))
    with _truncator.begin() as conn:
        conn.execute(sql(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    tmp = tmp_path_factory.mktemp("frameworks")
    shared_env = {
        "DAR_TEST_FAKE_URL": messages_api.url,
        "DAR_TEST_OPENAI_URL": openai_api.url,
        "DAR_TEST_TOOL_LEDGER": str(tmp / "tool.jsonl"),
        "DAR_TEST_MCP_LEDGER": str(tmp / "mcp.jsonl"),
        "DAR_TEST_FRAMEWORKS": request.module.FRAMEWORKS,
    }
    log_path = tmp / "stack.log"
    with pytest.MonkeyPatch.context() as mp, log_path.open("wb") as log:
        for name, value in shared_env.items():  # the stack's own preflight loads the agents
            mp.setenv(name, value)
        worker_env = {k: v for k, v in os.environ.items() if k != "DAR_WORKER_POOL"}
        s = DevStack(
            data_dir=tmp,
            port=free_port(),
            workers=2,
            concurrency=20,
            pool=WORKER_POOL,  # as shipped: gevent
            env={
                **worker_env,
                "DATABASE_URL": test_db,
                "REDIS_URL": redis_url,
                "DAR_QUEUE": f"dar-test-fw-{uuid.uuid4().hex[:10]}",
                "DAR_LEASE_SECONDS": str(LEASE_SECONDS),
                "DAR_HEARTBEAT_SECONDS": "1",
                "DAR_REAPER_INTERVAL_SECONDS": "0.5",
                "DAR_AGENT_MODULES": "tests.e2e.framework_agent",
                **shared_env,
                "ANTHROPIC_API_KEY": "",
                "OPENAI_API_KEY": "",
            },
            output=log,
            # A killed worker back within a second, not after the shipped backoff (1 s doubling
            # to 10 s): the next test's ``settle`` waits for it. And no giving up after five
            # deaths a minute: with no lease waited out, these files kill that often.
            restart=RestartPolicy(base=0.5, cap=1.0, limit=50),
        )
        try:
            s.start(timeout=120)
            yield SharedStack(s, tmp / "tool.jsonl", tmp / "mcp.jsonl", log_path)
        finally:
            s.stop()


@pytest.fixture
def stack(shared_stack: SharedStack) -> Iterator[DevStack]:
    """The file's stack, every process up and ready, no slow tool's mark left over; after the
    test, the stack's output during it (printed: shown when the test failed)."""
    settle(shared_stack.stack)
    shared_stack.tool_marker.unlink(missing_ok=True)
    shared_stack.mcp_marker.unlink(missing_ok=True)
    start = shared_stack.log.stat().st_size
    try:
        yield shared_stack.stack
    finally:
        with shared_stack.log.open("rb") as log:
            log.seek(start)
            print(log.read().decode(errors="replace")[-20000:])


class _Bill(Protocol):
    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...


B = TypeVar("B", bound=_Bill, covariant=True)


class _Fake(Protocol[B]):
    @property
    def calls(self) -> int: ...
    @property
    def billed(self) -> Sequence[B]: ...


class Tally(Generic[B]):
    """A shared fake's model calls and bills since this test began (the runs of the earlier
    tests have ended: nothing of theirs comes after)."""

    def __init__(self, fake: _Fake[B]) -> None:
        self.fake = fake
        self._calls = fake.calls
        self._billed = len(fake.billed)

    @property
    def calls(self) -> int:
        return self.fake.calls - self._calls

    @property
    def billed(self) -> list[B]:
        return list(self.fake.billed[self._billed :])

    @property
    def billed_tokens(self) -> int:
        return sum(b.input_tokens + b.output_tokens for b in self.billed)


@pytest.fixture
def fake(stack: DevStack, messages_api: FakeMessagesApi) -> Tally[Billed]:
    return Tally(messages_api)


@pytest.fixture
def openai_fake(stack: DevStack, openai_api: FakeOpenAiApi) -> Tally[Turn]:
    return Tally(openai_api)


class NewRows(Ledger):
    """A shared ledger's rows written since this test began (all of them: a repeated or
    stray call of this test's run is not filtered out)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._skip = len(super().entries())

    def entries(self, tool: str | None = None) -> list[dict[str, Any]]:
        rows = super().entries()[self._skip :]
        return [r for r in rows if tool is None or r["tool"] == tool]


@dataclass(frozen=True)
class Ledgers:
    tool: NewRows
    mcp: NewRows
    tool_marker: Path
    mcp_marker: Path


@pytest.fixture
def ledgers(stack: DevStack, shared_stack: SharedStack) -> Ledgers:
    return Ledgers(
        NewRows(shared_stack.tool_ledger),
        NewRows(shared_stack.mcp_ledger),
        shared_stack.tool_marker,
        shared_stack.mcp_marker,
    )


class Watch:
    """One run, watched from the test process while the stack is supervised."""

    def __init__(self, stack: DevStack, agent: str, prompt: str) -> None:
        self.stack = stack
        self.engine = make_engine(stack.database_url, pool_size=2)
        self.store = RunStore(self.engine)
        status, accepted = stack.request(
            "POST", "/api/runs", {"agent": agent, "input": prompt, "tokenBudget": 50000}
        )
        assert status == 201, accepted
        self.run_id = uuid.UUID(accepted["id"])
        self.killed: list[str] = []

    def streamed(self, key: str) -> bool:
        """Whether the step's model call has text on the run's live stream yet."""
        channel = LiveChannel(self.stack.env["REDIS_URL"])
        try:
            entries = channel.entries(self.run_id)
            return any(e.type == "text.delta" and e.key == key for e in entries)
        finally:
            channel.close()

    def state(self) -> Any:
        run = self.store.get_run(self.run_id)
        return run.status, run.error, [(s.step_key, s.status.value) for s in self.steps()]

    def steps(self) -> list[Any]:
        return self.store.steps(self.run_id)

    def until(self, what: str, ready: Callable[[], Any], seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            assert time.monotonic() < deadline, f"never saw {what}: {self.state()}"
            self.stack.poll()
            time.sleep(0.05)

    def kill_holder(self) -> None:
        self.until("a worker holding the run", lambda: self.store.get_run(self.run_id).locked_by)
        holder = self.store.get_run(self.run_id).locked_by
        assert holder is not None
        self.stack.kill(holder)
        self.killed.append(holder)
        self.lapse_dead_lease(holder)

    def lapse_dead_lease(self, holder: str) -> None:
        """What waiting out the killed holder's lease (:data:`LEASE_SECONDS`, 20 s) would do,
        without the wait: its lease lapsed a second ago. Only while the dead process still
        holds it under the epoch read after the kill (nothing else can renew it; a claim
        since, which would move the epoch, is left alone). The reaper, the re-dispatch and
        the other worker's claim stay real; ``tests/e2e/test_kill_worker.py`` waits a real
        lease out. This saved ~20 s per kill, eight kills in these two files."""
        run = self.store.get_run(self.run_id)
        if run.locked_by != holder:
            return
        with self.engine.begin() as conn:
            conn.execute(
                sql(
                    "UPDATE run SET locked_until = now() - interval '1 second',"
                    " dispatched_at = LEAST(dispatched_at, now() - interval '2 seconds')"
                    " WHERE id = :id AND locked_by = :holder AND lease_epoch = :epoch"
                ),
                {"id": self.run_id, "holder": holder, "epoch": run.lease_epoch},
            )

    def approve_after_killing(self, asked_in: str) -> Run:
        """Wait for the run's approval, kill the worker that made the model step
        ``asked_in`` (the run holds no lease while it waits), approve over REST and return
        the run at its end."""
        self.until(
            "the approval", lambda: self.store.get_run(self.run_id).status is RunStatus.WAITING
        )
        [pending] = self.store.list_approvals(run_id=self.run_id)
        asked = next(s for s in self.steps() if s.step_key == asked_in)
        assert asked.worker is not None
        holder = next(
            n for n in self.stack.processes if asked.worker.startswith(n) or n in asked.worker
        )
        self.stack.kill(holder)
        self.killed.append(holder)
        status, decided = self.stack.request("POST", f"/api/approvals/{pending.id}/approve", {})
        assert status == 200, decided
        return self.end()

    def end(self) -> Run:
        # After a kill: the reaper's next sweep past the lapsed lease (``lapse_dead_lease``),
        # a restarted worker's boot if the other one is down too, then the rest of the run.
        self.until("the run end", lambda: self.store.get_run(self.run_id).status in ENDED, 180)
        run = self.store.get_run(self.run_id)
        print(f"killed {self.killed}; run {self.run_id} {run.status}")
        return run

    def close(self) -> None:
        """A run a failed test leaves going is cancelled: the next test shares the stack and
        the fakes."""
        with contextlib.suppress(Exception):
            if self.store.get_run(self.run_id).status not in ENDED:
                self.stack.request("POST", f"/api/runs/{self.run_id}/cancel", {})
        self.engine.dispose()


def assert_retracted_then_shown(stack: DevStack, run_id: uuid.UUID, key: str) -> None:
    """The run's live stream for the model step cut by the kill: the cut attempt's text, its
    retraction, then the new attempt's text, which is the whole text once."""
    channel = LiveChannel(stack.env["REDIS_URL"])
    try:
        entries = [e for e in channel.entries(run_id) if e.key == key]
    finally:
        channel.close()
    kinds = [(e.type, e.attempt) for e in entries]
    assert ("text.delta", 1) in kinds, f"the cut attempt streamed: {kinds}"
    retract = kinds.index(("text.retract", 1))
    assert ("text.delta", 1) in kinds[:retract]
    last = max(e.attempt for e in entries)
    assert last >= 2
    assert "".join(e.text for e in entries if e.type == "text.delta" and e.attempt == last) == (
        PREAMBLE
    ), "the new attempt's text, once"


def _wait_marker(watch: Watch, marker: Path, what: str) -> None:
    watch.until(what, lambda: marker.exists() and marker.read_text().find(what) >= 0)
    marker.unlink()


def test_sigkill_at_a_model_request_and_a_tool(
    stack: DevStack, fake: Tally[Billed], ledgers: Ledgers
) -> None:
    watch = Watch(stack, "fw-e2e", "Pack A-7")
    try:
        watch.until("the first model request", lambda: fake.calls >= 1)
        watch.until("its first text, live", lambda: watch.streamed("model.request:0"))
        watch.kill_holder()
        _wait_marker(watch, ledgers.tool_marker, "pack")
        watch.kill_holder()

        run = watch.end()
        assert run.status is RunStatus.SUCCEEDED, run.error
        steps = watch.steps()
        assert [s.step_key for s in steps] == [
            "agent:0",
            "model.request:0",
            "tool.pack:0",
            "model.request:1",
        ]
        assert all(s.status is StepStatus.DONE for s in steps)
        packs = ledgers.tool.entries("pack")
        assert [p["key"] for p in packs] == [f"{run.id}/tool.pack:0"] * 2, "re-run, same key"
        assert len({p["pid"] for p in packs}) == 2, "by the other worker"
        assert fake.calls == 3, "the cut request once more; no recorded request repeated"
        assert_retracted_then_shown(stack, run.id, "model.request:0")
        recorded = sum(s.usage.input_tokens + s.usage.output_tokens for s in steps)
        assert recorded == sum(b.total for b in fake.billed[-2:]), "the recorded answers"
        counted = run.tokens_used + run.unrecorded_tokens
        print(f"billed {fake.billed_tokens}, recorded {run.tokens_used}, counted {counted}")
        assert counted >= fake.billed_tokens, "the cut call counted (estimated)"
    finally:
        watch.close()


def test_sigkill_in_an_mcp_call_of_a_pydantic_ai_agent(
    stack: DevStack, fake: Tally[Billed], ledgers: Ledgers
) -> None:
    """A function tool and an MCP tool of one answer, then a slow read-only MCP call killed
    mid-way: it runs again (annotated read-only) with the same key; the destructive
    ``add_note`` and the function tool, completed, are not repeated."""
    watch = Watch(stack, "fw-mcp", "Note A-7, then count the notes")
    mcp = ledgers.mcp
    try:
        _wait_marker(watch, ledgers.mcp_marker, "count_notes")
        watch.kill_holder()

        run = watch.end()
        assert run.status is RunStatus.SUCCEEDED, run.error
        assert run.result == "noted"
        steps = watch.steps()
        assert [s.step_key for s in steps] == [
            "agent:0",
            "mcp.notes.tools:0",
            "model.request:0",
            "tool.lookup:0",
            "mcp.notes.add_note:0",
            "model.request:1",
            "mcp.notes.count_notes:0",
            "model.request:2",
        ]
        assert all(s.status is StepStatus.DONE for s in steps)
        assert mcp.count("add_note") == 1, "the completed MCP call was not repeated"
        counts = mcp.entries("count_notes")
        assert [c["key"] for c in counts] == [f"{run.id}/mcp.notes.count_notes:0"] * 2
        assert ledgers.tool.count("lookup") == 1
        assert fake.calls == 3, "no model request repeated"
        recorded = sum(s.usage.input_tokens + s.usage.output_tokens for s in steps)
        assert recorded == fake.billed_tokens == run.tokens_used
    finally:
        watch.close()


def test_sigkill_while_a_pydantic_ai_run_waits_for_approval(
    stack: DevStack, fake: Tally[Billed], ledgers: Ledgers
) -> None:
    """The worker that ran the agent up to its approval is killed while the run waits; the
    approval (REST) continues the run on the other worker from the recorded steps."""
    watch = Watch(stack, "fw-approve", "Refund A-7")
    try:
        run = watch.approve_after_killing("model.request:0")
        assert run.status is RunStatus.SUCCEEDED, run.error
        assert run.result == "refunded"
        assert [s.step_key for s in watch.steps()] == [
            "agent:0",
            "model.request:0",
            "approve.refund:0",
            "tool.refund:0",
            "model.request:1",
        ]
        assert ledgers.tool.count("refund") == 1
        assert fake.calls == 2, "the recorded request was not made again"
        assert run.tokens_used == fake.billed_tokens
    finally:
        watch.close()


def test_sigkill_in_a_tool_after_its_nested_agent_answered(
    stack: DevStack, fake: Tally[Billed], ledgers: Ledgers
) -> None:
    """Pydantic AI's case of :func:`kill_in_a_tool_after_its_nested_agent_answered` (the
    Agents SDK's runs in the other file, on its stack)."""
    kill_in_a_tool_after_its_nested_agent_answered(stack, fake, ledgers, "fw-delegate")


def kill_in_a_tool_after_its_nested_agent_answered(
    stack: DevStack, billing: Tally[Billed] | Tally[Turn], ledgers: Ledgers, agent: str
) -> None:
    """The tool has a writer agent draft (a model call the tool makes itself), then the
    worker is killed inside the tool. The writer's call was billed and is counted (with the
    tool's step); the idempotent tool runs again on the other worker and its writer's call is
    counted too; the recorded model calls are not made again. Tokens counted = billed."""
    watch = Watch(stack, agent, "Draft about tides")
    model_key = "model.request" if agent.startswith("fw") else "model"
    tool_key = "tool.draft:0"
    try:
        _wait_marker(watch, ledgers.tool_marker, "draft")
        watch.kill_holder()

        run = watch.end()
        assert run.status is RunStatus.SUCCEEDED, run.error
        assert run.result == "filed"
        steps = watch.steps()
        assert [s.step_key for s in steps] == [
            "agent:0",
            f"{model_key}:0",
            tool_key,
            f"{tool_key}/usage:0",
            f"{tool_key}/usage:1",
            f"{model_key}:1",
        ]
        drafts = ledgers.tool.entries("draft")
        assert [d["key"] for d in drafts] == [f"{run.id}/{tool_key}"] * 2, "re-run, same key"
        assert billing.calls == 4, "two model calls of the run, the writer's twice"
        assert run.unrecorded_tokens == 0
        assert run.tokens_used == billing.billed_tokens, "every billed token, once"
        nested = [s for s in steps if "/usage:" in s.step_key]
        assert all(s.model for s in nested), "priced as the writer's model"
    finally:
        watch.close()
