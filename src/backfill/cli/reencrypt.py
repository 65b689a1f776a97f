"""``backfill db reencrypt``: rewrite content of the old, unbound blob format in the current one.

Blobs written before format 2 are not bound to their file, so someone with write access to the
storage alone could swap two of them. They stay readable only while the database's blob-format
floor is 1; this command rewrites each one (atomically, under the same key) and then raises
the floor to 2, after which format-1 blobs are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from backfill.adapters.blobs.master import CURRENT_BLOB_FORMAT
from backfill.cli.common import opened
from backfill.domain.files import content_key, index_key
from backfill.errors import BackfillError
from backfill.settings import Settings

_PAGE = 1000


@dataclass
class Outcome:
    files: int = 0
    rewritten: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    """File id → why its content could not be rewritten."""


async def reencrypt_all(settings: Settings, console: Console) -> Outcome:
    """Rewrite every format-1 blob; raise the floor only when all of them succeeded."""
    outcome = Outcome()
    async with opened(settings) as backfill:
        store, blobs = backfill.store, backfill.blobs
        ids: list[str] = []
        while page := await store.stored_file_ids(ids[-1] if ids else None, _PAGE):
            ids.extend(page)
        with Progress(
            TextColumn("Re-encrypting"), BarColumn(), MofNCompleteColumn(), console=console
        ) as progress:
            task = progress.add_task("files", total=len(ids))
            for file_id in ids:
                try:
                    for key in (content_key(file_id), index_key(file_id)):
                        outcome.rewritten += await blobs.reencrypt(key)
                except BackfillError as exc:
                    outcome.failed[file_id] = exc.message
                outcome.files += 1
                progress.advance(task)
        if not outcome.failed:
            await store.set_min_blob_format(CURRENT_BLOB_FORMAT)
    return outcome
