"""The WSGI entry point for gunicorn: ``gunicorn api.wsgi:app``."""

import os

from api import create_app
from runtime.logctx import configure_logging

configure_logging(
    os.environ.get("DAR_LOG_FORMAT", "console"), os.environ.get("DAR_LOG_LEVEL", "INFO")
)
app = create_app()
