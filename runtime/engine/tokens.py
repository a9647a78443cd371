"""API tokens as configured: ``name:role+role:sha256hex[:tenant][:expires=WHEN]`` entries of
``DAR_API_TOKENS`` and ``DAR_API_TOKENS_FILE``, kept only as SHA-256 hashes
(:mod:`api.auth` checks them on each request).

Here, below the API, because the engine asks them too: a schedule's ticks start runs in its
creator's name only while that token is configured and unexpired (the beat reads the same
table, the file again when it changes)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from runtime.config import ConfigError

log = logging.getLogger(__name__)

ROLES = ("read", "submit", "cancel", "approve", "metrics", "admin")
"""``admin`` holds every one of these roles, in every tenant (and alone may resolve a run that
needs attention). It does not hold the approval roles of durable functions: an approval is
decided only by a token that names its role. ``metrics`` reads the web process's
``/metrics`` (fleet-wide counts, every tenant's), unless ``DAR_METRICS_PUBLIC`` opens it."""

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
ROLE = re.compile(r"^[A-Za-z0-9_.-]+$")
NAME = re.compile(r"^[A-Za-z0-9_.@-]+$")
"""Token and tenant names: no ``:`` or ``,`` (the entry's separators), no spaces."""


@dataclass(frozen=True)
class Principal:
    name: str
    roles: frozenset[str]
    tenant: str = ""
    expires_at: float | None = None
    """Unix seconds after which the token is refused; ``None``: never."""

    @property
    def admin(self) -> bool:
        return "admin" in self.roles

    def has(self, role: str) -> bool:
        """A built-in role (``admin`` implies each of them)."""
        return role in self.roles or self.admin

    def holds(self, role: str) -> bool:
        """An approval role, named by the token itself (``admin`` does not imply it)."""
        return role in self.roles


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return "dar_" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class TokenTable:
    entries: tuple[tuple[bytes, Principal], ...]

    @property
    def enabled(self) -> bool:
        return bool(self.entries)

    @classmethod
    def parse(cls, raw: str | None) -> TokenTable:
        entries: list[tuple[bytes, Principal]] = []
        names: set[str] = set()
        for item in filter(None, (p.strip() for p in re.split(r"[,\n]", raw or ""))):
            if item.startswith("#"):
                continue  # a comment line of DAR_API_TOKENS_FILE
            parts = item.split(":")
            expires_at: float | None = None
            if len(parts) > 3 and parts[-1].strip().startswith("expires="):
                expires_at = parse_expiry(parts[0], parts.pop().strip()[len("expires=") :])
            if len(parts) not in (3, 4):
                raise ConfigError(
                    f"DAR_API_TOKENS entry {parts[0]!r} must be name:role+role:sha256hex, "
                    "optionally followed by :tenant and :expires=YYYY-MM-DD "
                    "(make one with `dar token new NAME --roles read,submit`)"
                )
            name, roles_raw, digest = (p.strip() for p in parts[:3])
            tenant = parts[3].strip() if len(parts) == 4 else name
            if not NAME.match(name) or not NAME.match(tenant):
                raise ConfigError(
                    f"DAR_API_TOKENS entry {name!r}: token and tenant names are letters, "
                    "digits and _ . @ -"
                )
            roles = frozenset(r for r in roles_raw.split("+") if r)
            bad = sorted(r for r in roles if not ROLE.match(r))
            if not name or not roles or bad:
                raise ConfigError(
                    f"DAR_API_TOKENS entry {name!r}: roles are {', '.join(ROLES)}, or approval "
                    "roles of your durable functions (letters, digits, _ . -)"
                    + (f"; not a role: {', '.join(bad)}" if bad else "")
                )
            if not _HEX64.match(digest.lower()):
                raise ConfigError(
                    f"DAR_API_TOKENS entry {name!r}: the third part must be the token's "
                    "SHA-256 as 64 hex digits, never the token itself"
                )
            if name in names:
                raise ConfigError(f"DAR_API_TOKENS names {name!r} twice")
            names.add(name)
            entries.append(
                (bytes.fromhex(digest.lower()), Principal(name, roles, tenant, expires_at))
            )
        return cls(tuple(entries))

    def authenticate(self, token: str) -> Principal | None:
        presented = hashlib.sha256(token.encode()).digest()
        found: Principal | None = None
        for digest, principal in self.entries:  # no early exit: constant time over entries
            if hmac.compare_digest(presented, digest):
                found = principal
        if found is not None and found.expires_at is not None and time.time() >= found.expires_at:
            return None  # expired: refused like an unknown token
        return found

    def bearer(self, header: str) -> Principal | None:
        """The principal of an ``Authorization: Bearer <token>`` header, if valid."""
        scheme, _, token = header.partition(" ")
        return self.authenticate(token.strip()) if scheme.lower() == "bearer" else None

    def current(self, name: str) -> bool:
        """A token of this name is configured and has not expired (a schedule it created
        may start runs in its name)."""
        now = time.time()
        return any(
            p.name == name and (p.expires_at is None or now < p.expires_at) for _, p in self.entries
        )

    def admits(self, header: str) -> bool:
        """The header carries a valid token, or authentication is off."""
        return not self.enabled or self.bearer(header) is not None


def parse_expiry(name: str, raw: str) -> float:
    """``expires=``: a date (``2027-01-31``: the start of that day, UTC) or Unix seconds."""
    raw = raw.strip()
    if raw.isdigit():
        return float(raw)
    try:
        day = datetime.strptime(raw, "%Y-%m-%d").replace(tzinfo=UTC)
    except ValueError:
        raise ConfigError(
            f"DAR_API_TOKENS entry {name!r}: expires= takes a date (2027-01-31) or Unix "
            f"seconds, got {raw!r}"
        ) from None
    return day.timestamp()


class TokenSource:
    """The token table of ``DAR_API_TOKENS`` plus ``DAR_API_TOKENS_FILE``, read again when
    the file changes (its mtime, size or inode; looked at most once a second), so tokens are
    added and revoked without a restart. A file that no longer parses keeps the last good
    table, with an error in the log; at start it fails the process like a bad variable."""

    CHECK_SECONDS = 1.0

    def __init__(
        self,
        env: str | None,
        path: str | None,
        check: Callable[[TokenTable], None] = lambda _: None,
    ) -> None:
        self.env = env
        self.path = path
        self.check = check
        self._lock = threading.Lock()
        self._seen: tuple[float, int, int] | None = None
        self._looked = 0.0
        self.table = self._load()

    def _stat(self) -> tuple[float, int, int] | None:
        if not self.path:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return (0.0, -1, 0)
        return (st.st_mtime, st.st_size, st.st_ino)

    def _load(self) -> TokenTable:
        self._seen = self._stat()
        text = self.env or ""
        if self.path:
            try:
                with open(self.path, encoding="utf-8") as f:
                    text += "\n" + f.read()
            except FileNotFoundError:
                raise ConfigError(
                    f"DAR_API_TOKENS_FILE {self.path!r} does not exist (an empty file means "
                    "no tokens from it)"
                ) from None
        table = TokenTable.parse(text)
        self.check(table)
        return table

    def may_act_for(self, name: str) -> bool:
        """Whether a schedule created by the token ``name`` may start a run in its name now:
        the token is still configured and unexpired (always, with no tokens configured)."""
        table = self.current()
        return not table.enabled or table.current(name)

    def current(self) -> TokenTable:
        """The table now: the file read again if it changed since it was last read."""
        if not self.path:
            return self.table
        now = time.monotonic()
        if now - self._looked < self.CHECK_SECONDS:
            return self.table
        with self._lock:
            self._looked = now
            if self._stat() != self._seen:
                try:
                    self.table = self._load()
                    log.info(
                        "API tokens read again from DAR_API_TOKENS_FILE: %d tokens",
                        len(self.table.entries),
                    )
                except ConfigError as e:
                    log.error("DAR_API_TOKENS_FILE not applied, the last tokens stay: %s", e)
        return self.table
