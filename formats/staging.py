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

import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from formats.errors import CortiqError


def refuse_special(out: Path) -> None:
    """Refuse an output name that exists as anything but a regular file or a folder (a
    device such as /dev/full, a FIFO, a socket), whatever ``--force`` says: writers replace
    only regular files."""
    try:
        st = os.stat(out)
    except OSError:
        return  # absent, or a dangling symlink: a new file takes the name
    if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket"
            if stat.S_ISSOCK(st.st_mode)
            else "not a regular file"
        )
        raise CortiqError(f"{out} is {kind}; cortiq replaces only regular files (--force included)")


def place(tmp: Path, out: Path) -> None:
    """Rename the staged ``tmp`` over ``out`` (atomic on one filesystem), checking at the
    last moment that ``out`` is not a device, FIFO, socket or folder."""
    refuse_special(out)
    if out.is_dir() and not out.is_symlink():
        raise CortiqError(f"{out} is a folder; give a file name")
    os.replace(tmp, out)


def new_temp(path: Path) -> tuple[int, Path]:
    """A staging file ``.NAME.<random>.tmp`` beside ``path`` with the permissions a plain
    ``open`` would give (mkstemp makes 0600 files)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0o022)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, Path(tmp)


def preallocate(fd: int, size: int, path: Path) -> None:
    """Reserve ``size`` bytes for a file that is then written through a memory map: a full
    disk fails here with one CortiqError (ENOSPC), not later as SIGBUS on a page store."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise CortiqError(f"{path}: cannot reserve {size} bytes ({e.strerror or e})") from None
        try:  # a filesystem without fallocate: zeros written back every page
            _write_zeros(fd, size)
        except OSError as e2:
            raise CortiqError(f"{path}: cannot reserve {size} bytes ({e2.strerror or e2})") from None


def _write_zeros(fd: int, size: int) -> None:
    block = bytes(1 << 20)
    os.lseek(fd, 0, os.SEEK_SET)
    left = size
    while left:
        left -= os.write(fd, block[: min(left, len(block))])


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


@contextmanager
def staged_file(path: Path) -> Iterator[tuple[int, Path]]:
    """A new staging file beside ``path`` (its open fd and its name), renamed over
    ``path`` when the block succeeds and removed when it raises. What dead runs left
    on ``path`` goes first."""
    remove_stale(path)
    fd, tmp = new_temp(path)
    held = hold(tmp)  # a later run removes it only once this process is gone
    try:
        yield fd, tmp
        place(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        held.release()


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
