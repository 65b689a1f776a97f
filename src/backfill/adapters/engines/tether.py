"""Run a command that dies with the process that started it (``python -m … PARENT -- CMD``).

A managed engine is started in its own session, so a terminal's Ctrl-C reaches Backfill first and
Backfill stops the engine in order. That also means nothing stops the engine when Backfill is
killed with SIGKILL: it would be re-parented to init and keep its port and memory, and each
restart would start another. On Linux the kernel can send a signal to a process when its parent
dies (``PR_SET_PDEATHSIG``); this shim sets it and then becomes the engine with ``exec``, which
keeps the setting. Elsewhere it only execs, and the engine outlives a SIGKILL of its parent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> bool:
    """Ask the kernel for SIGKILL when the parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return bool(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m backfill.adapters.engines.tether PARENT_PID -- COMMAND …")
    parent, command = int(argv[0]), argv[2:]
    if _die_with_parent() and os.getppid() != parent:
        # The parent died before the request above took effect: nobody is left to serve.
        sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
