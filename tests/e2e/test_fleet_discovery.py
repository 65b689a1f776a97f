"""Replicas found by name, end to end (docs/fleet.md): ``backfill up`` with one engine entry
whose base_url names a host that a real DNS server on loopback resolves (dnslib, answering
from a table the test changes) to simulator processes on 127.0.0.2, .3 and .4. Mid-drain one
replica is SIGKILLed and leaves the name, and another joins it: every line is answered once,
charged once, and the newcomer takes work."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.common import start_simulator, wait_batch
from bench.dns_server import DnsTable, dns_server
from tests.support import (
    ADMIN_TOKEN,
    SIM_MODEL,
    assert_exactly_once,
    batch_of,
    chat_line,
    free_port,
    rows_of,
    serve_config,
    submit,
    until,
    write_sim_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

NAME = "sim.fleet.backfill.test"


class Replicas:
    """Simulator processes on loopback addresses, all on one port, as pods of one Service."""

    def __init__(self) -> None:
        self.port = free_port()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, address: str) -> None:
        args = ("--ttft-ms", "20", "--itl-ms", "5", "--output-tokens", "16")
        process, _ = start_simulator(*args, host=address, port=self.port)
        self.processes[address] = process

    def kill(self, address: str) -> None:
        process = self.processes.pop(address)
        process.send_signal(signal.SIGKILL)
        process.wait()

    def served(self, address: str) -> int:
        stats = httpx.get(f"http://{address}:{self.port}/stats", timeout=5).json()
        return int(stats["by_status"].get("200", 0))

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            process.wait(10)


@pytest.fixture
def replicas() -> Iterator[Replicas]:
    fleet = Replicas()
    try:
        yield fleet
    finally:
        fleet.stop()


def engine_names(client: httpx.Client) -> set[str]:
    listed = client.get("/admin/v1/engines", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert listed.status_code == 200, listed.text
    return {e["id"] for e in listed.json()["data"] if e["state"] == "up"}


def test_a_replica_that_leaves_mid_drain_and_one_that_joins_lose_and_repeat_nothing(
    tmp_path: Path, replicas: Replicas
) -> None:
    table = DnsTable()
    with dns_server(table) as dns_port:
        for address in ("127.0.0.2", "127.0.0.3"):
            replicas.start(address)
        table.set_a(NAME, ["127.0.0.2", "127.0.0.3"])
        config = tmp_path / "backfill.toml"
        write_sim_config(
            config,
            "",
            extra=f'admin_token = "{ADMIN_TOKEN}"',
            engines=f"""
[[engines]]
name = "sim"
base_url = "http://{NAME}:{replicas.port}/v1"
models = ["{SIM_MODEL}"]
max_concurrency = 4
request_timeout_s = 5.0
discovery = "dns"
discovery_interval_s = 0.3
discovery_nameservers = ["127.0.0.1:{dns_port}"]
""",
        )
        server = serve_config(tmp_path, config)
        try:
            with server.client() as client:
                port_s = replicas.port
                both = {f"sim@127.0.0.2:{port_s}", f"sim@127.0.0.3:{port_s}"}
                until("both replicas found and up", lambda: engine_names(client) == both)
                rows = [chat_line(f"r{i}", f"question {i} " * (i % 5 + 1)) for i in range(400)]
                batch_id = submit(client, rows)
                until("the leaver took work", lambda: replicas.served("127.0.0.3") >= 20)
                # A pod deleted: its process dies with requests in flight, its address leaves
                # the name; another pod starts and its address joins.
                replicas.kill("127.0.0.3")
                replicas.start("127.0.0.4")
                table.set_a(NAME, ["127.0.0.2", "127.0.0.4"])
                batch = wait_batch(client, batch_of(client, batch_id))
                assert batch["status"] == "completed", batch
                out = rows_of(client, batch["output_file_id"])
                err = rows_of(client, batch.get("error_file_id"))
                assert err == []
                assert_exactly_once(rows, out, err)
                assert replicas.served("127.0.0.4") > 0, "the replica that joined took no work"
                # Each line charged once, for the answer it delivered.
                receipts = [client.get(f"/v1/receipts/{r['response']['request_id']}") for r in out]
                assert all(r.status_code == 200 for r in receipts)
                receipted = sum(int(r.json()["amount"]["value"]) for r in receipts)
                ledger = client.get("/v1/organization/ledger").json()["data"]
                charge = next(e for e in ledger if e["batch_id"] == batch_id)
                assert -int(charge["amount"]["value"]) == receipted > 0
                joined = {f"sim@127.0.0.2:{port_s}", f"sim@127.0.0.4:{port_s}"}
                until(
                    "the leaver is gone from engine health", lambda: engine_names(client) == joined
                )
            log = server.log.read_text()
            assert f"replica sim@127.0.0.4:{port_s} joined" in log
            assert f"replica sim@127.0.0.3:{port_s} left" in log
        finally:
            server.stop()
