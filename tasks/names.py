"""The names of the Celery tasks, on their own so that the app's configuration
(:mod:`tasks.celery_app`), the tasks (:mod:`tasks.drive`) and the sender
(:mod:`tasks.dispatch`) share them without importing each other in a circle."""

DRIVE_RUN = "dar.drive_run"
REAP = "dar.reap"
UPGRADE_UNSERVED = "dar.upgrade_unserved"
RETENTION = "dar.retention"
STATS_ROLLUP = "dar.stats_rollup"
