"""What ``backfill up`` prints once it answers: where it is, the first key, what to try next."""

from __future__ import annotations

import ipaddress
from pathlib import Path

RULE = "─" * 72


def site(host: str, port: int) -> str:
    """The address a browser on this machine reaches: a wildcard listen address is not one."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        if ipaddress.ip_address(shown).version == 6:
            shown = f"[{shown}]"
    except ValueError:
        pass  # a host name
    return f"http://{shown}:{port}"


def ready_banner(*, root: str, data_dir: Path, key: str | None, program: str) -> str:
    """The block printed when the server answers. ``key`` is the organization's first API key,
    given only on the start that made it (it is never stored in the clear)."""
    base = f"{root}/v1"
    shown_key = key or "bf-..."
    lines = [
        "",
        RULE,
        f"  Backfill is ready at {base}   (data in {data_dir})",
        "",
    ]
    if key:
        lines += [
            "  The API key of organization 'default', shown only on this first start: keep it.",
            "",
            f"      {key}",
            "",
        ]
    lines += [
        f"  Batches page:  {root}/",
        "",
        "  Next:",
        f"      export OPENAI_BASE_URL={base} OPENAI_API_KEY={shown_key}",
        f"      {program} batch run requests.jsonl     # your JSONL, one request per line",
        f"      {program} batch list",
        '      curl "$OPENAI_BASE_URL/models" -H "Authorization: Bearer $OPENAI_API_KEY"',
    ]
    if not key:
        lines += [
            "",
            "  OPENAI_API_KEY: the key printed at the first start, or a new one from",
            f"      {program} admin key create --org default --data {data_dir}",
        ]
    lines += [RULE, ""]
    return "\n".join(lines)
