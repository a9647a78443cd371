"""The WSGI entry point for gunicorn: ``gunicorn --worker-class gevent api.wsgi:app``."""

import os
import socket
import sys

from api import create_app
from api.serving import BodyDeadline
from db.errors import DarError
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
