"""Helpers the tests share, one module per concern; ``from tests.support import X`` finds each.

- ``lines``: the simulated model, its prices, request lines (``chat_line``, ``jsonl``).
- ``waits``: ``eventually`` and ``wait_terminal``, the one way a test waits.
- ``settings``: settings for a Backfill on the simulator, in process or as a TOML file.
- ``in_process``: Backfill and the simulator in the test's event loop.
- ``processes``: both as real processes, started by the launcher in ``bench.common``.
- ``api``: a real Backfill's HTTP API as the end-to-end tests use it.
- ``infra``: PostgreSQL, S3 (moto) and tmpfs, skipping loudly where they are missing.
- ``blobs``: blobs as older releases wrote them.
"""

from __future__ import annotations

from bench.common import free_port, wait_http
from tests.support.api import (
    ADMIN_TOKEN,
    Api,
    assert_exactly_once,
    batch_of,
    ended,
    rows_of,
    submit,
)
from tests.support.blobs import legacy_blob
from tests.support.in_process import (
    FAST,
    Attempt,
    InProcess,
    Sim,
    backfill_on,
    backfill_on_raw_store,
    backfill_with,
    in_flight,
    in_process_backfill,
    recording_simulator,
    retained,
    running_simulator,
    sim_engine,
)
from tests.support.infra import (
    PG_ADMIN_URL,
    S3_CREDENTIALS,
    create_pg_database,
    drop_pg_database,
    missing_infrastructure,
    moto_endpoint,
    new_bucket,
    stores_on_one_database,
    tmpfs,
)
from tests.support.lines import (
    SIM_MODEL,
    SIM_PRICES,
    STARTING_CREDIT_USD,
    TERMINAL,
    chat_line,
    jsonl,
)
from tests.support.processes import (
    ServerProcess,
    SimulatorProcess,
    backfill_process,
    batch_cli,
    scale_out,
    serve_config,
    serve_role,
    simulator_process,
    start_server_process,
    start_simulator_process,
    stop_all,
)
from tests.support.settings import sim_settings, slow_sim_model, write_sim_config
from tests.support.waits import eventually, sdk_wait_terminal, until, wait_terminal

__all__ = [
    "ADMIN_TOKEN",
    "FAST",
    "PG_ADMIN_URL",
    "S3_CREDENTIALS",
    "SIM_MODEL",
    "SIM_PRICES",
    "STARTING_CREDIT_USD",
    "TERMINAL",
    "Api",
    "Attempt",
    "InProcess",
    "ServerProcess",
    "Sim",
    "SimulatorProcess",
    "assert_exactly_once",
    "backfill_on",
    "backfill_on_raw_store",
    "backfill_process",
    "backfill_with",
    "batch_cli",
    "batch_of",
    "chat_line",
    "create_pg_database",
    "drop_pg_database",
    "ended",
    "eventually",
    "free_port",
    "in_flight",
    "in_process_backfill",
    "jsonl",
    "legacy_blob",
    "missing_infrastructure",
    "moto_endpoint",
    "new_bucket",
    "recording_simulator",
    "retained",
    "rows_of",
    "running_simulator",
    "scale_out",
    "sdk_wait_terminal",
    "serve_config",
    "serve_role",
    "sim_engine",
    "sim_settings",
    "simulator_process",
    "slow_sim_model",
    "start_server_process",
    "start_simulator_process",
    "stop_all",
    "stores_on_one_database",
    "submit",
    "tmpfs",
    "until",
    "wait_http",
    "wait_terminal",
    "write_sim_config",
]
