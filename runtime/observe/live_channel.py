"""The live side of a run's event stream, in Redis: text deltas and retractions, and the cancel
flag a model call in flight watches.

Nothing here is the truth (PostgreSQL is, see ``run_event``): a delta lost with Redis costs a
client some text of the step in flight, whose full text still arrives in its
``step.finished`` event. Every call is best effort on the worker's side: Redis being down never
fails or slows a model call for long (after an error it is left alone for a few seconds).

Keys, per run: ``dar:live:<run>`` a stream capped near ``DAR_LIVE_MAXLEN`` entries of
``text.delta`` / ``text.retract`` (fields ``type, key, attempt, base, text``);
``dar:live-attempts:<run>`` the attempt counter per step key; ``dar:live-once:<run>`` the
ids of the other live events published (``steps.live_event``: each once per run);
``dar:cancel:<run>`` set by ``POST /cancel``; ``dar:interrupt:<run>`` set by a message
posted with ``policy: "interrupt"`` (it aborts the agent loop's model call in flight only,
never a tool, and is consumed by the worker that acts on it). All expire a day after their
last write.

A delta's ``base`` is the run's last durable event number when its attempt began: clients
order it after that event and before the next one.

Deltas and retractions are sent by one sender per process, every entry queued within a
window (:data:`FLUSH_WINDOW_SECONDS`) in one round trip (:meth:`LiveChannel.publish` only
queues): a gevent worker streams thousands of calls at once, a few hundred deltas each, and an
``XADD`` round trip per delta was 40% of its CPU (issue 36). Each entry is still one ``XADD``
(a client sees every delta, as sent), encoded once as the Redis protocol's bytes when it is
queued: a delta is the bytes of its attempt's fields, made once per attempt, plus its text
(redis-py's pipeline encoded the sixteen arguments of every ``XADD`` anew, in Python: half of
the live stream's CPU, issue 36). The queue is in order, and every other write (and read) of
this process sends it first, so a client sees the entries in the order they were made.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis

from runtime.redisconn import redis_client

log = logging.getLogger(__name__)

TTL_SECONDS = 86_400
BACKOFF_SECONDS = 5.0
FLUSH_WINDOW_SECONDS = 0.02
"""How long the sender lets entries gather after the first one queued before it sends them
all in one round trip: a delta reaches clients at most this much later, and a worker
streaming thousands of calls makes at most 1 / window round trips a second for them."""


def stream_key(run_id: uuid.UUID) -> str:
    return f"dar:live:{run_id}"


def attempts_key(run_id: uuid.UUID) -> str:
    return f"dar:live-attempts:{run_id}"


def cancel_key(run_id: uuid.UUID) -> str:
    return f"dar:cancel:{run_id}"


def interrupt_key(run_id: uuid.UUID) -> str:
    return f"dar:interrupt:{run_id}"


def once_key(run_id: uuid.UUID) -> str:
    return f"dar:live-once:{run_id}"


def _arg(value: str | int | bytes) -> bytes:
    """One argument of a Redis command, as the protocol sends it (a bulk string; text as
    UTF-8, a number in decimal: what redis-py's encoder makes of it)."""
    raw = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(raw), raw)


def xadd_head(key: str, fields: dict[str, str | int], maxlen: int, *, more: int = 0) -> bytes:
    """``XADD key MAXLEN ~ maxlen * field value ...`` as the protocol's bytes; with ``more``,
    that many further arguments are to follow (a delta's ``text`` and its value)."""
    parts = [
        b"*%d\r\n$4\r\nXADD\r\n" % (6 + 2 * len(fields) + more),
        _arg(key),
        b"$6\r\nMAXLEN\r\n$1\r\n~\r\n",
        _arg(maxlen),
        b"$1\r\n*\r\n",
    ]
    for name, value in fields.items():
        parts += (_arg(name), _arg(value))
    return b"".join(parts)


def expire_command(key: str, seconds: int) -> bytes:
    return b"*3\r\n$6\r\nEXPIRE\r\n%s%s" % (_arg(key), _arg(seconds))


