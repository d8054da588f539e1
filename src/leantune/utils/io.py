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
