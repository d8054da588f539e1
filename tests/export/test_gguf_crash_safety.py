"""No kill point of a GGUF export loses or breaks anything: the export (`--format gguf`, and the
adapter alone, `gguf-lora`) is killed (SIGKILL, in a forked child: utils/faults.py) at every kill
point it passes, in turn, and the same export run again finishes the job.

After each kill: OUT holds the previous export whole (byte-identical, its Modelfile naming its
own GGUF) until the new one has taken its place, and the new one whole after; the rerun succeeds
and leaves nothing beside OUT. GGUF exports publish as the merged export does
(export/publish.py: a journal beside OUT, one recovery for every format), so what a killed
export of one format left is mended by the next export of any format, and the leftovers of GGUF
exports before the journal (`.OUT.tmp-PID-XXXXXXXX`) go too, where they hold only a GGUF
export's files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import in_child, kill_points
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import quiet, save_random_adapter, tiny_ckpt  # noqa: F401

gguf = pytest.importorskip("gguf")

from leantune import LeantuneError, export_merged  # noqa: E402
from leantune.export import export_gguf, export_gguf_lora  # noqa: E402
from leantune.export.publish import journal_path, journal_text, stage_names  # noqa: E402


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def beside(out: Path) -> list[str]:
    """What an export of `out` could leave beside it (its lock file aside: utils/lock.py)."""
    return sorted(p.name for p in out.parent.iterdir()  # (`..OUT.`: the journal's temporary)
                  if p.name.startswith((f".{out.name}.", f"..{out.name}."))
                  and "lock" not in p.name)


def consistent(out: Path) -> None:
    """A GGUF export folder whose Modelfile names a GGUF beside it."""
    if (out / "Modelfile").exists():
        first = (out / "Modelfile").read_text().splitlines()[0]
        assert first.startswith("FROM ./"), first
        assert (out / first.removeprefix("FROM ./")).is_file(), first


@pytest.fixture(scope="module")
def adapter(tiny_ckpt, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("gguf_kills") / "adapter"
    save_random_adapter(tiny_ckpt, folder, seed=7)
    return folder


def _export(fmt: str, base: Path, adapter: Path, out: Path, overwrite: bool, quant="f16"):
    if fmt == "gguf":
        return lambda: export_gguf(base, adapter, out, quant=quant, overwrite=overwrite,
                                   log=quiet)
    return lambda: export_gguf_lora(base, adapter, out, quant=quant, overwrite=overwrite,
                                    log=quiet)


@pytest.mark.parametrize("fmt", ["gguf", "gguf-lora"])
def test_a_kill_at_any_point_of_an_overwrite_keeps_the_previous_export_whole(  # noqa: F811
        fmt, tiny_ckpt, adapter, tmp_path):
    """The previous export (another quant), a user's notes and a merged export of the user's
    in OUT; `--overwrite` killed at each point: OUT is the previous folder, byte for byte,
    until the swap, the new one after; the rerun gives the uninterrupted result and no
    leftovers beside OUT."""
    template = tmp_path / "template"
    export_merged(tiny_ckpt, adapter, template, log=quiet)  # the user's merged export: kept
    _export(fmt, tiny_ckpt, adapter, template, True, quant="q8_0")()
    (template / "notes.txt").write_text("mine")
    old = snapshot(template)
    assert any(n.endswith("q8_0.gguf") for n in old) and "config.json" in old

    probe = tmp_path / "probe"
    shutil.copytree(template, probe)
    points = kill_points(_export(fmt, tiny_ckpt, adapter, probe, True), tmp_path)
    new = snapshot(probe)
    assert beside(probe) == []
    suffix = "f16.gguf"
    assert {n for n in new if n not in old} == {n for n in new if n.endswith(suffix)}
    assert {n: b for n, b in new.items() if n in old and n != "Modelfile"} == \
        {n: b for n, b in old.items() if n != "Modelfile"}  # every other file kept as it was
    swap = points.index(f"replace {probe.name} -> .{probe.name}.leantune-old")
    assert points[swap + 1] == f"replace .{probe.name}.leantune-tmp -> {probe.name}"
    assert f"write {'model' if fmt == 'gguf' else 'adapter'}-f16.gguf" in points
    for n, label in enumerate(points, 1):
        out = tmp_path / f"out{n}"
        shutil.copytree(template, out)
        assert in_child(_export(fmt, tiny_ckpt, adapter, out, True), kill_at=n) == "killed"
        if n <= swap + 1:  # killed before the swap (points[swap]): nothing in OUT changed
            assert snapshot(out) == old, f"kill at {n} ({label})"
        elif n == swap + 2:  # between its two renames: OUT is aside, whole, the next export
            assert not out.exists()  # puts it back
            assert snapshot(stage_names(out)[1]) == old
        else:  # after it: the new export is whole in OUT (the user's files on their way back)
            assert {k: new[k] for k in new if k not in old or k == "Modelfile"} == \
                {k: v for k, v in snapshot(out).items() if k not in old or k == "Modelfile"}
        if out.exists():
            consistent(out)
        _export(fmt, tiny_ckpt, adapter, out, True)()  # the same command again
        assert snapshot(out) == new, f"kill at {n} ({label})"
        assert beside(out) == [], f"kill at {n} ({label})"
        shutil.rmtree(out)


@pytest.mark.parametrize("fmt", ["gguf", "gguf-lora"])
def test_a_kill_at_any_point_of_a_new_export_is_finished_by_the_rerun(  # noqa: F811
        fmt, tiny_ckpt, adapter, tmp_path):
    """Into a new OUT, without --overwrite (the report's `LEANTUNE_KILL_AT=1`): the same command
    again writes the export and leaves nothing beside OUT (the partial or complete GGUF of the
    killed one included). Killed once OUT is in place, the export is complete: the rerun says
    OUT is not empty."""
    probe = tmp_path / "probe"
    points = kill_points(_export(fmt, tiny_ckpt, adapter, probe, False), tmp_path)
    new = snapshot(probe)
    placed = points.index(f"replace .{probe.name}.leantune-tmp -> {probe.name}") + 1
    for n, label in enumerate(points, 1):
        out = tmp_path / f"out{n}"
        assert in_child(_export(fmt, tiny_ckpt, adapter, out, False), kill_at=n) == "killed"
        assert out.exists() == (n > placed), f"kill at {n} ({label})"
        if n > placed:
            assert snapshot(out) == new
            with pytest.raises(LeantuneError, match="not empty.*--overwrite"):
                _export(fmt, tiny_ckpt, adapter, out, False)()
        else:
            _export(fmt, tiny_ckpt, adapter, out, False)()
        assert snapshot(out) == new, f"kill at {n} ({label})"
        assert beside(out) == [], f"kill at {n} ({label})"
        shutil.rmtree(out)


def test_the_cli_rerun_after_a_kill_leaves_nothing_beside_the_output(  # noqa: F811
        tiny_ckpt, adapter, tmp_path, capsys):
    """The report's commands: `LEANTUNE_KILL_AT=N leantune export --format gguf`, then the same
    without the kill: no `.OUT.tmp-*` (nor anything else) is left beside OUT."""
    from leantune.cli import main

    args = ["export", "--model", str(tiny_ckpt), "--adapter", str(adapter), "--format", "gguf"]
    for n in (1, 3, 4):
        out = tmp_path / f"g{n}"
        assert in_child(lambda: main([*args, "--output", str(out)]), kill_at=n) == "killed"
        assert beside(out) != []  # (what the kill left)
        assert main([*args, "--output", str(out)]) == 0
        assert beside(out) == [] and sorted(p.name for p in out.iterdir()) == [
            "Modelfile", "model-f16.gguf"]
    capsys.readouterr()


def test_what_a_killed_gguf_export_left_is_mended_by_a_merged_export(  # noqa: F811
        tiny_ckpt, adapter, tmp_path):
    """One recovery for every format: a GGUF overwrite killed between the swap and the move of
    the user's files back, then a merged export into OUT: the files the GGUF export did not
    replace (the user's merged export, their notes) are moved back, not dropped as the merged
    export's own would be."""
    out = tmp_path / "out"
    export_merged(tiny_ckpt, None, out, log=quiet)
    (out / "notes.txt").write_text("mine")
    mine = snapshot(out)
    fn = _export("gguf", tiny_ckpt, adapter, out, True)
    probe = tmp_path / "probe"
    shutil.copytree(out, probe)
    points = kill_points(_export("gguf", tiny_ckpt, adapter, probe, True), tmp_path)
    after_swap = points.index(f"replace .{probe.name}.leantune-tmp -> {probe.name}") + 2
    assert in_child(fn, kill_at=after_swap) == "killed"
    assert stage_names(out)[1].exists() and journal_path(out).exists()
    with pytest.raises(LeantuneError, match="not empty"):
        export_merged(tiny_ckpt, None, out, log=quiet)  # (mends first, then refuses)
    have = snapshot(out)
    assert {k: have[k] for k in mine} == mine and beside(out) == []
    assert sorted(set(have) - set(mine)) == ["Modelfile", "model-f16.gguf"]


def _staged_leftover(out: Path, files: dict[str, bytes]) -> Path:
    """A folder as a GGUF export before the journal left it killed (its staged folder)."""
    folder = out.with_name(f".{out.name}.tmp-4242-0123abcd")
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


@pytest.mark.parametrize("then", ["gguf", "merged"])
def test_leftovers_of_gguf_exports_before_the_journal_are_removed(then, tiny_ckpt,  # noqa: F811
                                                                  adapter, tmp_path):
    """`.OUT.tmp-PID-XXXXXXXX` (utils/io.temp_name of OUT) holding only a GGUF export's files,
    finished or not (a partial GGUF, a Modelfile's temporary): the next export, of either
    format, removes it."""
    out = tmp_path / "out"
    export_gguf(tiny_ckpt, adapter, out, log=quiet)
    previous = snapshot(out)
    half = _staged_leftover(out, {"model-q8_0.gguf": b"GGUF half", "Modelfile": b"FROM ./x\n",
                                  ".Modelfile.tmp-4242-89abcdef": b"FR"})
    lines = []
    if then == "gguf":
        export_gguf(tiny_ckpt, adapter, out, overwrite=True, log=lines.append)
        assert snapshot(out) == previous
    else:
        with pytest.raises(LeantuneError, match="not empty"):
            export_merged(tiny_ckpt, adapter, out, log=lines.append)
    assert not half.exists() and beside(out) == [] and lines == []


def test_a_user_folder_named_like_a_gguf_leftover_stays(tiny_ckpt, adapter, tmp_path):  # noqa: F811
    """The same name holding a file a GGUF export never writes: not provably an export's, so it
    is left whole and named in one line."""
    out = tmp_path / "out"
    mine = _staged_leftover(out, {"model-f16.gguf": b"my model", "precious.txt": b"mine"})
    (mine / "sub").mkdir()
    before = snapshot(mine)
    lines = []
    export_gguf(tiny_ckpt, adapter, out, log=lines.append)
    export_gguf(tiny_ckpt, adapter, out, overwrite=True, log=lines.append)
    assert snapshot(mine) == before and (mine / "sub").is_dir()
    assert len(lines) == 2 and all(mine.name in line for line in lines)
    assert beside(out) == [mine.name]


def test_a_journal_naming_files_no_export_writes_is_in_the_way(  # noqa: F811
        tiny_ckpt, adapter, tmp_path):
    """A journal that lists a user's file is not one an export wrote: nothing beside or in OUT
    is touched, the export is refused."""
    out = tmp_path / "out"
    export_gguf(tiny_ckpt, adapter, out, log=quiet)
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    forged = json.loads(journal_text(out, ["Modelfile"]))
    forged["replaces"] = ["Modelfile", "notes.txt"]
    journal_path(out).write_text(json.dumps(forged, indent=2) + "\n")
    os.replace(out, stage_names(out)[1])
    (tmp_path / "out").mkdir()
    with pytest.raises(LeantuneError, match="cannot tell it made"):
        export_gguf(tiny_ckpt, adapter, out, overwrite=True, log=quiet)
    assert snapshot(stage_names(out)[1]) == before and list(out.iterdir()) == []


def test_a_journaled_gguf_publish_killed_between_the_renames_is_undone(  # noqa: F811
        tiny_ckpt, adapter, tmp_path):
    """OUT renamed aside, the new export not yet in place (its folder half written): the
    previous export comes back, byte for byte, and the unfinished one goes."""
    out = tmp_path / "out"
    export_gguf(tiny_ckpt, adapter, out, quant="q8_0", log=quiet)
    (out / "notes.txt").write_text("mine")
    previous = snapshot(out)
    journal_path(out).write_text(journal_text(out, ["Modelfile", "model-f16.gguf"]))
    os.replace(out, stage_names(out)[1])
    stage_names(out)[0].mkdir()
    (stage_names(out)[0] / "model-f16.gguf").write_bytes(b"GGUF half")
    with pytest.raises(LeantuneError, match="not empty"):
        export_gguf(tiny_ckpt, adapter, out, log=quiet)
    assert snapshot(out) == previous and beside(out) == []


def test_a_folder_at_an_export_file_name_is_refused_before_anything_is_written(  # noqa: F811
        tiny_ckpt, adapter, tmp_path):
    out = tmp_path / "out"
    (out / "Modelfile").mkdir(parents=True)
    (out / "Modelfile" / "mine.txt").write_text("mine")
    with pytest.raises(LeantuneError, match="a folder where the export writes a file") as e:
        export_gguf(tiny_ckpt, adapter, out, overwrite=True, log=quiet)
    assert "\n" not in str(e.value)
    assert snapshot(out) == {"Modelfile/mine.txt": b"mine"} and beside(out) == []


def test_the_missing_gguf_package_names_a_quoted_install(monkeypatch):
    """`pip install leantune[gguf]` unquoted is a glob in zsh (`no matches found`)."""
    import builtins

    from leantune.export.gguf.writer import _import_gguf

    real = builtins.__import__

    def no_gguf(name, *args, **kw):
        if name == "gguf":
            raise ImportError("No module named 'gguf'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    with pytest.raises(LeantuneError) as e:
        _import_gguf()
    assert str(e.value) == "GGUF export needs the gguf package: pip install 'leantune[gguf]'"
