"""One writer per folder: an exclusive `flock` on a lock file, held for the life of the process.

Two `leantune train` into one --output (or two exports into one folder) would interleave their
files and both report success. The first takes an exclusive, non-blocking `flock` on a lock file
and keeps it open; the second is refused in one line naming the first one's PID (written into the
lock file). The OS drops the lock when the holder exits or is killed (even SIGKILL), so a crash
never leaves a folder locked; a lock file left behind by a killed process is simply taken again.

- `lock_run(folder)`: OUTPUT/.leantune.lock, inside the run folder (which is never renamed).
- `lock_beside(folder)` (a `with` block): PARENT/.NAME.leantune-lock, for a folder that is
  replaced by a rename (an export): a lock inside it would move away with the old folder.

Within one process a folder already locked is locked again for free (the same process is not a
second run: tests, and `--merge-at-end` exporting into the run it is finishing). At exit every
lock file this process made is removed; a folder it created for the lock alone is removed too.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import os
from pathlib import Path

from ..errors import LeantuneError

LOCK_NAME = ".leantune.lock"

_held: dict[str, "_Lock"] = {}  # lock file path -> the lock this process holds


class _Lock:
    def __init__(self, path: Path, fd: int, created: Path | None):
        self.path, self.fd, self.created = path, fd, created

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no one else holds this file), then
        close it; rmdir the folder made for it if nothing else came into it."""
        try:
            if _same_file(self.path, self.fd):
                self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        if self.created is not None:
            try:
                self.created.rmdir()
            except OSError:
                pass


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


def _take(path: Path, what: str, hint: str, created: Path | None) -> _Lock:
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
    lock = _held[key] = _Lock(path, fd, created)
    return lock


def lock_run(folder: str | os.PathLike) -> None:
    """Lock the run folder `folder` (created if missing) for this process, or raise
    LeantuneError naming the PID that holds it."""
    folder = Path(folder)
    created = None
    if not folder.exists():
        missing = folder
        while not missing.parent.exists():
            missing = missing.parent
        folder.mkdir(parents=True)
        created = folder if missing == folder else None
    _take(folder / LOCK_NAME, f"{folder}: this output folder", "choose another --output",
          created)


@contextlib.contextmanager
def lock_beside(folder: str | os.PathLike):
    """Hold `folder` through a lock file beside it (its parent is created if missing) for the
    `with` block; the lock file goes at its end."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    path = _beside(folder)
    new = str(path.resolve(strict=False)) not in _held
    _take(path, f"{folder}: this output folder", "choose another --output", None)
    try:
        yield
    finally:
        if new:
            release(folder)


def _beside(folder: Path) -> Path:
    return folder.with_name(f".{folder.name}.leantune-lock")


def release(folder: str | os.PathLike | None = None) -> None:
    """Give up the lock(s) this process holds on `folder` (or all of them): tests, and exit."""
    mine = None if folder is None else {str((Path(folder) / LOCK_NAME).resolve(strict=False)),
                                        str(_beside(Path(folder)).resolve(strict=False))}
    for key, lock in list(_held.items()):
        if mine is None or key in mine:
            del _held[key]
            lock.release()


atexit.register(release)
