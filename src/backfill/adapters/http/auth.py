"""Bearer secrets read from raw headers, the admin-token check, and the per-address brake on
failed authentication with the secrets a person chooses."""

from __future__ import annotations

import hmac
import ipaddress
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from backfill.errors import BackfillError, NotFound, RateLimited, Unauthorized

Headers = Iterable[tuple[bytes, bytes]]


def bearer(headers: Headers) -> bytes | None:
    """The secret of the first ``Authorization: Bearer …`` header, as the client sent it."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, secret = value.partition(b" ")
            if scheme.lower() != b"bearer":
                return None
            return secret.strip() or None
    return None


def secret_matches(given: bytes | None, expected: str) -> bool:
    """Constant-time comparison of bytes: a header may hold any byte, and comparing ``str``
    with non-ASCII characters raises instead of answering no."""
    return given is not None and hmac.compare_digest(given, expected.encode())


def admin_refusal(headers: Headers, token: str | None) -> BackfillError | None:
    """Why a request may not use the admin API (None: it may), from its headers alone."""
    if not token:
        return NotFound("The admin API is disabled; set admin_token (BACKFILL_ADMIN_TOKEN).")
    if not secret_matches(bearer(headers), token):
        return Unauthorized(
            "The admin token is missing or wrong; send it as 'Authorization: Bearer <token>'.",
            code="invalid_admin_token",
        )
    return None


def brake_key(address: str) -> str:
    """The unit the brake counts: an IPv4 address, or an IPv6 /64 (one client commonly holds a
    whole /64 and could otherwise take a fresh address for every few guesses)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return address


class FailureBrake:
    """Counts failed authentications per client (``brake_key``) in a sliding window; a client
    with ``limit`` failures inside ``window_s`` is refused until the oldest of them leaves the
    window.

    State is in memory, per process: each API process brakes on its own. Successes are neither
    counted nor slowed. At most ``max_clients`` clients are remembered, so a flood of addresses
    costs bounded memory (the least recently failing ones are forgotten first).
    """

    def __init__(
        self,
        limit: int,
        window_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_clients: int = 10_000,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._max_clients = max_clients
        # Least recently failing first: the front is what leaves the window (and memory) first.
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def refusal(self, address: str) -> RateLimited | None:
        """A 429 for the client at ``address`` while it is braked, else None."""
        failures = self._failures.get(brake_key(address))
        if failures is None or len(failures) < self.limit:
            return None
        wait = failures[0] + self.window_s - self._clock()
        if wait <= 0:
            return None
        return RateLimited(
            f"Too many failed authentications from this address ({self.limit} within "
            f"{self.window_s:g} s); check the token, and retry after the wait.",
            code="too_many_auth_failures",
            retry_after_s=math.ceil(wait),
        )

    def record_failure(self, address: str) -> None:
        key = brake_key(address)
        failures = self._failures.get(key)
        if failures is None:
            # Evicting from the front costs the same however many clients are remembered.
            while len(self._failures) >= self._max_clients:
                self._failures.popitem(last=False)
            failures = self._failures[key] = deque(maxlen=self.limit)
        else:
            self._failures.move_to_end(key)
        failures.append(self._clock())
