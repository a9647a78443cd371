"""The Celery app the Procfile's processes run: ``celery -A tasks.app worker``."""

from runtime.config import Settings
from tasks.celery_app import make_celery
from tasks.signals import connect_signals

settings = Settings.from_env()
app = make_celery(settings)
connect_signals(app)
