"""The worker's configuration has one source: Settings, through one constructor."""

from __future__ import annotations

import dataclasses

from backfill.runner.worker import WorkerConfig
from backfill.settings import Settings


def test_worker_config_has_no_defaults_of_its_own() -> None:
    for f in dataclasses.fields(WorkerConfig):
        assert f.default is dataclasses.MISSING, f.name
        assert f.default_factory is dataclasses.MISSING, f.name


def test_every_field_comes_from_settings() -> None:
    settings = Settings(
        lease_s=11.0,
        max_attempts=7,
        retry_base_s=0.25,
        retry_max_s=9.0,
        poll_interval_s=0.5,
        result_flush_s=0.03,
        lifecycle_interval_s=0.4,
        idle_poll_s=3.0,
        gpu_time_flush_s=2.0,
        janitor_interval_s=90.0,
        output_file_ttl_s=3600,
        dispatch_gather_s=0.01,
        validating_grace_s=12.0,
        validating_retry_max_s=45.0,
        prefix_locality=False,
        max_media_bytes_per_line=12345,
        fetch_concurrency=3,
        fetch_total_timeout_s=25.0,
        engine_down_log_interval_s=120.0,
    )
    config = WorkerConfig.from_settings(settings, sole_worker=True)
    assert config == WorkerConfig(
        lease_s=11.0,
        max_attempts=7,
        retry_base_s=0.25,
        retry_max_s=9.0,
        poll_interval_s=0.5,
        result_flush_s=0.03,
        lifecycle_interval_s=0.4,
        idle_poll_s=3.0,
        gpu_time_flush_s=2.0,
        janitor_interval_s=90.0,
        output_ttl_s=3600,
        dispatch_gather_s=0.01,
        sole_worker=True,
        validating_grace_s=12.0,
        validating_retry_max_s=45.0,
        prefix_locality=False,
        media_line_bytes=12345,
        fetch_concurrency=3,
        fetch_total_s=25.0,
        engine_down_log_interval_s=120.0,
    )
