"""Helpers the tests share: start Backfill and the simulator, in process or as processes."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import httpx
import orjson
import pytest
from aiohttp import web

import backfill.container
from backfill.adapters.blobs.raw import LocalRawStore
from backfill.adapters.clock import SystemClock
from backfill.adapters.db.store import SqlStore
from backfill.adapters.engines.openai_http import OpenAIHttpEngine
from backfill.container import Backfill, build
from backfill.domain.money import usd_to_pico
from backfill.ports import Clock, Engine
from backfill.settings import EngineSettings, ModelSettings, PricingSettings, Settings
from backfill.simulator.server import Simulator, SimulatorConfig
from bench.common import spawn_up

T = TypeVar("T")

SIM_MODEL = "sim-model"
# Batch prices of the simulated model, microdollars per million tokens.
SIM_PRICES = PricingSettings(input=100_000, cached_input=50_000, output=400_000)
STARTING_CREDIT_USD = "1000"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_line(
    custom_id: str,
    content: str = "hello",
    *,
    model: str = SIM_MODEL,
    max_tokens: int = 16,
    **body: Any,
) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    import orjson

    return b"".join(orjson.dumps(r) + b"\n" for r in rows)


async def eventually(
    read: Callable[[], Awaitable[T]], holds: Callable[[T], bool], timeout_s: float = 30
) -> T:
    """Read until ``holds`` is true of what was read (what is read changes on its own)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await read()
        if holds(value):
            return value
        assert time.monotonic() < deadline, f"still {value!r}"
        await asyncio.sleep(0.01)


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


@asynccontextmanager
async def running_simulator(
    config: SimulatorConfig | None = None,
) -> AsyncIterator[tuple[str, Simulator]]:
    simulator = Simulator(config or SimulatorConfig(ttft_ms=1, itl_ms=0, output_tokens=4))
    runner = web.AppRunner(
        simulator.app(), access_log=None, shutdown_timeout=1.0, handler_cancellation=True
    )
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}/v1", simulator
    finally:
        await runner.cleanup()


@dataclass
class InProcess:
    """A started in-process Backfill and an HTTP client authenticated as org ``default``."""

    backfill: Backfill
    client: httpx.AsyncClient
    key: str
    clock: Clock
    settings: Settings

    async def upload(self, content: bytes, purpose: str = "batch") -> httpx.Response:
        return await self.client.post(
            "/v1/files",
            data={"purpose": purpose},
            files={"file": ("input.jsonl", content, "application/jsonl")},
        )

    async def create(self, file_id: str, **extra: Any) -> httpx.Response:
        body = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **extra,
        }
        return await self.client.post("/v1/batches", json=body)

    async def run_batch(self, rows: list[dict[str, Any]], timeout_s: float = 60) -> dict[str, Any]:
        uploaded = await self.upload(jsonl(rows))
        assert uploaded.status_code == 200, uploaded.text
        created = await self.create(uploaded.json()["id"])
        assert created.status_code == 200, created.text
        return await self.wait(created.json()["id"], timeout_s)

    async def wait(self, batch_id: str, timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batch: dict[str, Any] = (await self.client.get(f"/v1/batches/{batch_id}")).json()
            if batch["status"] in TERMINAL:
                return batch
            await asyncio.sleep(0.05)
        raise AssertionError(f"batch {batch_id} did not finish in {timeout_s}s")

    async def rows(self, file_id: str | None) -> list[dict[str, Any]]:
        import orjson

        if not file_id:
            return []
        response = await self.client.get(f"/v1/files/{file_id}/content")
        assert response.status_code == 200, response.text
        return [orjson.loads(line) for line in response.content.splitlines()]


@asynccontextmanager
async def in_process_backfill(
    tmp_path: Path,
    sim_url: str,
    *,
    clock: Clock | None = None,
    engines: list[Engine] | None = None,
    **overrides: Any,
) -> AsyncIterator[InProcess]:
    settings = sim_settings(tmp_path / "data", sim_url, **overrides)
    clock = clock or SystemClock()
    if engines is None:
        engines = [
            OpenAIHttpEngine(
                e.name,
                e.base_url,
                {m: m for m in e.models},
                max_concurrency=e.max_concurrency,
                request_timeout_s=e.request_timeout_s,
            )
            for e in settings.engines
        ]
    app_backfill = build(settings, clock=clock, engines=engines)
    await app_backfill.start()
    key = await app_backfill.services.tenants.bootstrap(credit=usd_to_pico(STARTING_CREDIT_USD))
    assert key is not None
    transport = httpx.ASGITransport(app=app_backfill.app())
    client = httpx.AsyncClient(
        transport=transport,
        base_url="http://backfill.test",
        headers={"Authorization": f"Bearer {key}"},
    )
    try:
        yield InProcess(app_backfill, client, key, clock, settings)
    finally:
        await client.aclose()
        await app_backfill.stop()


# ---- real processes ----------------------------------------------------------------------


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before {url} answered")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout_s}s")


