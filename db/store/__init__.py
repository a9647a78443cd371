"""The store: the only code that executes SQL against the run tables.

Every method is one named statement from ``queries.sql`` (or a few in one transaction).
Writes made by a worker after claiming are fenced on (holder, lease epoch) and raise
:class:`LeaseLost`, rolling the transaction back, when the worker no longer holds the run.

The store is split by who calls it: :mod:`db.store.worker` (a worker holding a run's lease),
:mod:`db.store.api` (the REST API), :mod:`db.store.sweeps` (the beat and the gauges), on
:mod:`db.store.base` (what they share). :class:`RunStore` is all of them, as one object.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from sqlalchemy.exc import DataError

from db.errors import DatabaseUnavailable, ValueRefused, database_unavailable
from db.store.api import ApiStore
from db.store.base import COMPENSABLE_KINDS, MESSAGE_SIGNAL, SendLimits, SubmitQuota
from db.store.sweeps import SweepStore
from db.store.worker import WorkerStore

__all__ = [
    "COMPENSABLE_KINDS",
    "MESSAGE_SIGNAL",
    "RunStore",
    "SendLimits",
    "SubmitQuota",
]


class RunStore(WorkerStore, ApiStore, SweepStore):
    """All reads and writes of runs and steps."""


P = ParamSpec("P")
R = TypeVar("R")


def _translating(method: Callable[P, R]) -> Callable[P, R]:
    """``method`` raising :class:`DatabaseUnavailable` (from the driver's error) when the
    database is away, :class:`ValueRefused` when it refused a value; every other error as
    it is."""

    @functools.wraps(method)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except (DatabaseUnavailable, ValueRefused):
            raise
        except DataError as e:  # bad data, refused every time: not worth a retry
            raise ValueRefused.from_error(e) from e
        except Exception as e:
            if database_unavailable(e):
                raise DatabaseUnavailable.from_error(e) from e
            raise

    return call


# Database errors are translated once, here: every public method of the store raises
# DatabaseUnavailable when the database is away and ValueRefused when it refused a value, so
# the engine and the API above never classify a driver's exception.
for _name, _member in inspect.getmembers(RunStore, inspect.isfunction):
    if not _name.startswith("_") and inspect.isfunction(_member):
        setattr(RunStore, _name, _translating(_member))
