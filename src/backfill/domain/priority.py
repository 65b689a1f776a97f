"""A batch's priority, and the rank its chunks are claimed in (docs/scheduling.md, "Priority
and pause").

Priority orders the batches of one org's lane: higher first. Across orgs it changes nothing:
lanes still take turns by weighted fair share. A batch the planner finds about to miss its
window is rescued: it goes before every priority of its lane, earliest deadline first.
"""

from __future__ import annotations

from backfill.errors import InvalidInput

MIN_PRIORITY = -100
MAX_PRIORITY = 100
"""The bounds no org's cap may pass."""
DEFAULT_MAX_PRIORITY = 10
"""The cap of an org whose administrator set none."""
URGENT_RANK = MIN_PRIORITY - MAX_PRIORITY - 1
"""Below the rank of any priority: a rescued batch's chunks go first."""


def claim_rank(priority: int, urgent: bool) -> int:
    """Where a batch's chunks stand in its lane: lower goes first (the claim's index holds it
    ascending)."""
    return URGENT_RANK if urgent else -priority


def check_priority(value: object, cap: int, param: str = "priority") -> int:
    """``value`` as a batch's priority for an org whose cap is ``cap``, or a 400 that says
    what is allowed."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(
            f"'{param}' must be a whole number from {MIN_PRIORITY} to {cap} (higher runs first).",
            code="invalid_value",
            param=param,
        )
    if value < MIN_PRIORITY:
        raise InvalidInput(
            f"'{param}' is {value}; the lowest priority is {MIN_PRIORITY}.",
            code="invalid_value",
            param=param,
        )
    if value > cap:
        raise InvalidInput(
            f"'{param}' is {value}; your organization's batches may have a priority of at most "
            f"{cap}. An administrator can raise the cap (up to {MAX_PRIORITY}).",
            code="priority_too_high",
            param=param,
        )
    return value


def check_cap(value: object) -> int:
    """An org's priority cap as an administrator sets it."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise InvalidInput(
            f"'max_priority' must be a whole number from 0 to {MAX_PRIORITY}.",
            code="invalid_value",
            param="max_priority",
        )
    return value
