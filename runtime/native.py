"""Native OS threads for step code that may block in C (tool bodies), also under gevent.

The worker ships with Celery's gevent pool: a step in flight is a greenlet, so a model call
waiting on its socket costs no thread and one process holds thousands. A greenlet only yields
where gevent patched the call (a socket, ``time.sleep``, a lock): a tool that hashes 50 MB,
compresses, or waits inside a C database driver holds the one OS thread of the process, and
every model call beside it stalls. So the code of a step with a time limit (every tool) runs
here, on a bounded pool of real OS threads (``DAR_STEP_THREADS``, default 64; gevent's own
native thread pool when ``threading`` is monkey-patched, else a standard one), and the
step's greenlet waits for it cooperatively. A C call releases the GIL for its heavy part
(hashlib, zlib, a driver's socket wait), so the hub keeps serving the other greenlets.

Futures from either pool are waited on only with :func:`wait` (``exception(timeout)``, the
one waiting method both kinds honour from a greenlet and from a thread).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

DEFAULT_STEP_THREADS = 64


def gevent_patched() -> bool:
    """Whether this process runs under gevent's monkey-patched ``threading``."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey is not None and monkey.is_module_patched("threading"))


class _Pool:
    """The process's step pool, made on first use (after gevent patched, after a fork)."""

    lock = threading.Lock()
    executor: concurrent.futures.Executor | None = None
    native_under_gevent = False

    @classmethod
    def get(cls) -> concurrent.futures.Executor:
        with cls.lock:
            if cls.executor is None:
                size = max(1, int(os.environ.get("DAR_STEP_THREADS") or DEFAULT_STEP_THREADS))
                if gevent_patched():
                    from gevent.threadpool import ThreadPoolExecutor as NativeExecutor

                    cls.executor = NativeExecutor(max_workers=size)
                    cls.native_under_gevent = True
                else:
                    cls.executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=size, thread_name_prefix="dar-step"
                    )
            return cls.executor

    @classmethod
    def after_fork(cls) -> None:
        cls.lock = threading.Lock()
        cls.executor = None
        cls.native_under_gevent = False


os.register_at_fork(after_in_child=_Pool.after_fork)


def submit(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
    """Run ``fn(*args)`` on a native thread of the step pool, in a copy of the caller's
    context (its logging context and run)."""
    return _Pool.get().submit(contextvars.copy_context().run, fn, *args)


def wait(future: concurrent.futures.Future[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``future``; whether it is done."""
    try:
        future.exception(timeout=max(0.0, timeout))
    except concurrent.futures.TimeoutError:
        return False
    except concurrent.futures.CancelledError:
        return True
    return True


def cancel(future: concurrent.futures.Future[Any]) -> bool:
    """Cancel ``future`` if it has not started; whether it was (gevent's native pool cannot
    take a queued call back: ``False``, as for a call that started)."""
    if _Pool.native_under_gevent:
        return False
    return future.cancel()
