"""Startup that tells the truth: a taken port, a broken setting or an unknown agent stops
``dar dev`` (and a worker) at once, with exit status 1 and one line naming the fix; the
supervisor restarts a child that dies and gives up on one that keeps dying."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cli.devstack import DevStack, RestartPolicy, StackError
from cli.embedded import free_port
from runtime.config import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

DAR = str(Path(sys.executable).with_name("dar"))
ROOT = Path(__file__).resolve().parents[2]


def _env(database_url: str, redis_url: str, settings: Settings, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "DAR_QUEUE": settings.queue,
        "ANTHROPIC_API_KEY": "",
        **extra,
    }


def _dar(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DAR, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=90
    )


def test_a_taken_port_is_named_with_the_fix_and_nothing_starts(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = _dar(["dev", "--port", str(port)], {**os.environ}, tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        f"dar: port {port} is in use (another `dar dev`, or another server); "
        f"choose a free one with --port, e.g. --port {port + 1}\n"
    )
    assert result.stdout == "", "no embedded server, no worker was started"
    assert not (tmp_path / ".dar").exists()


def test_a_second_dar_dev_on_the_same_data_is_refused(tmp_path: Path) -> None:
    (tmp_path / ".dar").mkdir()
    (tmp_path / ".dar" / "stack.json").write_text(
        json.dumps({"pid": os.getpid(), "port": 1, "api": "", "processes": {}})
    )
    result = _dar(["dev", "--port", str(free_port())], {**os.environ}, tmp_path)
    assert result.returncode == 1
    assert result.stderr == (
        f"dar: another `dar dev` (pid {os.getpid()}) runs on .dar; stop it, or give this "
        "one its own --data-dir\n"
    )


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (
            {"DATABASE_URL": "postgres//nope"},
            "dar: DATABASE_URL does not parse as a PostgreSQL URL: expected "
            "postgresql://user:password@host:5432/dbname",
        ),
        (
            {"DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/db"},
            "dar: DATABASE_URL does not connect to 127.0.0.1:1/db (connection failed: "
            'connection to server at "127.0.0.1", port 1 failed: Connection refused): '
            "expected postgresql://user:password@host:5432/dbname of a running PostgreSQL",
        ),
        (
            {"DAR_API_TOKENS": "ci:read"},
            "dar: DAR_API_TOKENS entry 'ci' must be name:role+role:sha256hex, optionally "
            "followed by :tenant and :expires=YYYY-MM-DD (make one with `dar token new NAME "
            "--roles read,submit`)",
        ),
        (
            {"DAR_API_TOKENS": f"ci:sumbit:{'0' * 64}"},
            "dar: DAR_API_TOKENS entry 'ci' names the unknown role 'sumbit' (did you mean "
            "'submit'?): roles are read, submit, cancel, approve, metrics, admin, or an "
            "approval role a durable function declares (none declared)",
        ),
        (
            {"DAR_AGENT_MODULES": "nowhere.agents"},
            "dar: DAR_AGENT_MODULES names 'nowhere.agents', which fails to import: No module "
            "named 'nowhere' (start the process in the directory that holds it, or add it to "
            "PYTHONPATH)",
        ),
        (
            {"DAR_DEFAULT_AGENT": "nope"},
            "dar: DAR_DEFAULT_AGENT is 'nope', which is not registered; known agents: "
            "acme-tickets; register it with DAR_AGENT_MODULES=your.module",
        ),
    ],
    ids=["url-parse", "url-connect", "tokens", "role-typo", "agent-module", "default-agent"],
)
def test_a_broken_setting_is_one_line_and_no_process_starts(
    database_url: str,
    redis_url: str,
    settings: Settings,
    tmp_path: Path,
    setting: dict[str, str],
    expected: str,
) -> None:
    env = _env(database_url, redis_url, settings, **setting)
    result = _dar(["dev", "--port", str(free_port()), "--metrics-port", "0"], env, tmp_path)
    assert result.returncode == 1, result.stdout
    assert result.stderr == expected + "\n"
    assert "hunter2" not in result.stderr
    assert "worker" not in result.stdout.replace("DAR_", "")


def test_dar_demo_names_an_unknown_agent_and_how_to_register_one(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> None:
    env = _env(database_url, redis_url, settings)
    result = _dar(
        ["demo", "--agent", "orders", "--port", str(free_port()), "--metrics-port", "0"],
        env,
        tmp_path,
    )
    assert result.returncode == 1
    assert result.stderr == (
        "dar: unknown agent 'orders'; known agents: acme-tickets. Register your own with "
        "DAR_AGENT_MODULES=your.module (a module with register(registry))\n"
    )


def _worker_line() -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith("worker:"):
            return line.partition(":")[2].strip()
    raise AssertionError("no worker line in the Procfile")


def _procfile_worker(env: dict[str, str]) -> subprocess.Popen[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.Popen(
        ["sh", "-c", _worker_line()],
        cwd=ROOT,
        env={**env, "PATH": path, "DAR_METRICS_PORT": "0", "DAR_WORKER_CONCURRENCY": "2"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def test_a_worker_with_a_broken_configuration_exits_non_zero_at_start(
    database_url: str, redis_url: str, settings: Settings
) -> None:
    proc = _procfile_worker(_env(database_url, redis_url, settings, DAR_DEFAULT_AGENT="nope"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, out
    assert out.splitlines()[-1] == (
        "dar: worker cannot start: DAR_DEFAULT_AGENT is 'nope', which is not registered; "
        "known agents: acme-tickets; register it with DAR_AGENT_MODULES=your.module"
    )
    assert "Traceback" not in out
    assert "ready." not in out


def test_the_procfile_worker_loads_the_readmes_example_agents(
    database_url: str, redis_url: str, settings: Settings
) -> None:
    env = _env(database_url, redis_url, settings, DAR_AGENT_MODULES="examples.orders_agent")
    proc = _procfile_worker(env)
    assert proc.stdout is not None
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.rstrip().endswith("ready."):
                break
        assert proc.poll() is None, "".join(lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=30)


def _stack(tmp_path: Path, policy: RestartPolicy) -> DevStack:
    return DevStack(data_dir=tmp_path, restart=policy, env={**os.environ})


def test_the_supervisor_restarts_a_killed_child(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = _stack(tmp_path, RestartPolicy(base=0.1))
    try:
        stack._spawn("sleeper", ["tests.e2e.child", "sleep"])
        first = stack.processes["sleeper"].pid
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while "sleeper" not in stack.processes or stack.processes["sleeper"].pid == first:
            assert time.monotonic() < deadline
            stack.poll()
            time.sleep(0.05)
        assert stack.processes["sleeper"].poll() is None
    finally:
        stack.stop()
    out = capsys.readouterr().out
    assert f"dar: sleeper (pid {first}) was killed by SIGKILL; restarting in 0.1s\n" in out
    assert "dar: sleeper restarted (pid " in out


def test_the_supervisor_gives_up_on_a_child_that_keeps_dying(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = _stack(tmp_path, RestartPolicy(base=0.05, limit=3, window=60))
    try:
        stack._spawn("crasher", ["tests.e2e.child", "exit", "3"])
        deadline = time.monotonic() + 30
        error: StackError | None = None
        while error is None and time.monotonic() < deadline:
            try:
                stack.poll()
            except StackError as e:
                error = e
            time.sleep(0.05)
    finally:
        stack.stop()
    out = capsys.readouterr().out
    assert out.count("exited with status 3; restarting in") == 3
    for delay in ("0.05s", "0.1s", "0.2s"):  # backoff doubles
        assert f"restarting in {delay}" in out
    assert error is not None, "it never gave up"
    assert re.fullmatch(
        r"crasher \(pid \d+\) exited with status 3, its 4th exit within 60s: giving up",
        str(error),
    )


def test_flower_runs_under_dar_dev_on_the_embedded_broker(
    database_url: str, redis_url: str, settings: Settings, tmp_path: Path
) -> None:
    port, flower = free_port(), free_port()
    env = _env(database_url, redis_url, settings)
    proc = subprocess.Popen(
        [DAR, "dev", "--port", str(port), "--metrics-port", "0", "--workers", "1",
         "--flower", "--flower-port", str(flower)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out = ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out += line
            if "dar: the stack is up" in line:
                break
        with urllib.request.urlopen(f"http://127.0.0.1:{flower}/healthcheck", timeout=5) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        out += proc.stdout.read()  # not communicate(): it would skip what the loop buffered
        proc.stdout.close()
    assert proc.returncode == 0, out
    assert f"Flower:     http://127.0.0.1:{flower}" in out
