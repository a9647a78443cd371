"""Gunicorn's logger in our format: ``--logger-class api.gunicorn_logging.Logger``.

Gunicorn's own lines (its banner, worker boots) and its access lines go through the same
handler as the app's, so with ``DAR_LOG_FORMAT=json`` every line of the web process is JSON.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from gunicorn.glogging import Logger as GunicornLogger  # type: ignore[import-untyped]

from runtime.observe.logctx import make_handler

_SECRET_PARAM = re.compile(
    r"(?i)([?&;](?:[^=&;]*(?:token|key|secret|password|passwd|auth|bearer|session)[^=&;]*)=)"
    r"[^&;#\s]*"
)
_DAR_TOKEN = re.compile(r"dar_[A-Za-z0-9_-]{8,}")
"""A token ``dar token new`` made (``dar_`` and 43 characters), wherever it appears."""


def redact(text: str) -> str:
    """``text`` (a request line, a query string, a referer) with the values of parameters
    that look like credentials (``?token=``, ``api_key=``, ``access_token=``) and anything
    shaped like an API token replaced by ``[redacted]``: a token sent in a URL (refused by
    the API) is not written to the access log."""
    if not text:
        return text
    bare = "?" not in text and "=" in text  # a query string on its own
    text = _SECRET_PARAM.sub(r"\1[redacted]", "?" + text if bare else text)
    return _DAR_TOKEN.sub("[redacted]", text[1:] if bare else text)


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

    def atoms(self, resp: Any, req: Any, environ: Any, request_time: Any) -> dict[str, Any]:
        atoms: dict[str, Any] = super().atoms(resp, req, environ, request_time)
        for name in ("r", "q", "f", "U", "{raw_uri}e", "{query_string}e", "{http_referer}e"):
            if isinstance(atoms.get(name), str):
                atoms[name] = redact(atoms[name])
        for name in ("{authorization}i", "{http_authorization}e", "{cookie}i", "{http_cookie}e"):
            if name in atoms:
                atoms[name] = "[redacted]"
        return atoms
