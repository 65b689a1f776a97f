"""Name resolution that lets a connection reach only the addresses it checked."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence

from aiohttp.abc import AbstractResolver, ResolveResult

from backfill.adapters.fetch.addresses import parse_address
from backfill.adapters.fetch.policy import AddressRule, Refused
from backfill.adapters.fetch.urls import ONLY_PUBLIC

Lookup = Callable[[str, int], Awaitable[Sequence[str]]]
"""Resolves a host name and port to the addresses (as text) a connection may go to."""

_NUMERIC = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV


async def system_lookup(host: str, port: int) -> list[str]:
    """The operating system's resolver."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_ADDRCONFIG
    )
    return [str(info[4][0]) for info in infos]


class PublicOnlyResolver(AbstractResolver):
    """Resolves once per connection and hands aiohttp only addresses it has checked, so the
    connection goes to exactly those (a name that answers differently the next time, DNS
    rebinding, gains nothing). TLS still verifies the certificate against the host name.

    A name with any non-public address is refused whole: picking a good one would still
    let the name's owner aim the other answers at internal hosts."""

    def __init__(self, rule: AddressRule, lookup: Lookup) -> None:
        self._rule = rule
        self._lookup = lookup

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        try:
            answers = await self._lookup(host, port)
        except OSError:
            raise Refused("the host name does not resolve") from None
        results: list[ResolveResult] = []
        for answer in dict.fromkeys(answers):
            try:
                address = parse_address(answer)
            except ValueError:
                raise Refused(
                    "the host name resolves to something that is not an address"
                ) from None
            kind = self._rule.refusal(address)
            if kind is not None:
                # The address stays out: the message reaches the user, who must not learn what
                # names resolve to inside the operator's network.
                raise Refused(f"the host resolves to {kind}; {ONLY_PUBLIC}")
            address_family = socket.AF_INET if address.version == 4 else socket.AF_INET6
            if family not in (socket.AF_UNSPEC, address_family):
                continue
            results.append(
                ResolveResult(
                    hostname=host,
                    host=str(address),
                    port=port,
                    family=address_family,
                    proto=0,
                    flags=_NUMERIC,
                )
            )
        if not results:
            raise Refused("the host name does not resolve")
        return results

    async def close(self) -> None:
        return None
