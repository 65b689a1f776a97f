"""Fetching user URLs safely: public HTTPS hosts only, checked at connect time and pinned,
with size, time, type and redirect limits (SPEC §10.4).

Build one for production from a policy: ``SafeFetcher(FetchPolicy(max_bytes=..., timeout_s=...))``.
"""

from backfill.adapters.fetch.fetcher import SafeFetcher
from backfill.adapters.fetch.policy import FetchPolicy
from backfill.adapters.fetch.resolver import Lookup, system_lookup

__all__ = ["FetchPolicy", "Lookup", "SafeFetcher", "system_lookup"]
