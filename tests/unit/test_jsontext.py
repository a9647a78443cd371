"""db/jsontext.py: every JSON value round-trips, escaped only when it must be (issue 23
defect 5)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from db import jsontext

ODD = ["\x00", "\ud800", "\udfff", "\ue000", "e", "0", "s", "\\", "\\u0000", "a", "é", "😀"]


def _random_string(rng: random.Random) -> str:
    return "".join(rng.choice(ODD) for _ in range(rng.randint(0, 8)))


def _parsed(text: str) -> Any:
    """As PostgreSQL hands a jsonb value back: parsed."""
    return json.loads(text)


@pytest.mark.parametrize("seed", range(20))
def test_random_values_with_nul_surrogates_and_the_escape_round_trip(seed: int) -> None:
    rng = random.Random(seed)
    value = {
        _random_string(rng): [_random_string(rng), {_random_string(rng): _random_string(rng)}]
        for _ in range(5)
    }
    text = jsontext.dumps(value)
    assert "\\u0000" not in text.replace("\\\\", "")
    text.encode("utf-8")  # no lone surrogate left
    assert jsontext.loads(_parsed(text)) == value


@pytest.mark.parametrize(
    "value",
    [
        {"a": 1, "b": [True, None, 2.5, "x\ue000y"]},
        "plain",
        [1, 2],
        None,
    ],
)
def test_values_that_need_nothing_are_stored_as_plain_json(value: Any) -> None:
    text = jsontext.dumps(value)
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    assert jsontext.loads(_parsed(text)) == value


def test_a_users_object_with_the_marker_key_is_wrapped_so_it_reads_back_as_it_was() -> None:
    value = {jsontext.MARKER: 1, "v": "not a wrapper"}
    text = jsontext.dumps(value)
    assert _parsed(text) != value
    assert jsontext.loads(_parsed(text)) == value


def test_text_for_people_shows_nul_and_surrogates_visibly() -> None:
    assert jsontext.text("a\x00b\ud800") == "a\\u0000b\\ud800"
    assert jsontext.text("fine") == "fine"
    assert jsontext.text(None) is None


@pytest.mark.parametrize("value", ["a\x00b", {"k\x00": "plain"}, ["é\x00", "😀"], "\ue000\x00"])
def test_nul_without_a_surrogate_is_escaped_too(value: Any) -> None:
    """NUL alone (in an ASCII text, or beside other non-ASCII characters): ``json.dumps``
    writes it as ``\\u0000``, which ``jsonb`` refuses just the same."""
    text = jsontext.dumps(value)
    assert "\\u0000" not in text.replace("\\\\", "")
    assert jsontext.loads(_parsed(text)) == value
