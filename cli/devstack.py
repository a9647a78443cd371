"""The development stack: embedded PostgreSQL and Redis when none is configured, then the
Procfile's processes (web, workers, beat, optionally flower) as supervised children.

A child that dies is logged and restarted with backoff; one that keeps dying stops the whole
stack. Stopping the stack stops all it started and removes its temporary files.

The end-to-end tests drive the same class (and ``dar dev`` itself, as a subprocess), so what
they prove is what ``dar dev`` runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from cli.embedded import EmbeddedPostgres, EmbeddedRedis
from db.demo import TicketStore
from db.engine import make_engine
from db.errors import DarError
from db.migrate import upgrade
from runtime.agents import AgentRegistry
from runtime.config import WORKER_CONCURRENCY, WORKER_POOL

log = logging.getLogger(__name__)

WORKER_NAMES = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Children run from the directory that holds our packages, so that a folder called ``api``
# or ``tasks`` in the user's working directory cannot shadow them (gunicorn and celery put
# the working directory first on sys.path).
CODE_ROOT = Path(__file__).resolve().parent.parent
STATE_FILE = "stack.json"


class StackError(DarError):
    """The development stack could not start or keep running."""


def say(message: str) -> None:
    """One line of the supervisor's own, on stdout, flushed (children interleave with it)."""
    print(f"dar: {message}", flush=True)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether binding ``host:port`` fails, as gunicorn's bind would."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE or e.errno == errno.EACCES
    return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # Linux: if `dar dev` itself is SIGKILLed, its children get SIGTERM instead of living on.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _gunicorn_has_control_socket() -> bool:
    # Gunicorn 27's control socket sits at one path per user: two stacks would share it.
    from gunicorn import config  # type: ignore[import-untyped]

    return hasattr(config, "ControlSocketDisable")


def describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


@dataclass
class RestartPolicy:
    """Backoff ``base * 2^(n-1)`` seconds (capped) before the n-th restart in a row; more
    than ``limit`` deaths within ``window`` seconds stops the stack."""

    base: float = 1.0
    cap: float = 10.0
    limit: int = 5
    window: float = 60.0

    def delay(self, deaths_in_window: int) -> float:
        return float(min(self.cap, self.base * 2 ** max(0, deaths_in_window - 1)))


@dataclass
class Supervised:
    """What the supervisor remembers about one child across its restarts."""

    args: list[str]
    extra_env: dict[str, str]
    deaths: list[float] = field(default_factory=list)
    restart_at: float | None = None
    announced_ready: bool = True


