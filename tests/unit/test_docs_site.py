"""The documentation site (``mkdocs.yml``, ``docs/``) and the short README.

- The site builds with ``mkdocs build --strict``: a broken link or anchor, a page left out of
  the navigation, a Python reference (mkdocstrings) that no longer resolves fails.
- The README stays a front page (at most 300 lines) whose links all lead somewhere.
- The reference tables follow the code both ways: configuration <-> ``runtime.config``,
  REST <-> the OpenAPI document, CLI <-> ``dar``'s parser, metrics <-> the metrics module.
  (The crash table, the module map and the worker defaults have their own tests:
  test_crash_table, test_layers, test_procfile.)
- Every Python example parses, and what it imports from the runtime exists.
- Every command line printed in the docs is accounted for: run as printed by a test, or
  named here as one that needs a running stack or is not run (an installer, a long job).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs_pages import DOCS, README, ROOT, command_lines, page, pages, table_rows

README_MAX_LINES = 300


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).with_name("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "python" / "durable" / "index.html").exists()
    built = (tmp_path / "site" / "reference" / "python" / "durable" / "index.html").read_text()
    assert "durable_agent" in built, "mkdocstrings rendered the Python API"
    assert not (tmp_path / "site" / "_incoming").exists(), "drafts are not published"


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"{len(lines)} lines: move detail into docs/"


def _heading_slugs(text: str) -> set[str]:
    slugs = set()
    fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        match = re.match(r"#+ (.*)", line)
        if match and not fence:
            title = re.sub(r"[^\w\- ]", "", match.group(1).replace("`", "").strip().lower())
            slugs.add(re.sub(r"\s+", "-", title))
    return slugs


def test_the_readme_links_lead_somewhere() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/") for link in local), "the README links into the site"
    for link in local:
        target, _, anchor = link.partition("#")
        path = ROOT / target if target else README
        assert path.exists(), link
        if anchor:
            assert anchor in _heading_slugs(path.read_text()), link


def test_the_site_serves_with_one_documented_command() -> None:
    assert "mkdocs serve" in README.read_text()
    assert "mkdocs serve" in page("index.md")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert "_incoming/" in config["exclude_docs"], "drafts in docs/_incoming/ stay out of the site"
    plugins = {p if isinstance(p, str) else next(iter(p)) for p in config["plugins"]}
    # Material's plugins that fetch from the internet at build time (fonts, images, cards)
    assert not plugins & {"social", "privacy", "optimize"}, "the site must build offline"
    assert config["theme"]["font"] is False, "no web fonts: nothing downloaded"


# --- the reference tables against the code ---------------------------------------------


def _config_variables() -> set[str]:
    """Every environment variable ``runtime.config`` reads."""
    source = (ROOT / "runtime" / "config.py").read_text()
    return set(
        re.findall(r'"((?:DAR|WEB|FLOWER|ANTHROPIC)_[A-Z_]+|DATABASE_URL|REDIS_URL)"', source)
    )


def _table_variables() -> set[str]:
    rows = table_rows(page("reference/configuration.md"), "| variable |")
    return {name for row in rows for name in re.findall(r"`([A-Z][A-Z_]+)`", row[0])}


def test_every_setting_is_in_the_configuration_table() -> None:
    missing = _config_variables() - _table_variables()
    assert not missing, f"document these in docs/reference/configuration.md: {sorted(missing)}"


def test_every_variable_in_the_configuration_table_is_read_somewhere() -> None:
    code = "\n".join(
        path.read_text()
        for folder in ("runtime", "api", "cli", "tasks", "db")
        for path in (ROOT / folder).rglob("*.py")
    )
    code += (ROOT / "Procfile").read_text() + (ROOT / "compose.yaml").read_text()
    unread = {name for name in _table_variables() if name not in code}
    assert not unread, f"documented but read nowhere: {sorted(unread)}"


def _defined_metrics() -> dict[str, str]:
    """Every ``dar_*`` metric the runtime defines, by its exposed name (counters end
    ``_total``), with its kind."""
    source = (ROOT / "runtime" / "observe" / "metrics.py").read_text()
    found = {}
    for kind, name in re.findall(
        r"\b(Counter|Gauge|Histogram|GaugeMetricFamily)\(\s*\"(dar_\w+)\"", source
    ):
        found[name + ("_total" if kind == "Counter" else "")] = kind
    return found


def test_the_metrics_table_and_the_runtime_name_the_same_metrics() -> None:
    rows = table_rows(page("operate/metrics.md"), "| metric |")
    listed = {name for row in rows for name in re.findall(r"`(dar_\w+)`", row[0])}
    defined = _defined_metrics()
    assert len(defined) >= 10, "the metrics module was read"
    missing = set(defined) - listed
    assert not missing, f"document these in docs/operate/metrics.md: {sorted(missing)}"
    # prometheus-flask-exporter's, prefixed "dar" in api/app.py
    unknown = listed - set(defined) - {"dar_http_request_duration_seconds"}
    assert not unknown, f"metrics in the docs that nothing defines: {sorted(unknown)}"


def _normal(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path.split("?")[0])


def test_the_rest_table_and_the_openapi_document_list_the_same_routes() -> None:
    from api.openapi import openapi_document

    document = openapi_document()
    documented: dict[tuple[str, str], set[str]] = {}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if method in {"get", "post", "put", "patch", "delete"}:
                query = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
                documented[(method.upper(), _normal(path))] = query
    text = page("reference/rest-api.md")
    rows = table_rows(text, "| method and path |")
    listed: dict[tuple[str, str], set[str] | None] = {}
    for row in rows:
        for method, path in re.findall(r"`(GET|POST|PUT|PATCH|DELETE) ([^`]+)`", row[0]):
            query = None
            if "?" in path:
                query = {q.split("=")[0] for q in path.split("?", 1)[1].split("&")}
            listed[(method, _normal(path))] = query
    assert "`/api/openapi.json`" in text
    listed[("GET", "/api/openapi.json")] = None
    assert set(listed) - set(documented) == set(), "routes in the docs the API does not have"
    assert set(documented) - set(listed) == set(), "routes missing from docs/reference/rest-api.md"
    for route, query in listed.items():
        if query is not None:
            assert query == documented[route], f"{route}: the docs list {query}"


def _dar_parsers() -> dict[str, argparse.ArgumentParser]:
    from cli.main import build_parser

    top = build_parser()
    (sub,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    return {"": top, **sub.choices}


def test_the_cli_table_and_dar_have_the_same_commands_and_options() -> None:
    parsers = _dar_parsers()
    rows = table_rows(page("reference/cli.md"), "| command |")
    first_cells = " ".join(row[0] for row in rows)
    shown = set(re.findall(r"`dar ([a-z][a-z-]*)", first_cells))
    assert shown - set(parsers) == set(), "commands in the docs that dar does not have"
    assert set(parsers) - {""} - shown == set(), "commands missing from docs/reference/cli.md"
    options: set[str] = set()
    for parser in parsers.values():
        for action in parser._actions:
            options.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    for a in child._actions:
                        options.update(a.option_strings)
    unknown = set(re.findall(r"(--[a-z][a-z-]*)", first_cells)) - options
    assert not unknown, f"options in docs/reference/cli.md that dar does not take: {unknown}"


# --- every command line printed in the docs ---------------------------------------------

# Run as printed, by tests/e2e/test_readme_commands.py (a fresh clone, the test services).
RUN_AS_PRINTED = {("dar", "demo"), ("dar", "token")}
# The site's own build: test_the_site_builds_in_strict_mode above.
BUILT_HERE = {("mkdocs", "build")}
# Need a running `dar dev` (or another stack): the walkthrough is test_dar_dev.py, the API
# and CLI calls are the integration tests of each route and command.
NEEDS_A_STACK = {"curl", "kill", "dar"}
# Not run by a test: installers, the dev server, the test runner, containers, benchmarks.
NOT_RUN = {"pip", "python3", "mkdocs", "pytest", "docker", "python"}


def _words(line: str) -> list[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return ["<continued>"]
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    return words


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_line_of_the_docs_is_accounted_for(path: Path) -> None:
    for line in command_lines(path):
        words = _words(line)
        if words == ["<continued>"] or line.startswith('"'):
            continue  # a JSON body a curl above spread over lines
        pair = tuple(words[:2])
        assert (
            pair in RUN_AS_PRINTED
            or pair in BUILT_HERE
            or words[0] in NEEDS_A_STACK
            or words[0] in NOT_RUN
        ), f"{path.relative_to(ROOT)}: run {line!r} in a test, or name it in this file"
        if words[0] == "dar":
            assert words[1] in _dar_parsers(), f"{line!r}: dar has no command {words[1]!r}"


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_example_parses_and_imports_what_exists(path: Path) -> None:
    """A renamed or removed public name breaks the example that imports it, here."""
    for body in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
        tree = ast.parse(body)  # a SyntaxError names the page
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] not in {"runtime", "tasks", "api", "db", "cli"}:
                    continue
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{path.name}: {node.module}.{alias.name}"


def test_the_pages_exist_where_the_navigation_says() -> None:
    nav = re.findall(r":\s+([\w/.-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert nav, "mkdocs.yml has a navigation"
    for name in nav:
        assert (DOCS / name).exists(), name
