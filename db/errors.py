"""The project's exceptions. One root for ordinary errors; lease loss is a BaseException.

Each class's docstring is its default message.
"""

from __future__ import annotations


class DarError(Exception):
    """Durable Agent Runtime error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class RunNotFound(DarError):
    """No run with this id."""


class InvalidTransition(DarError):
    """The run is not in a state that allows this."""


class IdempotencyConflict(DarError):
    """This Idempotency-Key was used before with a different request body."""


class TooManyPending(DarError):
    """The run holds as many undelivered messages and signals as it may
    (``DAR_MAX_PENDING_PER_RUN``): one more waits until it reads some."""


class QuotaExceeded(DarError):
    """A submitter's quota (submits per minute, runs in flight) is used up."""

    def __init__(self, message: str, *, retry_after: float, limit: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.limit = limit
        """``DAR_SUBMIT_RATE_PER_MINUTE`` or ``DAR_TOKEN_MAX_ACTIVE_RUNS``."""


class MigrationsPending(DarError):
    """The database schema is not at the current migration."""


class LeaseLost(BaseException):
    """This worker no longer holds the run's lease: another worker has taken it over.

    A ``BaseException`` so that no ``except Exception`` in user code (a tool, a durable
    function) can swallow it: the step must be abandoned without writing.
    """

    def __init__(self, run_id: object, detail: str = "") -> None:
        self.run_id = run_id
        msg = f"lease on run {run_id} lost"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class DatabaseUnavailable(DarError):
    """The database is not answering (a restart, a dropped or refused connection); the call
    may be tried again.

    What :class:`~db.store.RunStore` raises, in place of the driver's error (its
    ``__cause__``), whenever the database is away: the store classifies, once
    (:func:`database_unavailable`), and the engine only catches this class. Any other database
    error (bad data, a constraint, a bug) comes out as it is.
    """

    @classmethod
    def from_error(cls, e: BaseException) -> DatabaseUnavailable:
        """This error for the driver's ``e``: its kind and first line, never the statement or
        its parameters (they may quote a prompt)."""
        orig = getattr(e, "orig", None) or e
        first = (str(orig).strip().splitlines() or [""])[0][:200]
        error = cls(f"the database is not answering ({type(orig).__name__}: {first})")
        error.__cause__ = e
        return error


class ValueRefused(DarError):
    """The database refused a value (bad data, not a blip): the same value is refused every
    time, so trying again cannot help.

    What :class:`~db.store.RunStore` raises in place of the driver's ``DataError`` (its
    ``__cause__``): the store translates database errors, once; above it, catch this.
    """

    @classmethod
    def from_error(cls, e: BaseException) -> ValueRefused:
        """This error for the driver's ``e``: its kind and first line, never the statement or
        its parameters (they may quote a prompt)."""
        orig = getattr(e, "orig", None) or e
        first = (str(orig).strip().splitlines() or [""])[0][:200]
        error = cls(f"{type(orig).__name__}: {first}")
        error.__cause__ = e
        return error


def database_unavailable(e: BaseException) -> bool:
    """The database went away (a restart, a dropped or refused connection): the statement
    may be tried again. Any other error (bad data, a constraint, a bug) is not. The store's
    classifier: above it, catch :class:`DatabaseUnavailable`."""
    if isinstance(e, DatabaseUnavailable):
        return True
    # Imported here: `dar` and the client import this module and must not load SQLAlchemy.
    from sqlalchemy.exc import DBAPIError, OperationalError

    return isinstance(e, OperationalError) or (
        isinstance(e, DBAPIError) and e.connection_invalidated
    )