@dataclass
class SimulatorProcess:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = httpx.get(f"http://127.0.0.1:{self.port}/stats").json()
        return data

    def stop(self) -> None:
        _stop(self.process)


def start_simulator_process(*args: str) -> SimulatorProcess:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "backfill.cli", "simulate", "--port", str(port), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_http(f"http://127.0.0.1:{port}/health", process)
    return SimulatorProcess(process, port)


@dataclass
class ServerProcess:
    data_dir: Path
    config: Path
    port: int
    key: str
    log: Path
    process: subprocess.Popen[bytes]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=30,
        )

    def kill(self) -> None:
        """SIGKILL: no chance to clean up."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def restart(self) -> None:
        self.process = spawn_up(self.config, self.data_dir, self.port, self.log)
        wait_http(f"http://127.0.0.1:{self.port}/healthz", self.process)

    def stop(self) -> None:
        _stop(self.process)


def batch_of(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    response = client.get(f"/v1/batches/{batch_id}")
    assert response.status_code == 200, response.text
    batch: dict[str, Any] = response.json()
    return batch


def rows_of(client: httpx.Client, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines()]


def assert_exactly_once(
    rows: list[dict[str, Any]], out: list[dict[str, Any]], err: list[dict[str, Any]]
) -> None:
    """Every custom_id of ``rows`` has exactly one row across the output and error files."""
    seen = Counter(r["custom_id"] for r in out + err)
    duplicated = sorted(c for c, n in seen.items() if n > 1)
    assert not duplicated, f"custom_ids with more than one row: {duplicated[:10]}"
    assert set(seen) == {r["custom_id"] for r in rows}


def submit(
    client: httpx.Client,
    rows: list[dict[str, Any]],
    endpoint: str = "/v1/chat/completions",
    **fields: Any,
) -> str:
    """Upload ``rows`` and create a 24h batch from them (with ``fields`` in the create body);
    returns the batch id."""
    uploaded = client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("input.jsonl", jsonl(rows), "application/jsonl")},
    )
    assert uploaded.status_code == 200, uploaded.text
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": endpoint,
            "completion_window": "24h",
            **fields,
        },
    )
    assert created.status_code == 200, created.text
    batch_id: str = created.json()["id"]
    return batch_id


def write_sim_config(
    path: Path, sim_url: str, *, max_concurrency: int = 32, extra: str = ""
) -> None:
    path.write_text(
        f"""
local_engine = false
lease_s = 5.0
retry_base_s = 0.01
retry_max_s = 0.2
{extra}

[[models]]
id = "{SIM_MODEL}"
model_config_id = "sim-model-v1"
context_length = 4096
max_output_tokens = 1024
batch = {{ input = 100000, cached_input = 50000, output = 400000 }}

