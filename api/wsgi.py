"""The WSGI entry point for gunicorn: ``gunicorn --worker-class gevent api.wsgi:app``."""

import os
import signal
import socket
import sys
import threading
from types import FrameType

from api import create_app
from api.events import EVENT_HUB
from api.serving import BodyDeadline
from db.errors import DarError
from runtime.native import gevent_patched
from runtime.observe.logctx import configure_logging, set_process_worker
from runtime.observe.tracing import configure_from_env

try:
    configure_logging(
        os.environ.get("DAR_LOG_FORMAT", "console"), os.environ.get("DAR_LOG_LEVEL", "INFO")
    )
    set_process_worker(f"web@{socket.gethostname()}:{os.getpid()}")
    configure_from_env()
    app = create_app()
except (DarError, ValueError) as e:
    # One line naming the setting; exit status 4 is gunicorn's "App failed to load", which
    # stops the server instead of booting the worker again and again.
    print(f"dar: web cannot start: {e}", file=sys.stderr, flush=True)
    raise SystemExit(4) from None
app.wsgi_app = BodyDeadline(  # type: ignore[method-assign]
    app.wsgi_app, float(os.environ.get("DAR_HTTP_BODY_TIMEOUT_SECONDS", "30"))
)


def _end_event_streams_on_sigterm() -> None:
    """On SIGTERM gunicorn stops accepting and lets the requests in flight finish, for up to
    its graceful timeout (30 s). An event stream never finishes by itself, so every stop of
    the web process (a deploy, ``dar dev``'s Ctrl-C) waited that out, its clients held. The
    process's event streams end at once instead; gunicorn's own handler then runs as before.
    The ending runs off the signal handler (it takes a lock): in a greenlet under gevent, as
    gunicorn does its own work on a signal, else in a thread."""
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        hub = app.extensions.get(EVENT_HUB)
        if hub is not None:
            if gevent_patched():
                import gevent

                gevent.spawn(hub.drain)
            else:
                threading.Thread(target=hub.drain, name="dar-drain", daemon=True).start()
        if callable(previous):
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


_end_event_streams_on_sigterm()
