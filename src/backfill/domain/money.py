"""Exact money: integer picodollars, prices in microdollars per million tokens (SPEC §7.3).

``tokens x (uUSD per 1e6 tokens)`` is exactly ``tokens x price`` picodollars, so every charge
and reservation is an integer product: no floats, no rounding anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

PICO_PER_USD = 10**12
PICO_PER_MICRO = 10**6
PRICE_UNIT = "microusd_per_million_tokens"


@dataclass(frozen=True, slots=True)
class Prices:
    """Batch prices of one model revision, in microdollars per million tokens."""

    input: int
    cached_input: int
    output: int

    @classmethod
    def of(cls, input: int, cached_input: int | None, output: int) -> Prices:
        """Prices as configured: cached input costs what input costs unless said otherwise."""
        return cls(input, input if cached_input is None else cached_input, output)

    @classmethod
    def stored(
        cls, input: int | None, cached_input: int | None, output: int | None
    ) -> Prices | None:
        """Prices from nullable columns; None where no prices were stored."""
        if input is None or output is None:
            return None
        return cls(input, cached_input or 0, output)

    def as_api(self) -> dict[str, str]:
        return {
            "unit": PRICE_UNIT,
            "input": str(self.input),
            "cached_input": str(self.cached_input),
            "output": str(self.output),
        }


def token_charge(prices: Prices, input_tokens: int, cached_tokens: int, output_tokens: int) -> int:
    """Picodollars for one request's real usage."""
    cached = min(max(cached_tokens, 0), input_tokens)
    return (
        (input_tokens - cached) * prices.input
        + cached * prices.cached_input
        + output_tokens * prices.output
    )


def worst_case(prices: Prices, prompt_token_bound: int, max_output_tokens: int) -> int:
    """Picodollars reserved for requests that may use at most these many tokens."""
    return prompt_token_bound * max(prices.input, prices.cached_input) + (
        max_output_tokens * prices.output
    )


def gpu_time_charge(gpu_count: int, microusd_per_gpu_second: int, milliseconds: int) -> int:
    """Picodollars for ``milliseconds`` of a deployment with ``gpu_count`` GPUs."""
    # uUSD/s x ms = 1e-6 USD x 1e-3 = 1e-9 USD = 1000 pUSD.
    return gpu_count * microusd_per_gpu_second * milliseconds * 1000


def usd_to_pico(amount: str) -> int:
    """Parse a USD amount such as ``"12.50"`` exactly; raises ValueError when it is not exact."""
    try:
        value = Decimal(amount.strip())
    except InvalidOperation:
        raise ValueError(f"{amount!r} is not an amount of USD such as 12.50") from None
    pico = value * PICO_PER_USD
    if not value.is_finite() or pico != pico.to_integral_value():
        raise ValueError(f"{amount!r} has more precision than a picodollar")
    return int(pico)


def pico_to_usd(pico: int) -> str:
    """Picodollars as an exact decimal USD string, trailing zeros trimmed."""
    sign = "-" if pico < 0 else ""
    whole, frac = divmod(abs(pico), PICO_PER_USD)
    text = f"{whole}.{frac:012d}".rstrip("0").rstrip(".")
    return sign + text if "." in text else f"{sign}{whole}"
