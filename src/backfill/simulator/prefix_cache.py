"""The simulated engine's prefix cache: LRU over hashes of full prompt blocks.

A prompt is cut into blocks of ``block_tokens`` tokens; each full block is named by a hash of
its tokens chained with the hash of the block before it, as vLLM names KV-cache blocks
(``hash_block_tokens`` in ``vllm/v1/core/kv_cache_utils.py``). So a block hash stands for the
whole prefix up to that block: two prompts share a cached block only if everything before it
is the same too. A partial last block is never cached, as in vLLM.

The cache is per simulator process, like one engine replica's GPU memory. Unlike vLLM it does
not pin the blocks of running requests: it is an LRU of ``capacity_blocks`` hashes, its own
budget next to the KV-usage gauge (see ``docs/simulator.md``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def block_hashes(tokens: Sequence[str], block_tokens: int) -> tuple[int, ...]:
    """Chained hashes of the full blocks of ``tokens``, first block first.

    Python's ``hash`` of a tuple is enough: the cache lives in one process, and a collision
    of two 64-bit hashes over prompt prefixes would only misreport one simulated cache hit.
    """
    hashes: list[int] = []
    parent = 0
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        parent = hash((parent, *tokens[end - block_tokens : end]))
        hashes.append(parent)
    return tuple(hashes)


class PrefixCache:
    """Block hashes a new request can reuse, least recently used first out."""

    def __init__(self, block_tokens: int, capacity_blocks: int) -> None:
        if block_tokens < 1 or capacity_blocks < 1:
            raise ValueError("block_tokens and capacity_blocks must be at least 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def match(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Tokens of the longest cached prefix, touching nothing.

        At most ``prompt_tokens - 1`` tokens count, rounded down to whole blocks: vLLM always
        computes the last prompt token again to get the logits of the first output token.
        """
        limit = max(0, (prompt_tokens - 1) // self.block_tokens)
        hit = 0
        for block_hash in hashes[:limit]:
            if block_hash not in self._blocks:
                break
            hit += 1
        return hit * self.block_tokens

    def lookup(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """``match``, touching the blocks it reuses."""
        tokens = self.match(hashes, prompt_tokens)
        self._touch(hashes[: tokens // self.block_tokens])
        return tokens

    def insert(self, hashes: Sequence[int]) -> None:
        """Remember the blocks of a prompt whose prefill is done, evicting the oldest."""
        self._touch(hashes)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def _touch(self, hashes: Sequence[int]) -> None:
        # Last block first, so a prompt's first blocks are the most recent: eviction takes
        # the tail of a prefix before its head, which keeps the head reusable (vLLM frees a
        # request's blocks in reverse order for the same reason).
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
