"""Replicas looked up at a real DNS server on loopback (dnslib, answering from a table the
test changes): A and AAAA with the engine's port, SRV with their own targets and ports, a
name that does not exist as no replica, and a nameserver in trouble as a failure."""

from __future__ import annotations

import pytest

from backfill.adapters.engines.dns import DnsReplicas
from backfill.ports import DiscoveryFailed
from bench.dns_server import DnsTable, dns_server


async def test_every_a_and_aaaa_address_is_a_replica_at_the_engine_port() -> None:
    table = DnsTable(a={"vllm.models.svc": ["10.0.0.1", "10.0.0.2"]})
    table.aaaa["vllm.models.svc"] = ["fd00::7"]
    with dns_server(table) as port:
        finder = DnsReplicas("vllm.models.svc", 8000, nameservers=[("127.0.0.1", port)])
        assert await finder.find() == {("10.0.0.1", 8000), ("10.0.0.2", 8000), ("fd00::7", 8000)}
        table.set_a("vllm.models.svc", ["10.0.0.2", "10.0.0.3"])
        assert await finder.find() == {("10.0.0.2", 8000), ("10.0.0.3", 8000), ("fd00::7", 8000)}


async def test_srv_records_give_each_target_and_its_own_port() -> None:
    table = DnsTable(
        srv={"_http._tcp.vllm.models.svc": [("pod-a.vllm.models.svc", 8001), ("pod-b", 8002)]},
        a={"pod-a.vllm.models.svc": ["10.0.0.1"], "pod-b": ["10.0.0.2"]},
    )
    with dns_server(table) as port:
        finder = DnsReplicas(
            "_http._tcp.vllm.models.svc", 80, srv=True, nameservers=[("127.0.0.1", port)]
        )
        assert finder.name == "SRV _http._tcp.vllm.models.svc"
        assert await finder.find() == {("10.0.0.1", 8001), ("10.0.0.2", 8002)}


async def test_a_name_that_does_not_exist_has_no_replica() -> None:
    with dns_server(DnsTable()) as port:
        finder = DnsReplicas("gone.models.svc", 8000, nameservers=[("127.0.0.1", port)])
        assert await finder.find() == frozenset()


async def test_a_nameserver_in_trouble_or_silent_is_a_failure_not_an_empty_fleet() -> None:
    table = DnsTable(a={"vllm.models.svc": ["10.0.0.1"]}, down=True)
    with dns_server(table) as port:
        finder = DnsReplicas("vllm.models.svc", 8000, nameservers=[("127.0.0.1", port)])
        with pytest.raises(DiscoveryFailed, match=r"vllm\.models\.svc"):
            await finder.find()
    silent = DnsReplicas("vllm.models.svc", 8000, nameservers=[("127.0.0.1", port)], timeout_s=0.5)
    with pytest.raises(DiscoveryFailed, match=r"A vllm\.models\.svc"):
        await silent.find()


async def test_an_address_in_base_url_is_its_one_replica_without_a_lookup() -> None:
    finder = DnsReplicas("127.0.0.1", 8000, nameservers=[("127.0.0.1", 9)])
    assert await finder.find() == {("127.0.0.1", 8000)}
