"""One writer per folder: an exclusive `flock` on a lock file, held for the life of the process.

Two `leantune train` into one --output (or two exports into one folder) would interleave their
files and both report success. The first takes an exclusive, non-blocking `flock` on a lock file
and keeps it open; the second is refused in one line naming the first one's PID (written into the
lock file). The OS drops the lock when the holder exits or is killed (even SIGKILL), so a crash
never leaves a folder locked; a lock file left behind by a killed process is simply taken again.

The lock file is PARENT/.NAME.leantune-lock, beside the folder, not in it: an export's folder
is replaced by a rename (a lock inside would move away with the old folder), and a run's folder
need not exist yet (a run whose checks fail leaves no folder behind).
- `lock_run(folder)`: held until the process ends (a training run).
- `lock_beside(folder)`: held for a `with` block (an export).

Within one process a folder already locked is locked again for free (the same process is not a
second run: tests). At exit every lock file this process made is removed.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
from pathlib import Path

from ..errors import LeantuneError


_held: dict[str, "_Lock"] = {}  # lock file path -> the lock this process holds


class _Lock:
    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no one else holds this file), then
        close it."""
        try:
            if _same_file(self.path, self.fd):
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        a, b = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return f"PID {text}" if text.isdigit() else "another process"


def _take(path: Path, what: str, hint: str) -> _Lock:
    key = str(path.resolve(strict=False))
    if key in _held:
        return _held[key]
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LeantuneError(f"{path} is a symbolic link; leantune never writes through "
                                    "links: remove it") from None
            raise LeantuneError(f"{path}: cannot create the lock file ({e.strerror}); check "
                                "that the folder is writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise LeantuneError(f"{path}: cannot lock ({e.strerror})") from None
            raise LeantuneError(f"{what} is in use by another leantune process "
                                f"({_holder(path)}, lock {path}); wait for it to end, or "
                                f"{hint}") from None
        if _same_file(path, fd):  # (not a file its last holder removed as we opened it)
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    lock = _held[key] = _Lock(path, fd)
    return lock


def lock_path(folder: str | os.PathLike) -> Path:
    """The lock file of `folder`: beside it, in its parent."""
    folder = Path(folder)
    return folder.with_name(f".{folder.name}.leantune-lock")


def lock_run(folder: str | os.PathLike) -> None:
    """Lock the run folder `folder` for this process (its parent is created if missing), or
    raise LeantuneError naming the PID that holds it."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _take(lock_path(folder), f"{folder}: this output folder", "choose another --output")


@contextlib.contextmanager
def lock_beside(folder: str | os.PathLike):
    """Hold `folder` through a lock file beside it (its parent is created if missing) for the
    `with` block; the lock file goes at its end."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = lock_path(folder)
    new = str(path.resolve(strict=False)) not in _held
    _take(path, f"{folder}: this output folder", "choose another --output")
    try:
        yield
    finally:
        if new:
            release(folder)


def release(folder: str | os.PathLike | None = None) -> None:
    """Give up the lock(s) this process holds on `folder` (or all of them): tests, and exit."""
    mine = None if folder is None else {str(lock_path(folder).resolve(strict=False))}
    for key, lock in list(_held.items()):
        if mine is None or key in mine:
            del _held[key]
            lock.release()


atexit.register(release)