[[engines]]
name = "sim"
base_url = "{sim_url}"
models = ["{SIM_MODEL}"]
max_concurrency = {max_concurrency}
request_timeout_s = 5.0
"""
    )


def start_server_process(
    tmp_path: Path, sim_url: str, *, max_concurrency: int = 32, extra: str = ""
) -> ServerProcess:
    config = tmp_path / "backfill.toml"
    write_sim_config(config, sim_url, max_concurrency=max_concurrency, extra=extra)
    data_dir = tmp_path / "data"
    log = tmp_path / "server.log"
    port = free_port()
    process = spawn_up(config, data_dir, port, log)
    wait_http(f"http://127.0.0.1:{port}/healthz", process)
    match = re.search(r"bf-[A-Za-z0-9_-]+", log.read_text())
    assert match, log.read_text()
    return ServerProcess(data_dir, config, port, match.group(0), log, process)


def serve_role(
    config: Path, role: str, log: Path, port: int | None = None
) -> subprocess.Popen[bytes]:
    """``backfill serve --role ROLE`` as a real process, its output appended to ``log``."""
    args = [sys.executable, "-m", "backfill.cli", "serve", "--role", role, "--config", str(config)]
    if port is not None:
        args += ["--port", str(port)]
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


ADMIN_TOKEN = "admin-token-for-the-e2e-deployments-0123456789"


class Api:
    """A real Backfill's HTTP API, as an operator (``ADMIN_TOKEN``) and its orgs use it."""

    def __init__(self, port: int) -> None:
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120)
        self._admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def org(self, name: str, weight: int) -> dict[str, str]:
        """Create an org with credit and this weight; its API headers."""
        admin = self._admin
        assert (
            await self.client.post("/admin/v1/orgs", json={"name": name}, headers=admin)
        ).is_success
        key = await self.client.post("/admin/v1/keys", json={"org": name}, headers=admin)
        assert key.status_code == 200, key.text
        credit = {"org": name, "usd": "1000"}
        assert (await self.client.post("/admin/v1/credits", json=credit, headers=admin)).is_success
        patched = await self.client.patch(
            f"/admin/v1/orgs/{name}", json={"weight": weight}, headers=admin
        )
        assert patched.json()["weight"] == weight, patched.text
        return {"Authorization": f"Bearer {key.json()['key']}"}

    async def submit(self, headers: dict[str, str], rows: list[dict[str, Any]]) -> str:
        """Upload ``rows`` and create a 24h chat batch of them; its id."""
        uploaded = await self.client.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", jsonl(rows), "application/jsonl")},
            headers=headers,
        )
        assert uploaded.status_code == 200, uploaded.text
        created = await self.client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
            headers=headers,
        )
        assert created.status_code == 200, created.text
        batch_id: str = created.json()["id"]
        return batch_id

    async def batch(self, headers: dict[str, str], batch_id: str) -> dict[str, Any]:
        got = await self.client.get(f"/v1/batches/{batch_id}", headers=headers)
        assert got.status_code == 200, got.text
        found: dict[str, Any] = got.json()
        return found

    async def rows(self, headers: dict[str, str], file_id: str) -> list[dict[str, Any]]:
        got = await self.client.get(f"/v1/files/{file_id}/content", headers=headers)
        assert got.status_code == 200, got.text
        return [orjson.loads(line) for line in got.content.splitlines()]


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """Terminate every process at once, then wait for each (killing any that hangs)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        _stop(process)


# ---- PostgreSQL and S3 for the scale-out suites ---------------------------------------------

PG_ADMIN_URL = os.environ.get("BACKFILL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
S3_CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing"}


def missing_infrastructure(what: str) -> NoReturn:
    """Fail in CI, which must provide ``what``; elsewhere skip, saying so loudly."""
    import pytest

    if os.environ.get("CI"):
        raise RuntimeError(f"CI must provide this: {what}")
    pytest.skip(f"MISSING INFRASTRUCTURE (CI provides it): {what}")


@asynccontextmanager
async def stores_on_one_database(
    kind: str, tmp_path: Path, count: int
) -> AsyncIterator[list[SqlStore]]:
    """``count`` stores over one fresh database (``kind``: "postgresql" or "sqlite"), as that
    many worker processes hold them: each its own connections."""
    pg = kind == "postgresql"
    url = await create_pg_database() if pg else f"sqlite+aiosqlite:///{tmp_path / 'store.db'}"
    made = [SqlStore(url) for _ in range(count)]
    try:
        await made[0].init()
        yield made
    finally:
        for store in made:
            await store.close()
        if pg:
            await drop_pg_database(url)


async def create_pg_database() -> str:
    """A fresh, empty PostgreSQL database; skips (or fails in CI) when there is no server."""
    import asyncpg

    try:
        conn = await asyncpg.connect(PG_ADMIN_URL, timeout=5)
    except (OSError, asyncpg.PostgresError) as exc:
        missing_infrastructure(f"PostgreSQL at {PG_ADMIN_URL} ({exc})")
    name = f"bf_test_{os.urandom(6).hex()}"
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


async def drop_pg_database(url: str) -> None:
    import asyncpg

    name = url.rsplit("/", 1)[1]
    conn = await asyncpg.connect(PG_ADMIN_URL, timeout=5)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


_MOTO: dict[str, Any] = {}


def moto_endpoint() -> str:
    """An S3 API (moto's server mode) over real HTTP on this machine, started once."""
    if "url" not in _MOTO:
        from moto.server import ThreadedMotoServer

        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        _MOTO["server"] = server
        _MOTO["url"] = f"http://127.0.0.1:{port}"
    url: str = _MOTO["url"]
    return url


def new_bucket() -> str:
    import boto3

    name = f"bf-test-{os.urandom(6).hex()}"
    client = boto3.client(
        "s3",
        endpoint_url=moto_endpoint(),
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=name)
    return name


@contextmanager
def tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """A real, tiny filesystem that fills up (mounting needs root: CI has it)."""
    mount_point.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        missing_infrastructure(f"a tmpfs mount, which needs root ({exc})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False, timeout=10)


StoreT = TypeVar("StoreT", bound=LocalRawStore)


@asynccontextmanager
async def backfill_on_raw_store(
    tmp_path: Path,
    sim_url: str,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[Path], StoreT],
    **overrides: Any,
) -> AsyncIterator[tuple[InProcess, StoreT]]:
    """An in-process Backfill whose local blob store is ``make(root)``: a real store with a
    fault the test injects where a real disk or bucket would raise it."""
    made: list[StoreT] = []

    def raw_store(settings: Settings) -> StoreT:
        made.append(make(settings.resolved_storage_path))
        return made[-1]

    monkeypatch.setattr(backfill.container, "_raw_store", raw_store)
    async with in_process_backfill(tmp_path, sim_url, **overrides) as running:
        yield running, made[0]


def legacy_blob(master: bytes, data: bytes) -> bytes:
    """``data`` encrypted in blob format 1 ("BFE1", not bound to its key), as releases before
    the binding wrote it."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from backfill.adapters.blobs.crypto import SEGMENT

    data_key, prefix, nonce = AESGCM.generate_key(bit_length=256), os.urandom(7), os.urandom(12)
    wrapped = nonce + AESGCM(master).encrypt(nonce, data_key, b"backfill-data-key")
    out = [b"BFE1" + SEGMENT.to_bytes(4, "big") + prefix + wrapped]
    chunks = [data[i : i + SEGMENT] for i in range(0, len(data), SEGMENT)] or [b""]
    for index, chunk in enumerate(chunks):
        last = 1 if index == len(chunks) - 1 else 0
        seal = prefix + index.to_bytes(4, "big") + bytes([last])
        out.append(AESGCM(data_key).encrypt(seal, chunk, None))
    return b"".join(out)
