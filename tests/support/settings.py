"""Settings for a Backfill whose one engine is the simulator: in process, or as a TOML file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backfill.settings import EngineSettings, ModelSettings, PricingSettings, Settings
from tests.support.lines import SIM_MODEL, SIM_PRICES


def slow_sim_model() -> ModelSettings:
    """The simulator's model published at 1 token/s, so capacity admission refuses early."""
    return ModelSettings(
        id=SIM_MODEL,
        model_config_id="sim-model-v1",
        context_length=4096,
        max_output_tokens=1024,
        batch=PricingSettings(input=100_000, output=400_000),
        throughput_tokens_per_s=1,
    )


def sim_settings(data_dir: Path, sim_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "local_engine": False,
        "models": [
            ModelSettings(
                id=SIM_MODEL,
                model_config_id="sim-model-v1",
                context_length=4096,
                max_output_tokens=1024,
                batch=SIM_PRICES,
            )
        ],
        "engines": [
            EngineSettings(
                name="sim",
                base_url=sim_url,
                models=[SIM_MODEL],
                max_concurrency=32,
                request_timeout_s=5.0,
            )
        ],
        "retry_base_s": 0.01,
        "retry_max_s": 0.1,
        "lease_s": 5.0,
    }
    values.update(overrides)
    return Settings(**values)


def write_sim_config(
    path: Path,
    sim_url: str,
    *,
    max_concurrency: int = 32,
    extra: str = "",
    engines: str | None = None,
    aliases: Sequence[str] = (),
) -> None:
    """A TOML file for ``backfill up`` on the simulated model (with ``aliases``), served by one
    engine at ``sim_url`` (or by the ``[[engines]]`` tables ``engines`` holds instead)."""
    if engines is None:
        engines = f"""
[[engines]]
name = "sim"
base_url = "{sim_url}"
models = ["{SIM_MODEL}"]
max_concurrency = {max_concurrency}
request_timeout_s = 5.0
"""
    named = f"aliases = {json.dumps(list(aliases))}" if aliases else ""
    path.write_text(
        f"""
local_engine = false
worker.lease_s = 5.0
worker.retry_base_s = 0.01
worker.retry_max_s = 0.2
{extra}

[[models]]
id = "{SIM_MODEL}"
model_config_id = "sim-model-v1"
context_length = 4096
max_output_tokens = 1024
batch = {{ input = 100000, cached_input = 50000, output = 400000 }}
{named}
{engines}"""
    )
