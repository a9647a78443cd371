"""The Celery app the Procfile's processes run: ``celery -A tasks.app worker``."""

import os
import sys

from runtime.config import ConfigError, Settings
from tasks.celery_app import make_celery
from tasks.signals import connect_signals

# The working directory stays importable after our own packages, as it is for gunicorn and
# `python -m`: `DAR_AGENT_MODULES=examples.orders_agent` finds the same modules in every
# process started from the Procfile's lines. (Celery puts it on sys.path only while it
# imports this module and takes it off again, so append it whether or not it is there now.)
sys.path.append(os.getcwd())

try:
    settings = Settings.from_env()
    app = make_celery(settings)
except ConfigError as e:  # one line naming the setting, not a traceback
    print(f"dar: cannot start: {e}", file=sys.stderr, flush=True)
    raise SystemExit(1) from None
connect_signals(app)
