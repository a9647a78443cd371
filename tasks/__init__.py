"""Celery: the app factory, the drive_run and reap tasks, dispatch, and worker signals.

Tasks are thin: they turn ids into calls on the engine and send the next message after the
engine has committed. The logic lives in ``runtime``.
"""