@dataclass
class DevStack:
    data_dir: Path = field(default_factory=lambda: Path(".dar"))
    port: int = 8080
    workers: int = 2
    concurrency: int = field(
        default_factory=lambda: int(os.environ.get("DAR_WORKER_CONCURRENCY") or WORKER_CONCURRENCY)
    )
    """Steps per worker process (``DAR_WORKER_CONCURRENCY``; as the Procfile ships it)."""
    pool: str = field(default_factory=lambda: os.environ.get("DAR_WORKER_POOL") or WORKER_POOL)
    """Celery's worker pool (``DAR_WORKER_POOL``): ``gevent`` as shipped (a model call in
    flight costs a greenlet, not a thread: thousands per process), or ``threads``."""
    beat: bool = True
    flower_port: int = 0
    """Run Flower on this port (0: no Flower)."""
    metrics_port_base: int = 0
    """Worker i serves its metrics on base + i; 0 turns the worker endpoints off."""
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    output: IO[bytes] | None = None
    """Where children write; ``None`` inherits this process's stdout/stderr."""
    log_dir: Path | None = None
    """When set (and ``output`` is not), each child writes to ``<log_dir>/<name>.log``."""
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    access_log: bool = False

    database_url: str = ""
    redis_url: str = ""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    """The current process of each child, by name (``web``, ``worker-A``, ``beat``...)."""
    supervised: dict[str, Supervised] = field(default_factory=dict)
    agent: str | None = None
    """An agent the caller will run (``dar demo --agent``): checked by :meth:`preflight`."""
    agents: AgentRegistry | None = None
    """The agents the children will load, checked by :meth:`preflight`."""
    _postgres: EmbeddedPostgres | None = None
    _redis: EmbeddedRedis | None = None
    _run_dir: Path | None = None
    _log_files: list[IO[bytes]] = field(default_factory=list)

    def model_calls_per_worker(self) -> tuple[int, str]:
        """How many model calls one worker process of this stack can hold in flight, and what
        sets that number: its concurrency (a step holds its slot for its whole call), unless
        ``DAR_LLM_THREADS`` (a shared pool) or the open-files hard limit (a socket per call,
        see ``tasks.signals.raise_open_files_limit``) is lower."""
        bounds = [(self.concurrency, f"--concurrency {self.concurrency}")]
        raw = (self.env.get("DAR_LLM_THREADS") or "").strip()
        if raw.isdigit() and int(raw) > 0:
            bounds.append((int(raw), f"DAR_LLM_THREADS={raw}"))
        with contextlib.suppress(ImportError, ValueError, OSError):
            import resource

            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            if hard != resource.RLIM_INFINITY:
                bounds.append((max(0, (hard - 256) // 2), f"open-files hard limit {hard}"))
        calls, why = min(bounds)
        return calls, why

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state_file(self) -> Path:
        return self.data_dir / STATE_FILE

    # -- before anything starts ---------------------------------------------------------

    def check_free(self) -> None:
        """Refuse to start next to another stack: on its port, or on its data."""
        other = running_stack(self.data_dir)
        if other is not None:
            raise StackError(
                f"another `dar dev` (pid {other['pid']}) runs on {self.data_dir}; stop it, "
                "or give this one its own --data-dir"
            )
        if port_in_use(self.port):
            raise StackError(
                f"port {self.port} is in use (another `dar dev`, or another server); "
                f"choose a free one with --port, e.g. --port {self.port + 1}"
            )
        if self.flower_port and port_in_use(self.flower_port):
            raise StackError(
                f"Flower's port {self.flower_port} is in use; choose a free one with --flower-port"
            )
        if self.metrics_port_base:
            busy = [
                p
                for p in (self.metrics_port(WORKER_NAMES[i]) for i in range(self.workers))
                if port_in_use(p)
            ]
            if busy:
                say(
                    f"metrics port(s) {', '.join(map(str, busy))} in use: worker metrics off "
                    "(choose free ones with --metrics-port)"
                )
                self.metrics_port_base = 0

    # -- services -----------------------------------------------------------------------

    def start_services(self) -> None:
        from runtime.engine.preflight import check_database_url

        self.database_url = self.env.get("DATABASE_URL", "")
        if self.database_url:
            check_database_url(self.database_url)
        else:
            self._postgres = EmbeddedPostgres((self.data_dir / "pgdata").resolve())
            self.database_url = self._postgres.start()
            say(f"embedded PostgreSQL at {self.database_url}")
        self.redis_url = self.env.get("REDIS_URL", "")
        if not self.redis_url:
            self._redis = EmbeddedRedis()
            self.redis_url = self._redis.start()
            say(f"embedded Redis at {self.redis_url}")
        engine = make_engine(self.database_url, pool_size=1)
        try:
            upgrade(engine)
            TicketStore(engine).seed()
        finally:
            engine.dispose()

    def preflight(self) -> None:
        """What would make every child fail, checked once here, before any child starts:
        the settings, the API tokens, the agents."""
        from api.auth import TokenSource, check_approval_roles, check_token_roles
        from runtime.config import Settings
        from runtime.engine.preflight import check_agents, unknown_agent_message

        settings = Settings.from_env(self._child_env())
        tokens = TokenSource(settings.api_tokens, settings.api_tokens_file).table
        registry = check_agents(settings)
        check_token_roles(tokens, registry.approval_roles())  # a typo'd role: one line, now
        check_approval_roles(tokens, registry.approval_roles())
        if self.agent is not None and self.agent not in registry:
            raise StackError(unknown_agent_message(self.agent, registry))
        self.agents = registry

    @property
    def agent_names(self) -> list[str]:
        return list(self.agents.names()) if self.agents is not None else []

    # -- processes ----------------------------------------------------------------------

    def _child_env(self, **extra: str) -> dict[str, str]:
        # The user's working directory stays importable (after our packages), so that
        # DAR_AGENT_MODULES can name their own modules.
        path = os.pathsep.join(p for p in (os.getcwd(), self.env.get("PYTHONPATH", "")) if p)
        return {
            **self.env,
            "PYTHONPATH": path,
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "PYTHONUNBUFFERED": "1",
            **extra,
        }

    def ready_file(self, name: str) -> Path | None:
        """The file a worker writes when it is ready (only under :meth:`start`)."""
        if self._run_dir is None or not name.startswith("worker-"):
            return None
        return self._run_dir / f"{name}.ready"

    def is_ready(self, name: str) -> bool:
        if name == "flower" and self.flower_port:
            try:
                socket.create_connection(("127.0.0.1", self.flower_port), timeout=0.5).close()
            except OSError:
                return False
            return True
        path = self.ready_file(name)
        return path is None or path.exists()

    def _stream(self, name: str) -> IO[bytes] | None:
        if self.output is not None:
            return self.output
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            f = (self.log_dir / f"{name}.log").open("ab")
            self._log_files.append(f)
            return f
        return None

    def _spawn(self, name: str, args: list[str], **extra_env: str) -> None:
        self.supervised.setdefault(name, Supervised(args, extra_env))
        ready_file = self.ready_file(name)
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
            extra_env = {**extra_env, "DAR_READY_FILE": str(ready_file)}
        out = self._stream(name)
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", *args],
            env=self._child_env(**extra_env),
            cwd=CODE_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            # Its own process group: a Ctrl-C or a hang-up reaches `dar dev` alone, which
            # stops every child in order (SIGTERM, then SIGKILL after a grace period).
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self._write_state()

    def start_web(self) -> None:
        # One gevent process, like the Procfile: idle or slow clients cost no thread, and its
        # /metrics is the whole truth.
        self._spawn(
            "web",
            [
                "gunicorn",
                "--bind", f"127.0.0.1:{self.port}",
                "--worker-class", "gevent",
                "--workers", "1",
                "--worker-connections", "2000",
                "--keep-alive", "5",
                "--logger-class", "api.gunicorn_logging.Logger",
                *(["--access-logfile", "-"] if self.access_log else []),
                *(["--no-control-socket"] if _gunicorn_has_control_socket() else []),
                "api.wsgi:app",
            ],
        )  # fmt: skip

    def metrics_port(self, letter: str) -> int:
        return self.metrics_port_base + WORKER_NAMES.index(letter) if self.metrics_port_base else 0

    def start_worker(self, letter: str) -> None:
        name = f"worker-{letter}"
        self._spawn(
            name,
            [
                "celery", "--quiet", "-A", "tasks.app", "worker",
                "--pool", self.pool,
                "--concurrency", str(self.concurrency),
                "--hostname", f"{name}@%h",
                "--without-gossip", "--without-mingle",
                "--loglevel", "INFO",
            ],
            DAR_WORKER_NAME=name,
            DAR_METRICS_PORT=str(self.metrics_port(letter)),
            DAR_METRICS_ADDR="127.0.0.1",
        )  # fmt: skip

    def start_beat(self) -> None:
        self._spawn(
            "beat",
            [
                "celery", "--quiet", "-A", "tasks.app", "beat",
                "--schedule", str((self.data_dir / "beat-schedule").resolve()),
                "--loglevel", "INFO",
            ],
        )  # fmt: skip

    def start_flower(self) -> None:
        self._spawn(
            "flower",
            [
                "celery", "--quiet", "-A", "tasks.app", "flower",
                "--address=127.0.0.1", f"--port={self.flower_port}",
            ],
        )  # fmt: skip

    def start(self, timeout: float = 60.0) -> None:
        """Start everything and return when this stack's web answers and every worker is
        ready; raise :class:`StackError` (having started nothing) when it cannot be."""
        self.check_free()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._run_dir = Path(tempfile.mkdtemp(prefix="dar-dev-"))
        self._write_state()
        self.start_services()
        self.preflight()
        self.start_web()
        for i in range(self.workers):
            self.start_worker(WORKER_NAMES[i])
        if self.beat:
            self.start_beat()
        if self.flower_port:
            self.start_flower()
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        web_up = "web" not in self.processes
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise StackError(
                        f"{name} {describe_exit(proc.returncode)} while starting"
                        " (its output above says why)"
                    )
            if not web_up:
                with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                    web_up = self.request("GET", "/healthz")[0] == 200
            if web_up and all(self.is_ready(n) for n in self.processes):
                return
            time.sleep(0.2)
        waiting = [n for n in self.processes if not self.is_ready(n)]
        if not web_up:
            waiting.insert(0, f"web on {self.api_url}")
        raise StackError(f"not ready within {timeout:.0f}s: {', '.join(waiting)}")

    # -- supervision --------------------------------------------------------------------

    def poll(self) -> None:
        """One supervision pass: note children that died, restart those whose backoff is
        over, announce restarted workers once ready. Raises :class:`StackError` when a child
        died more often than the policy allows."""
        now = time.monotonic()
        for name, sup in self.supervised.items():
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is not None:
                del self.processes[name]
                sup.deaths = [t for t in sup.deaths if now - t < self.restart.window]
                sup.deaths.append(now)
                how = describe_exit(proc.returncode)
                if len(sup.deaths) > self.restart.limit:
                    raise StackError(
                        f"{name} (pid {proc.pid}) {how}, its {len(sup.deaths)}th exit within "
                        f"{self.restart.window:.0f}s: giving up"
                    )
                delay = self.restart.delay(len(sup.deaths))
                sup.restart_at = now + delay
                say(f"{name} (pid {proc.pid}) {how}; restarting in {delay:g}s")
            elif proc is None and sup.restart_at is not None and now >= sup.restart_at:
                sup.restart_at = None
                sup.announced_ready = False
                self._spawn(name, sup.args, **sup.extra_env)
                say(f"{name} restarted (pid {self.processes[name].pid})")
            elif proc is not None and not sup.announced_ready and self.is_ready(name):
                sup.announced_ready = True
                say(f"{name} is ready again (pid {proc.pid})")

    def supervise(self, should_stop: Callable[[], bool], interval: float = 0.2) -> None:
        """Keep the children running until ``should_stop()``; raises :class:`StackError`
        when one keeps dying."""
        while not should_stop():
            self.poll()
            time.sleep(interval)

    def _write_state(self) -> None:
        if not self.data_dir.exists():
            return
        state = {
            "pid": os.getpid(),
            "port": self.port,
            "api": self.api_url,
            "processes": {n: p.pid for n, p in self.processes.items()},
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_file)

    # -- using it -----------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.api_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def kill(self, name: str) -> None:
        """SIGKILL one process, as a crash would (:meth:`poll` restarts it)."""
        proc = self.processes[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)

    def stop(self) -> None:
        procs = list(self.processes.values())
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.processes.clear()
        self.supervised.clear()
        for f in self._log_files:
            f.close()
        self._log_files.clear()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
        if self._postgres is not None:
            self._postgres.stop()
            self._postgres = None
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None
        state = read_state(self.data_dir)
        if state is not None and state.get("pid") == os.getpid():
            self.state_file.unlink(missing_ok=True)


def read_state(data_dir: Path) -> dict[str, Any] | None:
    try:
        state: dict[str, Any] = json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state


def running_stack(data_dir: Path) -> dict[str, Any] | None:
    """The state of the `dar dev` running on ``data_dir``, if one runs (not this process)."""
    state = read_state(data_dir)
    if state is None or state.get("pid") == os.getpid() or not pid_alive(int(state["pid"])):
        return None
    return state
