"""Putting a finished export in place of OUT, and mending what a killed export left beside it.

Every export (merged safetensors, GGUF, GGUF LoRA) goes through here:

    with lock_beside(out):            # one export into OUT at a time
        open_output(out, overwrite)   # mend what a killed export left, then the checks
        ...                           # (slow checks: reading the base, the adapter)
        with publishing(out, replaces) as tmp:
            ...                       # write the export's files into tmp

The export is written into a hidden folder beside OUT and renamed into place at the end (a
short sequence of renames, `_publish`, whose every prefix the next export mends:
`recover_publish`); a journal file beside OUT, written before the hidden folder is made and
removed once it is gone, is the proof that the folders at leantune's names beside OUT are an
export's, and names the files that export replaces. Without it nothing there is deleted or
moved unless its contents are exactly an export's (what leantune <= 0.3's merged export and the
GGUF exports before the journal left), so a user's folder of a like name is never touched. A
failed, interrupted or killed export leaves OUT as it was (its previous export whole) until the
new one is complete. `--overwrite` replaces the files an export writes (by their exact names)
and keeps every other file in OUT: the merged export's (`is_merged_file`: config, tokenizer
files, its index and shards: a previous export's stale shards go too), a GGUF export's own two
(`model-<quant>.gguf`, `Modelfile`; another quant's GGUF stays), a GGUF LoRA's one.
"""

from __future__ import annotations

import contextlib
import glob
import json
import re
import shutil
from pathlib import Path
from typing import Callable, Iterable

from ..errors import LeantuneError
from ..utils import signals
from ..utils.io import atomic_write_text, fsync_dir, remove, replace, temp_of
from .full import TOKENIZER_FILES
from .shards import INDEX, SHARD_NAME

MERGED_FILES = ("config.json", "model.safetensors", INDEX, *TOKENIZER_FILES)
# the files a GGUF export (export/gguf/writer.py) writes: the only names a journal may list
GGUF_FILE = re.compile(r"Modelfile|(model|adapter)-[0-9a-z_]+\.gguf")

IsExport = Callable[[str], bool]


def is_merged_file(name: str) -> bool:
    """Whether `name` is one of the files a merged export writes (exactly:
    `model_v1.safetensors` is a user's file), which its `--overwrite` replaces."""
    return name in MERGED_FILES or SHARD_NAME.fullmatch(name) is not None


def is_gguf_file(name: str) -> bool:
    """Whether `name` is a file a GGUF export of some quant writes (`model-q8_0.gguf`,
    `adapter-f16.gguf`, `Modelfile`)."""
    return GGUF_FILE.fullmatch(name) is not None


def _names(replaces: Iterable[str]) -> IsExport:
    names = frozenset(replaces)
    return lambda name: name in names


def stage_names(out: Path) -> tuple[Path, Path]:
    """The new export's folder while it is written, and the previous export's while the new one
    takes its place: fixed names beside `out` (one export at a time holds `out`: lock_beside),
    so the next export finds what a killed one left."""
    return (out.with_name(f".{out.name}.leantune-tmp"),
            out.with_name(f".{out.name}.leantune-old"))


def journal_path(out: Path) -> Path:
    """The file beside `out` that is there while the stage folders are an export's."""
    return out.with_name(f".{out.name}.leantune-publish.json")


def journal_text(out: Path, replaces: Iterable[str] | None = None) -> str:
    """The journal of an export into `out`: the stage names, and the files of OUT it replaces
    where they are not the merged export's (`is_merged_file`): a GGUF export's exact names."""
    tmp, old = stage_names(out)
    text = {"leantune": "export publish", "output": out.name, "new": tmp.name,
            "previous": old.name}
    if replaces is not None:
        text["replaces"] = sorted(set(replaces))
    return json.dumps(text, indent=2) + "\n"


def _read_journal(out: Path) -> IsExport | None:
    """Which files the export whose journal is beside `out` replaces, or None where that file is
    not a journal an export wrote (a regular file, exactly the text `journal_text` gives for
    the names it lists, each a name a GGUF export writes)."""
    path = journal_path(out)
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > 1 << 16:
            return None
        data = path.read_bytes()
        content = json.loads(data)
    except (OSError, ValueError):
        return None
    replaces = content.get("replaces") if isinstance(content, dict) else None
    if replaces is not None and not (isinstance(replaces, list) and replaces and all(
            isinstance(n, str) and is_gguf_file(n) for n in replaces)):
        return None
    if data != journal_text(out, replaces).encode():
        return None
    return is_merged_file if replaces is None else _names(replaces)


