"""Sums of picodollar columns that never overflow a 64-bit integer."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, literal_column


def sum_halves(column: Any) -> tuple[Any, Any]:
    """``SUM(column)`` as two sums, of its high and of its low 32 bits: lifetime credits may
    exceed any one balance, and SQLite's SUM raises "integer overflow" past 2**63. Both halves
    are exact on SQLite and PostgreSQL up to 2**31 rows; ``joined`` adds them back."""
    high = func.coalesce(func.sum(column.op(">>")(literal_column("32"))), 0)
    low = func.coalesce(func.sum(column.op("&")(literal_column("4294967295"))), 0)
    return high, low


def joined(high: Any, low: Any) -> int:
    """The sum whose halves ``sum_halves`` read."""
    return (int(high) << 32) + int(low)
