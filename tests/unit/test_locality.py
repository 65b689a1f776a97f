"""Prefix keys and the bounded rendezvous choice of a replica (SPEC §9.5)."""

from __future__ import annotations

from collections import Counter

import orjson

from backfill.domain.scheduling.locality import SINGLE_PROMPT_PREFIX, assign, prefix_key


def line(*messages: tuple[str, str], custom_id: str = "a") -> bytes:
    body = {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    return orjson.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


SYSTEM = ("system", "You are a careful assistant. " * 20)


def test_lines_sharing_leading_messages_share_a_key_whatever_their_last() -> None:
    a = prefix_key(line(SYSTEM, ("user", "first question")))
    b = prefix_key(line(SYSTEM, ("user", "another question"), custom_id="b"))
    c = prefix_key(line(("system", "Another system prompt."), ("user", "first question")))
    assert a == b
    assert a != c


def test_a_single_message_or_prompt_is_keyed_by_its_first_bytes() -> None:
    shared = "x" * SINGLE_PROMPT_PREFIX
    assert prefix_key(line(("user", shared + "one"))) == prefix_key(line(("user", shared + "2")))
    assert prefix_key(line(("user", "short one"))) != prefix_key(line(("user", "short two")))
    prompt = orjson.dumps(
        {
            "custom_id": "p",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": shared + "tail"},
        }
    )
    assert prefix_key(prompt) == prefix_key(prompt.replace(b"tail", b"other"))


def test_an_unreadable_line_gets_the_empty_prefix_and_no_error() -> None:
    assert prefix_key(b"") == prefix_key(b"not json")


def test_each_key_goes_to_one_replica_while_it_has_room_the_same_on_every_process() -> None:
    keys = [prefix_key(line(("system", f"prompt {g}"), ("user", "q"))) for g in range(30)]
    replicas = ["a", "b", "c"]
    first = assign(keys * 4, replicas, [1000, 1000, 1000])
    again = assign(keys * 4, replicas, [1000, 1000, 1000])
    assert first == again
    by_key: dict[bytes, set[int]] = {}
    for key, pick in zip(keys * 4, first, strict=True):
        by_key.setdefault(key, set()).add(pick)
    assert all(len(picks) == 1 for picks in by_key.values())
    # Thirty prefixes spread over every replica.
    assert set(first) == {0, 1, 2}


def test_room_bounds_each_replica_so_none_idles() -> None:
    one = prefix_key(line(SYSTEM, ("user", "q")))
    picks = assign([one] * 12, ["a", "b", "c"], [4, 4, 4])
    assert Counter(picks) == {0: 4, 1: 4, 2: 4}
    # Beyond every replica's room, the one with the most room left takes it.
    picks = assign([one] * 5, ["a", "b"], [1, 2])
    assert Counter(picks)[0] + Counter(picks)[1] == 5


def test_a_replica_that_leaves_or_joins_moves_only_the_prefixes_it_must() -> None:
    """Rendezvous hashing under churn (docs/fleet.md): when a replica leaves, only its own
    prefixes move; when one joins, only the prefixes it now wins move, about one in n."""
    keys = [prefix_key(line(("system", f"prompt {g}"), ("user", "q"))) for g in range(4000)]
    room = [len(keys)] * 4  # room for all: where each prefix goes by its hash alone

    def placed(replicas: list[str]) -> dict[bytes, str]:
        picks = assign(keys, replicas, room[: len(replicas)])
        return {key: replicas[pick] for key, pick in zip(keys, picks, strict=True)}

    three = placed(["r@a", "r@b", "r@c"])
    left = placed(["r@a", "r@c"])
    moved = [k for k in keys if three[k] != left[k]]
    assert all(three[k] == "r@b" for k in moved), "only the leaver's prefixes move"
    assert len(moved) == sum(1 for k in keys if three[k] == "r@b")
    assert 0.28 < len(moved) / len(keys) < 0.39  # about a third

    joined = placed(["r@a", "r@b", "r@c", "r@d"])
    moved = [k for k in keys if three[k] != joined[k]]
    assert all(joined[k] == "r@d" for k in moved), "prefixes move only to the newcomer"
    assert 0.21 < len(moved) / len(keys) < 0.29  # about a quarter
