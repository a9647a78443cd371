"""Pytest fixtures for the durable-function test kit: ``pytest_plugins =
["runtime.testing.pytest_plugin"]``. Needs a ``runtime`` fixture of your own (a ``Runtime`` on a
test database); provides ``fake_model`` and ``durable`` (a :class:`DurableTester`)."""

from __future__ import annotations

import pytest

from runtime.engine.bootstrap import Runtime
from runtime.testing.testkit import DurableTester, FakeModel


@pytest.fixture
def fake_model() -> FakeModel:
    return FakeModel()


@pytest.fixture
def durable(runtime: Runtime, fake_model: FakeModel) -> DurableTester:
    return DurableTester(runtime, fake_model)
