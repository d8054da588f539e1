"""Atomic file writes: write to a temporary file in the same folder, fsync, then rename.

A crash mid-write leaves the previous file intact, never a truncated one."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path next to `path`; on success it replaces `path` atomically."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path, text: str) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)


def atomic_write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse an output path that is a file, or a non-empty folder unless `overwrite`."""
    from ..errors import LeantuneError

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise LeantuneError(f"{out}: output exists and is a file; choose a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise LeantuneError(f"{out}: output folder is not empty; choose a new folder or pass "
                            "--overwrite")


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike, overwrite: bool = False):
    """Yield a new temporary folder beside `out` to write into; on success its files land in
    `out`: the folder is renamed into place when `out` is new or empty, or (overwrite) each file
    replaces its namesake in `out`, other files there are kept. On failure nothing in `out`
    changes and the temporary folder is removed."""
    import shutil
    import uuid

    out = Path(out)
    check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()  # the umask's permissions, as the output folder should have
    try:
        yield tmp
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            os.replace(tmp, out)
        else:
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
