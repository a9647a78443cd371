"""The chaos harness: a private stack of real processes, a scripted model, and the faults.

* :class:`ChaosStack` is the dev stack (:class:`cli.devstack.DevStack`) on PRIVATE embedded
  PostgreSQL and Redis (so they can be killed and restarted without touching anything else),
  with workers of several kinds: plain thread-pool workers (``worker-A``, ``worker-B``), two
  that crash themselves at the runtime's named crash points (``worker-C``, ``worker-E``,
  ``DAR_FAULTS``), one ``--pool prefork`` worker whose pool child gets killed (``worker-D``),
  in the long version one with random crash points everywhere (``worker-F``), and two beats.
* :class:`Scenario` answers the fake Messages API: each run's input carries a tag; the reply
  to its n-th model turn is a deterministic plan of ``list_tickets`` and ``add_comment`` calls
  (parallel ones too), then an ``end_turn``. Every reply names itself (``chaos reply N``) and
  bills a distinct number of tokens, so the checker can map calls, steps and token counters.
* :class:`Campaign` submits runs through the REST API, injects the faults of the profile,
  respawns what died, waits for every run to end and gathers the :class:`Evidence`.
* Durable-function runs (``tests/chaos/durable_agents.py``) flow among them: side-effect steps,
  nested steps, two model calls, an approval that a campaign thread decides through REST
  (approve or reject, sometimes twice) while the faults go on, compensations on rejection.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, urlparse

import psutil
import redis
from sqlalchemy import Engine, text

from cli.devstack import CODE_ROOT, DevStack
from cli.embedded import EmbeddedPostgres, EmbeddedRedis, free_port
from db.demo import TicketStore
from db.engine import make_engine
from db.migrate import upgrade
from db.records import Run, RunStatus, Step
from db.store import RunStore
from runtime.config import Settings
from runtime.pipeline.faults import POINTS
from tasks.celery_app import DRIVE_RUN, make_celery
from tests.chaos import durable_agents
from tests.chaos.checker import (
    ApprovalRow,
    AuditRow,
    Comment,
    Decision,
    EffectRow,
    Evidence,
    Fault,
    ModelCall,
)
from tests.fakes.messages_api import FakeMessagesApi, Reply, message, tool_uses
from tests.pgbouncer import PgBouncer

QUEUE = "dar-chaos"
LEASE_SECONDS = 3.0
HEARTBEAT_SECONDS = 0.5
REAPER_INTERVAL_SECONDS = 0.5
REDISPATCH_AFTER_SECONDS = 3.0
POOLER = os.environ.get("DAR_CHAOS_PGBOUNCER", "0").lower() in ("1", "true", "yes")
"""DAR_CHAOS_PGBOUNCER=1: every process of the campaign connects through a PgBouncer in
transaction mode (``tests/pgbouncer.py``)."""
STRICT = os.environ.get("DAR_CHAOS_STRICT", "1").lower() in ("1", "true", "yes")
"""Treat a worker exit on a Redis outage as a failure (the default since ack emulation is
off); DAR_CHAOS_STRICT=0 tolerates it, for brokers settings that still restore unacked."""
TICKETS = (101, 102, 103, 104, 105, 106, 107, 108)


# -- profiles -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    name: str
    min_runs: int
    """Runs submitted at least; more are submitted while faults remain to be injected."""
    max_runs: int
    in_flight: int
    """Runs kept alive at once while submitting."""
    tool_turns: tuple[int, int]
    """Model turns that call tools, per run (then one that ends the run)."""
    model_latency: tuple[float, float]
    plan: tuple[str, ...]
    """Harness-driven faults, injected in a seeded random order."""
    crash_cycles: int
    """How many times worker-C and worker-E go through all six crash points (one death
    each)."""
    random_crash_probability: float
    """When above 0, worker-F runs with every crash point at this probability."""
    gap: tuple[float, float]
    """Pause between two harness-driven faults, seconds."""
    settle_timeout: float
    test_timeout: float
    durable_runs: int = 0
    """Runs of the chaos durable function, submitted among the others."""
    durable_spread: int = 1
    """A durable run is submitted once ``spread`` agent-loop runs per durable run were."""
    reject_share: float = 0.4
    """Share of the durable runs' approvals the campaign rejects (seeded per run)."""
    decide_delay: tuple[float, float] = (0.2, 2.0)
    """Seconds between an approval appearing and the campaign deciding it."""


SHORT_PLAN = (
    "kill_worker",
    "kill_worker",
    "sigstop_worker",
    "kill_pool_child",
    "restart_redis",
    "restart_postgres",
    "duplicate_messages",
    "duplicate_messages",
    "duplicate_messages",
)

SHORT = Profile(
    name="short",
    min_runs=10,
    max_runs=80,
    in_flight=4,
    tool_turns=(3, 5),
    model_latency=(0.3, 0.8),
    plan=SHORT_PLAN,
    crash_cycles=1,
    random_crash_probability=0.0,
    gap=(0.3, 1.2),
    settle_timeout=60.0,
    test_timeout=200.0,
    durable_runs=3,
    durable_spread=1,
)

LONG = Profile(
    name="long",
    min_runs=80,
    max_runs=1000,
    in_flight=10,
    tool_turns=(2, 6),
    model_latency=(0.2, 1.0),
    plan=SHORT_PLAN * 5 + ("sigstop_worker", "kill_pool_child", "kill_worker") * 3,
    crash_cycles=4,
    random_crash_probability=0.02,
    gap=(0.5, 3.0),
    settle_timeout=180.0,
    test_timeout=1800.0,
    durable_runs=24,
    durable_spread=3,
)


POOL_CHILD_WAIT_SECONDS = 10.0
"""How long ``kill_pool_child`` waits for the prefork master to have a child: it has none
between a child's death and the fork of the next, and the dead child's lease, not yet
lapsed, still says worker-D holds a run, so the next kill may come in that window (seed
991233 once reported "no pool child to kill"; a note says when it waited)."""


def chaos_profile(env: dict[str, str] | None = None) -> Profile:
    value = (os.environ if env is None else env).get("DAR_CHAOS", "").strip().lower()
    if value in ("", "short", "ci"):
        return SHORT
    if value == "long":
        return LONG
    raise ValueError(f"DAR_CHAOS must be 'short' or 'long', got {value!r}")


def chaos_seed(env: dict[str, str] | None = None) -> int:
    raw = (os.environ if env is None else env).get("DAR_CHAOS_SEED", "").strip()
    return int(raw) if raw else random.SystemRandom().randrange(1, 10**6)


# -- the scripted model -----------------------------------------------------------------------

TAG_RE = re.compile(r"\[chaos (\w+)\]")
REPLY_RE = re.compile(r"chaos reply (\d+) ")


class Scenario:
    """The fake Messages API's responder: a deterministic plan per run and turn."""

    def __init__(self, seed: int, profile: Profile) -> None:
        self.seed = seed
        self.profile = profile
        self._lock = threading.Lock()
        self._n = 0
        self.received: dict[int, float] = {}

    @staticmethod
    def input_for(tag: str) -> str:
        return f"[chaos {tag}] Remind the owners of the overdue acme tickets, then summarise."

    def tool_turns(self, tag: str) -> int:
        return random.Random(f"{self.seed}:{tag}").randint(*self.profile.tool_turns)

    def __call__(self, request: dict[str, Any]) -> Reply:
        with self._lock:
            self._n += 1
            n = self._n
            self.received[n] = time.time()
        messages = request.get("messages") or []
        found = TAG_RE.search(str(messages[0].get("content"))) if messages else None
        tag = found.group(1) if found else "unknown"
        turn = 1 + sum(1 for m in messages if m.get("role") == "assistant")
        rng = random.Random(f"{self.seed}:{tag}:{turn}")
        time.sleep(rng.uniform(*self.profile.model_latency))
        usage = {
            "input_tokens": 300 + n,
            "output_tokens": 10 + turn,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        }
        marker = f"chaos reply {n} for {tag} turn {turn}"
        if found and "durable step" in str(messages[0].get("content")):
            return message([{"type": "text", "text": f"{marker}: advice."}], usage=usage)
        if not found or turn > self.tool_turns(tag):
            return message([{"type": "text", "text": f"{marker}: done."}], usage=usage)
        calls: list[tuple[str, str, dict[str, Any]]] = []
        if turn == 1:
            calls.append((f"toolu_{tag}_{turn}_0_{n}", "list_tickets", {"overdue": True}))
        else:
            for j in range(rng.choice((1, 1, 2))):
                ticket = rng.choice(TICKETS)
                body = f"chaos {tag} turn {turn} call {j}: please look at #{ticket}"
                calls.append(
                    (
                        f"toolu_{tag}_{turn}_{j}_{n}",
                        "add_comment",
                        {"ticket_id": ticket, "text": body},
                    )
                )
            if rng.random() < 0.3:
                calls.append((f"toolu_{tag}_{turn}_l_{n}", "list_tickets", {"status": "open"}))
        return tool_uses(calls, preamble=marker, usage=usage)

    def calls(self, fake: FakeMessagesApi) -> list[ModelCall]:
        out = []
        for number, rec in enumerate(fake.requests, start=1):
            if rec.path.split("?")[0] != "/v1/messages" or not isinstance(rec.json, dict):
                continue
            body: dict[str, Any] = {}
            with contextlib.suppress(ValueError):
                body = json.loads(rec.response_body or b"{}")
            content = body.get("content") if rec.status == 200 else None
            received = 0.0
            if content:
                found = REPLY_RE.search(str(content[0].get("text", "")))
                if found:
                    received = self.received.get(int(found.group(1)), 0.0)
            out.append(
                ModelCall(
                    request_id=f"req_fake_{number:04d}",
                    messages=rec.json.get("messages") or [],
                    status=rec.status,
                    content=content,
                    usage=body.get("usage") or {},
                    received_at=received,
                )
            )
        return out


# -- private servers --------------------------------------------------------------------------


class PrivatePostgres:
    """An embedded PostgreSQL (pgserver) this suite may stop and start on the same data
    directory and socket, as a crash (``-m immediate``) or a clean restart (``-m fast``)."""

    def __init__(self, data_dir: Path) -> None:
        self._embedded = EmbeddedPostgres(data_dir)
        self.url = ""

    def start(self) -> str:
        self.url = self._embedded.start()
        return self.url

    def _pg_ctl(self, args: list[str], timeout: float = 30) -> None:
        from pgserver import _commands  # the pg_ctl pgserver itself runs

        server: Any = self._embedded._server
        _commands.pg_ctl(args, pgdata=server.pgdata, user=server.system_user, timeout=timeout)  # type: ignore[attr-defined]

    def stop_server(self, mode: str) -> None:
        self._pg_ctl(["-w", "-m", mode, "stop"])

    def start_server(self) -> None:
        server: Any = self._embedded._server
        socket_dir = parse_qs(urlparse(self.url).query)["host"][0]
        self._pg_ctl(
            ["-w", "-o", '-h ""', "-o", f"-k {socket_dir}", "-l", str(server.pgdata / "log"),
             "start"]
        )  # fmt: skip

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.stop_server("fast")
        self._embedded.stop()


# -- the stack ---------------------------------------------------------------------------------


@dataclass
class WorkerSpec:
    pool: str = "threads"
    concurrency: int = 8
    faults: Callable[[str], str] | None = None
    """``DAR_FAULTS`` for the next (re)spawn of this worker (called with its name)."""
    restart_on_exit: bool = False
    """A worker that kills itself at crash points: its deaths are faults, not errors."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of this worker (its own ``DATABASE_URL`` or ``REDIS_URL``: through a
    proxy the test cuts, ``tests/netproxy.py``)."""


