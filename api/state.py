"""What the app factory builds once and the views use: the runtime and the Celery client."""

from __future__ import annotations

from dataclasses import dataclass

from celery import Celery
from flask import current_app

from runtime.engine.bootstrap import Runtime


@dataclass(frozen=True)
class ApiState:
    runtime: Runtime
    celery: Celery


def state() -> ApiState:
    s: ApiState = current_app.extensions["dar"]
    return s
