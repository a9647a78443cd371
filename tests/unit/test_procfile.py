"""compose.yaml runs the Procfile's processes with the same commands."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from tests.docs_pages import page

ROOT = Path(__file__).resolve().parents[2]


def _procfile() -> dict[str, str]:
    entries = {}
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, command = line.partition(":")
            entries[name.strip()] = command.strip()
    return entries


def _compose_command(service: dict[str, object]) -> str:
    command = service["command"]
    assert isinstance(command, list)
    if command[:2] == ["sh", "-c"]:
        return str(command[2]).replace("$$", "$")
    return shlex.join(str(c) for c in command)


def test_procfile_names_the_processes_users_script_against() -> None:
    assert set(_procfile()) == {"release", "web", "worker", "beat", "flower"}


def test_compose_runs_the_same_commands_as_the_procfile() -> None:
    procfile = _procfile()
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    mapping = {"release": "migrate", "web": "web", "worker": "worker", "beat": "beat"}
    mapping["flower"] = "flower"
    for proc, service in mapping.items():
        assert _compose_command(services[service]) == procfile[proc], proc
    for service in mapping.values():
        env = services[service]["environment"]
        assert {"DATABASE_URL", "REDIS_URL", "ANTHROPIC_API_KEY"} <= set(env), service


def test_web_serves_with_gevent_and_a_header_deadline() -> None:
    """Issue 12.1: an idle connection costs a greenlet, not one of a few threads."""
    web = _procfile()["web"]
    assert "--worker-class gevent" in web
    assert "--keep-alive" in web
    assert "--threads" not in web


def test_listeners_are_local_or_authenticated() -> None:
    """Issue 12.6: Flower binds loopback unless told otherwise; compose gives it a password
    and publishes it on loopback only; compose refuses to publish an API without tokens;
    worker metrics bind loopback unless the Procfile/compose say otherwise."""
    from runtime.config import Settings

    assert "--address=${FLOWER_ADDRESS:-127.0.0.1}" in _procfile()["flower"]
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert services["web"]["environment"]["DAR_API_TOKENS"].startswith("${DAR_API_TOKENS:?")
    flower = services["flower"]
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    assert all(str(p).startswith("127.0.0.1:") for p in flower["ports"])
    assert Settings().metrics_addr == "127.0.0.1"
    assert Settings.from_env({}).metrics_addr == "127.0.0.1"


def test_the_worker_defaults_are_defined_once_and_shipped_everywhere() -> None:
    """Issue 26.4: the Procfile, compose.yaml, `dar dev`, the bench and the docs (configuration,
    processes, capacity planning) run the worker with the same pool and concurrency: those of
    runtime.config."""
    from cli.devstack import DevStack
    from runtime.config import WORKER_CONCURRENCY, WORKER_POOL

    assert (WORKER_POOL, WORKER_CONCURRENCY) == ("gevent", 2000)
    pool = f"--pool ${{DAR_WORKER_POOL:-{WORKER_POOL}}}"
    concurrency = f"--concurrency ${{DAR_WORKER_CONCURRENCY:-{WORKER_CONCURRENCY}}}"
    worker = _procfile()["worker"]
    assert pool in worker
    assert concurrency in worker
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    assert _compose_command(services["worker"]) == worker
    # `dar dev` reads DAR_WORKER_* from the environment, as the Procfile's shell does
    with pytest.MonkeyPatch.context() as env:
        env.delenv("DAR_WORKER_POOL", raising=False)
        env.delenv("DAR_WORKER_CONCURRENCY", raising=False)
        stack = DevStack(env={})
        assert (stack.pool, stack.concurrency) == (WORKER_POOL, WORKER_CONCURRENCY)
        env.setenv("DAR_WORKER_POOL", "threads")
        env.setenv("DAR_WORKER_CONCURRENCY", "32")
        assert (DevStack(env={}).pool, DevStack(env={}).concurrency) == ("threads", 32)
    bench = (ROOT / "bench" / "suite.py").read_text()
    assert "concurrency=WORKER_CONCURRENCY" in bench
    assert "pool=WORKER_POOL" in bench
    configuration = page("reference/configuration.md")
    assert f"`DAR_WORKER_POOL` | `{WORKER_POOL}`" in configuration
    assert f"`DAR_WORKER_CONCURRENCY` | `{WORKER_CONCURRENCY}`" in configuration
    assert f"--pool ${{DAR_WORKER_POOL:-{WORKER_POOL}}}" in page("operate/processes.md")
    assert f"--pool {WORKER_POOL} --concurrency {WORKER_CONCURRENCY}" in page("operate/capacity.md")
    assert f"else {WORKER_CONCURRENCY})" in (ROOT / "cli" / "main.py").read_text(), "dar dev -h"
