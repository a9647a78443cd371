"""Prices per million tokens, from configuration, and the cost of a step.

A model the table does not price is never free: its tokens are charged at the highest known
rate of each kind (so a cost budget still stops it, early rather than never), a warning is
logged once per model and process, and every such lookup is counted
(``dar_unpriced_cost_lookups_total``). Give the model a price in ``DAR_PRICES`` to fix it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal

from db.errors import DarError
from db.records import Usage

MILLION = Decimal(1_000_000)

log = logging.getLogger(__name__)


class PricingError(DarError):
    """Invalid price configuration."""


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens."""

    input: Decimal
    output: Decimal
    cache_write: Decimal
    cache_read: Decimal

    def cost(self, usage: Usage) -> Decimal:
        return (
            self.input * usage.input_tokens
            + self.output * usage.output_tokens
            + self.cache_write * usage.cache_creation_input_tokens
            + self.cache_read * usage.cache_read_input_tokens
        ) / MILLION


def _price(i: str, o: str, cw: str, cr: str) -> Price:
    return Price(Decimal(i), Decimal(o), Decimal(cw), Decimal(cr))


# Defaults, overridable with DAR_PRICES (JSON). Matched by longest model-name prefix.
DEFAULT_PRICES: dict[str, Price] = {
    "claude-opus-4": _price("15", "75", "18.75", "1.50"),
    "claude-sonnet-4": _price("3", "15", "3.75", "0.30"),
    "claude-haiku-4": _price("1", "5", "1.25", "0.10"),
    "claude-3-5-haiku": _price("0.80", "4", "1", "0.08"),
    # The runtime's own stand-ins for a model (the demo client, the scripted test double)
    # bill nothing, and say so here rather than by being unknown.
    "demo": _price("0", "0", "0", "0"),
    "dar-demo": _price("0", "0", "0", "0"),  # the demo model's name before 0.2.0
    "scripted": _price("0", "0", "0", "0"),
}


class PriceTable:
    def __init__(self, prices: Mapping[str, Price]) -> None:
        self._prices = dict(prices)
        values = list(self._prices.values())
        # What a model without a price is charged: the highest known rate of each kind.
        self.fallback = Price(
            max((p.input for p in values), default=Decimal(0)),
            max((p.output for p in values), default=Decimal(0)),
            max((p.cache_write for p in values), default=Decimal(0)),
            max((p.cache_read for p in values), default=Decimal(0)),
        )
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._listeners: list[Callable[[str], None]] = []

    def on_unpriced(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(model)`` whenever a cost is computed at the fallback rate."""
        self._listeners.append(listener)

    @classmethod
    def from_json(cls, raw: str | None) -> PriceTable:
        """``{"model-prefix": {"input": 3, "output": 15, "cache_write": 3.75,
        "cache_read": 0.3}, ...}`` merged over the defaults."""
        prices = dict(DEFAULT_PRICES)
        if raw:
            try:
                data = json.loads(raw)
                for model, p in data.items():
                    prices[model] = Price(
                        Decimal(str(p["input"])),
                        Decimal(str(p["output"])),
                        Decimal(str(p.get("cache_write", p["input"]))),
                        Decimal(str(p.get("cache_read", p["input"]))),
                    )
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise PricingError(
                    "DAR_PRICES must be JSON like "
                    '{"claude-sonnet-4": {"input": 3, "output": 15}}: ' + str(e)
                ) from None
        return cls(prices)

    def price_for(self, model: str) -> Price | None:
        best = max((k for k in self._prices if model.startswith(k)), key=len, default=None)
        return self._prices[best] if best else None

    def cost(self, model: str, usage: Usage) -> Decimal:
        """The cost of ``usage`` on ``model``; at :attr:`fallback` when it has no price."""
        price = self.price_for(model)
        if price is not None:
            return price.cost(usage)
        with self._lock:
            first = model not in self._warned
            self._warned.add(model)
        if first:
            log.warning(
                "model %r has no price in DAR_PRICES: charging its tokens at the highest known "
                "rate ($%s in, $%s out per million) until it gets one",
                model,
                self.fallback.input,
                self.fallback.output,
                extra={"event": "unpriced_model", "model": model},
            )
        for listener in self._listeners:
            listener(model)
        return self.fallback.cost(usage)
