"""Replica groups under churn: a drain over three replicas found by name, one of which is
killed and leaves the name mid-drain while another joins, against the same drain with a fixed
fleet (docs/scheduling.md, "Replica groups under churn").

    PYTHONPATH=. python -m bench.churn                      # about five minutes
    PYTHONPATH=. python -m bench.churn --lines 20000 --groups 300

Both runs find their replicas the same way: one engine entry with ``discovery = "dns"``, its
name answered by a DNS server on loopback (dnslib, from a table the bench changes), the
replicas simulator processes on 127.0.0.2 and up, all on one port, each with its own prefix
cache (as ``bench.locality``). In the churn run, once a third of the lines are done, the
replica on 127.0.0.3 is SIGKILLed (its requests in flight are cut) and leaves the name, and
127.0.0.5, started beforehand as a pod is ready before its address is published, joins it.

Printed: each run's seconds and requests/s, the churn run's throughput against the fixed
fleet's, the cached share of prompt tokens, the requests sent again (those the replicas
received, less the lines: requests cut on the killed replica and sent to another), the prefix
groups whose replica changed (rendezvous hashing: the leaver's, and those the newcomer now
wins), and lines lost and duplicated (custom_ids missing from or repeated in the output and
error files).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from backfill.domain.scheduling.locality import assign, prefix_key
from backfill.runner.discovery import replica_name
from bench.common import (
    MODEL,
    create_batch,
    free_port,
    start_backfill,
    start_simulator,
    stop,
    upload,
)
from bench.dns_server import DnsTable, dns_server
from bench.locality import BLOCK_TOKENS, PREFIX_WORDS, write_input

NAME = "sim.fleet.backfill.bench"
SLOTS = 16
FIRST = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
LEAVER, JOINER = "127.0.0.3", "127.0.0.5"


@dataclass(frozen=True)
class Run:
    name: str
    port: int
    seconds: float
    input_tokens: int
    cached_tokens: int
    resent: int
    lost: int
    duplicated: int

    @property
    def share(self) -> float:
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0


class Fleet:
    def __init__(self, groups: int) -> None:
        self.port = free_port()
        self.blocks = (PREFIX_WORDS // BLOCK_TOKENS + 2) * groups // 2
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, address: str) -> None:
        process, _ = start_simulator(
            *("--slots", str(SLOTS)),
            *("--ttft-ms", "5", "--prefill-ms-per-token", "0.2"),
            *("--itl-ms", "20", "--output-tokens", "8"),
            *("--block-tokens", str(BLOCK_TOKENS), "--prefix-cache-blocks", str(self.blocks)),
            *("--model-name", MODEL),
            host=address,
            port=self.port,
        )
        self.processes[address] = process

    def requests(self, address: str) -> int:
        """Requests the replica at ``address`` has received so far."""
        stats = httpx.get(f"http://{address}:{self.port}/stats", timeout=10).json()
        return int(stats["requests"])

    def kill(self, address: str) -> int:
        """SIGKILL the replica; the requests it had received (read just before: one that
        arrives in between is not counted)."""
        received = self.requests(address)
        process = self.processes.pop(address)
        process.send_signal(signal.SIGKILL)
        process.wait()
        return received

    def stop(self) -> None:
        for process in self.processes.values():
            stop(process)


def config(path: Path, port: int, dns_port: int) -> Path:
    path.write_text(
        f"""
local_engine = false

[[models]]
id = "{MODEL}"
model_config_id = "sim-model-v1"
batch = {{ input = 100000, cached_input = 50000, output = 400000 }}

