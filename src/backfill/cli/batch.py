"""``backfill batch``: the whole client workflow, resumable, with live progress."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from backfill.cli.common import JsonOpt, print_json
from backfill.cli.follow import UNAVAILABLE, ResultFollower
from backfill.cli.rates import Throughput, format_eta, format_rate, sample_of, seconds_left
from backfill.domain.lifecycle import TERMINAL, BatchStatus

app = typer.Typer(help="Run and inspect batches.", no_args_is_help=True)
console = Console(stderr=True)

DEFAULT_BASE_URL = "http://127.0.0.1:8080/v1"
DEFAULT_ENDPOINT = "/v1/chat/completions"
BaseUrl = Annotated[
    str | None,
    typer.Option(
        envvar="BACKFILL_BASE_URL",
        help=f"API base URL, ending in /v1 (default {DEFAULT_BASE_URL}, or OPENAI_BASE_URL "
        "with the key OPENAI_API_KEY).",
        show_default=False,
    ),
]
# The OpenAI SDKs' key too, so one pair of exports serves the SDK and the CLI.
ApiKey = Annotated[str, typer.Option(envvar=["BACKFILL_API_KEY", "OPENAI_API_KEY"], help="Key.")]


def base_url_for(base_url: str | None, api_key: str, env: Mapping[str, str]) -> str:
    """``base_url`` as given (option or ``BACKFILL_BASE_URL``), else ``OPENAI_BASE_URL`` but only
    with the key of the same pair, ``OPENAI_API_KEY``: a Backfill key is never sent where those
    variables point for another service."""
    if base_url is not None:
        return base_url
    pair_url = env.get("OPENAI_BASE_URL")
    if pair_url and not env.get("BACKFILL_API_KEY") and api_key == env.get("OPENAI_API_KEY"):
        return pair_url
    return DEFAULT_BASE_URL


class Client:
    def __init__(self, base_url: str | None, api_key: str) -> None:
        self._http = httpx.Client(
            base_url=base_url_for(base_url, api_key, os.environ).rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(600.0, connect=10.0),
        )

    def request(
        self, method: str, path: str, *, allow: Collection[int] = (), **kwargs: Any
    ) -> httpx.Response:
        """The answer, after retrying passing faults; a 4xx not in ``allow`` ends the CLI."""
        for attempt in range(5):
            try:
                response = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:
                if attempt == 4:
                    _fail(f"Cannot reach Backfill at {self._http.base_url}: {exc}")
                time.sleep(2**attempt)
                continue
            if response.status_code >= 500 and attempt < 4:
                time.sleep(2**attempt)
                continue
            if response.status_code >= 400 and response.status_code not in allow:
                try:
                    message = response.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = response.text
                _fail(f"{method} {path} failed ({response.status_code}): {message}")
            return response
        raise AssertionError("unreachable")

    @property
    def base_url(self) -> str:
        return str(self._http.base_url)

    def json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        data: dict[str, Any] = self.request(method, path, **kwargs).json()
        return data


def _fail(message: str) -> None:
    # The message may quote the server or the user's file; as markup, "[/x]" would crash rich.
    console.print(Text.assemble(("Error:", "red"), " ", message))
    raise typer.Exit(1)


def _state_path(file: Path) -> Path:
    return file.with_name(file.name + ".backfill.json")


def _digest(file: Path) -> str:
    h = hashlib.sha256()
    with file.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


def _with_model(file: Path, model: str | None) -> bytes | None:
    if model is None:
        return None
    out = []
    for line in file.read_bytes().splitlines():
        if line.strip():
            row = json.loads(line)
            row.setdefault("body", {})["model"] = model
            out.append(json.dumps(row).encode())
    return b"\n".join(out) + b"\n"


def _upload(client: Client, file: Path, data: bytes | None) -> str:
    size = len(data) if data is not None else file.stat().st_size
    with Progress(
        TextColumn("Uploading"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("upload", total=size)

        def chunks() -> Iterator[bytes]:
            if data is not None:
                progress.update(task, completed=size)
                yield data
                return
            with file.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    progress.advance(task, len(chunk))
                    yield chunk

        boundary = secrets.token_hex(16)
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{file.name}"\r\nContent-Type: application/jsonl\r\n\r\n'
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()

        def body() -> Iterator[bytes]:
            yield head
            yield from chunks()
            yield tail

        created = client.json(
            "POST",
            "/files",
            content=body(),
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
    return str(created["id"])


def _lengths(out: Path, errors: Path) -> dict[str, int]:
    return {"out_bytes": out.stat().st_size, "errors_bytes": errors.stat().st_size}


def _poll(client: Client, batch_id: str, follower: ResultFollower | None = None) -> dict[str, Any]:
    """Follow the batch to its end; with ``follower``, write its rows as they are stored.
    ``follower.complete`` says afterwards whether the rows came that way."""
    with Progress(
        TextColumn("{task.fields[status]}", style="bold", markup=False),
        BarColumn(bar_width=30),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TextColumn("{task.fields[rate]}", markup=False),
        TextColumn("{task.fields[eta]}", markup=False),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(
            "batch", total=None, status="validating", failed=0, rate="", eta=""
        )
        throughput = Throughput()
        while True:
            batch = client.json("GET", f"/batches/{batch_id}")
            counts = batch["request_counts"]
            throughput.observe(sample_of(batch, time.monotonic()))
            rate, eta = _speed(batch, throughput)
            progress.update(
                task,
                total=counts["total"] or None,
                completed=counts["completed"] + counts["failed"],
                status=_status_line(batch),
                failed=counts["failed"],
                rate=rate,
                eta=eta,
            )
            if follower is not None and not follower.catch_up():
                follower = None  # the published files will be downloaded instead
            if batch["status"] in TERMINAL:
                return batch
            time.sleep(1.0)


def _status_line(batch: dict[str, Any]) -> str:
    """The progress line's status, with why the batch waits when it does (its code: the
    message is in ``backfill batch status``)."""
    waiting = batch.get("waiting_on")
    if isinstance(waiting, dict) and waiting.get("code"):
        return f"{batch['status']} (waiting: {waiting['code']})"
    return str(batch["status"])


def _speed(batch: dict[str, Any], throughput: Throughput) -> tuple[str, str]:
    """The progress line's tokens/s and ETA; both only while lines run."""
    if batch["status"] != BatchStatus.IN_PROGRESS:
        return "", ""
    counts = batch["request_counts"]
    left = seconds_left(
        remaining_lines=counts["total"] - counts["completed"] - counts["failed"],
        lines_per_s=throughput.lines_per_s,
        estimated_completion_at=batch.get("estimated_completion_at"),
        now=time.time(),
    )
    return format_rate(throughput.tokens_per_s), format_eta(left)


