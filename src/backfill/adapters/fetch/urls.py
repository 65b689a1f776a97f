"""The URL rules checked before any connection, and how error messages show a URL."""

from __future__ import annotations

from yarl import URL

from backfill.adapters.fetch.addresses import BadHost, host_address
from backfill.adapters.fetch.policy import AddressRule, FetchPolicy, Refused

MAX_URL_CHARS = 8192
ONLY_PUBLIC = "Backfill fetches only public HTTPS URLs"


def checked_url(url: str | URL, policy: FetchPolicy, rule: AddressRule) -> URL:
    """``url`` parsed, if its scheme, credentials and host pass the rules. A host written as an
    address is judged here, because aiohttp connects to such hosts without asking the
    resolver; host names are judged by the resolver, at connect time."""
    text = str(url)
    if len(text) > MAX_URL_CHARS:
        raise Refused(f"the URL is longer than {MAX_URL_CHARS} characters")
    try:
        parsed = url if isinstance(url, URL) else URL(text)
    except ValueError:
        raise Refused("the URL is not valid") from None
    if parsed.scheme not in policy.schemes:
        if parsed.scheme == "http":
            raise Refused(f"the URL is plain http; {ONLY_PUBLIC}")
        raise Refused(f"the URL is not an https URL; {ONLY_PUBLIC}")
    if parsed.raw_user is not None or parsed.raw_password is not None:
        raise Refused("the URL carries a user name or password; Backfill sends no credentials")
    host = parsed.raw_host
    if not host:
        raise Refused("the URL has no host")
    try:
        literal = host_address(host)
    except BadHost as exc:
        raise Refused(f"the host is {exc}") from None
    if literal is not None:
        address, canonical = literal
        kind = rule.refusal(address)
        if kind is not None:
            raise Refused(f"the host is {kind} ({address}); {ONLY_PUBLIC}")
        if not canonical:
            # The system would connect to it, but this spelling is how filters are evaded.
            raise Refused(f"the host is the address {address} written in another form")
    return parsed


def shown(url: str | URL) -> str:
    """``url`` as messages show it: scheme, host and port. The path and query are elided:
    they can carry signed tokens, and what a message must name is the host and the rule."""
    try:
        parsed = url if isinstance(url, URL) else URL(url[:MAX_URL_CHARS])
    except ValueError:
        return "the URL"
    host = parsed.raw_host
    if not host or not parsed.scheme:
        return "the URL"
    host = host[:100]
    if ":" in host:
        host = f"[{host}]"
    port = f":{parsed.explicit_port}" if parsed.explicit_port is not None else ""
    rest = "/" if parsed.raw_path in ("", "/") and not parsed.raw_query_string else "/…"
    return f"{parsed.scheme}://{host}{port}{rest}"
