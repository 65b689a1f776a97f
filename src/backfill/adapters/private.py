"""Files and directories that only the service's own user may read (modes 0600 and 0700).

Modes are set explicitly after creation, so a permissive umask (022 is common) never leaves
metadata, keys or content readable by other local users.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path) -> None:
    """Create ``path`` and its missing parents with mode 0700; tighten ``path`` if it exists."""
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=DIR_MODE)
        os.chmod(directory, DIR_MODE)
    if not missing:
        os.chmod(path, DIR_MODE)


def create_private(path: Path, *, exclusive: bool = True) -> int:
    """Open ``path`` for writing as a new 0600 file; returns the descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


def tighten_file(path: Path) -> None:
    """Set an existing file to 0600, creating it empty when missing."""
    os.close(create_private(path, exclusive=False))


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (the directory entry itself)."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
