"""A TCP proxy a test puts between one process and a server (PostgreSQL, Redis), to cut the
network and heal it while both keep running, or to move the server to a new address.

- :meth:`TcpProxy.cut`: a partition. Nothing is forwarded any more in either direction, and a
  new connection is accepted but never reaches the server (as SYNs that get no answer would
  leave a client waiting on its connect timeout). Bytes already sent wait in the sockets'
  buffers, as TCP would retransmit them: after :meth:`heal` they arrive, late, as they would
  on a real network that came back before the connections timed out.
- :meth:`TcpProxy.heal`: forwarding resumes.
- :meth:`TcpProxy.reset`: every open connection is closed (a failover, a restart).
- :meth:`TcpProxy.repoint`: new connections go to another address (DNS or a virtual IP
  moving to a new primary); with ``reset`` the old ones are closed too.

Limitation: the proxy's own kernel acknowledges what the client sends, so the client's TCP
keepalives and ``tcp_user_timeout`` do not see a cut made here; a real partition (or network
namespaces) would. What the runtime must do about a hung statement is tested here; what the
kernel detects is not.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator


class TcpProxy:
    """Listens on a loopback port; forwards to ``target_host:target_port``, or to a
    PostgreSQL Unix socket when ``target_host`` is a directory (``/dir``, port 5432)."""

    def __init__(self, target_host: str, target_port: int, *, listen_port: int = 0) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", listen_port))
        self._listener.listen(512)
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()  # set: forwarding; clear: cut
        self._open.set()
        self._reject = False
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket | None]] = set()
        self.connections = 0
        """Connections accepted so far."""
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._thread.start()

    # -- the test's controls -----------------------------------------------------------------

    def cut(self, *, reject: bool = False) -> None:
        """Stop forwarding (see the module docstring). ``reject``: instead, close every
        connection and refuse new ones at once (a host that is down, a firewall that
        answers with resets): clients get errors, not silence."""
        self._reject = reject
        self._open.clear()
        if reject:
            self.reset()

    def heal(self) -> None:
        self._reject = False
        self._open.set()

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    def reset(self) -> None:
        with self._lock:
            pairs, self._pairs = set(self._pairs), set()
        for client, server in pairs:
            _close(client)
            if server is not None:
                _close(server)

    def repoint(self, host: str, port: int, *, reset: bool = True) -> None:
        self.target = (host, port)
        if reset:
            self.reset()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        _close(self._listener)
        self.reset()
        self._thread.join(5)

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def partitioned(self, *, reject: bool = False) -> Iterator[None]:
        self.cut(reject=reject)
        try:
            yield
        finally:
            self.heal()

    # -- forwarding --------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            if self._reject:
                _close(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        pair: tuple[socket.socket, socket.socket | None] = (client, None)
        with self._lock:
            self._pairs.add(pair)
        self._open.wait()  # a connection made during a cut hangs until the heal
        try:
            server = self._connect()
        except OSError:
            self._drop(pair)
            return
        server.settimeout(None)
        with self._lock:
            if pair not in self._pairs:  # reset meanwhile
                _close(server)
                return
            self._pairs.discard(pair)
            pair = (client, server)
            self._pairs.add(pair)
        self._pump(client, server)
        self._drop(pair)

    def _connect(self) -> socket.socket:
        host, port = self.target
        if host.startswith("/"):  # a Unix socket directory, as libpq names one
            server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            server.settimeout(5)
            server.connect(f"{host}/.s.PGSQL.{port}")
            return server
        return socket.create_connection((host, port), timeout=5)

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        peers = {client: server, server: client}
        while not self._closed.is_set():
            if not self._open.wait(0.2):
                continue  # cut: read nothing, so nothing is forwarded
            try:
                ready, _, _ = select.select(list(peers), [], [], 0.2)
            except (OSError, ValueError):
                return
            for src in ready:
                if not self._open.is_set():
                    break
                try:
                    data = src.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                try:
                    peers[src].sendall(data)
                except OSError:
                    return

    def _drop(self, pair: tuple[socket.socket, socket.socket | None]) -> None:
        with self._lock:
            self._pairs.discard(pair)
        _close(pair[0])
        if pair[1] is not None:
            _close(pair[1])


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()
