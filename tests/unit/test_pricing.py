"""Prices: configured, matched by prefix, and never a silent zero for an unknown model."""

from __future__ import annotations

import logging
from decimal import Decimal

import pytest

from db.records import Usage
from runtime.llm.pricing import DEFAULT_PRICES, PriceTable, PricingError


def test_known_models_are_priced_by_longest_prefix() -> None:
    table = PriceTable.from_json('{"claude-sonnet-4-5": {"input": 1, "output": 2}}')
    usage = Usage(input_tokens=1_000_000, output_tokens=1_000_000)
    assert table.cost("claude-sonnet-4-5-20250929", usage) == Decimal(3)
    assert table.cost("claude-sonnet-4-0", usage) == Decimal(18)


def test_an_unknown_model_costs_the_highest_known_rate_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = PriceTable.from_json(None)
    seen: list[str] = []
    table.on_unpriced(seen.append)
    usage = Usage(input_tokens=1_000_000, output_tokens=1_000_000)
    top_in = max(p.input for p in DEFAULT_PRICES.values())
    top_out = max(p.output for p in DEFAULT_PRICES.values())
    with caplog.at_level(logging.WARNING, logger="runtime.llm.pricing"):
        first = table.cost("gpt-unknown", usage)
        second = table.cost("gpt-unknown", usage)
    assert first == second == top_in + top_out
    assert first > 0
    warnings = [r for r in caplog.records if "gpt-unknown" in r.getMessage()]
    assert len(warnings) == 1, "one warning per model and process, not one per call"
    assert "DAR_PRICES" in warnings[0].getMessage()
    assert seen == ["gpt-unknown", "gpt-unknown"], "every lookup is counted"


def test_a_price_of_zero_set_on_purpose_is_zero() -> None:
    table = PriceTable.from_json(None)
    assert table.cost("dar-demo", Usage(input_tokens=1000)) == 0


def test_bad_price_json_is_refused() -> None:
    with pytest.raises(PricingError, match="DAR_PRICES"):
        PriceTable.from_json('{"m": {"input": 1}}')
