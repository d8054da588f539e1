"""Safe file writes into a user's folders: atomic, never through a link, with kill points.

Every file leantune writes into a run, export or output folder goes through here:
- `atomic_path` / `atomic_write_text` / `atomic_write_json`: a temporary file is created in
  the target's own folder (O_EXCL | O_NOFOLLOW: a link planted at that name is never followed),
  written, fsynced, then renamed over the target. A rename replaces a link at the target name
  itself: the link goes, its target is never written.
- `refuse_links(path, root)`: a folder between `root` (the folder the user named) and `path`
  that is a symbolic link is refused in one line, so a shared run folder whose `checkpoints/`
  points elsewhere cannot make leantune write outside it.
- `open_append`: appending to a log (metrics.jsonl) without following a link.
- `replace`, `remove`: a rename or a delete, each at a kill point (utils/faults.py), so tests can
  kill a write sequence at every step and check that what is left is recoverable.
A crash mid-write leaves the previous file intact, never a truncated one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from . import faults


def refuse_links(path: str | os.PathLike, root: str | os.PathLike | None = None) -> None:
    """Raise LeantuneError if a folder strictly between `root` and `path`, or `path` itself when
    it is a folder we would write into, is a symbolic link. With no `root`, only `path`'s own
    folder's chain below its parent is checked (nothing: the caller names the root)."""
    from ..errors import LeantuneError

    path = Path(path)
    if root is None:
        return
    root = Path(root)
    try:
        rel = path.relative_to(root)
    except ValueError:
        return
    cur = root
    for part in rel.parts:
        cur = cur / part
        if cur.is_symlink():
            raise LeantuneError(f"{cur} is a symbolic link (to {os.readlink(cur)}); leantune "
                                "never writes through links: remove it, or choose another "
                                "output folder")


def refuse_link_at(path: str | os.PathLike, what: str = "output") -> None:
    """Raise LeantuneError if `path` itself is a symbolic link: a folder or file we would
    replace or write into must be the real thing, not a link planted to send writes elsewhere
    (name the link's target instead)."""
    from ..errors import LeantuneError

    path = Path(path)
    if path.is_symlink():
        raise LeantuneError(f"{path}: the {what} is a symbolic link (to {os.readlink(path)}); "
                            "leantune never writes through links: remove it, or name its target "
                            "instead")


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_copy_sources(src: str | os.PathLike, names) -> list[Path]:
    """The files `names` that exist in the folder `src`, after checking them all (before anything
    is copied): a file that is a symbolic link must stay inside `src`, or, for a Hugging Face hub
    cache snapshot (`.../snapshots/<revision>/`, whose files are links into the repository's
    `blobs/`), inside that repository's `blobs/`. Any other link (a `tokenizer.json` pointing at
    a private file elsewhere) is refused in one line, so an export never carries it out."""
    from ..errors import LeantuneError

    src = Path(src)
    real_src = src.resolve()
    allowed = [real_src]
    if real_src.parent.name == "snapshots":
        allowed.append(real_src.parent.parent / "blobs")
    found = []
    for name in names:
        f = src / name
        if not (f.exists() or f.is_symlink()):
            continue
        if f.is_symlink():
            target = f.resolve()
            if not any(_inside(target, a) for a in allowed) or not target.is_file():
                raise LeantuneError(f"{f} is a symbolic link to {os.readlink(f)}, outside the "
                                    "model folder; leantune does not copy through such links: "
                                    "replace it with the file itself")
        elif not f.is_file():
            raise LeantuneError(f"{f} is not a regular file; replace it with the file itself")
        found.append(f)
    return found


def temp_name(name: str) -> str:
    """The hidden name a temporary of `name` takes beside it: `.NAME.tmp-PID-XXXXXXXX`."""
    return f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def temp_of(name: str) -> str | None:
    """The name whose temporary (`temp_name`) `name` is, or None where it is not one."""
    m = re.fullmatch(r"\.(.+)\.tmp-\d+-[0-9a-f]{8}", name)
    return m[1] if m else None


def _create_tmp(path: Path) -> Path:
    """A new, empty, regular file beside `path` (never an existing file or link)."""
    while True:
        tmp = path.with_name(temp_name(path.name))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp


def _finish_tmp(tmp: Path, mode: int) -> None:
    """fsync the written temporary file, with `mode`, the one it was created with (0o666 less
    the umask): a library that wrote it by its own rename (safetensors' save_file since 0.8
    does) leaves it 0o600, which would keep other users (a server) from reading an export. Not
    through a link (O_NOFOLLOW)."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_mode & 0o777 != mode:
            os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename in `folder` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """os.replace at a kill point. A link at `dst` is replaced, never followed."""
    faults.point(f"replace {Path(src).name} -> {Path(dst).name}")
    os.replace(src, dst)


def remove(path: str | os.PathLike) -> None:
    """Delete a file, a link (not what it points to) or a folder tree, at a kill point."""
    path = Path(path)
    faults.point(f"remove {path.name}")
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, root: str | os.PathLike | None = None):
    """Yield a new temporary path next to `path`; on success it replaces `path` atomically.
    `root`: the folder the user named; links between it and `path` are refused."""
    path = Path(path)
    refuse_links(path.parent, root)
    tmp = _create_tmp(path)
    mode = tmp.lstat().st_mode & 0o777  # (0o666 less the umask)
    try:
        faults.point(f"write {path.name}")
        yield tmp
        _finish_tmp(tmp, mode)
        replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists() or tmp.is_symlink():
            tmp.unlink()


def atomic_write_text(path, text: str, root=None) -> None:
    with atomic_path(path, root) as tmp:
        Path(tmp).write_text(text)


def atomic_write_bytes(path, data: bytes, root=None) -> None:
    with atomic_path(path, root) as tmp:
        Path(tmp).write_bytes(data)


def atomic_write_json(path, obj, root=None) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2) + "\n", root)


def atomic_copy(src: str | os.PathLike, dst: str | os.PathLike, root=None) -> None:
    """Copy the regular file `src` to `dst` atomically. A `src` that is a link is refused (a
    linked side file of a model folder could point anywhere on the machine)."""
    from ..errors import LeantuneError

    src = Path(src)
    if src.is_symlink():
        raise LeantuneError(f"{src} is a symbolic link (to {os.readlink(src)}); leantune does "
                            "not copy through links: replace it with the file itself")
    with atomic_path(dst, root) as tmp:
        shutil.copyfile(src, tmp)


def open_append(path: str | os.PathLike, truncate: bool = False):
    """Open a log file for appending (or truncated), never through a link at `path`."""
    path = Path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_TRUNC if truncate else os.O_APPEND)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if path.is_symlink():
            from ..errors import LeantuneError

            raise LeantuneError(f"{path} is a symbolic link (to {os.readlink(path)}); leantune "
                                "never writes through links: remove it") from None
        raise
    return os.fdopen(fd, "w")


def publish_files(tmp: Path, out: Path) -> None:
    """Move each file of the folder `tmp` into `out` (renames, which replace links at those
    names), then remove `tmp`."""
    for f in sorted(tmp.iterdir()):
        replace(f, out / f.name)
    fsync_dir(out)
    tmp.rmdir()


def save_pretrained_safely(obj, out: str | os.PathLike, root=None) -> None:
    """`obj.save_pretrained` (a tokenizer) into a private temporary folder beside `out`, whose
    files are then renamed into `out`: its writes never follow a link planted in `out`."""
    out = Path(out)
    refuse_links(out, root)
    tmp = out / f".save-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        obj.save_pretrained(str(tmp))
        publish_files(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
