"""Bearer parsing, byte-wise secret comparison, the failure brake and the admin-token floor."""

from __future__ import annotations

import pytest

from backfill.adapters.http.auth import (
    FailureBrake,
    admin_refusal,
    bearer,
    brake_key,
    secret_matches,
)
from backfill.errors import NotFound, Unauthorized
from backfill.settings import MIN_ADMIN_TOKEN_CHARS, Settings

TOKEN = "t" * MIN_ADMIN_TOKEN_CHARS


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([(b"authorization", b"Bearer abc")], b"abc"),
        ([(b"authorization", b"bearer   abc  ")], b"abc"),
        ([(b"authorization", b"Basic abc")], None),
        ([(b"authorization", b"Bearer ")], None),
        ([(b"x-other", b"Bearer abc")], None),
        ([(b"authorization", b"Bearer first"), (b"authorization", b"Bearer second")], b"first"),
    ],
)
def test_bearer(headers: list[tuple[bytes, bytes]], expected: bytes | None) -> None:
    assert bearer(headers) == expected


def test_secrets_compare_as_bytes() -> None:
    assert secret_matches(TOKEN.encode(), TOKEN)
    assert secret_matches("é".encode(), "é")
    assert not secret_matches(b"\xff", TOKEN)
    assert not secret_matches(None, TOKEN)


def test_admin_refusal() -> None:
    assert isinstance(admin_refusal([], None), NotFound)
    assert isinstance(
        admin_refusal([(b"authorization", b"Bearer " + TOKEN.encode())], ""), NotFound
    )
    assert isinstance(admin_refusal([(b"authorization", b"Bearer \xff")], TOKEN), Unauthorized)
    assert admin_refusal([(b"authorization", b"Bearer " + TOKEN.encode())], TOKEN) is None


def test_brake_refuses_after_the_limit_until_the_window_passes() -> None:
    clock = FakeClock()
    brake = FailureBrake(3, 60.0, clock=clock)
    for _ in range(2):
        brake.record_failure("a")
        clock.now += 1
    assert brake.refusal("a") is None
    brake.record_failure("a")
    refusal = brake.refusal("a")
    assert refusal is not None
    assert refusal.status == 429
    assert refusal.retry_after_s == 58  # the first failure leaves the window 58 s from now
    assert brake.refusal("b") is None
    clock.now += 58
    assert brake.refusal("a") is None
    brake.record_failure("a")  # the window slides: failures at 1001, 1002 and now
    assert brake.refusal("a") is not None


def test_brake_remembers_a_bounded_number_of_addresses() -> None:
    clock = FakeClock()
    brake = FailureBrake(2, 60.0, clock=clock, max_clients=3)
    for client in ("a", "b", "c"):
        brake.record_failure(client)
        brake.record_failure(client)
    assert all(brake.refusal(c) is not None for c in "abc")
    brake.record_failure("d")
    # The least recently failing address was forgotten to make room.
    assert brake.refusal("a") is None
    assert brake.refusal("b") is not None
    assert len(brake._failures) == 3


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2::ffff", "2001:db8:1:2::/64"),
        ("::ffff:203.0.113.7", "203.0.113.7"),
        ("unknown", "unknown"),
    ],
)
def test_brake_key(address: str, key: str) -> None:
    assert brake_key(address) == key


def test_brake_counts_an_ipv6_64_as_one_client() -> None:
    brake = FailureBrake(2, 60.0, clock=FakeClock())
    brake.record_failure("2001:db8::1")
    brake.record_failure("2001:db8::2")
    assert brake.refusal("2001:db8::3") is not None
    assert brake.refusal("2001:db8:0:1::1") is None


def test_brake_forgets_from_the_front_without_scanning() -> None:
    clock = FakeClock()
    brake = FailureBrake(2, 60.0, clock=clock, max_clients=3)
    brake.record_failure("a")
    brake.record_failure("b")
    brake.record_failure("c")
    brake.record_failure("a")  # "a" failed again: "b" is now the least recently failing
    clock.now += 3600  # all have left the window; only one is forgotten per new address
    brake.record_failure("d")
    assert list(brake._failures) == ["c", "a", "d"]


def test_short_admin_token_is_a_problem() -> None:
    assert Settings.model_construct(admin_token=None).admin_token_problem() is None
    assert Settings.model_construct(admin_token="").admin_token_problem() is None
    assert Settings.model_construct(admin_token=TOKEN).admin_token_problem() is None
    problem = Settings.model_construct(admin_token="short").admin_token_problem()
    assert problem is not None
    assert str(MIN_ADMIN_TOKEN_CHARS) in problem
