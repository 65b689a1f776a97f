"""PostgreSQL, S3 (moto) and a tiny filesystem for the suites that need them: CI provides each,
elsewhere a test that lacks one skips, saying so."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pytest

from backfill.adapters.db.store import SqlStore
from bench.common import free_port

PG_ADMIN_URL = os.environ.get("BACKFILL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
S3_CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing"}


def missing_infrastructure(what: str) -> NoReturn:
    """Fail in CI, which must provide ``what``; elsewhere skip, saying so loudly."""
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