def _is_journal_start(out: Path, data: bytes) -> bool:
    """Whether `data` is the start of a journal of an export into `out` (an unfinished write)."""
    merged = journal_text(out).encode()
    gguf = journal_text(out, ["Modelfile"]).encode()
    head = gguf[:gguf.index(b'"Modelfile"')]  # up to the first name of "replaces"
    return (merged.startswith(data) or head.startswith(data)
            or (data.startswith(head)
                and re.fullmatch(rb'[0-9A-Za-z_.\-", \n\]}]*', data[len(head):]) is not None))


def open_output(out: Path, overwrite: bool, log=print) -> None:
    """What an export does first, holding `out`'s lock: mend what an export killed in `out`
    left (`recover_publish`), then refuse a non-empty `out` without `overwrite`, and names
    beside `out` that the export writes taken by something leantune cannot tell it made."""
    recover_publish(out, log)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LeantuneError(f"{out}: output folder is not empty; choose a new folder or pass "
                            "--overwrite")
    _refuse_in_the_way(out)


@contextlib.contextmanager
def publishing(out: Path, replaces: Iterable[str] | None = None):
    """Yield a new folder beside `out` to write the export into; when the block ends without
    an error, the folder takes the place of `out` (`_publish`): files of `out` that the export
    replaces go, the others stay. `replaces`: the exact names the export writes (a GGUF
    export's); None: the merged export's (`is_merged_file`). On an error (or a kill: the next
    export mends it) `out` is as it was."""
    replaces = None if replaces is None else sorted(set(replaces))
    if replaces is not None and not all(is_gguf_file(n) for n in replaces):
        raise ValueError(f"publishing: not names a GGUF export writes: {replaces}")
    is_export = is_merged_file if replaces is None else _names(replaces)
    _refuse_folders_at_export_names(out, is_export)
    tmp, old = stage_names(out)
    journal = journal_path(out)
    atomic_write_text(journal, journal_text(out, replaces))  # before the folder it vouches for
    made = False
    try:
        tmp.mkdir()  # the umask's permissions, as the output folder should have
        made = True
        yield tmp
        _publish(tmp, out, is_export)
    finally:
        if made and tmp.exists():
            shutil.rmtree(tmp)
        if not old.exists():  # (else a publish failed between its renames: kept to mend)
            remove(journal)


def _refuse_folders_at_export_names(out: Path, is_export: IsExport) -> None:
    """A folder in `out` at a name the export writes is not a file the export replaces: refused
    before anything is written (it would go with the previous export's files)."""
    if not out.is_dir():
        return
    for f in sorted(out.iterdir()):
        if is_export(f.name) and f.is_dir() and not f.is_symlink():
            raise LeantuneError(f"{f}: a folder where the export writes a file of that name; "
                                "move it away (or choose another output folder)")


def _publish(tmp: Path, out: Path, is_export: IsExport) -> None:
    """Put the finished export `tmp` in place of `out`, while the journal (`journal_path`) is
    there:
        1. out -> OLD          (a kill here: out missing, OLD there -> OLD goes back to out)
        2. tmp -> out          (a kill here: out and OLD there -> step 3 is finished)
        3. the files of OLD that the export does not replace (a user's notes) move into out,
        4. OLD is deleted.
    No stale file of a previous export survives, no kill leaves `out` missing for good, and
    `out` holds the previous export whole until it holds the new one whole."""
    if not out.exists():
        replace(tmp, out)
        fsync_dir(out.parent)
        return
    _, old = stage_names(out)
    with signals.deferred():
        replace(out, old)
        replace(tmp, out)
        fsync_dir(out.parent)
    _merge_back(old, out, is_export)


def _merge_back(old: Path, out: Path, is_export: IsExport) -> bool:
    """Steps 3-4 of `_publish`: keep the user's files of the previous export folder `old` (all
    but the files, or links, at names `is_export` replaces). Whether `old` is gone: a file of
    the user's that `out` has a namesake of (never so after a publish; a folder of leantune
    <= 0.3 might) keeps it there, untouched but for the moves."""
    kept = False
    for f in sorted(old.iterdir()):
        if is_export(f.name) and (f.is_symlink() or not f.is_dir()):
            continue
        if (out / f.name).exists() or (out / f.name).is_symlink():
            kept = True
        else:
            replace(f, out / f.name)
    fsync_dir(out)
    if not kept:
        remove(old)
    return not kept


def _restore(old: Path, out: Path, is_export: IsExport) -> bool:
    """A previous export renamed aside: back in place of a missing `out`, or its user's files
    into the new `out` (steps 3-4 of `_publish`). Whether `old` is gone."""
    if out.exists():
        return _merge_back(old, out, is_export)
    replace(old, out)  # killed between the renames: the previous export comes back
    fsync_dir(out.parent)
    return True


