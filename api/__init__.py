"""The REST API: a Flask app factory with its blueprints (the ``dar`` command is :mod:`cli`).

``create_app`` lives in :mod:`api.app` and is imported on first use, so that ``dar`` (which
is :mod:`cli.main`) answers without loading Flask, Celery or SQLAlchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from api.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from api.app import create_app

        return create_app
    raise AttributeError(f"module 'api' has no attribute {name!r}")
