"""The container image (Containerfile, docs/deployment.md "Container image"), built and run
with podman as an operator would: `db upgrade`, then an API and a worker container against
this machine's PostgreSQL and an S3 server on loopback, a batch drained on the simulator (run
from the same image) with the official SDK, as a non-root user, in an image of bounded size.

CI installs podman and makes the base image from Debian's packages (.ci/run); elsewhere the
test skips, saying so, where podman is missing."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from backfill.settings import LOCAL_MODEL
from tests.support import (
    SIM_MODEL,
    chat_line,
    create_pg_database,
    drop_pg_database,
    free_port,
    jsonl,
    moto_endpoint,
    new_bucket,
    sdk_wait_terminal,
    write_sim_config,
)
from tests.support.infra import missing_infrastructure

pytestmark = [pytest.mark.container, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/backfill:test"
LOCAL_IMAGE = "localhost/backfill:test-local"
PODMAN_CONF = ROOT / "deploy" / "container" / "podman.conf"
# The fleet image without the local engine (the aim: at most 250 MB), with room for
# the base image's own drift between Debian point releases.
MAX_IMAGE_BYTES = 260_000_000
LINES = 24


def podman(*args: str, timeout: float = 120, check: bool = True) -> str:
    done = subprocess.run(
        ["podman", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | {"CONTAINERS_CONF": str(PODMAN_CONF)},
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout.strip()


def build(tag: str, target: str) -> str:
    """``podman build`` of ``target`` as docs/deployment.md gives it; its layers are cached
    between runs on the same machine."""
    if shutil.which("podman") is None:
        missing_infrastructure("podman (apt-get install podman runc debootstrap)")
    env = os.environ | {"CONTAINERS_CONF": str(PODMAN_CONF)}
    subprocess.run([str(ROOT / "deploy/container/base-image.sh")], check=True, env=env, timeout=900)
    command = ["podman", "build", "--format", "docker", "--network", "host"]
    command += ["--target", target, "-t", tag]
    # Behind a proxy that re-signs TLS, pip in the build trusts what pip here trusts.
    if (ca := os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")) and Path(ca).is_file():
        command += ["--secret", f"id=pip-ca,src={ca}"]
    done = subprocess.run(
        [*command, str(ROOT)], capture_output=True, text=True, env=env, timeout=1200
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return tag


@pytest.fixture(scope="module")
def image() -> str:
    return build(IMAGE, "fleet")


@pytest.fixture(scope="module")
def local_image() -> str:
    return build(LOCAL_IMAGE, "local")


@pytest.fixture
def pg_url() -> Iterator[str]:
    import asyncio

    url = asyncio.run(create_pg_database())
    yield url
    asyncio.run(drop_pg_database(url))


class Containers:
    """The containers one test starts, removed at its end (their logs printed on failure)."""

    def __init__(self, config: Path) -> None:
        self.config = config
        self.names: list[str] = []

    def run(self, *args: str, name: str | None = None, detach: bool = False) -> str:
        options = ["--network", "host", "-v", f"{self.config}:/etc/backfill/backfill.toml:ro"]
        options += ["-e", "BACKFILL_CONFIG=/etc/backfill/backfill.toml"]
        if detach:
            assert name is not None
            self.names.append(name)
            return podman("run", "-d", "--name", name, *options, *args)
        return podman("run", "--rm", *options, *args, timeout=300)

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n" + podman("logs", name, check=False, timeout=30) for name in self.names
        )

    def remove(self) -> None:
        for name in self.names:
            podman("rm", "-f", "-t", "10", name, check=False, timeout=60)


def wait_ok(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered 200"
        time.sleep(0.5)


def drain(api: str, key: str, model: str, lines: int) -> list[dict[str, Any]]:
    """A batch of ``lines`` chat lines through the official SDK, waited for; its output rows."""
    client = OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0)
    requests = [chat_line(f"line-{i}", f"question {i}", model=model) for i in range(lines)]
    uploaded = client.files.create(file=("in.jsonl", jsonl(requests)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = sdk_wait_terminal(client, batch, timeout_s=300, interval_s=1)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None
    output = client.files.content(batch.output_file_id).text
    rows = [json.loads(row) for row in output.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"line-{i}" for i in range(lines))
    assert all(r["response"]["status_code"] == 200 for r in rows)
    return rows


def test_the_image_runs_a_scale_out_drain_as_a_non_root_user(
    image: str, pg_url: str, tmp_path: Path
) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image))
    print(f"image size: {size / 1e6:.1f} MB")
    assert size <= MAX_IMAGE_BYTES, f"the image grew to {size / 1e6:.1f} MB"
    inspected = json.loads(podman("image", "inspect", image))[0]
    assert inspected["Config"]["User"] == "10001:10001"
    assert inspected["Config"]["Entrypoint"] == ["backfill"]
    assert "/data" in inspected["Config"]["Volumes"]

    sim_port, api_port, worker_port = free_port(), free_port(), free_port()
    config = tmp_path / "backfill.toml"
    write_sim_config(
        config,
        f"http://127.0.0.1:{sim_port}/v1",
        extra=f"""
