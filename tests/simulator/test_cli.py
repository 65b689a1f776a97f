"""``backfill simulate``: every option reaches the simulator's config, bad mixes are refused."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import backfill.simulator.server as simulator_module
from backfill.cli.main import app
from backfill.simulator.model import STEP_PROFILES, BatchingConfig
from backfill.simulator.server import SimulatorConfig


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[SimulatorConfig, str, int]]:
    calls: list[tuple[SimulatorConfig, str, int]] = []

    def fake_run(config: SimulatorConfig, host: str, port: int) -> None:
        calls.append((config, host, port))

    monkeypatch.setattr(simulator_module, "run_simulator", fake_run)
    return calls


def test_defaults_keep_each_request_timed_alone(
    started: list[tuple[SimulatorConfig, str, int]],
) -> None:
    result = CliRunner().invoke(app, ["simulate"])
    assert result.exit_code == 0, result.output
    [(config, host, port)] = started
    assert (host, port) == ("127.0.0.1", 9000)
    assert config == SimulatorConfig()
    assert config.batching() is None


def test_batching_options_reach_the_config(
    started: list[tuple[SimulatorConfig, str, int]],
) -> None:
    args = [
        "simulate", "--slots", "64", "--ttft-ms", "30", "--itl-ms", "12",
        "--prefill-ms-per-token", "0.2", "--itl-growth", "1.5", "--itl-knee", "8",
        "--kv-capacity-tokens", "500000",
        "--block-tokens", "32", "--prefix-cache-blocks", "4096", "--model-name", "org/model",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    batching = started[0][0].batching()
    assert batching is not None
    assert (batching.slots, batching.ttft_ms, batching.itl_ms) == (64, 30, 12)
    assert (batching.prefill_ms_per_token, batching.itl_growth) == (0.2, 1.5)
    assert batching.itl_knee == 8
    assert (batching.kv_capacity_tokens, batching.block_tokens) == (500_000, 32)
    assert batching.prefix_cache_blocks == 4096
    assert started[0][0].model_name == "org/model"
    assert batching.priority_scheduling is False
    assert batching.max_num_batched_tokens == 2048


def test_a_step_profile_sets_four_timings_and_given_flags_win(
    started: list[tuple[SimulatorConfig, str, int]],
) -> None:
    args = ["simulate", "--slots", "16", "--step-profile", "steep", "--itl-ms", "20"]
    result = CliRunner().invoke(app, [*args, "--max-num-batched-tokens", "512"])
    assert result.exit_code == 0, result.output
    config = started[0][0]
    assert config.step_profile == "steep"
    steep = STEP_PROFILES["steep"]
    assert (config.ttft_ms, config.itl_ms) == (steep.ttft_ms, 20)
    assert (config.itl_growth, config.prefill_ms_per_token) == (0.89, 1.0)
    batching = config.batching()
    assert batching is not None
    assert batching.max_num_batched_tokens == 512
    # One step with all 16 slots busy, as measured on the CPU engine: 27 * (1 + 0.89) ms.
    assert BatchingConfig(slots=16, itl_ms=steep.itl_ms, itl_growth=0.89).step_s(
        16, 0
    ) == pytest.approx(0.05103)


def test_step_profiles_in_the_config() -> None:
    flat = SimulatorConfig(slots=4, step_profile="flat")
    assert (flat.ttft_ms, flat.itl_ms, flat.itl_growth, flat.prefill_ms_per_token) == (
        5,
        10,
        0.1,
        0.02,
    )
    given = SimulatorConfig(slots=4, step_profile="flat", itl_growth=0.0, ttft_ms=50)
    assert (given.ttft_ms, given.itl_ms, given.itl_growth) == (50, 10, 0.0)
    plain = SimulatorConfig(slots=4)
    assert (plain.ttft_ms, plain.itl_ms, plain.itl_growth, plain.prefill_ms_per_token) == (
        50,
        1,
        0,
        0,
    )


def test_the_priority_scheduling_policy_reaches_the_model(
    started: list[tuple[SimulatorConfig, str, int]],
) -> None:
    args = ["simulate", "--slots", "8", "--scheduling-policy", "priority"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    config = started[0][0]
    assert config.scheduling_policy == "priority"
    batching = config.batching()
    assert batching is not None
    assert batching.priority_scheduling is True


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--slots", "4", "--max-concurrency", "2"], "slots replaces max_concurrency"),
        (["--prefix-cache-blocks", "100"], "prefix_cache_blocks only act with slots"),
        (["--itl-growth", "1"], "itl_growth only act with slots"),
        (["--itl-knee", "2"], "itl_knee only act with slots"),
        (["--slots", "2", "--itl-knee", "3"], "itl_knee must be between 0 and slots"),
        (["--slots", "-1"], "--slots"),
        (["--slots", "2", "--block-tokens", "0"], "--block-tokens"),
        (["--scheduling-policy", "priority"], "scheduling_policy=priority only act with slots"),
        (["--slots", "2", "--scheduling-policy", "lifo"], "--scheduling-policy"),
        (["--step-profile", "flat"], "step_profile only act with slots"),
        (["--slots", "2", "--step-profile", "fast"], "--step-profile"),
        (["--max-num-batched-tokens", "100"], "max_num_batched_tokens only act with slots"),
        (["--slots", "64", "--max-num-batched-tokens", "32"], "must be greater than or equal"),
    ],
)
def test_bad_mixes_are_refused(
    started: list[tuple[SimulatorConfig, str, int]], args: list[str], says: str
) -> None:
    # Wide enough that the error box does not wrap the message.
    result = CliRunner().invoke(app, ["simulate", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert says in result.output
    assert started == []
