"""``/metrics`` of the simulated engine, in Prometheus text format under vLLM's own names.

Backfill's engine-pressure signals are read from a real vLLM's ``/metrics``; the simulator
writes the same names, types and ``model_name`` / ``engine`` labels so one reader serves
both. The names follow ``PrometheusStatLogger`` in ``vllm/v1/metrics/loggers.py`` (see
``docs/simulator.md``). Counters are written as prometheus_client writes them in this format
(vLLM uses it): ``vllm:prompt_tokens`` is declared and sampled as ``vllm:prompt_tokens_total``.

The text is built by hand from an ``EngineSnapshot``: it costs nothing between scrapes and
keeps each simulator's numbers out of prometheus_client's process-wide registry.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

# Bucket bounds of vLLM's histograms of the same names, so dashboards line up
# (``vllm/v1/metrics/buckets.py``).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)  # fmt: skip


class Histogram:
    """Observations counted into fixed buckets (upper bounds, inclusive, as Prometheus)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def observe_many(self, value: float, times: int) -> None:
        """``times`` observations of the same ``value``."""
        self.counts[bisect_left(self.bounds, value)] += times
        self.total += value * times
        self.count += times


@dataclass
class EngineSnapshot:
    """What one scrape reports; counters only ever grow."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    """Requests that ended with all their tokens, by finish reason (``stop``, ``length``)."""
    ttft: Histogram | None = None
    e2e_latency: Histogram | None = None
    queue_time: Histogram | None = None
    inter_token_latency: Histogram | None = None
    decode_time: Histogram | None = None
    iteration_tokens: Histogram | None = None


def render(snapshot: EngineSnapshot, model_name: str) -> str:
    labels = f'model_name="{_escape(model_name)}",engine="0"'
    out: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")

    def gauge(name: str, help_text: str, value: float) -> None:
        family(name, "gauge", help_text)
        out.append(f"{name}{{{labels}}} {_number(value)}")

    def counter(name: str, help_text: str, value: float) -> None:
        family(f"{name}_total", "counter", help_text)
        out.append(f"{name}_total{{{labels}}} {_number(value)}")

    def histogram(name: str, help_text: str, hist: Histogram | None) -> None:
        if hist is None:
            return
        family(name, "histogram", help_text)
        cumulative = 0
        for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{_number(bound)}"}} {_number(cumulative)}')
        out.append(f"{name}_count{{{labels}}} {_number(hist.count)}")
        out.append(f"{name}_sum{{{labels}}} {_number(hist.total)}")

    s = snapshot
    gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.running)
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting)
    gauge(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage
    )
    counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.prefix_cache_queries,
    )
    counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        s.prefix_cache_hits,
    )
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
    counter("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens)
    counter(
        "vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.preemptions
    )
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
    for reason in sorted({"stop", "length", *s.finished}):
        out.append(
            f'vllm:request_success_total{{{labels},finished_reason="{_escape(reason)}"}} '
            f"{_number(s.finished.get(reason, 0))}"
        )
    histogram(
        "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", s.ttft
    )
    histogram(
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        s.e2e_latency,
    )
    histogram(
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        s.queue_time,
    )
    histogram(
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        s.inter_token_latency,
    )
    histogram(
        "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        s.decode_time,
    )
    histogram(
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        s.iteration_tokens,
    )
    return "\n".join(out) + "\n"


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
