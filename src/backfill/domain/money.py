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

# Balances, reservations and charges are int64 picodollar columns (2**63 - 1 is about 9.22 M
# USD). These caps keep every value Backfill writes inside that range with room to spare; sums
# over many rows (lifetime credits, all receipts) are computed without the cap (see the ledger).
MAX_CREDIT_USD = 1_000_000
MAX_BALANCE_USD = 9_000_000
MAX_CREDIT = MAX_CREDIT_USD * PICO_PER_USD
MAX_BALANCE = MAX_BALANCE_USD * PICO_PER_USD
# uUSD per million tokens: 10,000 USD per million tokens. With at most MAX_TOKENS tokens a
# request's charge stays under 10**18 pUSD (1 M USD) per price, so it always fits.
MAX_TOKEN_PRICE = 10**10
MAX_TOKENS = 100_000_000
# uUSD per GPU-second (0.10 USD, 360 USD per GPU-hour) and GPUs per deployment: at most
# 102.4 USD a second, so a GPU-time receipt of up to MAX_GPU_RECEIPT_MS (one hour, 368,640 USD)
# fits with room to spare; the meter splits longer spans.
MAX_GPU_SECOND_PRICE = 10**5
MAX_GPUS = 1024
MAX_GPU_RECEIPT_MS = 3_600_000
# Digits before the point that an amount may have at all; the real caps are checked after.
_MAX_USD_DIGITS = 24


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
    """Parse a USD amount such as ``"12.50"`` exactly; raises ValueError when it is not exact.

    Integer arithmetic on the decimal's digits: Decimal multiplication rounds to 28 digits and
    raises on huge exponents, and neither may happen to money.
    """
    try:
        value = Decimal(amount.strip())
    except InvalidOperation:
        raise ValueError(f"{amount!r} is not an amount of USD such as 12.50") from None
    sign, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):  # NaN or infinity
        raise ValueError(f"{amount!r} is not an amount of USD such as 12.50")
    if value.is_zero():
        return 0
    if value.adjusted() >= _MAX_USD_DIGITS:
        raise ValueError(f"{amount!r} is too large")
    whole = int("".join(map(str, digits)))
    shift = exponent + 12  # the power of ten that turns the digits into picodollars
    if shift >= 0:
        pico: int = whole * 10**shift
    else:
        # Bounded by the number of digits given, so "1e-999999999" costs nothing.
        drop: int = 10 ** min(-shift, len(digits) + 1)
        if whole % drop:
            raise ValueError(f"{amount!r} has more precision than a picodollar")
        pico = whole // drop
    return -pico if sign else pico


def pico_to_usd(pico: int) -> str:
    """Picodollars as an exact decimal USD string, trailing zeros trimmed."""
    sign = "-" if pico < 0 else ""
    whole, frac = divmod(abs(pico), PICO_PER_USD)
    text = f"{whole}.{frac:012d}".rstrip("0").rstrip(".")
    return sign + text if "." in text else f"{sign}{whole}"
