"""Replicas found by name: every address a DNS name resolves to is one replica of an engine
(A and AAAA records with the engine's port, or SRV records with their own targets and
ports), looked up with dnspython so that SRV records and a nameserver of the operator's
choosing (a cluster's DNS, or one a test starts) work alike (docs/fleet.md)."""

from __future__ import annotations

import ipaddress
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.rdatatype
import dns.resolver

from backfill.ports import DiscoveryFailed

# A lookup that takes longer failed: what was found before stands until the next one.
LOOKUP_TIMEOUT_S = 5.0

# The name exists but has no record of that type, or does not exist at all: no replica there.
_NONE = (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN)


class DnsReplicas:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        srv: bool = False,
        nameservers: list[tuple[str, int]] | None = None,
        timeout_s: float = LOOKUP_TIMEOUT_S,
    ) -> None:
        self._host = host
        self._port = port
        self._srv = srv
        self._timeout_s = timeout_s
        if nameservers:
            resolver = dns.asyncresolver.Resolver(configure=False)
            resolver.nameservers = [
                dns.nameserver.Do53Nameserver(address, port) for address, port in nameservers
            ]
        else:
            # The system's: /etc/resolv.conf, with its search domains (a Kubernetes pod's
            # "qwen-7b.models.svc" is completed as its own lookups would be).
            resolver = dns.asyncresolver.Resolver()
        self._resolver = resolver

    @property
    def name(self) -> str:
        return f"{'SRV ' if self._srv else ''}{self._host}"

    async def find(self) -> frozenset[tuple[str, int]]:
        if _is_address(self._host):
            return frozenset({(self._host, self._port)})
        if not self._srv:
            return frozenset((address, self._port) for address in await self._addresses(self._host))
        found: set[tuple[str, int]] = set()
        for target, port in await self._services():
            found.update((address, port) for address in await self._addresses(target))
        return frozenset(found)

    async def _services(self) -> list[tuple[str, int]]:
        answer = await self._lookup(self._host, dns.rdatatype.SRV)
        return [(str(r.target).rstrip("."), int(r.port)) for r in answer]

    async def _addresses(self, name: str) -> set[str]:
        if _is_address(name):
            return {name}
        found: set[str] = set()
        for kind in (dns.rdatatype.A, dns.rdatatype.AAAA):
            found.update(str(r.address) for r in await self._lookup(name, kind))
        return found

    async def _lookup(self, name: str, kind: dns.rdatatype.RdataType) -> list[Any]:
        """The records of ``kind`` (their type follows ``kind``: dnspython's Rdata)."""
        try:
            answer = await self._resolver.resolve(name, kind, search=True, lifetime=self._timeout_s)
        except _NONE:
            return []
        except dns.exception.DNSException as exc:
            raise DiscoveryFailed(
                f"looking up {dns.rdatatype.to_text(kind)} {name} failed: {exc}"
            ) from None
        return list(answer)


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
