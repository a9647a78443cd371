"""The pytest plugin's old path (``pytest_plugins = ["runtime.pytest_plugin"]``), kept: the
fixtures live in :mod:`runtime.testing.pytest_plugin`."""

from runtime.testing.pytest_plugin import durable as durable
from runtime.testing.pytest_plugin import fake_model as fake_model

__all__ = ["durable", "fake_model"]
