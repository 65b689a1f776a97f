"""The real vLLM engine (vLLM's CPU build serving SmolLM2-135M) for the ``vllm`` tier.

One generating engine serves the whole tier (it takes 25-60 s to start); tests that need an
engine of their own (another scheduling policy, a replica to kill, the embedding runner)
start it themselves. The virtualenv comes from ``make vllm-env``, which ``make test`` runs:
in CI a missing one fails the tier, elsewhere it skips, saying so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench import vllm
from bench.vllm import VllmProcess
from tests.support import missing_infrastructure

# What Backfill's catalog calls the model; the engines serve it as ``vllm.SERVED_MODEL``.
MODEL = "smollm2"
EMBED_MODEL = "smollm2-embed"
# µUSD per million tokens: cached input at half price, so a cache hit shows in every receipt.
PRICES = {"input": 100_000, "cached_input": 50_000, "output": 400_000}


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.fixture
def calibrated_cpu() -> None:
    """The tests that compare the real engine's timing with fitted figures (the simulator's
    step profiles, the step curve, a person's wait against a batch request) hold on a CPU
    with AVX-512, where vLLM's CPU backend runs its fast kernels and the profiles were
    fitted. Without it (AVX2 only, seen on an AMD EPYC of this machine kind) the same engine
    took 26 ms per prompt token instead of about 1, and 56 ms a step instead of 27: timing,
    and orderings decided by timing, are another engine's. Those tests are skipped there,
    saying why; everything else of the tier runs."""
    if "avx512f" not in cpu_flags():
        pytest.skip(
            "NOT CALIBRATED FOR THIS CPU: no AVX-512, so vLLM's CPU backend runs its slow path "
            "and its timing is not the one the simulator's profiles were fitted to "
            "(docs/simulator.md)"
        )


def require_vllm() -> None:
    reason = vllm.missing()
    if reason is not None:
        missing_infrastructure(f"the real vLLM engine ({reason})")


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """The tier's engine: priority scheduling, 8 sequence slots."""
    require_vllm()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    engine = vllm.start_vllm(log, max_num_seqs=8, policy="priority")
    try:
        yield engine
    finally:
        engine.stop()


def engine_table(name: str, url: str, *, models: str = MODEL, extra: str = "") -> str:
    served = f'served_names = {{ "{models}" = "{vllm.SERVED_MODEL}" }}' if models != MODEL else ""
    return f"""
[[engines]]
name = "{name}"
base_url = "{url}"
models = ["{models}"]
max_concurrency = 8
request_timeout_s = 120
{served}
{extra}
"""


def backfill_config(path: Path, engines: str, *, extra: str = "") -> Path:
    """Settings for a Backfill whose engines are real vLLM processes (``engines``: the
    ``[[engines]]`` tables)."""
    prices = ", ".join(f"{k} = {v}" for k, v in PRICES.items())
    path.write_text(
        f"""
local_engine = false
worker.retry_base_s = 0.05
worker.retry_max_s = 0.5
{extra}

[[models]]
id = "{MODEL}"
model_config_id = "smollm2-135m-v1"
context_length = 8192
max_output_tokens = 1024
endpoints = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
batch = {{ {prices} }}

[[models]]
id = "{EMBED_MODEL}"
model_config_id = "smollm2-135m-embed-v1"
context_length = 8192
max_output_tokens = 1
endpoints = ["/v1/embeddings"]
batch = {{ {prices} }}
{engines}
"""
    )
    return path
