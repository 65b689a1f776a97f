"""The one way the tests wait: poll until something holds, or fail saying what never did."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
import openai
from openai.types import Batch

from tests.support.lines import TERMINAL

T = TypeVar("T")


async def eventually(
    read: Callable[[], Awaitable[T]],
    holds: Callable[[T], object] = bool,
    timeout_s: float = 30,
    *,
    what: str = "",
    interval_s: float = 0.01,
) -> T:
    """Read until ``holds`` is true of what was read (what is read changes on its own); the
    last value read. Past ``timeout_s`` the test fails with ``what`` and that value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await read()
        if holds(value):
            return value
        assert time.monotonic() < deadline, (
            f"timed out after {timeout_s}s waiting for {what or 'a condition'}: still {value!r}"
        )
        await asyncio.sleep(interval_s)


def until(what: str, holds: Callable[[], object], timeout_s: float = 30) -> None:
    """``eventually`` for tests that drive real processes without an event loop: poll
    ``holds`` until it is true, or fail saying ``what`` never happened."""
    deadline = time.monotonic() + timeout_s
    while not holds():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.05)


async def wait_terminal(
    client: httpx.AsyncClient,
    batch_id: str,
    *,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60,
) -> dict[str, Any]:
    """The batch once its status is terminal, read through ``client`` (with ``headers``)."""

    async def read() -> dict[str, Any]:
        response = await client.get(f"/v1/batches/{batch_id}", headers=headers)
        assert response.status_code == 200, response.text
        batch: dict[str, Any] = response.json()
        return batch

    return await eventually(
        read,
        lambda batch: batch["status"] in TERMINAL,
        timeout_s,
        what=f"batch {batch_id} to end",
        interval_s=0.05,
    )


def sdk_wait_terminal(
    client: openai.OpenAI, batch: Batch, timeout_s: float = 120, interval_s: float = 0.2
) -> Batch:
    """The batch once its status is terminal, read through the official SDK's ``client``, as
    a user's script polls it."""
    deadline = time.monotonic() + timeout_s
    while batch.status not in TERMINAL:
        assert time.monotonic() < deadline, f"the batch stayed {batch.status}: {batch}"
        time.sleep(interval_s)
        batch = client.batches.retrieve(batch.id)
    return batch