@dataclass
class ChaosStack(DevStack):
    specs: dict[str, WorkerSpec] = field(default_factory=dict)
    beats: int = 2
    log_dir: Path = field(default_factory=lambda: Path("."))
    pg: PrivatePostgres | None = None
    broker: EmbeddedRedis | None = None
    log_offsets: dict[str, int] = field(default_factory=dict)
    spawned_at: dict[str, float] = field(default_factory=dict)
    pooler: bool = False
    """Every child (web, workers, beats) connects through a PgBouncer in transaction mode
    (:attr:`bouncer`) in front of the private PostgreSQL; migrations and the harness's own
    reads go directly (:attr:`database_url`)."""
    direct: frozenset[str] = frozenset()
    """Children (``worker-A``, ``beat-2``...) that connect to PostgreSQL directly even when the
    others go through the :attr:`pooler`: one stack then tries both ways at once."""
    bouncer: PgBouncer | None = None
    _logs: dict[str, IO[bytes]] = field(default_factory=dict)

    def _child_env(self, **extra: str) -> dict[str, str]:
        env = super()._child_env(**extra)
        if self.bouncer is not None and "DATABASE_URL" not in extra:
            env["DATABASE_URL"] = self.bouncer.url_for(self.database_url)
        return env

    def start_services(self) -> None:
        self.pg = PrivatePostgres(self.data_dir / "pgdata")
        self.database_url = self.pg.start()
        self.broker = EmbeddedRedis(port=free_port())
        self.redis_url = self.broker.start()
        engine = make_engine(self.database_url, pool_size=1)
        try:
            upgrade(engine)
            TicketStore(engine).seed()
            with engine.begin() as conn:
                conn.execute(text(durable_agents.EFFECT_DDL))
        finally:
            engine.dispose()
        if self.pooler:
            self.bouncer = PgBouncer(self.database_url)
            self.bouncer.start()

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _spawn(self, name: str, args: list[str], **extra_env: str) -> None:
        if name in self.direct:
            extra_env = {**extra_env, "DATABASE_URL": self.database_url}
        ready_file = self.ready_file(name)
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
            extra_env = {**extra_env, "DAR_READY_FILE": str(ready_file)}
        log = self._logs.get(name)
        if log is None:
            log = self._logs[name] = self.log_path(name).open("ab")
        log.flush()
        self.log_offsets[name] = self.log_path(name).stat().st_size
        self.spawned_at[name] = time.time()
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", *args],
            env=self._child_env(**extra_env),
            cwd=CODE_ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def start_web(self) -> None:
        # One gunicorn worker: the suite submits a few runs, and CPU is scarce on 2 cores.
        self._spawn(
            "web",
            [
                "gunicorn",
                "--bind", f"127.0.0.1:{self.port}",
                "--workers", "1",
                "--threads", "4",
                "api.wsgi:app",
            ],
        )  # fmt: skip

    def start_worker(self, letter: str) -> None:
        spec = self.specs[letter]
        name = f"worker-{letter}"
        self._spawn(
            name,
            [
                "celery", "--quiet", "-A", "tasks.app", "worker",
                "--pool", spec.pool,
                "--concurrency", str(spec.concurrency),
                "--hostname", f"{name}@%h",
                "--without-gossip", "--without-mingle",
                "--loglevel", "INFO",
            ],
            DAR_WORKER_NAME=name,
            DAR_FAULTS=spec.faults(name) if spec.faults else "",
            **spec.env,
        )  # fmt: skip

    def start_beat(self, name: str = "beat") -> None:
        self._spawn(
            name,
            [
                "celery", "-A", "tasks.app", "beat",
                "--schedule", str((self.data_dir / f"{name}-schedule").resolve()),
                "--loglevel", "WARNING",
            ],
        )  # fmt: skip

    def prepare(self) -> None:
        """Its folders, and the one each worker writes its ready file in (``DAR_READY_FILE``):
        without it :meth:`wait_ready` waits for the web alone, and a worker still starting
        (seen: 14 s through a proxy on a loaded host) misses the runs a test submits next."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._run_dir = Path(tempfile.mkdtemp(prefix="dar-chaos-run-"))

    def start(self, timeout: float = 60.0) -> None:
        self.prepare()
        self.start_services()
        self.start_web()
        for letter in self.specs:
            self.start_worker(letter)
        for i in range(self.beats):
            self.start_beat("beat" if i == 0 else f"beat-{i + 1}")
        self.wait_ready(timeout)

    def new_log_text(self, name: str) -> str:
        """What the current incarnation of ``name`` has logged."""
        with self.log_path(name).open("rb") as f:
            f.seek(self.log_offsets.get(name, 0))
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        procs: list[psutil.Process] = []
        for proc in self.processes.values():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(proc.pid)
                procs += [p, *p.children(recursive=True)]
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGCONT)
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        for proc in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.processes.clear()
        for log in self._logs.values():
            log.close()
        self._logs.clear()
        if self.broker is not None:
            self.broker.stop()
        if self.bouncer is not None:
            self.bouncer.stop()
        if self.pg is not None:
            self.pg.stop()
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None


class CrashPlan:
    """``DAR_FAULTS`` for each (re)spawn of the crash-point workers: one crash point at
    probability 1, so the next step that passes it dies there. Every point is planned
    ``cycles`` times, in a seeded order, shared out between the workers (so the six points
    are reached in parallel); when the plan is done they carry on as plain workers."""

    def __init__(self, rng: random.Random, cycles: int) -> None:
        self._lock = threading.Lock()
        self._plan: list[str] = []
        self._assigned: dict[str, str] = {}
        for _ in range(cycles):
            points = list(POINTS)
            rng.shuffle(points)
            self._plan += points

    def __call__(self, worker: str) -> str:
        with self._lock:
            self._assigned.pop(worker, None)
            taken = list(self._assigned.values())
            for point in self._plan:
                if point in taken:
                    taken.remove(point)
                    continue
                self._assigned[worker] = point
                return f"{point}=1"
            return ""

    def consumed(self, worker: str, point: str) -> None:
        with self._lock:
            if point in self._plan:
                self._plan.remove(point)
            if self._assigned.get(worker) == point:
                del self._assigned[worker]

    def left(self) -> list[str]:
        with self._lock:
            return list(self._plan)


def build_stack(
    tmp: Path, fake: FakeMessagesApi, profile: Profile, seed: int, crash_plan: CrashPlan
) -> ChaosStack:
    """The private stack: API, workers A-D (E in the long version), two beats."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAR_", "ANTHROPIC_"))}
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    env.update(
        {
            "DAR_QUEUE": QUEUE,
            "DAR_LEASE_SECONDS": str(LEASE_SECONDS),
            "DAR_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS),
            "DAR_REAPER_INTERVAL_SECONDS": str(REAPER_INTERVAL_SECONDS),
            "DAR_REDISPATCH_AFTER_SECONDS": str(REDISPATCH_AFTER_SECONDS),
            # A run may be hit by several crashes on one step here; the default (3) would
            # give up on it, which is right in production and not what this suite tests.
            "DAR_MAX_CLAIMS_WITHOUT_PROGRESS": "50",
            "DAR_MODEL_TIMEOUT_SECONDS": "30",
            "DAR_FAULTS_SEED": str(seed),
            "DAR_LOG_LEVEL": "INFO",
            # A process that dies of a signal it did not get from us (a segfault) leaves the
            # Python stack of every thread in its log.
            "PYTHONFAULTHANDLER": "1",
            "DAR_AGENT_MODULES": "tests.chaos.durable_agents",
            "ANTHROPIC_API_KEY": "test",
            "ANTHROPIC_BASE_URL": fake.url,
        }
    )
    specs = {
        "A": WorkerSpec(concurrency=8),
        "B": WorkerSpec(concurrency=8),
        "C": WorkerSpec(concurrency=4, faults=crash_plan, restart_on_exit=True),
        "D": WorkerSpec(pool="prefork", concurrency=1),
        "E": WorkerSpec(concurrency=4, faults=crash_plan, restart_on_exit=True),
    }
    if profile.random_crash_probability > 0:
        every_point = ",".join(f"{point}={profile.random_crash_probability}" for point in POINTS)
        specs["F"] = WorkerSpec(
            concurrency=4, faults=lambda _worker: every_point, restart_on_exit=True
        )
    return ChaosStack(
        data_dir=tmp,
        port=free_port(),
        env=env,
        specs=specs,
        beats=2,
        log_dir=tmp / "logs",
        pooler=POOLER,
    )


