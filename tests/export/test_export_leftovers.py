"""What a merged export touches beside and inside its output folder: only what it provably made.

Beside OUT, the folders an interrupted export leaves are mended by the next one only while its
journal vouches for them (or, for leantune <= 0.3's `.OUT.tmp-PID` / `.OUT.old-PID`, when they
hold nothing but an export's files); a user's folder of a like name is never deleted, moved or
renamed. Inside OUT, `--overwrite` replaces only the files an export writes, by exact name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import quiet, save_random_adapter, tiny_ckpt  # noqa: F401

from leantune import LeantuneError, export_merged
from leantune.export.publish import is_merged_file as _is_export_file
from leantune.export.publish import journal_path as _journal
from leantune.export.publish import journal_text as _journal_text
from leantune.export.publish import stage_names as _stage_names


def tree(folder: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `folder`."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def beside(out: Path) -> list[str]:
    """The hidden names an export of `out` could leave beside it (its lock file aside)."""
    return sorted(p.name for p in out.parent.iterdir()
                  if p.name.startswith(f".{out.name}.") and "lock" not in p.name)


@pytest.fixture(scope="module")
def adapter(tiny_ckpt, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("leftovers") / "base2"
    save_random_adapter(tiny_ckpt, folder, seed=5)
    return folder


def user_folder(path: Path, text: str) -> Path:
    path.mkdir()
    (path / "precious.txt").write_text(text)
    (path / "sub").mkdir()
    (path / "sub" / "more.bin").write_bytes(os.urandom(64))
    return path


# --- bug 1: user folders beside --output ---------------------------------------------------------

def test_user_folders_named_like_old_leftovers_survive_the_cli_export(  # noqa: F811
        tiny_ckpt, adapter, tmp_path, capsys):
    """The report's case: `.OUT.tmp-mydata` was deleted and `.OUT.old-2024` renamed to OUT."""
    from leantune.cli import main

    out = tmp_path / "e_tmpuser"
    mine = [user_folder(tmp_path / ".e_tmpuser.tmp-mydata", "PRECIOUS"),
            user_folder(tmp_path / ".e_tmpuser.old-2024", "x"),  # (a legacy-looking name)
            user_folder(tmp_path / ".e_tmpuser.tmp-12345", "y")]
    (mine[2] / "config.json").write_text("{}")  # export-named files, and a user's besides
    before = {p.name: tree(p) for p in mine}
    rc = main(["export", "--model", str(tiny_ckpt), "--adapter", str(adapter), "--output",
               str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and (out / "config.json").is_file()
    assert not (out / "precious.txt").exists()
    assert {p.name: tree(p) for p in mine} == before
    notes = [line for line in printed.splitlines() if "left as they are" in line]
    # one line names those of leantune <= 0.3's name pattern (`.tmp-mydata` is not one)
    assert len(notes) == 1 and all(p.name in notes[0] for p in mine[1:]), printed
    # a second export, refused (not empty) or with --overwrite, leaves them as they are too
    with pytest.raises(LeantuneError, match="output folder is not empty"):
        export_merged(tiny_ckpt, adapter, out, log=quiet)
    export_merged(tiny_ckpt, adapter, out, overwrite=True, log=quiet)
    assert {p.name: tree(p) for p in mine} == before
    assert beside(out) == sorted(p.name for p in mine)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_user_folder_at_a_stage_name_without_a_journal_is_not_touched(  # noqa: F811
        tiny_ckpt, tmp_path, stage):
    """Even at leantune's own stage names: no journal, not an export's contents -> the export
    is refused in one line, the folder and OUT stay as they are."""
    out = tmp_path / "out"
    folder = user_folder(_stage_names(out)[stage], "mine")
    before = tree(folder)
    for existing in (False, True):
        with pytest.raises(LeantuneError, match="cannot tell it made") as e:
            export_merged(tiny_ckpt, None, out, overwrite=True, log=quiet)
        assert str(folder) in str(e.value) and "\n" not in str(e.value)
        assert tree(folder) == before
        assert out.exists() == existing  # (not renamed to OUT, nor OUT into it)
        if not existing:
            export_merged(tiny_ckpt, None, tmp_path / "other", log=quiet)
            os.replace(tmp_path / "other", out)
    exported = tree(out)
    folder_name = folder.name
    (folder / "precious.txt").unlink()  # emptied by its user: nothing left to lose
    (folder / "sub" / "more.bin").unlink()
    (folder / "sub").rmdir()
    export_merged(tiny_ckpt, None, out, overwrite=True, log=quiet)
    assert tree(out) == exported and beside(out) == [], folder_name


def test_a_journal_not_written_by_leantune_is_in_the_way(tiny_ckpt, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    _journal(out).write_text('{"mine": 1}\n')
    old = user_folder(_stage_names(out)[1], "mine")
    before = tree(old)
    with pytest.raises(LeantuneError, match="cannot tell it made"):
        export_merged(tiny_ckpt, None, out, log=quiet)
    assert tree(old) == before and not out.exists()
    assert _journal(out).read_text() == '{"mine": 1}\n'


# --- bug 1: what an export did leave is still mended -------------------------------------------

def _previous(tiny_ckpt, out: Path) -> dict:  # noqa: F811
    export_merged(tiny_ckpt, None, out, log=quiet)
    (out / "notes.txt").write_text("mine")
    return tree(out)


def _set_aside(tiny_ckpt, out: Path) -> dict:  # noqa: F811
    """A previous export with a user's notes in `out`, set aside by a publish (step 1), the
    journal there: its files."""
    previous = _previous(tiny_ckpt, out)
    _journal(out).write_text(_journal_text(out))
    os.replace(out, _stage_names(out)[1])
    return previous


def test_journaled_leftovers_of_a_kill_between_the_renames_are_mended(  # noqa: F811
        tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    previous = _set_aside(tiny_ckpt, out)  # killed before step 2
    tmp = _stage_names(out)[0]
    tmp.mkdir()
    (tmp / "model-00001-of-00001.safetensors").write_bytes(b"new")
    (tmp / "stray.txt").write_text("written by nobody but the export's own folder")
    with pytest.raises(LeantuneError, match="output folder is not empty"):
        export_merged(tiny_ckpt, None, out, log=quiet)
    assert tree(out) == previous and beside(out) == []


def test_journaled_leftovers_of_a_kill_after_the_renames_are_mended(  # noqa: F811
        tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    previous = _set_aside(tiny_ckpt, out)
    export_merged(tiny_ckpt, None, tmp_path / "new", log=quiet)
    os.replace(tmp_path / "new", out)  # step 2 done, killed before the user's files moved
    unfinished = tmp_path / f".{_journal(out).name}.tmp-123-0123abcd"
    unfinished.write_text(_journal_text(out)[:10])  # (and a journal write of another export)
    export_merged(tiny_ckpt, None, out, overwrite=True, log=quiet)
    assert tree(out) == previous and beside(out) == [] and not unfinished.exists()


def test_legacy_leftovers_holding_only_an_export_are_mended(tiny_ckpt, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    previous = _previous(tiny_ckpt, out)
    os.replace(out, tmp_path / ".out.old-4242")  # leantune 0.3, killed between the renames
    half = tmp_path / ".out.tmp-4242"
    half.mkdir()
    (half / "model-00001-of-00002.safetensors").write_bytes(b"half")
    (half / ".config.json.tmp-4242-deadbeef").write_bytes(b"{")
    export_merged(tiny_ckpt, None, out, overwrite=True, log=quiet)
    assert tree(out) == previous and beside(out) == []


def test_a_legacy_looking_export_whose_files_clash_with_the_output_is_kept(tiny_ckpt,  # noqa: F811
                                                                          tmp_path):
    """An export's files and a user's file at `.out.old-N`, while `out` has a file of that
    name too: nothing of either is lost (the folder stays, named in the note)."""
    out = tmp_path / "out"
    _previous(tiny_ckpt, out)
    aside = tmp_path / ".out.old-7"
    export_merged(tiny_ckpt, None, aside, log=quiet)
    (aside / "notes.txt").write_text("the other notes")
    kept, mine = tree(aside), tree(out)
    lines = []
    export_merged(tiny_ckpt, None, out, overwrite=True, log=lines.append)
    assert tree(aside) == kept and tree(out) == mine
    assert len(lines) == 1 and aside.name in lines[0]


# --- bug 2: --overwrite keeps every file whose name an export does not write ------------------

def test_overwrite_keeps_user_files_named_like_shards(tiny_ckpt, adapter, tmp_path):  # noqa: F811
    out = tmp_path / "e_user"
    out.mkdir()
    mine = {"notes.txt": b"hi\n", "model_v1_backup.safetensors": b"W\n",
            "model.safetensors.bak": b"1", "model-1-of-2.safetensors": b"2",
            "my_model.safetensors": b"3", "model-00001-of-00002.safetensors.orig": b"4",
            "config.json.bak": b"5"}
    for name, data in mine.items():
        (out / name).write_bytes(data)
    stale = ("model-00001-of-00009.safetensors", "model.safetensors")  # a previous export's
    for name in stale:
        (out / name).write_bytes(b"stale")
    export_merged(tiny_ckpt, adapter, out, overwrite=True, log=quiet)
    assert {n: (out / n).read_bytes() for n in mine} == mine
    assert not any((out / n).exists() for n in stale)
    assert (out / "model-00001-of-00001.safetensors").is_file()


def test_export_files_are_the_exact_names_an_export_writes():
    for name in ("config.json", "generation_config.json", "tokenizer.json", "model.safetensors",
                 "model.safetensors.index.json", "model-00001-of-00001.safetensors",
                 "model-00003-of-00012.safetensors"):
        assert _is_export_file(name), name
    for name in ("model_v1_backup.safetensors", "model-1-of-2.safetensors", "model.safetensors.x",
                 "modelx.safetensors", "model-00001-of-00002.safetensors.bak", "notes.txt",
                 "xmodel.safetensors", "model-00001-of-000002.safetensors", "config.json~"):
        assert not _is_export_file(name), name


def test_a_user_model_folder_of_a_legacy_name_beside_an_output_stays(tiny_ckpt, tmp_path):  # noqa: F811
    """`.OUT.old-2024` holding a config, weights and notes of the user's, beside an existing
    OUT: without a journal nothing proves an export left it, so --overwrite leaves it whole."""
    out = tmp_path / "out"
    export_merged(tiny_ckpt, None, out, log=quiet)
    folder = user_folder(tmp_path / ".out.old-2024", "notes")
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"the user's weights")
    before = tree(folder)
    notes = []
    export_merged(tiny_ckpt, None, out, overwrite=True, log=notes.append)
    assert tree(folder) == before
    assert any(".out.old-2024" in n for n in notes), notes
