"""Gunicorn's logger in our format: ``--logger-class api.gunicorn_logging.Logger``.

Gunicorn's own lines (its banner, worker boots) and its access lines go through the same
handler as the app's, so with ``DAR_LOG_FORMAT=json`` every line of the web process is JSON.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from gunicorn.glogging import Logger as GunicornLogger  # type: ignore[import-untyped]

from runtime.logctx import make_handler


class Logger(GunicornLogger):  # type: ignore[misc]
    def setup(self, cfg: Any) -> None:
        super().setup(cfg)
        fmt = os.environ.get("DAR_LOG_FORMAT", "console")
        if fmt not in ("console", "json"):
            fmt = "console"  # the app itself says why, in one line, when it loads
        for target, wanted in ((self.error_log, True), (self.access_log, bool(cfg.accesslog))):
            for h in list(target.handlers):
                target.removeHandler(h)
            if wanted:
                target.addHandler(make_handler(fmt))
            target.propagate = False
        self.access_log.setLevel(logging.INFO)