# -- the campaign -------------------------------------------------------------------------------


HELD_BY = text("SELECT id FROM run WHERE locked_by = :w AND status = 'RUNNING'")
# Runs a dead worker had just handed on: committed a step, the next message maybe never sent.
HANDED_ON_BY = text(
    """
    SELECT r.id FROM run r
    JOIN LATERAL (SELECT worker, finished_at FROM run_step s WHERE s.run_id = r.id
                  ORDER BY seq DESC LIMIT 1) last ON true
    WHERE r.status = 'RUNNING' AND r.locked_by IS NULL AND last.worker = :w
      AND last.finished_at > now() - interval '0.75 seconds'
    """
)
# Leases the live process named :w holds: renewed within the last second or so. (Names
# collide on purpose: a respawned worker-A reuses the name, and the runs its dead predecessor
# held stay locked by "worker-A" until their leases lapse.)
LIVE_LEASES = (
    "SELECT 1 FROM run WHERE locked_by = :w AND status = 'RUNNING' "
    f"AND locked_until > now() + interval '{LEASE_SECONDS - 1.5} seconds'"
)
LIVE = text("SELECT id FROM run WHERE status IN ('QUEUED', 'RUNNING')")
NOT_ENDED = text("SELECT id FROM run WHERE status IN ('QUEUED', 'RUNNING', 'WAITING')")
EFFECTS = text("SELECT id, run_id, key, kind, at FROM chaos_effect")
APPROVALS = text("SELECT id, run_id, step_key, status, decided_by FROM approval")
AUDITS = text("SELECT run_id, approval_id, action FROM audit_event")
TOKENS = text("SELECT id, dispatch_token, locked_by FROM run WHERE status IN ('QUEUED', 'RUNNING')")
COMMENTS = text("SELECT id, ticket_id, body, idempotency_key, created_at FROM acme_comment")
FAULT_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) WARNING\s+\S+ fault injection: SIGKILL at (\w+)",
    re.MULTILINE,
)


def log_time(date_time: str, millis: str) -> float:
    """A log line's timestamp (local time, as logging writes it) as ``time.time()``."""
    return time.mktime(time.strptime(date_time, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000


# The heartbeat's warning. It also fires, harmlessly, right after a step of that run commits
# or the run ends (the commit releases the lease the heartbeat still renews; see chaos.md):
# such lines are told apart by the step the same worker committed just before.
HEARTBEAT_LOST = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) WARNING\s+(\S+) "
    r"run=([0-9a-f-]{36}) lease lost",
    re.MULTILINE,
)
BENIGN_WINDOW = (-1.5, 0.3)
# A step whose write the fence refused (``tasks/drive.py``): the worker was alive and lost
# its lease. When the heartbeat found that first, its own line above says so already (the
# reason then is NOTICED_BY_THE_HEARTBEAT); otherwise (the claim's lease lapsed before the
# step held it, or the run was taken over between two beats and the step wrote first) this
# line is the only trace of the loss: a claim that produced nothing, and maybe a repeated
# model call, with no fault injected.
FENCED_OUT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) WARNING\s+(\S+) run=[0-9a-f]{8} "
    r"step abandoned, nothing written: lease on run ([0-9a-f-]{36}) lost(?:: (.*))?$",
    re.MULTILINE,
)
NOTICED_BY_THE_HEARTBEAT = "heartbeat found the lease taken over"


def heartbeat_losses(logged: str) -> list[tuple[str, uuid.UUID, float, int]]:
    """(worker, run, time, offset) of each heartbeat "lease lost" warning in a log."""
    return [
        (m.group(3), uuid.UUID(m.group(4)), log_time(m.group(1), m.group(2)), m.start())
        for m in HEARTBEAT_LOST.finditer(logged)
    ]


SAME_LOSS_SECONDS = 10.0
"""A step the fence refused this soon after its worker's heartbeat logged the same run's lease
lost is that loss (the step wrote before it looked at the heartbeat's flag), not another."""


def fenced_out_losses(logged: str) -> list[tuple[str, uuid.UUID, float, int]]:
    """(worker, run, time, offset) of each lease loss only the fence noticed: a step
    abandoned whose reason is not the heartbeat's finding, with no heartbeat line of its
    worker for that run just before (either way, that loss has its heartbeat line)."""
    noticed = heartbeat_losses(logged)
    out = []
    for m in FENCED_OUT.finditer(logged):
        if (m.group(5) or "").strip() == NOTICED_BY_THE_HEARTBEAT:
            continue
        worker, run_id = m.group(3), uuid.UUID(m.group(4))
        at = log_time(m.group(1), m.group(2))
        if any(
            (w, r) == (worker, run_id) and 0 <= at - t <= SAME_LOSS_SECONDS
            for w, r, t, _ in noticed
        ):
            continue
        out.append((worker, run_id, at, m.start()))
    return out


