"""The real vLLM engine as a process: vLLM's CPU build serving SmolLM2-135M-Instruct from the
virtualenv ``make vllm-env`` builds (scripts/build_vllm_env.py). The ``vllm`` test tier and
the benchmarks that run on a real engine start it with ``start_vllm``."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from bench.common import free_port

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("BACKFILL_VLLM_VENV", ROOT / ".venv-vllm"))
MODEL_DIR = VENV / "models" / "SmolLM2-135M"
SERVED_MODEL = "smollm2"
# vLLM's first answer comes 23-32 s after the start on 2 cores with --enforce-eager; a
# second engine on the same cores, or a busy machine, takes longer.
START_TIMEOUT_S = 240.0


def missing() -> str | None:
    """Why the real vLLM engine cannot start here, or None when it can."""
    if not (VENV / "bin" / "python").exists():
        return f"no vLLM virtualenv at {VENV}: run `make vllm-env`"
    if not (MODEL_DIR / "config.json").exists():
        return f"no model folder at {MODEL_DIR}: run `make vllm-env` again"
    return None


@dataclass
class VllmProcess:
    process: subprocess.Popen[bytes]
    port: int
    log: Path
    args: tuple[str, ...] = field(default=())

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def metrics(self) -> str:
        return httpx.get(f"{self.root}/metrics", timeout=10).text

    def kill(self) -> None:
        """SIGKILL to the whole process group (API server, engine core, worker): a crash."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_vllm(
    log: Path,
    *,
    max_num_seqs: int = 16,
    policy: Literal["fcfs", "priority"] = "priority",
    extra: Sequence[str] = (),
    port: int | None = None,
) -> VllmProcess:
    """vLLM on a free port (or ``port``), once it answers a chat request; its output in
    ``log``. ``extra`` are more vLLM arguments (``--runner pooling``, KV-block overrides)."""
    reason = missing()
    if reason is not None:
        raise RuntimeError(reason)
    port = port or free_port()
    cache = Path(tempfile.mkdtemp(prefix="vllm-cache-"))
    args = (
        "--model",
        str(MODEL_DIR),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(max_num_seqs),
        "--scheduling-policy",
        policy,
        "--enforce-eager",
        "--dtype",
        "bfloat16",
        "--enable-prompt-tokens-details",
        *extra,
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CACHE_ROOT": str(cache),
    }
    with log.open("ab") as out:
        process = subprocess.Popen(
            [str(VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its engine core and worker die with it
        )
    engine = VllmProcess(process, port, log, args)
    try:
        _wait_ready(engine, pooling="pooling" in extra)
    except BaseException:
        engine.kill()
        raise
    return engine


def _wait_ready(engine: VllmProcess, *, pooling: bool) -> None:
    """/health answers before the model has run once; wait for a real answer."""
    deadline = time.monotonic() + START_TIMEOUT_S
    path, body = (
        ("/v1/embeddings", {"model": SERVED_MODEL, "input": "ready?"})
        if pooling
        else (
            "/v1/chat/completions",
            {
                "model": SERVED_MODEL,
                "messages": [{"role": "user", "content": "ready?"}],
                "max_tokens": 1,
            },
        )
    )
    while time.monotonic() < deadline:
        if engine.process.poll() is not None:
            tail = engine.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vLLM exited with {engine.process.returncode}:\n{tail}")
        try:
            if httpx.post(engine.root + path, json=body, timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM did not answer within {START_TIMEOUT_S:.0f} s; see {engine.log}")
