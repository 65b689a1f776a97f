from array import array
from collections.abc import Callable

from backfill.domain.strict_lines import StrictChatLine

def add_ids(table: array[int], ids: list[str], start: int) -> int: ...
def rehash(old: array[int], new: array[int]) -> None: ...
def chat_run(
    lines: list[bytes],
    start: int,
    decode: Callable[[bytes], StrictChatLine],
    errors: tuple[type[Exception], ...],
    context: int,
    max_id_bytes: int,
    ids: list[str],
) -> tuple[int, int, int, bool]: ...
