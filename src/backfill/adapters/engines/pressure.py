"""Reading an engine's load from its Prometheus ``/metrics`` (vLLM and SGLang names).

Only the few lines Backfill needs are parsed, by prefix, so a scrape of a large page (vLLM
publishes histograms for everything) costs little CPU at several looks a second. Values of
one name are summed over its label sets (one per served model).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import aiohttp

from backfill.domain.scheduling.concurrency import Pressure


class Flavor(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


@dataclass(frozen=True, slots=True)
class _Names:
    running: bytes
    waiting: bytes
    kv_usage: tuple[bytes, ...]
    slots: bytes | None
    itl: bytes | None = None
    """The inter-token latency histogram (its ``_sum`` and ``_count`` are read)."""
    steps: bytes | None = None
    """A counter of the engine's steps that produced tokens."""


# vLLM: vllm/v1/metrics/loggers.py (V1; ``gpu_cache_usage_perc`` is the V0 name of the KV
# use). SGLang: python/sglang/srt/metrics/collector.py.
_NAMES = {
    Flavor.VLLM: _Names(
        b"vllm:num_requests_running",
        b"vllm:num_requests_waiting",
        (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc"),
        None,
        b"vllm:inter_token_latency_seconds",
        # One observation per engine step with outputs (vllm/v1/engine/async_llm.py builds
        # one IterationStats per EngineCoreOutputs): its count is the steps.
        b"vllm:iteration_tokens_total_count",
    ),
    Flavor.SGLANG: _Names(
        b"sglang:num_running_reqs",
        b"sglang:num_queue_reqs",
        (b"sglang:token_usage",),
        b"sglang:max_running_requests",
    ),
}


def _value(rest: bytes) -> float | None:
    """The value of a sample line after its name: ``{labels} value [timestamp]``."""
    if rest.startswith(b"{"):
        rest = rest[rest.rindex(b"}") + 1 :]
    try:
        return float(rest.split()[0])
    except (IndexError, ValueError):
        return None


def _sum(page: list[bytes], name: bytes) -> float | None:
    """The sum of ``name``'s samples (any labels); None when the page has none."""
    total: float | None = None
    for line in page:
        if line.startswith(name) and line[len(name) : len(name) + 1] in (b"{", b" "):
            value = _value(line[len(name) :])
            if value is not None:
                total = (total or 0.0) + value
    return total


def parse(text: bytes, flavor: Flavor | None = None) -> tuple[Flavor, Pressure] | None:
    """The load a metrics page reports, and whose names it uses; None when it has neither
    vLLM's nor SGLang's running and waiting gauges."""
    page = [line for line in text.splitlines() if line and not line.startswith(b"#")]
    for candidate in (flavor,) if flavor else tuple(Flavor):
        names = _NAMES[candidate]
        running, waiting = _sum(page, names.running), _sum(page, names.waiting)
        if running is None or waiting is None:
            continue
        kv = next((v for n in names.kv_usage if (v := _sum(page, n)) is not None), None)
        slots = _sum(page, names.slots) if names.slots else None
        itl_sum = itl_count = None
        if names.itl is not None:
            itl_sum, itl_count = _sum(page, names.itl + b"_sum"), _sum(page, names.itl + b"_count")
        steps = _sum(page, names.steps) if names.steps else None
        load = Pressure(running, waiting, kv, slots or None, itl_sum, itl_count, steps)
        return candidate, load
    return None


class MetricsProbe:
    """Reads one engine's ``/metrics``; which names it uses is learnt from the first page
    unless the settings say. An engine that answers without them (llama.cpp, most other
    servers) has none: ``absent`` turns true and the caller stops asking."""

    def __init__(self, url: str, flavor: Flavor | None = None, timeout_s: float = 2.0) -> None:
        self.url = url
        self.flavor = flavor
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self.absent = False

    async def read(self) -> Pressure | None:
        """The engine's load now; None when the page cannot be read or has no known names."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.get(self.url) as response:
                status = response.status
                text = await response.read() if status == 200 else b""
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        found = parse(text, self.flavor)
        if found is None:
            # A page without the names, or none at all, is an answer: unless the settings
            # named the engine's kind, it has no metrics to follow.
            self.absent = self.flavor is None and (status == 200 or 400 <= status < 500)
            return None
        self.flavor = found[0]
        return found[1]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
