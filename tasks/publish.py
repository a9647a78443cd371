"""``drive_run`` messages written straight onto the broker's Redis list.

Every step ends by sending the run's next message, so publishing is on the hot path.
Through ``app.send_task`` it cost a fifth of a worker's CPU per step (``python -m bench
diagnose``): Celery builds the message (router lookup, ``saferepr`` of the arguments, ~20
headers), acquires a producer from its pool, kombu re-checks the queue's declaration,
augments the envelope, base64-encodes the body and creates a Redis client object per call,
all around one ``LPUSH``. Here the same message is built from a template and pushed through
one shared redis-py connection pool: the bytes on the list are those kombu's Redis transport
writes for ``send_task`` (protocol 2, JSON, base64 body, priority 0, default exchange), so
any Celery worker consumes them as usual; ``tests/unit/test_publish.py`` compares the two
field for field against the installed Celery and kombu.

Used only where it is exactly equivalent: a plain ``redis://``/``rediss://``/``unix://``
broker with no key prefix, and no countdown (a timer's message carries an ``eta`` and goes
through ``send_task``). Anything else, and any app that is not configured like
:func:`tasks.celery_app.make_celery`'s, falls back to ``send_task``.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import uuid
from typing import Any

import redis
from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from runtime.redisconn import redis_client

_SCHEMES = ("redis://", "rediss://", "unix://")
_EMBED = b', {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'


class DrivePublisher:
    """Publishes one task's messages (``args`` of two strings, no options) for ``app``."""

    def __init__(self, app: Celery, task: str) -> None:
        conf = app.conf
        route = (conf.task_routes or {}).get(task) or {}
        self.queue: str = route.get("queue") or conf.task_default_queue
        options = conf.broker_transport_options or {}
        self._client = redis_client(
            conf.broker_url,
            socket_timeout=options.get("socket_timeout", 5),
            socket_connect_timeout=options.get("socket_connect_timeout", 3),
            health_check_interval=options.get("health_check_interval", 10),
            socket_keepalive=options.get("socket_keepalive", True),
            # One more try on a pooled connection that died (Redis restarted): as kombu's
            # publish retry did, then the caller's fallback (the reaper) takes over.
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
        self._task = task
        self._origin = f"gen{os.getpid()}@{socket.gethostname()}"
        # Celery puts the sending thread's id (a uuid3 made once per thread) in reply_to,
        # for replies no one sends here (no result backend). Under the gevent pool every
        # task is a new "thread" and made a new one for each message: one per process.
        self._reply_to = app.thread_oid

    @staticmethod
    def usable(app: Celery) -> bool:
        conf = app.conf
        options = conf.broker_transport_options or {}
        url = conf.broker_url or ""
        return (
            url.startswith(_SCHEMES)
            and not options.get("global_keyprefix")
            and options.get("queue_order_strategy", "list") == "list"
            and conf.task_serializer == "json"
            and not conf.task_send_sent_event
            and conf.task_protocol == 2
            and conf.task_default_exchange in (None, "", conf.task_default_queue)
        )

    def message(self, run_id: str, token: str, queue: str | None = None) -> bytes:
        """The envelope kombu's Redis transport would store for ``send_task(task, [run_id,
        token], queue=queue)`` (the task's routed queue by default)."""
        task_id = str(uuid.uuid4())
        args = json.dumps([run_id, token])
        body = base64.b64encode(b"[" + args.encode() + _EMBED).decode()
        envelope: dict[str, Any] = {
            "body": body,
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {
                "lang": "py",
                "task": self._task,
                "id": task_id,
                "shadow": None,
                "eta": None,
                "expires": None,
                "group": None,
                "group_index": None,
                "retries": 0,
                "timelimit": [None, None],
                "root_id": task_id,
                "parent_id": None,
                "argsrepr": repr([run_id, token]),
                "kwargsrepr": "{}",
                "origin": self._origin,
                "ignore_result": None,
                "replaced_task_nesting": 0,
                "stamped_headers": None,
                "stamps": {},
            },
            "properties": {
                "correlation_id": task_id,
                "reply_to": self._reply_to,
                "delivery_mode": 2,
                "delivery_info": {"exchange": "", "routing_key": queue or self.queue},
                "priority": 0,
                "body_encoding": "base64",
                "delivery_tag": str(uuid.uuid4()),
            },
        }
        return json.dumps(envelope).encode()

    def send(self, run_id: str, token: str, queue: str | None = None) -> None:
        self._client.lpush(queue or self.queue, self.message(run_id, token, queue))


_lock = threading.Lock()


def publisher(app: Celery, task: str) -> DrivePublisher | None:
    """``app``'s publisher for ``task`` (made once per process), or ``None`` when the lean
    path would not be exactly ``send_task``."""
    cache: dict[tuple[int, str], DrivePublisher | None] = app.__dict__.setdefault(
        "_dar_publishers", {}
    )
    key = (os.getpid(), task)
    if key not in cache:
        with _lock:
            if key not in cache:
                cache[key] = DrivePublisher(app, task) if DrivePublisher.usable(app) else None
    return cache[key]
