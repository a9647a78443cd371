"""The test tiers: plain `pytest` is the fast tier (unit and integration), `pytest --all` is
every test, and CI runs the README's test command, which is `pytest --all`."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import FULL_ONLY_TIERS

ROOT = Path(__file__).resolve().parents[2]
SLOW_TIERS = " or ".join(FULL_ONLY_TIERS)


def _nodeid(text: str) -> str:
    """A test id without its parameters (some are random uuids)."""
    return re.sub(r"\[.*\]$", "", text)


class _Seen:
    """A plugin of one collection: the ids it kept and how many it deselected."""

    def __init__(self) -> None:
        self.ids: Counter[str] = Counter()
        self.deselected = 0

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected += len(items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.ids = Counter(_nodeid(item.nodeid) for item in session.items)


@contextmanager
def _in(folder: Path) -> Iterator[None]:
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _collect(*args: str) -> tuple[Counter[str], int]:
    """Test ids collected by a `pytest` given ``args`` in the checkout's root, and how many
    it deselected. In this process (``pytest.main``, what the `pytest` command runs): the
    test modules this session imported are not imported again, so under CI's `pytest --all`
    (every module imported already) a collection takes seconds, where a `pytest
    --collect-only` subprocess importing them all took ~55 s of CI's loaded minutes."""
    seen = _Seen()
    with _in(ROOT):
        code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args], [seen])
    assert code == pytest.ExitCode.OK, f"pytest {' '.join(args)}: {code!r} (output above)"
    return seen.ids, seen.deselected


def _whole_suite_here(session: pytest.Session) -> bool:
    """Whether this session collected every test file (a `pytest --all` with no filter): then
    its own items are the whole suite, and no second collection is needed to know it."""
    config = session.config
    if not config.getoption("--all") or config.option.markexpr or config.option.keyword:
        return False
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    seen = {item.nodeid.split("::")[0] for item in session.items}
    return files <= seen


@pytest.mark.slow  # collections of the whole suite: the first one imports every test module
@pytest.mark.timeout(900)
def test_all_runs_every_test_and_plain_pytest_leaves_out_only_the_slow_tiers(
    request: pytest.FixtureRequest,
) -> None:
    session = request.session
    if _whole_suite_here(session):  # CI's `pytest --all`: its items are everything
        everything = Counter(_nodeid(item.nodeid) for item in session.items)
        slow = Counter(
            _nodeid(item.nodeid)
            for item in session.items
            if any(item.get_closest_marker(t) for t in FULL_ONLY_TIERS)
        )
    else:
        everything, deselected = _collect("--all")
        assert deselected == 0
        slow, _ = _collect("--all", "-m", SLOW_TIERS)
    fast, _ = _collect()
    assert fast + slow == everything
    assert not fast & slow
    assert any(t.startswith("tests/unit/") for t in fast)
    assert any(t.startswith("tests/integration/") for t in fast)
    for folder in ("tests/e2e/", "tests/chaos/"):
        assert not [t for t in fast if t.startswith(folder)], folder
        assert [t for t in slow if t.startswith(folder)], folder


def _two_commands(text: str) -> str:
    return text.split("## The two commands", 1)[1].split("```", 2)[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    block = _two_commands(readme)
    # the site's "Try it" page shows the same two commands, word for word
    assert _two_commands((ROOT / "docs" / "try" / "index.md").read_text()) == block
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:]]
    test_command = next(c for c in commands if c.startswith("pytest"))
    assert test_command == "pytest --all"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(test_command)}$", ci, re.MULTILINE), "CI runs it verbatim"


def test_the_longest_files_named_for_the_suite_order_exist() -> None:
    """A renamed or deleted file left in LONGEST_FILES silently stops being handed out first."""
    from tests.conftest import LONGEST_FILES

    root = Path(__file__).resolve().parents[2]
    missing = [name for name in LONGEST_FILES if not (root / name).is_file()]
    assert missing == [], missing
    assert len(set(LONGEST_FILES)) == len(LONGEST_FILES), "a file named twice"
