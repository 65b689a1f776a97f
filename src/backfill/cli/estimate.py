"""``backfill batch estimate``: what a batch of a file would cost, whether it would be accepted,
and when it would finish, before it is created (docs/cli.md, docs/api.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from backfill.cli.batch import (
    DEFAULT_ENDPOINT,
    ApiKey,
    BaseUrl,
    Client,
    _endpoint,
    _fail,
    _rows_table,
    _upload,
    _when,
    _with_model,
    console,
)
from backfill.cli.common import JsonOpt, print_json


def estimate(
    file: Annotated[
        Path | None,
        typer.Argument(exists=True, dir_okay=False, help="Input JSONL: uploaded, then estimated."),
    ] = None,
    file_id: Annotated[
        str | None,
        typer.Option(help="Estimate a file uploaded before (its id) instead of FILE."),
    ] = None,
    base_url: BaseUrl = None,
    api_key: ApiKey = "",
    model: Annotated[str | None, typer.Option(help="Use this model for every line.")] = None,
    window: Annotated[str, typer.Option(help="Completion window.")] = "24h",
    endpoint: Annotated[
        str | None,
        typer.Option(
            help=f"The lines' endpoint (default: FILE's first line's url; {DEFAULT_ENDPOINT} "
            "with --file-id)."
        ),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Show what a batch of FILE would cost (worst case and expected), whether it would be
    accepted now, and when it would finish; no batch is created and nothing is reserved."""
    if not api_key:
        _fail("Give an API key with --api-key or BACKFILL_API_KEY.")
    if (file is None) == (file_id is None):
        _fail("Give either FILE (to upload) or --file-id (a file uploaded before), not both.")
    if file_id is not None and model is not None:
        _fail("--model rewrites FILE's lines before the upload; it cannot change --file-id.")
    client = Client(base_url, api_key)
    if file is not None:
        file_id = _upload(client, file, _with_model(file, model))
        endpoint = endpoint or _endpoint(file)
    found = client.json(
        "POST",
        "/batches/estimate",
        json={
            "input_file_id": file_id,
            "endpoint": endpoint or DEFAULT_ENDPOINT,
            "completion_window": window,
        },
    )
    if json_:
        print_json(found)
        return
    Console().print(summary(found))
    if found["admission"]["admitted"]:
        console.print(
            Text(
                f"Nothing was created. To submit it: backfill batch run FILE, or POST "
                f"/v1/batches with input_file_id {found['input_file_id']}."
            )
        )


def summary(found: dict[str, Any]) -> Table:
    """The estimate as rows a person reads: costs with the tokens they stand for, admission,
    and the completion time; ids whole, however narrow the terminal."""
    worst, expected, admission = found["worst_case"], found["expected"], found["admission"]
    rows: list[tuple[str, str]] = [
        ("input file", found["input_file_id"]),
        ("model", found["model"]),
        ("requests", f"{found['request_count']:,}"),
        ("window", f"{found['completion_window']} (until {_when(found['expires_at'])})"),
        (
            "worst case",
            f"{_usd(worst['cost'])}, reserved at creation "
            f"({worst['input_tokens']:,} input tokens at most, "
            f"{worst['output_tokens']:,} output tokens at most)",
        ),
        ("expected", _expected(expected, found["billing"])),
        ("admission", _admission(admission)),
        ("estimated end", _completion(found.get("estimated_completion_at"))),
    ]
    return _rows_table(rows)


def _usd(amount: str | None) -> str:
    return "—" if amount is None else f"{amount} USD"


def _expected(expected: dict[str, Any], billing: str) -> str:
    tokens = f"{expected['input_tokens']:,} input, {expected['output_tokens']:,} output tokens"
    sample = expected["sample"]
    if expected["basis"] == "measured":
        basis = (
            f"{sample['output_tokens_per_request']:g} output tokens per request, measured "
            f"over your last {sample['size']:,} answers of this model"
        )
    else:
        basis = "no answer of this model measured yet: every line at its max_tokens"
    if billing == "gpu_time":
        return f"billed by GPU time ({tokens}; {basis})"
    return f"{_usd(expected['cost'])} ({tokens}; {basis})"


def _admission(admission: dict[str, Any]) -> str:
    credit = f"{admission['available_credit']} USD available"
    error = admission.get("error")
    if admission["admitted"] or not error:
        return f"would be accepted now ({credit})"
    return f"would be refused now, {error['status']} {error['code']}: {error['message']}"


def _completion(unix: int | None) -> str:
    if not unix:
        return "unknown: the model's rate is not measured yet"
    return f"{_when(unix)} (in about {_span(unix - time.time())})"


def _span(seconds: float) -> str:
    """``40 s``, ``12 min``, ``3.5 h``, ``2.0 d``."""
    s = max(0, round(seconds))
    if s < 90:
        return f"{s} s"
    if s < 5400:
        return f"{round(s / 60)} min"
    if s < 172_800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86_400:.1f} d"