def _connection(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py 5 wants a command name
        return pool.get_connection("XADD")


@dataclass(frozen=True, slots=True)
class LiveEntry:
    """One entry of a run's live stream."""

    rid: str
    """The Redis stream id (``<ms>-<n>``)."""
    type: str
    key: str
    attempt: int
    base: int
    text: str

    @property
    def order(self) -> tuple[int, int, int]:
        ms, _, n = self.rid.partition("-")
        return (self.base, int(ms), int(n or 0))


def _entry(rid: Any, fields: Any) -> LiveEntry | None:
    try:
        return LiveEntry(
            rid=rid.decode() if isinstance(rid, bytes) else rid,
            type=fields[b"type"].decode(),
            key=fields[b"key"].decode(),
            attempt=int(fields[b"attempt"]),
            base=int(fields[b"base"]),
            text=fields.get(b"text", b"").decode(),
        )
    except (KeyError, ValueError, AttributeError, TypeError):
        return None


@dataclass
class _Watched:
    cancelled: threading.Event = field(default_factory=threading.Event)
    """Set when the work in flight must stop: the run was cancelled, or interrupted."""
    aborts: list[Callable[[], None]] = field(default_factory=list)
    interruptible: bool = False
    """A message posted with ``policy: "interrupt"`` stops it too (the agent loop's model
    call; never a tool, whose effect may be half done)."""
    interrupted: threading.Event = field(default_factory=threading.Event)
    """Set (before ``cancelled``) when it stops for an interrupting message."""
    published: bool = False
    """Entries were queued for it: they are sent when the block ends, before the step that
    follows is recorded (a client orders a delta before its step's durable events)."""


class LiveChannel:
    """A process's connection to the live side. Thread-safe; one per process."""

    def __init__(
        self,
        redis_url: str,
        *,
        maxlen: int = 10_000,
        cancel_poll_seconds: float = 0.2,
        flush_window_seconds: float = FLUSH_WINDOW_SECONDS,
    ) -> None:
        self.redis = redis_client(redis_url, socket_timeout=2.0, socket_connect_timeout=1.0)
        self.maxlen = maxlen
        self.cancel_poll_seconds = cancel_poll_seconds
        self.flush_window_seconds = flush_window_seconds
        self.round_trips = 0
        """Round trips that sent queued entries (each carries every entry queued by then)."""
        self._down_until = 0.0
        self._lock = threading.Condition()
        self._watched: dict[uuid.UUID, list[_Watched]] = {}
        self._flag_keys: dict[uuid.UUID, tuple[str, str]] = {}
        """The cancel and interrupt keys of each watched run, made once (polled 5 times a
        second for every call in flight)."""
        self._watcher: threading.Thread | None = None
        self._closed = False
        self._outbox: collections.deque[tuple[bytes, int]] = collections.deque()
        """Commands to send, as the protocol's bytes, and how many replies each makes."""
        self._outbox_ready = threading.Condition()
        self._sending = threading.Lock()
        self._sender: threading.Thread | None = None
        self._sender_idle = False
        """The sender waits for an entry: the next one queued wakes it (only that one)."""

    # -- best effort writes (workers) ----------------------------------------------------

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: Exception) -> None:
        if self._available():
            log.warning(
                "live stream: Redis %s failed (%s); deltas are skipped for %.0f s",
                what,
                e,
                BACKOFF_SECONDS,
                extra={"event": "live_redis_down"},
            )
        self._down_until = time.monotonic() + BACKOFF_SECONDS

    def publish(self, run_id: uuid.UUID, fields: dict[str, str | int]) -> None:
        """Queue an entry for the run's stream; the process's sender sends it (in order)."""
        self.queue(xadd_head(stream_key(run_id), fields, self.maxlen))

    def queue(self, command: bytes, replies: int = 1) -> None:
        """Queue ``command`` (Redis protocol bytes, making ``replies`` replies: an ``XADD``,
        maybe followed by an ``EXPIRE``) for the sender."""
        if not self._available():
            return
        self._outbox.append((command, replies))  # a deque's append is atomic
        if self._sender_idle or self._sender is None:  # else it looks at the queue again
            with self._outbox_ready:
                if self._sender is None and not self._closed:
                    self._sender = threading.Thread(
                        target=self._send_loop, name="dar-live-sender", daemon=True
                    )
                    self._sender.start()
                self._outbox_ready.notify()

    def flush(self) -> None:
        """Send every queued entry now, in one round trip."""
        with self._sending:
            outbox = self._outbox
            batch = [outbox.popleft() for _ in range(len(outbox))]  # safe beside appends
            if not batch or not self._available():
                return
            try:
                self._send(b"".join(command for command, _ in batch), sum(n for _, n in batch))
            except redis.RedisError as e:
                self._failed("XADD", e)

    def _send(self, commands: bytes, replies: int) -> None:
        """Write ``commands`` at once and read their ``replies`` (pipelined, like redis-py's
        pipeline, less its encoding of every argument)."""
        pool = self.redis.connection_pool
        conn = _connection(pool)
        try:
            self.round_trips += 1
            conn.send_packed_command([commands])
            for _ in range(replies):
                try:
                    conn.read_response()
                except redis.ResponseError:  # one entry refused (a key of another type)
                    continue
        except BaseException:
            conn.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(conn)

    def _send_loop(self) -> None:
        while True:
            with self._outbox_ready:
                # idle first, then look: an entry queued after the look finds it idle
                self._sender_idle = True
                while not self._outbox and not self._closed:
                    self._outbox_ready.wait()
                self._sender_idle = False
                if self._closed and not self._outbox:
                    return
            if self.flush_window_seconds > 0 and not self._closed:
                time.sleep(self.flush_window_seconds)  # let the window's entries gather
            self.flush()

    def publish_once(self, run_id: uuid.UUID, once: str, fields: dict[str, str | int]) -> bool:
        """Publish ``fields`` unless an entry with the id ``once`` was published for the run
        before (a replay of the code that publishes it). ``False``: not published."""
        if not self._available():
            return False
        self.flush()
        try:
            if not self.redis.sadd(once_key(run_id), once):
                return False
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(stream_key(run_id), fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            pipe.expire(once_key(run_id), TTL_SECONDS)
            pipe.expire(stream_key(run_id), TTL_SECONDS)
            pipe.execute()
        except redis.RedisError as e:
            self._failed("XADD", e)
            return False
        return True

    def next_attempt(self, run_id: uuid.UUID, key: str, base: int) -> int:
        """Number a new attempt of step ``key``; when an earlier attempt exists (a retry, or
        a worker that died mid-stream), retract it first (queued: before any delta of the
        new attempt). 0 when Redis is unavailable. One round trip."""
        if not self._available():
            return 0
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hincrby(attempts_key(run_id), key, 1)
            pipe.expire(attempts_key(run_id), TTL_SECONDS)
            attempt = int(pipe.execute()[0])
        except redis.RedisError as e:
            self._failed("attempt", e)
            return 0
        if attempt > 1:
            self.retract(run_id, key, attempt - 1, base)
        return attempt

    def request_cancel(self, run_id: uuid.UUID) -> bool:
        """Raise the run's cancel flag for its model call in flight (the database's
        ``cancel_requested`` stays the truth). ``False`` when Redis could not be told."""
        try:
            self.redis.set(cancel_key(run_id), b"1", ex=TTL_SECONDS)
        except redis.RedisError as e:
            log.warning("cancel flag for run %s not set in Redis: %s", run_id, e)
            return False
        return True

    def request_interrupt(self, run_id: uuid.UUID) -> bool:
        """Raise the run's interrupt flag: its agent-loop model call in flight, if any, is
        aborted and the step re-run with the messages posted (the database's pending
        messages stay the truth). ``False`` when Redis could not be told."""
        try:
            self.redis.set(interrupt_key(run_id), b"1", ex=TTL_SECONDS)
        except redis.RedisError as e:
            log.warning("interrupt flag for run %s not set in Redis: %s", run_id, e)
            return False
        return True

    def clear_interrupt(self, run_id: uuid.UUID) -> None:
        """Drop the run's interrupt flag (its messages were delivered at a step boundary):
        best effort, a stale flag costs at most one aborted call that is made again."""
        if not self._available():
            return
        try:
            self.redis.delete(interrupt_key(run_id))
        except redis.RedisError as e:
            self._failed("DEL", e)

    def retract(self, run_id: uuid.UUID, key: str, attempt: int, base: int) -> None:
        """Retract an attempt of step ``key`` (it was cut, or is retried): clients drop its
        text. Queued, in order with the deltas."""
        fields: Any = {"type": "text.retract", "key": key, "attempt": attempt, "base": base}
        self.queue(
            xadd_head(stream_key(run_id), {**fields, "text": ""}, self.maxlen)
            + expire_command(stream_key(run_id), TTL_SECONDS),
            2,
        )

    # -- reading (the API) --------------------------------------------------------------

    def entries(self, run_id: uuid.UUID, after: str = "0-0", count: int = 1000) -> list[LiveEntry]:
        """Entries after stream id ``after``, oldest first. Raises ``redis.RedisError``."""
        self.flush()  # what this process published is there to read
        rows: Any = self.redis.xrange(stream_key(run_id), min=f"({after}", count=count)
        return [e for rid, f in rows if (e := _entry(rid, f)) is not None]

    def wait(self, run_id: uuid.UUID, after: str, timeout_seconds: float) -> list[LiveEntry]:
        """Entries after ``after``, waiting up to ``timeout_seconds`` for the first.
        Raises ``redis.RedisError``."""
        self.flush()
        found: Any = self.redis.xread(
            {stream_key(run_id): after}, count=1000, block=max(1, int(timeout_seconds * 1000))
        )
        out: list[LiveEntry] = []
        for _, rows in found or []:
            out += [e for rid, f in rows if (e := _entry(rid, f)) is not None]
        return out

    # -- cancel watching (workers) ------------------------------------------------------

    @contextmanager
    def watch(self, run_id: uuid.UUID, *, interruptible: bool = False) -> Iterator[_Watched]:
        """Watch ``run_id``'s cancel flag (and, when ``interruptible``, its interrupt flag)
        while the block runs."""
        watched = _Watched(interruptible=interruptible)
        with self._lock:
            self._watched.setdefault(run_id, []).append(watched)
            if run_id not in self._flag_keys:
                self._flag_keys[run_id] = (cancel_key(run_id), interrupt_key(run_id))
            if self._watcher is None:
                self._watcher = threading.Thread(
                    target=self._watch_loop, name="dar-cancel-watch", daemon=True
                )
                self._watcher.start()
            self._lock.notify_all()
        try:
            yield watched
        finally:
            if watched.published:
                self.flush()  # the call's last deltas out before its step's record
            with self._lock:
                entries = self._watched.get(run_id, [])
                if watched in entries:
                    entries.remove(watched)
                if not entries:
                    self._watched.pop(run_id, None)
                    self._flag_keys.pop(run_id, None)

    def _watch_loop(self) -> None:
        while True:
            with self._lock:
                while not self._watched and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                runs = list(self._watched)
                pairs = [self._flag_keys[r] for r in runs]
            keys = [c for c, _ in pairs] + [i for _, i in pairs]
            try:
                flags = self.redis.mget(keys)
            except Exception:  # Redis down, or the client closed under us (close())
                if self._closed:
                    return
                flags = [None] * len(keys)
                time.sleep(1.0)
            for i, run_id in enumerate(runs):
                cancel, interrupt = flags[i], flags[len(runs) + i]
                if cancel is None and interrupt is None:
                    continue
                with self._lock:
                    watched = list(self._watched.get(run_id, []))
                if cancel is None:  # interrupted: only what may be interrupted
                    watched = [w for w in watched if w.interruptible]
                    if watched and not self._consume_interrupt(run_id):
                        continue  # another worker's (or a stale) flag, gone meanwhile
                for w in watched:
                    if w.cancelled.is_set():
                        continue
                    if cancel is None:
                        w.interrupted.set()
                    w.cancelled.set()
                    for abort in list(w.aborts):
                        try:
                            abort()
                        except Exception:
                            log.exception("aborting a cancelled model call failed")
            time.sleep(self.cancel_poll_seconds)

    def _consume_interrupt(self, run_id: uuid.UUID) -> bool:
        """Take the run's interrupt flag: one interrupt aborts one model call."""
        try:
            return self.redis.delete(interrupt_key(run_id)) == 1
        except redis.RedisError:
            return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        with self._outbox_ready:
            self._outbox_ready.notify_all()
        self.flush()
        if self._sender is not None:
            self._sender.join(5)
        self.redis.close()


class RedisLiveCall:
    """:class:`~runtime.llm.live_call.LiveCall` for one model call of step ``key``."""

    def __init__(
        self,
        channel: LiveChannel,
        run_id: uuid.UUID,
        key: str,
        base: Callable[[], int],
        watched: _Watched,
    ) -> None:
        self.channel = channel
        self.run_id = run_id
        self.key = key
        self._base_of = base
        self._base = 0
        self._watched = watched
        self.cancelled = watched.cancelled
        self.interrupted = watched.interrupted
        self.attempt = 0
        """The number of the attempt in flight (0: none, or Redis was unavailable)."""
        self._head = b""
        self._head_of: tuple[int, int] | None = None
        """The (attempt, base) that ``_head`` encodes."""

    def begin_attempt(self) -> int:
        self._base = self._base_of()
        self.attempt = self.channel.next_attempt(self.run_id, self.key, self._base)
        return self.attempt

    def retract(self) -> None:
        """Retract the attempt in flight on the live stream (it was cut)."""
        if self.attempt:
            self.channel.retract(self.run_id, self.key, self.attempt, self._base)

    def delta(self, attempt: int, text: str) -> None:
        if (attempt, self._base) != self._head_of:
            self._watched.published = True
            # the attempt's fields, encoded once; its first delta also keeps the stream a day
            self._head_of = (attempt, self._base)
            self._head = xadd_head(
                stream_key(self.run_id),
                {"type": "text.delta", "key": self.key, "attempt": attempt, "base": self._base},
                self.channel.maxlen,
                more=2,
            ) + _arg("text")
            self.channel.queue(
                self._head + _arg(text) + expire_command(stream_key(self.run_id), TTL_SECONDS),
                2,
            )
            return
        self.channel.queue(self._head + _arg(text))

    def on_cancel(self, abort: Callable[[], None]) -> Callable[[], None]:
        self._watched.aborts.append(abort)
        if self.cancelled.is_set():
            abort()

        def unregister() -> None:
            if abort in self._watched.aborts:
                self._watched.aborts.remove(abort)

        return unregister
