"""What a fetch may reach and how much it may take."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from ipaddress import ip_network

from backfill.adapters.fetch.addresses import IPAddress, IPNetwork, non_public_kind
from backfill.settings import OutboundPolicy


class Refused(OSError):
    """A rule refused a URL or an address. An ``OSError`` so that it passes through aiohttp's
    resolver plumbing, which wraps it in its own error with this one as the cause."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """Limits of one fetch and where it may go.

    ``timeout_s`` bounds the whole fetch, redirects and body included; ``connect_timeout_s``
    each connection attempt. ``allow_http``, ``allow_private`` and ``allowed_networks`` are for
    development and private deployments: they let a fetch reach plain HTTP, any address, or
    the listed networks (``"10.1.2.0/24"``) although they are not public. ``ssl_context`` is
    what verifies the servers' certificates (None: the system's CAs)."""

    max_bytes: int
    timeout_s: float
    connect_timeout_s: float = 5.0
    max_redirects: int = 3
    allow_http: bool = False
    allow_private: bool = False
    allowed_networks: tuple[str, ...] = ()
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    @classmethod
    def outbound(
        cls,
        rules: OutboundPolicy,
        *,
        max_bytes: int,
        connect_timeout_s: float,
        max_redirects: int = 3,
    ) -> FetchPolicy:
        """The policy a settings section (``[fetch]``, ``[webhooks]``) describes, with the
        bounds its user sets in code."""
        context = None
        if rules.ca_file is not None:
            context = ssl.create_default_context(cafile=str(rules.ca_file))
        return cls(
            max_bytes=max_bytes,
            timeout_s=rules.timeout_s,
            connect_timeout_s=connect_timeout_s,
            max_redirects=max_redirects,
            allow_http=rules.allow_http,
            allow_private=rules.allow_private,
            allowed_networks=tuple(rules.allowed_networks),
            ssl_context=context,
        )

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("max_bytes, timeout_s and connect_timeout_s must be positive")
        if self.max_redirects < 0:
            raise ValueError("max_redirects must not be negative")
        for network in self.allowed_networks:
            ip_network(network)  # a typo fails at start, not at the first fetch

    @property
    def networks(self) -> tuple[IPNetwork, ...]:
        return tuple(ip_network(network) for network in self.allowed_networks)

    @property
    def schemes(self) -> tuple[str, ...]:
        return ("https", "http") if self.allow_http else ("https",)


class AddressRule:
    """Decides, for a policy, whether an address may be connected to."""

    def __init__(self, policy: FetchPolicy) -> None:
        self._allow_all = policy.allow_private
        self._networks = policy.networks

    def refusal(self, address: IPAddress) -> str | None:
        """What kind of non-public address this is, when the policy does not allow it."""
        if self._allow_all:
            return None
        if any(address.version == n.version and address in n for n in self._networks):
            return None
        return non_public_kind(address)