[[engines]]
name = "sim"
base_url = "http://{NAME}:{port}/v1"
models = ["{MODEL}"]
max_concurrency = {SLOTS}
discovery = "dns"
discovery_interval_s = 1.0
discovery_nameservers = ["127.0.0.1:{dns_port}"]
"""
    )
    return path


def rows(client: httpx.Client, file_id: str | None) -> list[str]:
    if not file_id:
        return []
    content = client.get(f"/v1/files/{file_id}/content").content
    return [orjson.loads(line)["custom_id"] for line in content.splitlines()]


def drain(name: str, work: Path, source: Path, lines: int, groups: int, churn: bool) -> Run:
    table = DnsTable()
    fleet = Fleet(groups)
    with dns_server(table) as dns_port:
        try:
            for address in FIRST:
                fleet.start(address)
            table.set_a(NAME, FIRST)
            settings = config(work / f"{name}.toml", fleet.port, dns_port)
            process, base, key = start_backfill(
                settings, work / f"data-{name}", work / f"{name}.log"
            )
            try:
                client = httpx.Client(
                    base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=600
                )
                file_id = upload(client, source)
                start = time.perf_counter()
                batch = create_batch(client, file_id)
                churned = not churn
                sent = 0  # requests received by replicas that are gone
                while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
                    time.sleep(0.1)
                    batch = client.get(f"/v1/batches/{batch['id']}").json()
                    if not churned and batch["request_counts"]["completed"] >= lines // 3:
                        fleet.start(JOINER)
                        sent += fleet.kill(LEAVER)
                        table.set_a(NAME, [FIRST[0], FIRST[2], JOINER])
                        churned = True
                seconds = time.perf_counter() - start
                if batch["status"] != "completed":
                    raise RuntimeError(f"{name}: the batch ended {batch['status']}")
                answered = rows(client, batch["output_file_id"])
                answered += rows(client, batch.get("error_file_id"))
                seen = Counter(answered)
                sent += sum(fleet.requests(address) for address in fleet.processes)
                usage = batch["usage"]
                return Run(
                    name,
                    fleet.port,
                    seconds,
                    usage["input_tokens"],
                    usage["input_tokens_details"]["cached_tokens"],
                    resent=sent - lines,
                    lost=lines - len(seen),
                    duplicated=sum(n - 1 for n in seen.values()),
                )
            finally:
                stop(process)
        finally:
            fleet.stop()


def groups_moved(source: Path, port: int) -> tuple[int, int]:
    """Prefix groups whose replica changes from the first fleet to the churned one, by the
    same rendezvous choice the dispatcher makes (with room for all); and the groups."""
    keys = sorted({prefix_key(line) for line in source.read_bytes().splitlines()})

    def placed(addresses: list[str]) -> list[str]:
        names = [replica_name("sim", a, port) for a in addresses]
        return [names[i] for i in assign(keys, names, [len(keys)] * len(names))]

    before, after = placed(FIRST), placed([FIRST[0], FIRST[2], JOINER])
    return sum(1 for a, b in zip(before, after, strict=True) if a != b), len(keys)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--lines", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        source = work / "input.jsonl"
        write_input(source, args.groups, args.lines)
        fixed = drain("fixed", work, source, args.lines, args.groups, churn=False)
        churned = drain("churn", work, source, args.lines, args.groups, churn=True)
        moved, groups = groups_moved(source, churned.port)
    print(
        f"{len(FIRST)} replicas x {SLOTS} slots found by name; {args.lines:,} lines in "
        f"{args.groups} prefix groups; churn: {LEAVER} killed and {JOINER} joined once a "
        "third of the lines were done"
    )
    print(
        f"{'fleet':<6} {'seconds':>8} {'req/s':>7} {'cached share':>12} {'re-sent':>8} "
        f"{'lost':>5} {'duplicated':>10}"
    )
    for r in (fixed, churned):
        print(
            f"{r.name:<6} {r.seconds:8.1f} {args.lines / r.seconds:7.0f} {100 * r.share:11.1f}% "
            f"{r.resent:8d} {r.lost:5d} {r.duplicated:10d}"
        )
    print(
        f"churn: {fixed.seconds / churned.seconds:.2f}x the fixed fleet's throughput; "
        f"prefix groups moved {moved} of {groups} ({100 * moved / groups:.0f}%)"
    )


if __name__ == "__main__":
    main()