class Campaign:
    def __init__(
        self,
        stack: ChaosStack,
        fake: FakeMessagesApi,
        scenario: Scenario,
        profile: Profile,
        seed: int,
        crash_plan: CrashPlan,
    ) -> None:
        self.stack = stack
        self.crash_plan = crash_plan
        self.fake = fake
        self.scenario = scenario
        self.profile = profile
        self.seed = seed
        self.rng = random.Random(seed)
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self.notes: list[str] = []
        self.known_issues: list[str] = []
        self.timings: dict[str, float] = {}
        self._broker_outages: list[tuple[float, float]] = []
        self._stopped_logs: list[tuple[str, int, float, frozenset[uuid.UUID]]] = []
        self._last_live: frozenset[uuid.UUID] = frozenset()
        self._lock_snapshots: deque[tuple[float, dict[uuid.UUID, str]]] = deque(maxlen=64)
        self._monitor_rng = random.Random(f"{seed}:monitor")
        self.runs: dict[str, uuid.UUID] = {}
        self.decisions: list[Decision] = []
        self.tokens_seen: dict[uuid.UUID, list[uuid.UUID]] = {}
        self.started = time.time()
        self.engine: Engine = make_engine(stack.database_url, pool_size=3, max_overflow=2)
        self.store = RunStore(self.engine)
        self.celery = make_celery(Settings(redis_url=stack.redis_url, queue=QUEUE), register=False)
        self._proc_lock = threading.RLock()
        self._expected_dead: set[str] = set()
        self._respawn_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._faults_done = threading.Event()
        self._submit_paused = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- the whole campaign -------------------------------------------------------------

    def run(self) -> None:
        self.started = time.time()
        for target in (self._monitor, self._submitter, self._approver):
            t = threading.Thread(target=self._guarded(target), name=target.__name__, daemon=True)
            t.start()
            self._threads.append(t)
        plan = list(self.profile.plan)
        self.rng.shuffle(plan)
        self._wait(lambda: len(self.runs) >= 2, 30, "the first runs were not submitted")
        for kind in plan:
            time.sleep(self.rng.uniform(*self.profile.gap))
            getattr(self, kind)()
        if self.crash_plan.left():
            self._wait(
                lambda: not self.crash_plan.left(),
                min(30.0, 8.0 * len(self.crash_plan.left())),
                f"the crash-point workers did not reach {self.crash_plan.left()}",
                fail=False,
            )
        self._faults_done.set()
        self.timings["faults"] = time.time() - self.started
        self._threads[1].join(timeout=120)
        self._wait(self._all_ended, self.profile.settle_timeout, "runs did not all end")
        self.timings["all runs ended"] = time.time() - self.started
        time.sleep(1.0)  # let stale workers (stopped ones, lost leases) finish writing
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def close(self) -> None:
        self._stop.set()
        self._faults_done.set()
        for t in self._threads:
            t.join(timeout=10)
        self.engine.dispose()
        with contextlib.suppress(Exception):
            self.celery.close()

    # -- helpers --------------------------------------------------------------------------

    def _guarded(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except Exception as e:  # a harness thread must not die silently
                self.errors.append(f"harness thread {fn.__name__} failed: {e!r}")

        return run

    def _wait(
        self, predicate: Callable[[], bool], timeout: float, what: str, *, fail: bool = True
    ) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if predicate():
                    return True
            time.sleep(0.1)
        message = f"{what} within {timeout:.0f}s"
        if fail:
            raise AssertionError(message + "\n" + self.describe_live_runs())
        self.notes.append(message)
        return False

    def _query_ids(self, sql: Any, **params: Any) -> frozenset[uuid.UUID]:
        with self.engine.connect() as conn:
            return frozenset(r[0] for r in conn.execute(sql, params))

    def live_runs(self) -> frozenset[uuid.UUID]:
        return self._query_ids(LIVE)

    def hit_by_death(self, name: str, died_at: float) -> frozenset[uuid.UUID]:
        """The runs a worker that died at ``died_at`` was holding or had just handed on: what
        the database says now, and what the monitor saw it hold in the second before (in
        case the death was noticed late and a lease has lapsed meanwhile)."""
        seen = frozenset(
            run_id
            for at, locks in list(self._lock_snapshots)
            if died_at - 1.0 <= at <= died_at + 0.1
            for run_id, holder in locks.items()
            if holder == name
        )
        try:
            now = self._query_ids(HELD_BY, w=name) | self._query_ids(HANDED_ON_BY, w=name)
        except Exception:  # database away (restarting): every run live at the last look
            self.notes.append(f"death of {name} while the database was away")
            now = self._last_live
        return seen | now

    def holds_a_run(self, name: str) -> bool:
        with self.engine.connect() as conn:
            row = conn.execute(text(LIVE_LEASES + " LIMIT 1"), {"w": name}).first()
        return row is not None

    def _all_ended(self) -> bool:
        return not self._query_ids(NOT_ENDED)

    def describe_live_runs(self) -> str:
        lines = []
        with contextlib.suppress(Exception):
            for tag, run_id in self.runs.items():
                run = self.store.get_run(run_id)
                if run.status in (RunStatus.QUEUED, RunStatus.RUNNING):
                    steps = self.store.steps(run_id)
                    lines.append(
                        f"  {tag} {run_id} {run.status} steps={len(steps)} "
                        f"locked_by={run.locked_by} until={run.locked_until} "
                        f"epoch={run.lease_epoch} claims_without_progress="
                        f"{run.claims_without_progress}"
                    )
        return "still live:\n" + "\n".join(lines) if lines else ""

    def record(self, fault: Fault) -> None:
        self.faults.append(fault)
        print(
            f"chaos t={fault.at - self.started:6.1f}s {fault.kind} {fault.target} "
            f"runs={len(fault.disturbed)} {fault.detail}",
            flush=True,
        )

    def _pid(self, name: str) -> int:
        return self.stack.processes[name].pid

    # -- background threads -----------------------------------------------------------------

    def _monitor(self) -> None:
        """Watch the processes: a worker that killed itself at a crash point is a fault
        (recorded, then respawned); any other death is an error. Also remember the dispatch
        tokens runs go through, for stale duplicates."""
        last_tokens = 0.0
        while not self._stop.is_set():
            with self._proc_lock:
                for name, proc in list(self.stack.processes.items()):
                    if name in self._expected_dead or proc.poll() is None:
                        continue
                    self._on_exit(name, proc.returncode)
                for name, at in list(self._respawn_at.items()):
                    if time.monotonic() >= at:
                        del self._respawn_at[name]
                        self._respawn(name)
            if time.monotonic() - last_tokens > 0.25:
                last_tokens = time.monotonic()
                with contextlib.suppress(Exception), self.engine.connect() as conn:
                    live = conn.execute(TOKENS).all()
                    self._last_live = frozenset(run_id for run_id, _, _ in live)
                    self._lock_snapshots.append(
                        (time.time(), {run_id: holder for run_id, _, holder in live if holder})
                    )
                    for run_id, token, _ in live:
                        seen = self.tokens_seen.setdefault(run_id, [])
                        if not seen or seen[-1] != token:
                            seen.append(token)
            time.sleep(0.05)

    def _on_exit(self, name: str, code: int) -> None:
        at = time.time()
        letter = name.removeprefix("worker-")
        spec = self.stack.specs.get(letter) if name.startswith("worker-") else None
        logged = self.stack.new_log_text(name)
        fired = FAULT_LINE.findall(logged)
        self._expected_dead.add(name)
        if spec is not None and spec.restart_on_exit and fired and code == -signal.SIGKILL:
            date_time, millis, point = fired[-1]
            at = min(at, log_time(date_time, millis))
            if isinstance(spec.faults, CrashPlan):
                spec.faults.consumed(name, point)
            hit = self.hit_by_death(name, at)
            self.record(
                Fault(
                    f"crash_point:{point}",
                    name,
                    at,
                    repeat_runs=hit,
                    disturbed=hit,
                    detail=f"pid {self.stack.processes[name].pid}",
                )
            )
        elif self._broker_loss_exit(name, logged, code, at):
            hit = self.hit_by_death(name, at)
            self.record(
                Fault("worker_exit_on_broker_loss", name, at, repeat_runs=hit, disturbed=hit)
            )
            self.known_issues.append(
                f"{name} (pid {self.stack.processes[name].pid}) exited with status {code} when "
                "Redis went away: Celery's consumer, closing the lost connection, restores the "
                "worker's unacknowledged messages (kombu QoS.restore_unacked) on a channel whose "
                "connection is already gone -> AttributeError(\"'NoneType' object has no "
                "attribute 'hostname'\") -> 'Unrecoverable error', worker shut down"
            )
        else:
            self.errors.append(
                f"{name} exited unexpectedly (status {code}); its log ends:\n"
                + "\n".join(logged.splitlines()[-30:])
            )
        self._respawn_at[name] = time.monotonic() + self._monitor_rng.uniform(0.1, 0.6)

    def _broker_loss_exit(self, name: str, logged: str, code: int, at: float) -> bool:
        """The known way a worker dies when Redis does (see docs/chaos.md): tolerated as a
        fault (a supervisor restarts the worker) unless DAR_CHAOS_STRICT is set."""
        born = self.stack.spawned_at.get(name, 0.0)
        recent = any(born - 1 <= start <= at for start, _ in self._broker_outages)
        signature = "Unrecoverable error" in logged and "restore_unacked" in logged
        return code == 1 and recent and signature and not STRICT

    def _respawn(self, name: str) -> None:
        with self._proc_lock:
            if name.startswith("worker-"):
                self.stack.start_worker(name.removeprefix("worker-"))
            elif name.startswith("beat"):
                self.stack.start_beat(name)
            elif name == "web":
                self.stack.start_web()
            self._expected_dead.discard(name)

    def _submitter(self) -> None:
        n = d = 0
        while not self._stop.is_set():
            done = self._faults_done.is_set()
            durable_left = d < self.profile.durable_runs
            enough = done and n >= self.profile.min_runs and not durable_left
            if n >= self.profile.max_runs or enough:
                return
            if self._submit_paused.is_set():
                time.sleep(0.05)
                continue
            try:
                live = len(self.live_runs())
            except Exception:
                time.sleep(0.2)
                continue
            if live >= self.profile.in_flight:
                time.sleep(0.1)
                continue
            if durable_left and d * self.profile.durable_spread <= n:
                tag = f"d{d:03d}"
                self.runs[tag] = self._submit(tag, durable=True)
                d += 1
                continue
            tag = f"r{n:03d}"
            self.runs[tag] = self._submit(tag)
            n += 1

    def _submit(self, tag: str, *, durable: bool = False) -> uuid.UUID:
        """POST /api/runs with an Idempotency-Key, retried through outages."""
        run: dict[str, Any] = {"input": Scenario.input_for(tag), "tokenBudget": 1_000_000}
        if durable:
            run = {"agent": durable_agents.AGENT, "input": {"tag": tag}, "tokenBudget": 1_000_000}
        body = json.dumps(run).encode()
        deadline = time.monotonic() + 60
        last = ""
        while time.monotonic() < deadline and not self._stop.is_set():
            req = urllib.request.Request(self.stack.api_url + "/api/runs", data=body, method="POST")
            req.add_header("Content-Type", "application/json")
            req.add_header("Idempotency-Key", f"chaos-{self.seed}-{tag}")
            try:
                with urllib.request.urlopen(req, timeout=15) as resp:
                    return uuid.UUID(json.loads(resp.read())["id"])
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code}: {e.read()[:300]!r}"
            except OSError as e:
                last = repr(e)
            time.sleep(0.3)
        raise AssertionError(f"could not submit run {tag} within 60s: {last}")

    # -- approvals, decided through REST while the faults go on --------------------------------

    def _api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One request to the API: (status, JSON body); (0, error) when it did not answer."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.stack.api_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, e.read()[:300]
        except OSError as e:
            return 0, repr(e)

    def _post_decision(self, approval: dict[str, Any], verb: str) -> int:
        """POST approve|reject with the payload hash shown, retried through outages (a 5xx
        or no answer: the decision may have been committed or not); the final status."""
        path = f"/api/approvals/{approval['id']}/{verb}"
        body = {"payloadHash": approval["payloadHash"], "comment": f"chaos {verb}"}
        deadline = time.monotonic() + 60
        status, answer = 0, None
        while time.monotonic() < deadline and not self._stop.is_set():
            status, answer = self._api("POST", path, body)
            if status and status < 500:
                return status
            time.sleep(0.3)
        self.errors.append(f"{verb} of approval {approval['id']} never answered: {answer!r}")
        return status

    def _approver(self) -> None:
        """Decide each approval the durable runs ask for, a seeded moment after it appears:
        approve or reject (seeded per run), then sometimes the same decision again (must be
        answered 200 and change nothing) and sometimes the other one (must be refused, 409)."""
        seen: set[str] = set()
        due: list[tuple[float, dict[str, Any], random.Random]] = []
        while not self._stop.is_set():
            status, answer = self._api("GET", f"/api/approvals?role={durable_agents.ROLE}")
            if status == 200 and isinstance(answer, dict):
                tags = {run_id: tag for tag, run_id in self.runs.items()}
                for item in answer["items"]:
                    tag = tags.get(uuid.UUID(item["runId"]))
                    if item["id"] in seen or tag is None:
                        continue
                    seen.add(item["id"])
                    rng = random.Random(f"{self.seed}:{tag}:decide")
                    delay = rng.uniform(*self.profile.decide_delay)
                    due.append((time.monotonic() + delay, item, rng))
            for entry in sorted(due, key=lambda e: e[0]):
                at, item, rng = entry
                if time.monotonic() < at:
                    break
                due.remove(entry)
                self._decide(item, rng)
            time.sleep(0.2)

    def _decide(self, item: dict[str, Any], rng: random.Random) -> None:
        verb = "reject" if rng.random() < self.profile.reject_share else "approve"
        other = "approve" if verb == "reject" else "reject"
        again = [v for v, p in ((verb, 0.5), (other, 0.5)) if rng.random() < p]
        status = self._post_decision(item, verb)
        if status != 200:
            self.errors.append(f"{verb} of approval {item['id']} was answered {status}")
            return
        answers = tuple((v, self._post_decision(item, v)) for v in again)
        self.decisions.append(
            Decision(uuid.UUID(item["id"]), uuid.UUID(item["runId"]), verb, answers)
        )
        print(
            f"chaos t={time.time() - self.started:6.1f}s decided {item['stepKey']} of "
            f"{str(item['runId'])[:8]}: {verb}"
            + "".join(f", {v} again -> {code}" for v, code in answers),
            flush=True,
        )

    # -- the faults ---------------------------------------------------------------------------

    def _wait_for_holder(self, *names: str, timeout: float = 10.0) -> tuple[str, bool]:
        """One of ``names`` that holds a run, chosen at random among those that do (any of
        them, and ``False``, if none did within ``timeout``)."""
        holders: list[str] = []

        def found() -> bool:
            holders[:] = [n for n in names if self.holds_a_run(n)]
            return bool(holders)

        if self._wait(found, timeout, f"none of {names} held a run", fail=False):
            return self.rng.choice(holders), True
        return self.rng.choice(names), False

    def kill_worker(self) -> None:
        """SIGKILL a whole thread-pool worker at a random moment of a step it runs."""
        name, held = self._wait_for_holder("worker-A", "worker-B")
        time.sleep(self.rng.uniform(0.0, 0.6))
        with self._proc_lock:
            self._expected_dead.add(name)
            pid = self._pid(name)
            self.stack.kill(name)
        at = time.time()
        hit = self.hit_by_death(name, at)
        detail = f"pid {pid}" + ("" if held else ", held no run when killed")
        self.record(Fault("kill_worker", name, at, repeat_runs=hit, disturbed=hit, detail=detail))
        time.sleep(self.rng.uniform(0.5, 1.5))
        self._respawn(name)

    def sigstop_worker(self) -> None:
        """SIGSTOP a worker mid-step until its lease has lapsed and another worker has
        claimed each run it held, then SIGCONT it: it wakes up fenced out, and every write
        it still tries is refused (LeaseLost)."""
        name, _ = self._wait_for_holder("worker-A", "worker-B")
        time.sleep(self.rng.uniform(0.0, 0.4))
        with self._proc_lock:
            pid = self._pid(name)
            os.kill(pid, signal.SIGSTOP)
        at = time.time()
        with self.engine.connect() as conn:
            held = dict(
                conn.execute(
                    text(LIVE_LEASES.replace("SELECT 1", "SELECT id, lease_epoch")),
                    {"w": name},
                ).all()
            )

        def taken_over() -> bool:
            return all(
                (run := self.store.get_run(run_id)).lease_epoch > epoch or run.status.terminal
                for run_id, epoch in held.items()
            )

        time.sleep(LEASE_SECONDS)
        self._wait(taken_over, 8.0, f"the runs {name} held were not taken over", fail=False)
        time.sleep(self.rng.uniform(0.2, 1.2))  # the new holder may finish the step, or not
        with self._proc_lock:
            offset = self.stack.log_path(name).stat().st_size
            os.kill(pid, signal.SIGCONT)
        self._stopped_logs.append((name, offset, time.time(), frozenset(held)))
        self.record(
            Fault(
                "sigstop_past_lease",
                name,
                at,
                repeat_runs=frozenset(held),
                disturbed=frozenset(held),
                until=time.time(),
                detail=f"stopped {time.time() - at:.1f}s",
            )
        )

    def kill_pool_child(self) -> None:
        """SIGKILL the pool process of the prefork worker while it runs a step; its master
        lives on and forks a new child."""
        name, held = self._wait_for_holder("worker-D")
        time.sleep(self.rng.uniform(0.0, 0.2))
        looked = time.monotonic()
        while True:
            with self._proc_lock:
                children = psutil.Process(self._pid(name)).children()
                if children:
                    victim = self.rng.choice(children)
                    victim.kill()
                    break
            if time.monotonic() - looked > POOL_CHILD_WAIT_SECONDS:
                self.errors.append(
                    f"{name} (--pool prefork) has had no pool child to kill for "
                    f"{POOL_CHILD_WAIT_SECONDS:g}s"
                )
                return
            time.sleep(0.1)
        if time.monotonic() - looked > 0.05:
            self.notes.append(
                f"{name} had no pool child for {time.monotonic() - looked:.1f}s before this "
                "kill (its master was forking the next one)"
            )
        at = time.time()
        hit = self.hit_by_death(name, at)  # now: the master reaps the child seconds later
        detail = f"child pid {victim.pid}" + ("" if held else ", held no run when killed")
        self.record(
            Fault("kill_pool_child", name, at, repeat_runs=hit, disturbed=hit, detail=detail)
        )

    def restart_redis(self) -> None:
        """Kill Redis (every queued message is lost: it keeps nothing on disk) and start it
        again on the same port."""
        assert self.stack.broker is not None
        live = self.live_runs()
        self.stack.broker.stop()
        at = time.time()
        self._broker_outages.append((at, at + 60))
        time.sleep(self.rng.uniform(1.0, 2.5))
        self.stack.broker.start()
        self._broker_outages[-1] = (at, time.time())
        self.record(
            Fault("restart_redis", "redis", at, disturbed=live, until=time.time(),
                  detail=f"down {time.time() - at:.1f}s, queue lost")
        )  # fmt: skip

    def restart_postgres(self) -> None:
        """Stop PostgreSQL (as a crash, ``immediate``, or a clean ``fast`` shutdown) and
        start it again on the same data directory."""
        assert self.stack.pg is not None
        mode = self.rng.choice(("immediate", "fast"))
        self._submit_paused.set()
        try:
            time.sleep(0.2)  # a submission in progress finishes
            live = self.live_runs()
            self.stack.pg.stop_server(mode)
            at = time.time()
            time.sleep(self.rng.uniform(1.0, 2.0))
            self.stack.pg.start_server()
        finally:
            self._submit_paused.clear()
        self.record(
            Fault("restart_postgres", "postgres", at, repeat_runs=live, disturbed=live,
                  until=time.time(), detail=f"-m {mode}, down {time.time() - at:.1f}s")
        )  # fmt: skip

    def duplicate_messages(self) -> None:
        """Duplicate drive_run messages: copies carrying a run's live dispatch token, one
        carrying a stale token, and raw redeliveries of messages workers hold unacked (what
        Redis does when a visibility timeout passes)."""
        with self.engine.connect() as conn:
            live = list(conn.execute(TOKENS))
        self.rng.shuffle(live)
        copies = stale = raw = 0
        for run_id, token, _ in live[:3]:
            for _ in range(2):
                self.celery.send_task(DRIVE_RUN, args=[str(run_id), str(token)])
                copies += 1
            older = [t for t in self.tokens_seen.get(run_id, []) if t != token]
            if older:
                self.celery.send_task(DRIVE_RUN, args=[str(run_id), str(older[-1])])
                stale += 1
        client = redis.Redis.from_url(self.stack.redis_url)
        try:
            for raw_entry in list(client.hvals("unacked"))[:3]:
                payload, _exchange, _routing_key = json.loads(raw_entry)
                if payload.get("headers", {}).get("task") != DRIVE_RUN:
                    continue
                payload["headers"]["redelivered"] = True
                payload["properties"]["delivery_info"]["redelivered"] = True
                client.rpush(QUEUE, json.dumps(payload))
                raw += 1
        finally:
            client.close()
        self.record(
            Fault(
                "duplicate_messages",
                "queue",
                time.time(),
                detail=f"{copies} copies of live tokens, {stale} stale, {raw} raw redeliveries",
            )
        )

    # -- evidence -----------------------------------------------------------------------------

    def _worker_logs(self) -> list[str]:
        out = []
        for name in self.stack.specs:
            with contextlib.suppress(OSError):
                out.append(
                    self.stack.log_path(f"worker-{name}").read_bytes().decode(errors="replace")
                )
        return out

    def lease_loss_lines(self) -> list[tuple[str, uuid.UUID, float, int]]:
        """(worker, run, time, log offset) of every heartbeat "lease lost" warning."""
        return [e for logged in self._worker_logs() for e in heartbeat_losses(logged)]

    def genuine_lease_losses(
        self, runs: list[Run], steps: dict[uuid.UUID, list[Step]]
    ) -> list[tuple[str, uuid.UUID, float, int]]:
        """The heartbeat's warnings not explained by a commit of the same worker just before,
        and the losses only the fence noticed (:func:`fenced_out_losses`)."""
        ends = {r.id: r.finished_at for r in runs}
        lo, hi = BENIGN_WINDOW

        def benign(worker: str, run_id: uuid.UUID, at: float) -> bool:
            done = [s.finished_at for s in steps.get(run_id, []) if s.worker == worker]
            done.append(ends.get(run_id))
            return any(t is not None and lo <= t.timestamp() - at <= hi for t in done)

        noticed = [e for e in self.lease_loss_lines() if not benign(e[0], e[1], e[2])]
        fenced = [e for logged in self._worker_logs() for e in fenced_out_losses(logged)]
        return noticed + fenced

    def fenced_out_after_sigcont(self) -> tuple[int, int]:
        """(runs held by stopped workers, how many of them the worker found taken over by
        its first heartbeat after SIGCONT)."""
        events = self.lease_loss_lines()
        held_total = found = 0
        for name, offset, cont, held in self._stopped_logs:
            held_total += len(held)
            found += len(
                {
                    run
                    for w, run, at, pos in events
                    if w == name and pos >= offset and run in held and at <= cont + 3
                }
            )
        return held_total, found

    def evidence(self) -> Evidence:
        runs = self.store.list_runs(limit=10_000)
        submitted = set(self.runs.values())
        extra = {r.id for r in runs} - submitted
        if extra:
            self.errors.append(f"runs nobody submitted: {sorted(map(str, extra))}")
        with self.engine.connect() as conn:
            comments = [
                Comment(r.id, r.ticket_id, r.body, r.idempotency_key, r.created_at)
                for r in conn.execute(COMMENTS)
            ]
            effects = [
                EffectRow(r.id, r.run_id, r.key, r.kind, r.at) for r in conn.execute(EFFECTS)
            ]
            approvals = [
                ApprovalRow(r.id, r.run_id, r.step_key, r.status, r.decided_by)
                for r in conn.execute(APPROVALS)
            ]
            audits = [AuditRow(r.run_id, r.approval_id, r.action) for r in conn.execute(AUDITS)]
        steps = {r.id: self.store.steps(r.id) for r in runs}
        losses: dict[uuid.UUID, int] = {}
        loss_times: dict[uuid.UUID, list[tuple[str, float]]] = {}
        for worker, run_id, at, _ in self.genuine_lease_losses(runs, steps):
            losses[run_id] = losses.get(run_id, 0) + 1
            loss_times.setdefault(run_id, []).append((worker, at))
        return Evidence(
            runs=runs,
            steps=steps,
            comments=comments,
            calls=self.scenario.calls(self.fake),
            faults=list(self.faults),
            known_workers=frozenset(f"worker-{letter}" for letter in self.stack.specs),
            lease_losses=losses,
            lease_loss_times=loss_times,
            effects=effects,
            approvals=approvals,
            audits=audits,
            decisions=list(self.decisions),
        )

    def run_history(self, run_id: uuid.UUID, limit: int = 80) -> str:
        """Every line the processes logged about one run, in time order."""
        short = str(run_id)[:8]
        found: list[str] = []
        for name in sorted(self.stack._logs):
            with contextlib.suppress(OSError):
                text_ = self.stack.log_path(name).read_text("utf-8", "replace")
                found += [line for line in text_.splitlines() if short in line]
        found.sort()
        return f"--- run {run_id} ---\n" + "\n".join(found[-limit:])

    def log_tails(self, lines: int = 40) -> str:
        out = []
        for name in sorted(self.stack._logs):
            with contextlib.suppress(OSError):
                tail = self.stack.log_path(name).read_text("utf-8", "replace").splitlines()
                out.append(f"--- {name} (last {lines} lines) ---")
                out += tail[-lines:]
        return "\n".join(out)
