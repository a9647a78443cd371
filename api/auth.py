"""Bearer tokens with roles and tenants, configured by environment and kept only as SHA-256
hashes.

``DAR_API_TOKENS`` lists ``name:role+role:sha256hex[:tenant][:expires=WHEN]`` entries,
separated by commas or newlines; ``DAR_API_TOKENS_FILE`` names a file of more entries, read
again when it changes, so a token is added or revoked (its line removed) without a restart.
``expires=`` takes a date (``2027-01-31``, the start of that day UTC) or Unix seconds; an
expired token is refused (401) like an unknown one. A token belongs to its tenant (its own
name unless the entry names one): runs, approvals, idempotency keys and lists are scoped to
the tenant, and only ``admin`` sees every tenant. ``dar token new NAME --roles read,submit``
makes a token and prints its entry. A presented token is hashed and compared with every
configured hash in constant time. With no tokens configured the API is open (development)
and says so loudly at start.
"""

from __future__ import annotations

import difflib
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
from functools import wraps
from typing import Any, TypeVar

from flask import current_app, g, request

from api.errors import ApiError
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
F = TypeVar("F", bound=Callable[..., Any])


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


def current_principal() -> Principal | None:
    principal: Principal | None = g.get("dar_principal")
    return principal


def requires(role: str) -> Callable[[F], F]:
    """The view needs a token with ``role`` (any request passes when auth is off)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")

    def decorate(view: F) -> F:
        @wraps(view)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            check_role(role)
            return view(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def check_role(role: str) -> Principal | None:
    """The request's principal, which must hold ``role``: 401 without a valid token, 403
    without the role (``None``, anything allowed, when authentication is off)."""
    principal = _authenticate()
    if principal is not None and not principal.has(role):
        raise ApiError(
            403,
            f"token {principal.name!r} lacks the role {role!r} "
            f"(it has: {', '.join(sorted(principal.roles))})",
            code="forbidden",
        )
    return principal


def authenticated(view: F) -> F:
    """The view needs a valid token, whatever its roles (any request passes when auth is
    off)."""

    @wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _authenticate()
        return view(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _authenticate() -> Principal | None:
    """The request's principal (kept on ``g``); 401 without a valid bearer token when tokens
    are configured; ``None`` when they are not."""
    table = tokens_now()
    if not table.enabled:
        return None
    principal = table.bearer(request.headers.get("Authorization", ""))
    if principal is None:
        raise ApiError(
            401,
            "send a valid API token: Authorization: Bearer <token>",
            code="unauthorized",
        )
    g.dar_principal = principal
    return principal


def tokens_now() -> TokenTable:
    """This app's tokens as they are now (``DAR_API_TOKENS_FILE`` may have changed)."""
    source: TokenSource = current_app.extensions["dar_token_source"]
    table = source.current()
    current_app.extensions["dar_tokens"] = table
    return table


def check_token_roles(table: TokenTable, approval_roles: set[str]) -> None:
    """Every role a token names must be a built-in role or an approval role some durable
    function declares: a typo (``reed``, ``admn``) would otherwise grant nothing, silently."""
    known = set(ROLES) | approval_roles
    for _, principal in table.entries:
        for role in sorted(principal.roles - known):
            close = difflib.get_close_matches(role, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"DAR_API_TOKENS entry {principal.name!r} names the unknown role {role!r}"
                f"{hint}: roles are {', '.join(ROLES)}, or an approval role a durable "
                f"function declares ({', '.join(sorted(approval_roles)) or 'none declared'})"
            )


def tenant_scope() -> str | None:
    """The tenant whose runs this request may see: ``None`` for every tenant (an ``admin``
    token, or authentication off)."""
    principal = current_principal()
    if principal is None or principal.admin:
        return None
    return principal.tenant


def actor() -> tuple[str, str]:
    """``(token name, tenant)`` of the request, for the audit trail."""
    principal = current_principal()
    return (principal.name, principal.tenant) if principal else ("anonymous", "")


def check_approval_roles(table: TokenTable, roles: set[str]) -> None:
    """With tokens configured, every approval role a durable function declares must be held
    (explicitly, not through admin) by some token, or its approvals could never be decided."""
    if not table.enabled:
        return
    held = {r for _, p in table.entries for r in p.roles}
    missing = sorted(roles - held)
    if missing:
        raise ConfigError(
            f"approval role {missing[0]!r} is declared by a durable function but no token in "
            f"DAR_API_TOKENS has it: add it to a token's roles (e.g. lead:approve+{missing[0]}:...)"
        )


def warn_if_open(table: TokenTable) -> None:
    if not table.enabled:
        log.warning(
            "API AUTHENTICATION IS OFF: DAR_API_TOKENS is not set, so anyone who can reach "
            "this port can submit, read and cancel runs. Set DAR_API_TOKENS before exposing it."
        )