def _download(client: Client, file_id: str | None, target: Path) -> None:
    if not file_id:
        target.write_bytes(b"")
        return
    with client._http.stream("GET", f"/files/{file_id}/content") as response:
        if response.status_code != 200:
            _fail(f"Downloading {file_id} failed ({response.status_code}).")
        tmp = target.with_suffix(target.suffix + ".part")
        with tmp.open("wb") as fh:
            for chunk in response.iter_bytes():
                fh.write(chunk)
        os.replace(tmp, target)


def _reconcile(file: Path, results: Path, retry: Path) -> tuple[int, int]:
    succeeded: set[str] = set()
    for line in results.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        response = row.get("response") or {}
        if not row.get("error") and response.get("status_code") == 200:
            succeeded.add(row["custom_id"])
    remaining = 0
    with retry.open("wb") as out:
        for raw in file.read_bytes().splitlines():
            if raw.strip() and json.loads(raw)["custom_id"] not in succeeded:
                out.write(raw + b"\n")
                remaining += 1
    return len(succeeded), remaining


@app.command()
def run(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Input JSONL.")],
    base_url: BaseUrl = None,
    api_key: ApiKey = "",
    model: Annotated[str | None, typer.Option(help="Use this model for every line.")] = None,
    out: Annotated[Path | None, typer.Option(help="Results file.")] = None,
    errors: Annotated[Path | None, typer.Option(help="Errors file.")] = None,
    window: Annotated[str, typer.Option(help="Completion window.")] = "24h",
    priority: Annotated[
        int,
        typer.Option(help="Higher runs first among your organization's batches of the model."),
    ] = 0,
    output_validation: Annotated[
        bool,
        typer.Option(
            "--output-validation",
            help="Check each answer against its line's response_format schema; an answer "
            "that does not match becomes an error row (output_schema_mismatch).",
        ),
    ] = False,
) -> None:
    """Upload, create, follow, download and reconcile one batch; rerun to resume it."""
    if not api_key:
        _fail("Give an API key with --api-key or BACKFILL_API_KEY.")
    client = Client(base_url, api_key)
    out = out or file.with_name("results.jsonl")
    errors = errors or file.with_name("errors.jsonl")
    state_file = _state_path(file)
    digest = _digest(file)
    state: dict[str, Any] = {}
    if state_file.exists():
        state = json.loads(state_file.read_text())
        if state.get("sha256") != digest or state.get("model") != model:
            state = {}
    if not state:
        state = {"sha256": digest, "model": model, "idempotency_key": secrets.token_hex(16)}
        _save(state_file, state)
    if "input_file_id" not in state:
        state["input_file_id"] = _upload(client, file, _with_model(file, model))
        _save(state_file, state)
    if "batch_id" not in state:
        batch = client.json(
            "POST",
            "/batches",
            json={
                "input_file_id": state["input_file_id"],
                "endpoint": _endpoint(file),
                "completion_window": window,
                # Sent only when set: a server that does not know them still takes the batch.
                **({"priority": priority} if priority else {}),
                **({"output_validation": True} if output_validation else {}),
            },
            headers={"Idempotency-Key": state["idempotency_key"]},
        )
        state["batch_id"] = batch["id"]
        _save(state_file, state)
        console.print(Text.assemble("Batch ", (batch["id"], "bold"), " created."))
    else:
        console.print(Text.assemble("Resuming batch ", (state["batch_id"], "bold"), "."))
        found = client.request("GET", f"/batches/{state['batch_id']}", allow=(404,))
        if found.status_code == 404:
            _fail(
                f"Batch {state['batch_id']}, saved in {state_file}, is not on "
                f"{client.base_url} (another server, or deleted). Remove {state_file} to "
                "submit the file again."
            )

    def keep(results: dict[str, Any]) -> None:
        # Beside the batch id, so a rerun finds where the files stopped.
        state["results"] = results
        _save(state_file, state)

    follower = ResultFollower(
        lambda path, params: client.request("GET", path, params=params, allow=UNAVAILABLE),
        state["batch_id"],
        out,
        errors,
        state.get("results"),
        keep,
    )
    try:
        batch = _poll(client, state["batch_id"], follower)
    finally:
        follower.close()
    if not follower.complete:
        _download(client, batch["output_file_id"], out)
        _download(client, batch["error_file_id"], errors)
        # The files are whole now: a rerun must not cut them back to lengths saved before.
        keep({"complete": True, "out": str(out), "errors": str(errors)} | _lengths(out, errors))
    retry = file.with_name(file.name + ".retry.jsonl")
    ok, remaining = _reconcile(file, out, retry)
    console.print(
        Text.assemble(
            "Batch ",
            (batch["id"], "bold"),
            f": {batch['status']}, ",
            f"{ok:,} succeeded, {remaining:,} to retry",
        )
    )
    # Paths whole, one a line, however narrow the terminal: they are what gets opened next.
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for name, path in (("results", out), ("errors", errors), ("retry file", retry)):
        table.add_row(f"  {name}", Text(str(path)))
    console.print(table)


