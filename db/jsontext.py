"""JSON values as PostgreSQL ``jsonb`` accepts them, and back, unchanged.

``jsonb`` refuses two things a Python string may hold and a model answer or a tool's output
does hold now and then: the character NUL (``\\u0000``: "unsupported Unicode escape
sequence") and a lone surrogate (``\\ud800`` without its pair: not encodable as UTF-8). A
value holding either is stored in a reversible form, so it is recorded (and billed) like any
other and reads back equal:

- every string in it (keys included) is escaped with the private-use character U+E000 as
  the escape: U+E000 itself as ``U+E000 'e'``, NUL as ``U+E000 '0'``, a lone surrogate as
  ``U+E000 's'`` and four hex digits;
- the escaped value is wrapped as ``{"$dar.jsontext": 1, "v": <escaped>}``. A stored object
  with that key is always such a wrapper: a value that has the key at its top is wrapped
  too, so reading back never mistakes a user's object for one.

Every other value (nearly all) is stored as plain JSON text, and reading it back costs one
dict lookup. Non-finite floats (``NaN``, ``Infinity``) are not JSON: they are written as
``json.dumps`` writes them and ``jsonb`` refuses them (a ``DataError``), rather than being
stored as something else.
"""

from __future__ import annotations

import json
import re
from typing import Any

MARKER = "$dar.jsontext"
"""The key of the wrapper of an escaped value."""
_ESC = "\ue000"
_NEEDS = re.compile("[\x00\ud800-\udfff]")
_ESCAPED = re.compile(f"{_ESC}(?:e|0|s[0-9a-f]{{4}})")


def dumps(value: Any) -> str:
    """``value`` as JSON text ``jsonb`` accepts (see the module's docstring)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=True)
    wrapper = type(value) is dict and MARKER in value
    if not wrapper and "\\u0000" not in text and (text.isascii() or _NEEDS.search(text) is None):
        return text  # (a NUL is escaped as \\u0000 in the text; an ASCII text has no surrogate)
    return json.dumps(
        {MARKER: 1, "v": _walk(value, _escape)},
        separators=(",", ":"),
        ensure_ascii=False,
    )


def loads(value: Any) -> Any:
    """A value read from a ``jsonb`` column (already parsed by the driver) as it was given
    to :func:`dumps`."""
    if type(value) is dict and MARKER in value:
        return _walk(value["v"], _unescape)
    return value


def _escape(s: str) -> str:
    if _ESC not in s and _NEEDS.search(s) is None:
        return s
    s = s.replace(_ESC, _ESC + "e").replace("\x00", _ESC + "0")
    return _NEEDS.sub(lambda m: f"{_ESC}s{ord(m.group()):04x}", s)


def _unescape(s: str) -> str:
    if _ESC not in s:
        return s

    def one(m: re.Match[str]) -> str:
        code = m.group()[1:]
        if code == "e":
            return _ESC
        if code == "0":
            return "\x00"
        return chr(int(code[1:], 16))

    return _ESCAPED.sub(one, s)


def _key(k: Any) -> str:
    """A key as ``json.dumps`` writes it (``True`` as ``true``, ``1.5`` as ``1.5``)."""
    return k if isinstance(k, str) else json.dumps(k)


def _walk(value: Any, fix: Any) -> Any:
    if isinstance(value, str):
        return fix(value)
    if isinstance(value, dict):
        return {fix(_key(k)): _walk(v, fix) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_walk(v, fix) for v in value]
    return value


def text(value: str | None) -> str | None:
    """``value`` for a ``text`` column (an error message, a reason: read by people, not
    parsed back), which refuses NUL too: NUL and lone surrogates written as ``\\u0000``,
    ``\\udxxx``."""
    if value is None or _NEEDS.search(value) is None:
        return value
    return _NEEDS.sub(lambda m: f"\\u{ord(m.group()):04x}", value)
