"""A real DNS server on loopback, answering from a table the caller changes (dnslib's
server): replicas found by name are tested and measured against the wire, not a mocked
resolver (tests/e2e/test_fleet_discovery.py, bench/churn.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSServer

from bench.common import free_port


@dataclass
class DnsTable(BaseResolver):  # type: ignore[misc]
    """Names to records; a name not in the table answers NXDOMAIN. ``down`` answers SERVFAIL
    to everything (a nameserver in trouble)."""

    a: dict[str, list[str]] = field(default_factory=dict)
    aaaa: dict[str, list[str]] = field(default_factory=dict)
    srv: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    down: bool = False
    questions: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        name = str(request.q.qname).rstrip(".")
        kind = QTYPE[request.q.qtype]
        with self._lock:
            self.questions += 1
            if self.down:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            known = name in self.a or name in self.aaaa or name in self.srv
            if not known:
                reply.header.rcode = RCODE.NXDOMAIN
                return reply
            if kind == "A":
                for address in self.a.get(name, []):
                    reply.add_answer(RR(name, QTYPE.A, rdata=A(address), ttl=1))
            elif kind == "AAAA":
                for address in self.aaaa.get(name, []):
                    reply.add_answer(RR(name, QTYPE.AAAA, rdata=AAAA(address), ttl=1))
            elif kind == "SRV":
                for target, port in self.srv.get(name, []):
                    rdata = SRV(priority=0, weight=1, port=port, target=target)
                    reply.add_answer(RR(name, QTYPE.SRV, rdata=rdata, ttl=1))
        return reply

    def set_a(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self.a[name] = list(addresses)


@contextmanager
def dns_server(table: DnsTable) -> Iterator[int]:
    """Serve ``table`` over UDP on 127.0.0.1 while the block runs; yields the port."""
    port = free_port()
    server = DNSServer(table, port=port, address="127.0.0.1", logger=_Quiet())
    server.start_thread()
    try:
        yield port
    finally:
        server.stop()


class _Quiet:
    """dnslib logs every question to stdout by default."""

    def __getattr__(self, _name: str) -> object:
        return lambda *args, **kwargs: None
