"""compose.yaml runs the Procfile's processes with the same commands."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

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