def _holds_an_export(folder: Path) -> bool:
    """A previous merged export renamed aside by leantune <= 0.3 (no journal): its config.json
    and its weights (an index or model.safetensors), regular files."""
    def regular(name):
        return (folder / name).is_file() and not (folder / name).is_symlink()

    return regular("config.json") and (regular(INDEX) or regular("model.safetensors"))


def _only_export_files(folder: Path, is_export: IsExport) -> bool:
    """An unfinished export folder left without a journal: nothing in it but regular files an
    export writes (`is_export`), finished or not (utils/io.temp_name's `.NAME.tmp-PID-XXXXXXXX`)."""
    def ours(name):
        of = temp_of(name)
        return is_export(name) or (of is not None and is_export(of))

    return all(f.is_file() and not f.is_symlink() and ours(f.name) for f in folder.iterdir())


def recover_publish(out: Path, log=print) -> None:
    """Finish or undo what an export killed while writing or publishing into `out` left beside
    it: a previous export renamed aside while `out` is missing goes back; one renamed aside
    after the new one arrived gives up its user files and goes; an unfinished new export is
    deleted.

    Only what leantune provably made is touched: the folders at the stage names
    (`stage_names`) while an export's journal is there, and, without one, the unfinished or
    previous exports of older versions: leantune <= 0.3's merged `.OUT.tmp-PID` /
    `.OUT.old-PID` (and stage folders without a journal), and the `.OUT.tmp-PID-XXXXXXXX` of a
    GGUF export before the journal (utils/io.temp_name of OUT). A tmp one whose contents are
    only its export's files (`_only_export_files`) is deleted; an old one holding a merged
    export (`_holds_an_export`) is renamed back where `out` is missing, and left where it is
    not. A link at a stage name is removed (never what it names); an empty folder there is
    removed (nothing in it to lose); anything else, a user's folder of a like name, is left as
    it is, named in one line to `log`."""
    tmp, old = stage_names(out)
    for stage in (old, tmp):
        if stage.is_symlink():  # not a folder an export made: the link goes, never what it names
            remove(stage)
    journaled = _read_journal(out)
    legacy = re.compile(rf"\.{re.escape(out.name)}\.(old|tmp)-\d+")
    # (path, kind, replaced names; None: no journal vouches for it)
    stages: list[tuple[Path, str, IsExport | None]] = [(old, "old", journaled),
                                                       (tmp, "tmp", journaled)]
    unjournaled: dict[Path, IsExport] = {old: is_merged_file, tmp: is_merged_file}
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.*-*")):
        m = legacy.fullmatch(path.name)
        if m:  # leantune <= 0.3's merged export
            stages.append((path, m[1], None))
            unjournaled[path] = is_merged_file
        elif temp_of(path.name) == out.name:  # a GGUF export's staged folder (no journal)
            stages.append((path, "tmp", None))
            unjournaled[path] = is_gguf_file
    left = []
    for path, kind, is_export in sorted(stages, key=lambda s: s[1]):  # the previous exports first
        if not path.is_dir() or path.is_symlink():
            if path.exists() or path.is_symlink():
                left.append(path)
            continue
        # (an old folder without a journal only goes back where `out` is missing: a rename
        # that loses nothing; beside an `out`, a user's folder of a like name stays)
        if kind == "old" and (is_export or (_holds_an_export(path) and not out.exists())):
            if not _restore(path, out, is_export or is_merged_file):
                left.append(path)
        elif kind == "tmp" and (is_export or _only_export_files(path, unjournaled[path])):
            remove(path)
        else:
            try:
                path.rmdir()  # an empty folder: nothing in it to lose
            except OSError:
                left.append(path)
    journal = journal_path(out)
    for path in out.parent.glob(f"{glob.escape('.' + journal.name)}.tmp-*"):
        try:  # an unfinished write of the journal (its text so far): the stages came after it
            if (temp_of(path.name) == journal.name and path.is_file() and not path.is_symlink()
                    and path.stat().st_size <= 1 << 16
                    and _is_journal_start(out, path.read_bytes())):
                remove(path)
        except OSError:
            pass
    if journaled:
        remove(journal)
    if left:
        log(f"note: left as they are beside {out}, not folders an export provably left: "
            f"{', '.join(p.name for p in left)}")


def _refuse_in_the_way(out: Path) -> None:
    """After `recover_publish`: a folder or file at a name the export writes beside `out` is not
    one it can tell it made; it is not deleted, the export is refused."""
    for path in (*stage_names(out), journal_path(out)):
        if path.exists() or path.is_symlink():
            raise LeantuneError(f"{path}: a name the export of {out.name} writes beside it is "
                                "taken by something leantune cannot tell it made; move it away "
                                "(or delete it) and run the export again")
