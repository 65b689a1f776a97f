"""The simulated engine's prefix cache: chained block hashes and LRU eviction."""

from __future__ import annotations

import pytest

from backfill.simulator.prefix_cache import PrefixCache, block_hashes


def words(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(words("w", 47), 16)) == 2
    assert len(block_hashes(words("w", 48), 16)) == 3
    assert block_hashes(words("w", 15), 16) == ()


def test_a_block_hash_names_its_whole_prefix() -> None:
    same_block_twice = block_hashes(["a", "b", "a", "b"], 2)
    assert same_block_twice[0] != same_block_twice[1]
    one, other = block_hashes(["x", "y", "a", "b"], 2), block_hashes(["z", "y", "a", "b"], 2)
    assert one[1] != other[1]  # same tokens, different prefix
    again = block_hashes(["x", "y", "a", "b", "c"], 2)
    assert again == one


def test_lookup_returns_the_longest_cached_prefix_in_tokens() -> None:
    cache = PrefixCache(block_tokens=4, capacity_blocks=100)
    base = words("w", 16)
    cache.insert(block_hashes(base, 4))
    diverging = [*base[:8], "other", *base[9:]]
    assert cache.lookup(block_hashes(diverging, 4), len(diverging)) == 8
    assert cache.lookup(block_hashes(words("v", 16), 4), 16) == 0


def test_lookup_leaves_the_last_prompt_token_to_compute() -> None:
    cache = PrefixCache(block_tokens=4, capacity_blocks=100)
    prompt = words("w", 16)
    cache.insert(block_hashes(prompt, 4))
    assert cache.lookup(block_hashes(prompt, 4), 16) == 12
    longer = [*prompt, "more"]
    assert cache.lookup(block_hashes(longer, 4), 17) == 16


def test_least_recently_used_blocks_are_evicted_first() -> None:
    cache = PrefixCache(block_tokens=2, capacity_blocks=4)
    a, b, c = (block_hashes(words(p, 4), 2) for p in "abc")
    cache.insert(a)
    cache.insert(b)
    assert cache.lookup(block_hashes([*words("a", 4), "q"], 2), 5) == 4  # touches a
    cache.insert(c)
    assert len(cache) == 4
    assert all(h in cache for h in (*a, *c))
    assert not any(h in cache for h in b)


def test_the_tail_of_a_prefix_goes_before_its_head() -> None:
    cache = PrefixCache(block_tokens=2, capacity_blocks=3)
    prompt = words("w", 8)  # four blocks, one more than fits
    cache.insert(block_hashes(prompt, 2))
    assert cache.lookup(block_hashes([*prompt, "x"], 2), 9) == 6


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PrefixCache(block_tokens=0, capacity_blocks=1)
    with pytest.raises(ValueError):
        PrefixCache(block_tokens=16, capacity_blocks=0)
