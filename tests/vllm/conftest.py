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
