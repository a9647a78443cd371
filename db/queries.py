"""Loads the named statements of ``queries.sql``: ``QUERIES["claim_run"]``."""

from __future__ import annotations

import re
from importlib import resources
from types import MappingProxyType

from sqlalchemy import TextClause, text

_HEADER = re.compile(r"^-- (?P<name>[a-z_]+) --$", re.MULTILINE)


def _load() -> dict[str, TextClause]:
    source = resources.files(__package__).joinpath("queries.sql").read_text(encoding="utf-8")
    parts = _HEADER.split(source)
    # parts = [preamble, name1, body1, name2, body2, ...]
    out: dict[str, TextClause] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        sql = "\n".join(lines).strip().rstrip(";")
        if name in out:
            raise RuntimeError(f"queries.sql names {name!r} twice")
        out[name] = text(sql)
    return out


QUERIES = MappingProxyType(_load())
