"""A real PgBouncer (Debian's ``pgbouncer``) in transaction mode, started by a test in front of
a PostgreSQL server, on its own port with a temporary configuration.

``server_round_robin = 1`` hands a client's transactions to the server connections in turn:
what a loaded pooler does anyway (each transaction goes to whichever server connection is
free), made to happen on a quiet test machine, so session state that a pooler would lose (a
prepared statement, a ``SET``, an advisory lock, a ``LISTEN``) is lost here too.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy.engine import make_url

from cli.embedded import free_port

PGBOUNCER = os.environ.get("DAR_PGBOUNCER", shutil.which("pgbouncer") or "/usr/sbin/pgbouncer")


class PgBouncer:
    """``start()`` it, point URLs at it with :meth:`url_for`, ``stop()`` it."""

    def __init__(
        self, upstream_url: str, *, pool_mode: str = "transaction", pool_size: int = 20
    ) -> None:
        self.upstream = make_url(upstream_url)
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.port = free_port()
        self._dir = Path(tempfile.mkdtemp(prefix="dar-pgbouncer-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self._dir / "pgbouncer.log"

    def url_for(self, database_url: str) -> str:
        """``database_url`` (a database of the upstream server) through this pooler."""
        return (
            make_url(database_url)
            .difference_update_query(["host"])
            .set(host="127.0.0.1", port=self.port)
            .render_as_string(hide_password=False)
        )

    def _upstream_host(self) -> str:
        """A host name, or a Unix socket directory (``?host=/dir`` in the URL)."""
        socket_dir = self.upstream.query.get("host")
        if isinstance(socket_dir, tuple):
            socket_dir = socket_dir[0]
        return self.upstream.host or socket_dir or "127.0.0.1"

    def _run_as(self) -> str:
        """Who PgBouncer runs as when started by root (it refuses root): the owner of the
        upstream's socket directory (an embedded server's is private), else ``postgres``."""
        host = self._upstream_host()
        if host.startswith("/"):
            return pwd.getpwuid(os.stat(host).st_uid).pw_name
        return "postgres" if _user_exists("postgres") else "nobody"

    def _config(self) -> str:
        host = self._upstream_host()
        port = self.upstream.port or 5432
        user = self.upstream.username or "postgres"
        password = self.upstream.password or ""
        (self._dir / "users.txt").write_text(f'"{user}" "{password}"\n')
        return "\n".join(
            [
                "[databases]",
                f"* = host={host} port={port}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {self._dir / 'users.txt'}",
                f"pool_mode = {self.pool_mode}",
                f"default_pool_size = {self.pool_size}",
                "max_client_conn = 1000",
                "server_round_robin = 1",
                # After a failed server login PgBouncer refuses clients at once for this long
                # (15 s by default: longer than a lease, so a 3 s restart of PostgreSQL would
                # cost every answer in flight). The docs (Capacity planning) recommend the same.
                "server_login_retry = 1",
                f"admin_users = {user}",
                # psycopg sends none of these, but a libpq URL may.
                "ignore_startup_parameters = extra_float_digits,options",
                "",
            ]
        )

    def start(self, timeout: float = 15.0) -> None:
        if not Path(PGBOUNCER).exists():  # .ci/run installs it; failing beats a silent skip
            raise RuntimeError(
                f"no pgbouncer at {PGBOUNCER}: apt-get install pgbouncer (or DAR_PGBOUNCER=path)"
            )
        ini = self._dir / "pgbouncer.ini"
        ini.write_text(self._config())
        args = [PGBOUNCER, "-v", str(ini)]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            user = self._run_as()
            os.chmod(self._dir, 0o755)
            shutil.chown(self._dir, user)
            args[1:1] = ["-u", user]
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while not _answers(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pgbouncer did not start: {self.log_text()[-2000:]}")
            time.sleep(0.05)

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console (``POOLS``, ``CLIENTS``, ``SERVERS``...).
        The console speaks only the simple query protocol: a client-side cursor."""
        user = self.upstream.username or "postgres"
        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user=user,
            dbname="pgbouncer",
            autocommit=True,
            cursor_factory=psycopg.ClientCursor,
            row_factory=dict_row,
        ) as conn:
            return conn.execute(f"SHOW {what}").fetchall()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # immediate shutdown
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
