"""Checks on an output path before anything is written to it, and the one line for a disk fault
(full, read-only, a file in the way, a closed pipe) met while writing."""

from __future__ import annotations

import errno
import os
import re
import uuid
from pathlib import Path

from ..errors import LeantuneError


def check_output_folder(output: Path, inputs: dict[str, Path | None],
                        may_lie_inside: tuple[str, ...] = ()) -> None:
    """`output` must be a folder or not exist yet, and must not be, contain or lie inside one of
    the `inputs` folders ({"model": path, ...}): writing there could replace the files the run
    reads (a model's shards, an adapter). It may lie inside those named in `may_lie_inside` (a
    subfolder of their own is written without touching their files). Then a write probe
    (`probe_writable`): a full or read-only disk fails here, before any weights load."""
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise LeantuneError(f"--output {output} is a file; give a folder (it is created if "
                            "missing)")
    out = output.resolve()
    for what, folder in inputs.items():
        if folder is None:
            continue
        src = Path(folder).resolve()
        where = ("is" if out == src else
                 "lies inside" if src in out.parents and what not in may_lie_inside else
                 "contains" if out in src.parents else None)
        if where:
            raise LeantuneError(f"--output {output} {where} the {what} folder {folder}; write to "
                                "a folder of its own, outside it")
    probe_writable(output)


# --- disk faults: one line naming the path ---------------------------------------------------------
# errno -> what it means for a folder leantune writes into, and what to do about it
_DISK_FAULTS = {
    errno.ENOSPC: ("the disk is full", "free some space, or write to a disk with room"),
    errno.EDQUOT: ("the disk quota is used up", "free some space, or write elsewhere"),
    errno.EFBIG: ("the file grew past what the filesystem allows",
                  "write to another filesystem"),
    errno.EROFS: ("the filesystem is read-only", "write to a folder on a writable disk"),
    errno.EACCES: ("permission denied", "fix its permissions, or choose a path you may "
                   "write to"),
    errno.EPERM: ("the operation is not permitted", "choose a path you may write to"),
    errno.ENOTDIR: ("a file lies where a folder is needed", "choose a path whose parent "
                    "folders are folders"),
    errno.EISDIR: ("a folder lies where a file is needed", "remove or rename that folder"),
    errno.EPIPE: ("stdout was closed (the program reading it, e.g. `head`, exited)",
                  "keep the whole output with `> FILE` or read it with `| tail`"),
}
DISK_ERRNOS = frozenset(_DISK_FAULTS)


def disk_error_message(e: OSError, path: str | os.PathLike | None = None) -> str | None:
    """The one line for an OSError caused by the disk or a path the user gave (full, read-only,
    no permission, a file in the way, a closed pipe), naming the path (`e.filename`, else
    `path`) and what to do; None for any other error (a bug: its traceback is wanted). The
    caller adds what happened to the run."""
    code = getattr(e, "errno", None)
    if code not in _DISK_FAULTS:
        return None
    what, todo = _DISK_FAULTS[code]
    if code == errno.EPIPE:
        return f"{what}; {todo}"
    where = e.filename if getattr(e, "filename", None) else path
    return f"{where}: {what} ({os.strerror(code)}); {todo}" if where else f"{what}; {todo}"


def os_error_of(e: BaseException) -> OSError | None:
    """`e` as an OSError: itself, or one rebuilt from a safetensors write error ("... (os error
    28) at path \"...\""), which is no OSError but carries the same errno; None otherwise."""
    if isinstance(e, OSError):
        return e
    if type(e).__name__ == "SafetensorError":
        m = re.search(r"\(os error (\d+)\)(?: at path \"(.*)\")?", str(e))
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code), m.group(2))
    return None


def probe_writable(output: str | os.PathLike, flag: str = "--output") -> None:
    """Check, before anything slow (loading weights), that files can be written where `output`
    is or will be created: the nearest existing folder on its path gets a small probe file,
    written, synced and removed. A file in the way, a read-only or full disk, or a folder
    without write permission is one LeantuneError naming the path."""
    output = Path(output)
    folder = output
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise LeantuneError(f"{flag} {output}: {folder} is a file, not a folder; choose an "
                            f"{flag} whose parent folders are folders")
    probe = folder / f".leantune-write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        message = disk_error_message(e, folder) or f"{folder}: {e.strerror or e}"
        raise LeantuneError(f"{flag} {output}: cannot write there: {message}") from None