database_url = "{pg_url.replace("localhost", "127.0.0.1")}"
storage_url = "s3://{new_bucket()}/backfill"
master_key = "{base64.b64encode(os.urandom(32)).decode()}"
port = {api_port}
s3.endpoint_url = "{moto_endpoint()}"
s3.access_key_id = "testing"
s3.secret_access_key = "testing"
""",
    )
    config.chmod(0o644)
    run = uuid.uuid4().hex[:8]
    containers = Containers(config)
    try:
        containers.run(image, "db", "upgrade")
        containers.run(image, "admin", "org", "create", "acme")
        containers.run(image, "admin", "credit", "add", "--org", "acme", "--usd", "10")
        key = containers.run(image, "admin", "key", "create", "--org", "acme").splitlines()[-1]

        containers.run(
            "--no-healthcheck", image, "simulate", "--port", str(sim_port),
            "--output-tokens", "8", name=f"sim-{run}", detach=True,
        )  # fmt: skip
        containers.run(image, "serve", "--role", "api", name=f"api-{run}", detach=True)
        containers.run(
            "-e", f"BACKFILL_WORKER__HTTP_PORT={worker_port}", image, "serve", "--role", "worker",
            name=f"worker-{run}", detach=True,
        )  # fmt: skip
        api = f"http://127.0.0.1:{api_port}"
        wait_ok(f"{api}/readyz")
        assert podman("exec", f"api-{run}", "id", "-u") == "10001"
        assert podman("exec", f"worker-{run}", "id", "-u") == "10001"
        wait_ok(f"http://127.0.0.1:{worker_port}/readyz")
        # The image's HEALTHCHECK passes on the API container and on the worker's probe port.
        podman("healthcheck", "run", f"api-{run}")
        podman("healthcheck", "run", f"worker-{run}")

        rows = drain(api, key, SIM_MODEL, LINES)
        assert {r["response"]["body"]["model"] for r in rows} == {SIM_MODEL}
    except BaseException:
        print(containers.logs())
        raise
    finally:
        containers.remove()


def test_the_local_image_runs_up_with_its_own_engine(local_image: str, tmp_path: Path) -> None:
    """`backfill up` as the local image's default command: the bundled llama.cpp engine and
    SmolLM2 in the container, the data on a volume, the first start's key in the log."""
    size = int(podman("image", "inspect", "--format", "{{.Size}}", local_image))
    print(f"local image size: {size / 1e6:.1f} MB")
    port = free_port()
    run = uuid.uuid4().hex[:8]
    name = f"local-{run}"
    volume = f"backfill-test-{run}"
    containers = Containers(tmp_path / "unused.toml")
    containers.names.append(name)
    try:
        # The default command (`up`), on a free port of the host's network.
        podman(
            "run", "-d", "--name", name, "--network", "host", "-v", f"{volume}:/data",
            "-e", f"BACKFILL_PORT={port}", "-e", "BACKFILL_HOST=127.0.0.1", local_image,
        )  # fmt: skip
        api = f"http://127.0.0.1:{port}"
        wait_ok(f"{api}/readyz", timeout_s=180)
        keys = re.findall(r"\b(bf-[A-Za-z0-9_-]{20,})", podman("logs", name))
        assert keys, "the first start printed no API key"
        assert podman("exec", name, "id", "-u") == "10001"
        podman("healthcheck", "run", name)
        rows = drain(api, keys[0], LOCAL_MODEL, 2)
        for row in rows:
            assert row["response"]["body"]["choices"][0]["message"]["content"]
            assert row["response"]["body"]["usage"]["completion_tokens"] > 0
    except BaseException:
        print(containers.logs())
        raise
    finally:
        containers.remove()
        podman("volume", "rm", "-f", volume, check=False)
