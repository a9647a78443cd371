"""`dar dev` says how many model calls a worker can hold in flight (issue 36): its
concurrency, unless a shared pool (DAR_LLM_THREADS) or the open-files limit is lower."""

from __future__ import annotations

import resource

import pytest

from cli.devstack import DevStack
from cli.main import _banner
from runtime.config import WORKER_CONCURRENCY


@pytest.fixture(autouse=True)
def _roomy_open_files(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 1_048_576))


def test_a_shipped_worker_holds_as_many_calls_as_its_concurrency() -> None:
    stack = DevStack(env={}, concurrency=WORKER_CONCURRENCY)
    assert stack.model_calls_per_worker() == (
        WORKER_CONCURRENCY,
        f"--concurrency {WORKER_CONCURRENCY}",
    )
    assert f"{WORKER_CONCURRENCY:,} model calls in flight per worker" in _banner(stack)
    assert f"{2 * WORKER_CONCURRENCY:,} in all" in _banner(stack)


def test_a_pool_or_the_open_files_limit_below_the_concurrency_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pooled = DevStack(env={"DAR_LLM_THREADS": "64"}, concurrency=2000)
    assert pooled.model_calls_per_worker() == (64, "DAR_LLM_THREADS=64")
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert DevStack(env={}, concurrency=2000).model_calls_per_worker() == (
        1920,
        "open-files hard limit 4096",
    )
