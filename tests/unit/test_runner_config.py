"""The worker is configured by one section of Settings, ``settings.worker``."""

from __future__ import annotations

from backfill.settings import FetchSettings, LimitsSettings, Settings, WorkerSettings


def test_the_worker_section_holds_what_the_runner_reads() -> None:
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
    assert settings.worker == WorkerSettings(
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
        dispatch_gather_s=0.01,
        validating_grace_s=12.0,
        validating_retry_max_s=45.0,
        prefix_locality=False,
        engine_down_log_interval_s=120.0,
    )
    # What the runner takes from the sections beside it.
    assert settings.limits == LimitsSettings(output_file_ttl_s=3600, max_media_bytes_per_line=12345)
    assert settings.fetch == FetchSettings(concurrency=3, total_timeout_s=25.0)


def test_whether_a_worker_is_alone_is_no_setting() -> None:
    # The container knows it (one embedded process on SQLite); no file or variable may say it.
    assert "sole_worker" not in WorkerSettings.model_fields
    assert Settings(sole_worker=True).worker == WorkerSettings()
