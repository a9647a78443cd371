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
import logging
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from flask import current_app, g, request

from api.errors import ApiError
from runtime.config import ConfigError
from runtime.engine.tokens import (
    NAME,
    ROLE,
    ROLES,
    Principal,
    TokenSource,
    TokenTable,
    hash_token,
    new_token,
    parse_expiry,
)

__all__ = [
    "NAME",
    "ROLE",
    "ROLES",
    "Principal",
    "TokenSource",
    "TokenTable",
    "hash_token",
    "new_token",
    "parse_expiry",
]

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


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
