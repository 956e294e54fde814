"""Temporary files and folders beside an output, and the clean-up of ones a killed
run left behind.

Every writer stages its output as ``.NAME.<random>.tmp`` (a file or a folder),
``.NAME.<random>.old`` (an old folder set aside) in the output's folder (a
``.NAME.gguf-<random>`` folder is what converters before the streamed GGUF source
staged; a dead one is still removed), and holds an exclusive
``flock`` on it while it lives (``hold``). A later run on the same output calls
``remove_stale(NAME)``: whatever it can lock belongs to no live process (a kill -9
releases the lock with the process) and is removed; a run in progress keeps its lock
and its files.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path


class Staged:
    """A writer into a staging file: ``with`` commits it under the final name on a
    clean exit and aborts (removes the staging file) on any exception, including a
    failing commit. Subclasses define ``commit`` and ``abort``."""

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.commit()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


class Held:
    """An exclusive lock on a staging file or folder, released by ``release`` or when
    this object is collected (or the process dies)."""

    def __init__(self, fd: int | None):
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.release()


def _lock(path: Path) -> int | None:
    """An fd holding an exclusive lock on ``path``, or None if another process holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0) | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def hold(path: Path) -> Held:
    """Mark ``path`` (just created by this process) as in use."""
    return Held(_lock(path))


def stale_pattern(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(f".{name}.") + r"(?:[^/]+\.(?:tmp|old)|gguf-[^/]+)")


def remove_stale(out: Path) -> list[Path]:
    """Remove the staging files and folders of dead runs on ``out`` (and its MTP
    sidecar); returns what was removed."""
    from formats.sidecar import sidecar_path

    removed: list[Path] = []
    folder = out.parent
    if not folder.is_dir():
        return removed
    patterns = [stale_pattern(out.name), stale_pattern(sidecar_path(out).name)]
    for entry in folder.iterdir():
        if not any(p.fullmatch(entry.name) for p in patterns) or entry.is_symlink():
            continue
        fd = _lock(entry)
        if fd is None:
            continue  # a live run holds it
        try:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed
