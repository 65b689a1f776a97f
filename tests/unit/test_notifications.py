"""What a batch's end sends, and when a failed delivery is tried again."""

from __future__ import annotations

import pytest

from backfill.domain.lifecycle import BatchStatus
from backfill.domain.notifications import (
    PREVIOUS_SECRET_GRACE_S,
    Channel,
    EndedBatch,
    Endpoint,
    ReplacedSecret,
    RetrySchedule,
    SealedSecrets,
    email_message,
    messages_for,
    new_webhook_secret,
    notify_address,
)
from backfill.errors import InvalidInput


def ended(status: BatchStatus = BatchStatus.EXPIRED, **changes: object) -> EndedBatch:
    values: dict[str, object] = {
        "id": "batch_1",
        "org_id": "org_1",
        "status": status,
        "metadata": None,
        "webhook_url": "https://h.example/x",
        "total": 10,
        "completed": 7,
        "failed": 3,
    }
    values.update(changes)
    return EndedBatch(**values)  # type: ignore[arg-type]


def test_the_retry_schedule_grows_by_four_and_stops() -> None:
    schedule = RetrySchedule(attempts=3, base_s=30)
    assert schedule.after(1, 100.0) == 130.0
    assert schedule.after(2, 100.0) == 220.0
    assert schedule.after(3, 100.0) is None
    capped = RetrySchedule(attempts=20, base_s=30, max_s=3600)
    assert capped.after(10, 0.0) == 3600


def test_each_terminal_status_has_its_openai_event() -> None:
    wanted = frozenset({"batch.completed", "batch.failed", "batch.expired", "batch.cancelled"})
    for status, event in [
        (BatchStatus.COMPLETED, "batch.completed"),
        (BatchStatus.FAILED, "batch.failed"),
        (BatchStatus.EXPIRED, "batch.expired"),
        (BatchStatus.CANCELLED, "batch.cancelled"),
    ]:
        messages = messages_for(ended(status), [Endpoint("we_1", "https://e", wanted)], None, 5)
        assert [(m.channel, m.event) for m in messages] == [
            (Channel.WEBHOOK, event),
            (Channel.ENDPOINT, event),
        ]
        assert messages[1].payload["type"] == event


def test_only_subscribed_endpoints_and_a_set_address_get_messages() -> None:
    endpoints = [
        Endpoint("we_1", "https://a", frozenset({"batch.completed"})),
        Endpoint("we_2", "https://b", frozenset({"batch.expired"})),
    ]
    messages = messages_for(ended(webhook_url=None), endpoints, "ops@example.com", 5)
    assert [(m.channel, m.target) for m in messages] == [
        (Channel.ENDPOINT, "https://b"),
        (Channel.EMAIL, "ops@example.com"),
    ]
    assert len({m.id for m in messages}) == 2


def test_the_email_names_counts_and_links_but_no_content() -> None:
    [email] = [m for m in messages_for(ended(), [], "ops@example.com", 5) if m.channel == "email"]
    subject, text = email_message(email.payload, "https://batch.example.com/")
    assert subject == "Backfill batch batch_1 expired"
    assert "10 in all, 7 completed, 3 failed" in text
    assert "https://batch.example.com/v1/batches/batch_1\n" in text
    _, without_url = email_message(email.payload, None)
    assert "GET /v1/batches/batch_1" in without_url


def test_secrets_are_standard_webhooks_secrets() -> None:
    secret = new_webhook_secret()
    assert secret.startswith("whsec_")
    assert secret != new_webhook_secret()


def test_each_replaced_secret_signs_for_a_day_after_its_own_rotation() -> None:
    day = PREVIOUS_SECRET_GRACE_S
    # Rotated at 1000, then again an hour later: the first secret keeps its day.
    second, first = ReplacedSecret(b"second", 1000 + 3600), ReplacedSecret(b"first", 1000)
    stored = SealedSecrets(b"third", (second, first))
    assert stored.signing_beside(1000 + 3600) == (second, first)
    assert stored.signing_beside(1000 + day - 1) == (second, first)
    assert stored.signing_beside(1000 + day) == (second,)
    assert stored.signing_beside(1000 + 3600 + day) == ()
    assert SealedSecrets(b"only").signing_beside(0) == ()


@pytest.mark.parametrize(
    "address", ["ops@example.com", "first.last+batches@mail.acme.example", "ops@exämple.de"]
)
def test_one_plain_address_is_kept(address: str) -> None:
    assert notify_address(address) == address
    assert notify_address(None) is None


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("ops@acme.example,postmaster", "is a list"),
        ("ops@acme.example;", "is a list"),
        ('"ops,cfo"@acme.example', "is a list"),
        ("<ops@acme.example>, <cfo@acme.example>", "is a list"),
        ("ops@acme.example\u0000", "control character (U+0000)"),
        ("ops@acme.example\nBcc: x@acme.example", "control character (U+000A)"),
        ("ops@acme.example\u0085", "control character (U+0085)"),
        ("Ops <ops@acme.example>", "with no spaces"),
        ("<ops@acme.example>", "bare address"),
        ("ops(team)@acme.example", "bare address"),
        ("ops@acme", "a user and a domain"),
        ("", "or null"),
        (5, "or null"),
        ("o" * 310 + "@example.com", "at most 320"),
    ],
)
def test_anything_but_one_plain_address_is_refused(value: object, words: str) -> None:
    with pytest.raises(InvalidInput) as info:
        notify_address(value)
    assert (info.value.param, info.value.code) == ("email", "invalid_value")
    assert words in info.value.message, info.value.message
