"""``/metrics`` text of the simulated engine: vLLM's names, parsed by prometheus_client."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from backfill.simulator.metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineSnapshot,
    Histogram,
    render,
)

LABELS = {"model_name": 'org/model "v2"', "engine": "0"}


def families(text: str) -> dict[str, tuple[str, dict[str, float]]]:
    """Family name -> (type, {sample name + sorted extra labels: value})."""
    out: dict[str, tuple[str, dict[str, float]]] = {}
    for family in text_string_to_metric_families(text):
        samples: dict[str, float] = {}
        for sample in family.samples:
            labels = dict(sample.labels)
            assert {k: labels.pop(k) for k in LABELS} == LABELS
            extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            samples[sample.name + (f"{{{extra}}}" if extra else "")] = sample.value
        out[family.name] = (family.type, samples)
    return out


def test_names_types_and_labels_are_vllms() -> None:
    ttft = Histogram(TTFT_BUCKETS)
    for value in (0.003, 0.05, 0.05, 3000.0):
        ttft.observe(value)
    snapshot = EngineSnapshot(
        running=3,
        waiting=7,
        kv_cache_usage=0.25,
        prefix_cache_queries=200,
        prefix_cache_hits=96,
        prompt_tokens=200,
        generation_tokens=40,
        finished={"length": 2, "stop": 1},
        ttft=ttft,
    )
    found = families(render(snapshot, LABELS["model_name"]))
    assert found["vllm:num_requests_running"] == ("gauge", {"vllm:num_requests_running": 3})
    assert found["vllm:num_requests_waiting"] == ("gauge", {"vllm:num_requests_waiting": 7})
    assert found["vllm:kv_cache_usage_perc"] == ("gauge", {"vllm:kv_cache_usage_perc": 0.25})
    assert found["vllm:prefix_cache_queries"] == (
        "counter",
        {"vllm:prefix_cache_queries_total": 200},
    )
    assert found["vllm:prefix_cache_hits"] == ("counter", {"vllm:prefix_cache_hits_total": 96})
    assert found["vllm:prompt_tokens"][1] == {"vllm:prompt_tokens_total": 200}
    assert found["vllm:generation_tokens"][1] == {"vllm:generation_tokens_total": 40}
    assert found["vllm:request_success"][1] == {
        "vllm:request_success_total{finished_reason=length}": 2,
        "vllm:request_success_total{finished_reason=stop}": 1,
    }
    kind, samples = found["vllm:time_to_first_token_seconds"]
    assert kind == "histogram"
    assert samples["vllm:time_to_first_token_seconds_bucket{le=0.001}"] == 0
    assert samples["vllm:time_to_first_token_seconds_bucket{le=0.005}"] == 1
    assert samples["vllm:time_to_first_token_seconds_bucket{le=0.06}"] == 3
    assert samples["vllm:time_to_first_token_seconds_bucket{le=2560.0}"] == 3
    assert samples["vllm:time_to_first_token_seconds_bucket{le=+Inf}"] == 4
    assert samples["vllm:time_to_first_token_seconds_count"] == 4
    assert samples["vllm:time_to_first_token_seconds_sum"] == 0.003 + 0.05 + 0.05 + 3000.0


def test_an_idle_engine_reports_zeros_and_both_finish_reasons() -> None:
    found = families(render(EngineSnapshot(), LABELS["model_name"]))
    assert found["vllm:num_requests_running"][1] == {"vllm:num_requests_running": 0}
    assert found["vllm:request_success"][1] == {
        "vllm:request_success_total{finished_reason=length}": 0,
        "vllm:request_success_total{finished_reason=stop}": 0,
    }
    assert "vllm:time_to_first_token_seconds" not in found


def test_a_bucket_bound_is_inclusive() -> None:
    hist = Histogram((0.1, 1.0))
    hist.observe(0.1)
    hist.observe(1.0)
    hist.observe(1.5)
    assert hist.counts == [1, 1, 1]


def test_step_histograms_have_vllms_names_and_buckets() -> None:
    itl = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
    itl.observe_many(0.02, 3)
    itl.observe(0.3)
    decode = Histogram(REQUEST_LATENCY_BUCKETS)
    decode.observe(1.2)
    tokens = Histogram(ITERATION_TOKENS_BUCKETS)
    tokens.observe(300)
    snapshot = EngineSnapshot(inter_token_latency=itl, decode_time=decode, iteration_tokens=tokens)
    found = families(render(snapshot, LABELS["model_name"]))
    kind, samples = found["vllm:inter_token_latency_seconds"]
    assert kind == "histogram"
    assert samples["vllm:inter_token_latency_seconds_bucket{le=0.01}"] == 0
    assert samples["vllm:inter_token_latency_seconds_bucket{le=0.025}"] == 3
    assert samples["vllm:inter_token_latency_seconds_bucket{le=0.3}"] == 4
    assert samples["vllm:inter_token_latency_seconds_bucket{le=80.0}"] == 4
    assert samples["vllm:inter_token_latency_seconds_count"] == 4
    assert samples["vllm:inter_token_latency_seconds_sum"] == 3 * 0.02 + 0.3
    kind, samples = found["vllm:request_decode_time_seconds"]
    assert kind == "histogram"
    assert samples["vllm:request_decode_time_seconds_bucket{le=1.5}"] == 1
    assert samples["vllm:request_decode_time_seconds_bucket{le=7680.0}"] == 1
    # A histogram whose vLLM name ends in _total (prometheus_client keeps it so).
    kind, samples = found["vllm:iteration_tokens_total"]
    assert kind == "histogram"
    assert samples["vllm:iteration_tokens_total_bucket{le=256.0}"] == 0
    assert samples["vllm:iteration_tokens_total_bucket{le=512.0}"] == 1
    assert samples["vllm:iteration_tokens_total_bucket{le=16384.0}"] == 1
    assert samples["vllm:iteration_tokens_total_count"] == 1
