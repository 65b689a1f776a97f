"""Which IP addresses count as public, and which hosts are addresses written as numbers."""

from __future__ import annotations

import re
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

LOOPBACK = "a loopback address"
PRIVATE = "a private address"
LINK_LOCAL = "a link-local address"
RESERVED = "a reserved address"

# Written out rather than taken from ``is_global`` alone: its tables change between Python
# versions, and it calls multicast addresses and every IPv4-in-IPv6 embedding global.
_IPV4: tuple[tuple[IPv4Network, str], ...] = tuple(
    (IPv4Network(net), kind)
    for net, kind in (
        ("0.0.0.0/8", "a this-network address"),
        ("10.0.0.0/8", PRIVATE),
        ("100.64.0.0/10", "a shared (carrier-grade NAT) address"),
        ("127.0.0.0/8", LOOPBACK),
        # 169.254.169.254 is where clouds serve instance metadata and credentials.
        ("169.254.0.0/16", LINK_LOCAL),
        ("172.16.0.0/12", PRIVATE),
        ("192.0.0.0/24", RESERVED),
        ("192.0.2.0/24", "a documentation address"),
        ("192.88.99.0/24", RESERVED),
        ("192.168.0.0/16", PRIVATE),
        ("198.18.0.0/15", "a benchmarking address"),
        ("198.51.100.0/24", "a documentation address"),
        ("203.0.113.0/24", "a documentation address"),
        ("224.0.0.0/4", "a multicast address"),
        ("240.0.0.0/4", RESERVED),
    )
)

_IPV6: tuple[tuple[IPv6Network, str], ...] = tuple(
    (IPv6Network(net), kind)
    for net, kind in (
        ("::/128", "an unspecified address"),
        ("::1/128", LOOPBACK),
        # NAT64 for local use only; the well-known 64:ff9b::/96 is an embedding (below).
        ("64:ff9b:1::/48", PRIVATE),
        ("100::/64", RESERVED),
        # Teredo, ORCHID and other protocol assignments: nothing an image is served from.
        ("2001::/23", RESERVED),
        ("2001:db8::/32", "a documentation address"),
        ("3fff::/20", "a documentation address"),
        ("fc00::/7", PRIVATE),
        ("fe80::/10", LINK_LOCAL),
        ("fec0::/10", "a site-local address"),
        ("ff00::/8", "a multicast address"),
    )
)

_GLOBAL_UNICAST = IPv6Network("2000::/3")
_MAPPED = IPv6Network("::ffff:0:0/96")
_COMPATIBLE = IPv6Network("::/96")
_NAT64 = IPv6Network("64:ff9b::/96")
_SIX_TO_FOUR = IPv6Network("2002::/16")


def embedded_ipv4(address: IPv6Address) -> IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, compatible, NAT64, 6to4): packets
    to it end up at that IPv4 address, so that is the one to judge."""
    value = int(address)
    if address in _MAPPED or address in _COMPATIBLE or address in _NAT64:
        return IPv4Address(value & 0xFFFFFFFF)
    if address in _SIX_TO_FOUR:
        return IPv4Address((value >> 80) & 0xFFFFFFFF)
    return None


def non_public_kind(address: IPAddress) -> str | None:
    """What kind of non-public address ``address`` is ("a loopback address"), or None when it
    is public."""
    if isinstance(address, IPv4Address):
        for network, kind in _IPV4:
            if address in network:
                return kind
        return None if address.is_global else RESERVED
    for network6, kind6 in _IPV6:
        if address in network6:
            return kind6
    embedded = embedded_ipv4(address)
    if embedded is not None:
        embedded_kind = non_public_kind(embedded)
        # IPv4-compatible addresses are deprecated: no public host is reached through one.
        return embedded_kind or (RESERVED if address in _COMPATIBLE else None)
    if address not in _GLOBAL_UNICAST or not address.is_global:
        return RESERVED
    return None


_NUMBER = re.compile(r"0x[0-9a-f]*|[0-9]+")
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")


class BadHost(ValueError):
    """A URL host that is neither a host name nor an address."""


def host_address(host: str) -> tuple[IPAddress, bool] | None:
    """The address a URL host names literally, with whether it was written canonically; None
    for a host name. Numbers in the forms ``inet_aton`` and browsers accept (``2130706433``,
    ``0x7f.1``, ``0177.0.0.1``) count as addresses, because the system would connect to them
    as such. Raises ``BadHost`` for anything else that is not a host name."""
    if ":" in host:
        if "%" in host:
            raise BadHost("an IPv6 address with a zone")
        try:
            return IPv6Address(host), True
        except ValueError:
            raise BadHost("not a valid IPv6 address") from None
    name = host.lower()
    if name.endswith("."):
        name = name[:-1]
    labels = name.split(".")
    if _NUMBER.fullmatch(labels[-1]):
        address = _numeric_ipv4(labels)
        return address, str(address) == host
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise BadHost("not a valid host name")
    return None


def _numeric_ipv4(labels: list[str]) -> IPv4Address:
    if len(labels) > 4:
        raise BadHost("not a valid IPv4 address")
    numbers: list[int] = []
    for label in labels:
        if not _NUMBER.fullmatch(label):
            raise BadHost("not a valid IPv4 address")
        try:
            if label.startswith("0x"):
                numbers.append(int(label[2:] or "0", 16))
            elif len(label) > 1 and label.startswith("0"):
                numbers.append(int(label, 8))
            else:
                numbers.append(int(label))
        except ValueError:
            raise BadHost("not a valid IPv4 address") from None
    *leading, last = numbers
    if any(n > 255 for n in leading) or last >= 256 ** (5 - len(numbers)):
        raise BadHost("not a valid IPv4 address")
    value = last
    for i, n in enumerate(leading):
        value += n << (8 * (3 - i))
    return IPv4Address(value)


def parse_address(text: str) -> IPAddress:
    """An address as a resolver writes it (an IPv6 zone, as in ``fe80::1%eth0``, dropped)."""
    return ip_address(text.split("%", 1)[0])
