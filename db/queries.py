"""Loads the named statements of ``queries.sql``: ``QUERIES["claim_run"]`` (and the demo's,
``demo.sql``, as ``DEMO_QUERIES``).

A section whose name starts with ``_`` is a fragment, not a statement: a line ``{{_name}}``
of a statement stands for its text, as written (its indentation kept)."""

from __future__ import annotations

import re
from importlib import resources
from types import MappingProxyType

from sqlalchemy import TextClause, text

_HEADER = re.compile(r"^-- (?P<name>[a-z_]+) --$", re.MULTILINE)
_FRAGMENT = re.compile(r"^\{\{(?P<name>_[a-z_]+)\}\}$", re.MULTILINE)


def _load(filename: str) -> dict[str, TextClause]:
    source = resources.files(__package__).joinpath(filename).read_text(encoding="utf-8")
    parts = _HEADER.split(source)
    # parts = [preamble, name1, body1, name2, body2, ...]
    bodies: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [ln for ln in body.strip("\n").splitlines() if not ln.lstrip().startswith("--")]
        if name in bodies:
            raise RuntimeError(f"queries.sql names {name!r} twice")
        bodies[name] = "\n".join(lines).strip("\n").rstrip().rstrip(";")

    def fragment(m: re.Match[str]) -> str:
        if m["name"] not in bodies:
            raise RuntimeError(f"queries.sql has no fragment {m['name']!r}")
        return bodies[m["name"]]

    return {
        name: text(_FRAGMENT.sub(fragment, sql).strip())
        for name, sql in bodies.items()
        if not name.startswith("_")
    }


QUERIES = MappingProxyType(_load("queries.sql"))
"""The runtime's statements (the store's)."""
DEMO_QUERIES = MappingProxyType(_load("demo.sql"))
"""The demo agent's statements, for its own tables (:mod:`db.demo`)."""