def _rows_table(rows: Sequence[tuple[str, str | None]]) -> Table:
    """Name and value, a row each; a row without a value is left out."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for name, value in rows:
        if value:
            table.add_row(name, Text(value))
    return table


def _endpoint(file: Path) -> str:
    with file.open("rb") as fh:
        first = fh.readline()
    try:
        return str(json.loads(first).get("url") or DEFAULT_ENDPOINT)
    except ValueError:
        return DEFAULT_ENDPOINT


@app.command()
def status(
    batch_id: str,
    base_url: BaseUrl = None,
    api_key: ApiKey = "",
    json_: JsonOpt = False,
) -> None:
    """Show one batch: its state, counts, tokens and files (--json: the API's batch object)."""
    batch = Client(base_url, api_key).json("GET", f"/batches/{batch_id}")
    if json_:
        print_json(batch)
        return
    Console().print(_summary(batch))


def _summary(batch: dict[str, Any]) -> Table:
    counts, usage = batch["request_counts"], batch.get("usage") or {}
    ended = counts["completed"] + counts["failed"]
    rows: list[tuple[str, str | None]] = [
        ("id", batch["id"]),
        ("status", batch["status"]),
        ("model", batch.get("model")),
        ("endpoint", batch["endpoint"]),
        ("lines", f"{ended:,}/{counts['total']:,} done, {counts['failed']:,} failed"),
        (
            "tokens",
            f"{usage.get('input_tokens', 0):,} in, {usage.get('output_tokens', 0):,} out",
        ),
        ("created", _when(batch["created_at"])),
        ("expires", _when(batch.get("expires_at"))),
        ("estimated end", _when(batch.get("estimated_completion_at"))),
        ("cost", _cost(batch.get("cost"))),
        ("priority", str(batch["priority"]) if batch.get("priority") else None),
        ("paused", _when(batch.get("paused_at"))),
        *_waiting_rows(batch.get("waiting_on")),
        ("output file", batch.get("output_file_id")),
        ("error file", batch.get("error_file_id")),
        ("retry of", batch.get("retry_of")),
    ]
    table = _rows_table(rows)
    for error in ((batch.get("errors") or {}).get("data")) or []:
        table.add_row("error", Text(f"line {error.get('line')}: {error.get('message')}"))
    return table


def _cost(cost: Any) -> str | None:
    """What the batch has cost so far and what is still reserved (catalog batches)."""
    if not isinstance(cost, dict) or cost.get("charged") is None:
        return None
    return f"${cost['charged']} charged, ${cost.get('reserved', '0')} still reserved"


def _waiting_rows(waiting: Any) -> list[tuple[str, str | None]]:
    """Why the batch does not move (docs/api.md, "Why a batch waits"): its code, since when
    and when it is expected to move again, then the server's message whole."""
    if not isinstance(waiting, dict) or not waiting.get("code"):
        return []
    head = f"{waiting['code']} since {_when(waiting.get('since')) or '?'}"
    resumes = _when(waiting.get("resumes_at"))
    if resumes:
        head += f", expected to move about {resumes}"
    return [("waiting", head), ("why", waiting.get("message"))]


def _when(unix: int | None) -> str | None:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix else None


@app.command()
def cancel(batch_id: str, base_url: BaseUrl = None, api_key: ApiKey = "") -> None:
    """Cancel a batch."""
    batch = Client(base_url, api_key).json("POST", f"/batches/{batch_id}/cancel", json={})
    typer.echo(f"{batch['id']}: {batch['status']}")


@app.command()
def pause(batch_id: str, base_url: BaseUrl = None, api_key: ApiKey = "") -> None:
    """Pause a batch: it starts no new request (those running finish) until resumed. Its
    window keeps running."""
    batch = Client(base_url, api_key).json("POST", f"/batches/{batch_id}/pause", json={})
    typer.echo(f"{batch['id']}: paused; 'backfill batch resume {batch['id']}' goes on.")


@app.command()
def resume(batch_id: str, base_url: BaseUrl = None, api_key: ApiKey = "") -> None:
    """Resume a paused batch."""
    batch = Client(base_url, api_key).json("POST", f"/batches/{batch_id}/resume", json={})
    typer.echo(f"{batch['id']}: {batch['status']}, running again.")


@app.command()
def priority(
    batch_id: str,
    value: Annotated[
        int, typer.Argument(help="Higher runs first among your organization's batches.")
    ],
    base_url: BaseUrl = None,
    api_key: ApiKey = "",
) -> None:
    """Change a running batch's priority."""
    client = Client(base_url, api_key)
    batch = client.json("POST", f"/batches/{batch_id}", json={"priority": value})
    typer.echo(f"{batch['id']}: priority {batch['priority']}")


@app.command("list")
def list_(
    base_url: BaseUrl = None,
    api_key: ApiKey = "",
    limit: Annotated[int, typer.Option(help="How many batches, newest first.")] = 20,
    after: Annotated[
        str | None, typer.Option(help="Start after this batch id (the previous page's last).")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """List recent batches, newest first (--json: the API's list object)."""
    params: dict[str, Any] = {"limit": limit} | ({"after": after} if after else {})
    page = Client(base_url, api_key).json("GET", "/batches", params=params)
    if json_:
        print_json(page)
        return
    Console().print(_listing(page["data"], time.time()))
    if page.get("has_more"):
        console.print(Text(f"More: backfill batch list --after {page['last_id']}"))


def _listing(batches: list[dict[str, Any]], now: float) -> Table:
    """Ids whole, however narrow the terminal: they are what gets copied. The other columns
    are short so the table fits 80 columns."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("id", no_wrap=True, min_width=max((len(b["id"]) for b in batches), default=2))
    table.add_column("status", no_wrap=True)
    table.add_column("done", justify="right", no_wrap=True)
    table.add_column("failed", justify="right", no_wrap=True)
    table.add_column("age", justify="right", no_wrap=True)
    for b in batches:
        c = b["request_counts"]
        table.add_row(
            b["id"],
            b["status"],
            f"{c['completed'] + c['failed']:,}/{c['total']:,}",
            f"{c['failed']:,}",
            _age(now - b["created_at"]),
        )
    return table


def _age(seconds: float) -> str:
    """``45s``, ``12m``, ``3h``, ``2d``: how long ago, in the largest whole unit."""
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


@app.command()
def download(
    batch_id: str,
    base_url: BaseUrl = None,
    api_key: ApiKey = "",
    out: Path = Path("results.jsonl"),
    errors: Path = Path("errors.jsonl"),
) -> None:
    """Download a finished batch's output and error files."""
    client = Client(base_url, api_key)
    batch = client.json("GET", f"/batches/{batch_id}")
    if batch["status"] not in TERMINAL:
        _fail(f"Batch {batch_id} is {batch['status']}; its files exist once it ends.")
    _download(client, batch["output_file_id"], out)
    _download(client, batch["error_file_id"], errors)
    typer.echo(f"Wrote {out} and {errors}.")


@app.command()
def retry(
    batch_id: str,
    base_url: BaseUrl = None,
    api_key: ApiKey = "",
    window: Annotated[
        str | None, typer.Option(help="Completion window of the rerun (default: the batch's).")
    ] = None,
    wait: Annotated[bool, typer.Option(help="Follow the rerun until it ends.")] = False,
) -> None:
    """Rerun an ended batch's failed, expired and cancelled lines as a new batch; prints its id."""
    client = Client(base_url, api_key)
    body = {} if window is None else {"completion_window": window}
    # One key per invocation: the client's own retries of a lost answer make one rerun.
    batch = client.json(
        "POST",
        f"/batches/{batch_id}/retry",
        json=body,
        headers={"Idempotency-Key": secrets.token_hex(16)},
    )
    typer.echo(batch["id"])
    if wait:
        batch = _poll(client, batch["id"])
        counts = batch["request_counts"]
        console.print(
            Text(
                f"Batch {batch['id']}: {batch['status']}, {counts['completed']} succeeded, "
                f"{counts['failed']} failed."
            )
        )


@app.command()
def delete(batch_id: str, base_url: BaseUrl = None, api_key: ApiKey = "") -> None:
    """Delete an ended batch's results and files (its receipts stay)."""
    deleted = Client(base_url, api_key).json("DELETE", f"/batches/{batch_id}")
    typer.echo(f"{deleted['id']}: deleted")
