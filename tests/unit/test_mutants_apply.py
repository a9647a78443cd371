"""The mutation audit (``python -m tests.mutants``) is not run in CI, so a mutant whose code
moved on went stale unseen: four had, each a guarantee no longer audited. This checks, in
milliseconds, that every mutant's patch still applies (its text is in its file exactly once)
and that the tests it names exist, so the audit stays runnable as the code changes."""

from __future__ import annotations

import pytest

from tests.mutants import MUTANTS, ROOT


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_each_mutants_patch_applies_and_its_tests_exist(mutant) -> None:  # type: ignore[no-untyped-def]
    source = (ROOT / mutant.path).read_text()
    assert source.count(mutant.old) == 1, (
        f"{mutant.name}: its patch's text is not in {mutant.path} exactly once; "
        "update the mutant with the code"
    )
    assert mutant.old != mutant.new
    for test in mutant.tests:
        path, _, name = test.partition("::")
        assert (ROOT / path).exists(), f"{mutant.name}: {path} does not exist"
        if name:
            assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), (
                f"{mutant.name}: {path} has no test {name}"
            )


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
