"""The layers point down (cli -> api -> tasks -> runtime -> db, and the folders of runtime/),
no package has an import circle, and the engine imports no Flask or Celery: the import-linter
contracts in pyproject.toml, checked on every test run. The module map of the docs ("How it
works", docs/try/how-it-works.md) names every package and folder, in the contract's order."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.docs_pages import page

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    result = subprocess.run(
        [lint, str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken" in result.stdout


# The old paths kept as aliases: not folders of their own, so not on the map.
ALIASES = {"testkit.py", "pytest_plugin.py"}


def _module_map() -> str:
    text = page("try/how-it-works.md")
    section = text[text.index("## Module map") :]
    return section[section.index("```") + 3 : section.index("```", section.index("```") + 3)]


def _runtime_layers() -> list[list[str]]:
    """The contract's layers of runtime/, top first; names sharing a layer in one list."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (inner,) = [c for c in contracts if c.get("containers") == ["runtime"]]
    return [[name.strip() for name in layer.split("|")] for layer in inner["layers"]]


def test_the_module_map_names_every_package_and_module() -> None:
    text = _module_map()
    listed = set(re.findall(r"([a-z_]+)/", text)) | set(re.findall(r"\b([a-z_]+)\.py\b", text))
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench", "examples"}
    folders = {p.parent.name for p in (ROOT / "runtime").glob("*/__init__.py")}
    modules = {
        p.stem for p in (ROOT / "runtime").glob("*.py") if p.name not in ALIASES | {"__init__.py"}
    }
    assert packages - listed == set(), "add these packages to the module map"
    assert folders - listed == set(), "add these folders of runtime/ to the module map"
    assert modules - listed == set(), "add these modules of runtime/ to the module map"
    for name in re.findall(r"^\s*([a-z_]+)/", text, re.M):
        assert any((ROOT / parent / name).is_dir() for parent in ("", "runtime", "db")), name


def test_the_module_map_lists_runtime_in_the_contracts_order() -> None:
    text = _module_map()
    runtime_part = text[text.index("\nruntime/") : text.index("\ndb/")]
    order = [m.group(1) for m in re.finditer(r"(?<![\w/.])([a-z_]+)(?:/|\.py)", runtime_part)]
    layers = _runtime_layers()
    missing = {name for layer in layers for name in layer} - set(order)
    assert missing == set(), f"the module map lacks {missing}"
    spans = [[order.index(name) for name in layer] for layer in layers]
    for upper, lower, names in zip(spans, spans[1:], layers[1:], strict=False):
        assert max(upper) < min(lower), f"{names} is listed above a layer that imports it"
