"""No kill point loses files: each write sequence of a run folder or an export is killed
(SIGKILL, in a forked child: utils/faults.py) at every kill point it passes, in turn, and the
next command recovers: nothing of the user's is lost and a retry or --resume finishes the job.

Sequences: a whole run's saves (checkpoints, the final save), an --overwrite's set-aside of a
previous run (with merged/, tensorboard/, loss.png, samples.jsonl), an export's publish over a
previous export; and the early stops (Ctrl-C before the first step, a closed stdout pipe) whose
folder a retry must accept."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from helpers import in_child, kill_points
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, tiny_ckpt  # noqa: F401
from helpers import quiet, train_cfg

from leantune.errors import LeantuneError
from leantune.train.checkpoint import latest_checkpoint
from leantune.train.output import FINAL_JOURNAL, JOURNAL, SET_ASIDE, RunFolder
from leantune.train.trainer import Trainer


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def final_files(out: Path) -> dict[str, bytes]:
    return {n: (out / n).read_bytes() for n in ("adapter_model.safetensors",
                                                 "adapter_config.json")}


def finish(cfg) -> None:
    """What a user does after a crash: the same command; if the folder holds a run, --resume."""
    try:
        Trainer(cfg, log=quiet).train()
    except LeantuneError as e:
        assert "pass --resume to continue it" in str(e), e
        Trainer(dataclasses.replace(cfg, resume=True, overwrite=False), log=quiet).train()


# --- a run's own saves, up to its final save ---------------------------------------------------

def test_a_kill_at_any_point_of_a_run_is_mended_by_a_retry(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    cfg = train_cfg(tiny_ckpt, alpaca_file, tmp_path / "ref", max_steps=2, save_every=1)
    points = kill_points(lambda: Trainer(cfg, log=quiet).train(), tmp_path)
    assert any("adapter_config.json" in p for p in points)
    reference = final_files(tmp_path / "ref")
    for n, label in enumerate(points, 1):
        run = dataclasses.replace(cfg, output=str(tmp_path / f"run{n}"))
        assert in_child(lambda: Trainer(run, log=quiet).train(), kill_at=n) == "killed", label
        finish(run)
        out = Path(run.output)
        assert not (out / FINAL_JOURNAL).exists(), label
        assert final_files(out) == reference, f"kill at {n} ({label}): final files differ"


def test_resume_repairs_a_final_save_cut_short(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    """The case the issue names: killed between the adapter's two files, --resume says more
    than "finished": it writes them again."""
    cfg = train_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=2)
    Trainer(cfg, log=quiet).train()
    good = final_files(tmp_path / "run")
    (tmp_path / "run" / "adapter_config.json").unlink()
    (tmp_path / "run" / FINAL_JOURNAL).write_text('{"step": 2}\n')
    logs = []
    Trainer(dataclasses.replace(cfg, resume=True), log=logs.append).train()
    assert final_files(tmp_path / "run") == good
    assert any(line.startswith("wrote the final adapter from") for line in logs)
    assert not (tmp_path / "run" / FINAL_JOURNAL).exists()


# --- --overwrite's set-aside -------------------------------------------------------------------

@pytest.fixture
def old_run(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    """A finished run with every kind of file --overwrite must set aside."""
    cfg = train_cfg(tiny_ckpt, alpaca_file, tmp_path / "old", max_steps=3)
    Trainer(cfg, log=quiet).train()
    out = tmp_path / "old"
    (out / "merged").mkdir(exist_ok=True)
    (out / "merged" / "model.safetensors").write_bytes(b"old merged")
    (out / "tensorboard").mkdir(exist_ok=True)
    (out / "tensorboard" / "events").write_bytes(b"old events")
    (out / "loss.png").write_bytes(b"old plot")
    (out / "samples.jsonl").write_text('{"step": 3}\n')
    (out / "notes.txt").write_text("mine")
    return cfg, out


def test_a_kill_at_any_point_of_an_overwrite_loses_nothing(old_run, tmp_path):
    cfg, template = old_run
    before = snapshot(template)
    new = dataclasses.replace(cfg, output=str(tmp_path / "probe"), overwrite=True, seed=7,
                              max_steps=2)
    shutil.copytree(template, tmp_path / "probe")
    points = kill_points(lambda: Trainer(new, log=quiet).train(), tmp_path)
    assert any(SET_ASIDE in p for p in points) and any(JOURNAL in p for p in points)
    reference = final_files(tmp_path / "probe")
    for n, label in enumerate(points, 1):
        out = tmp_path / f"run{n}"
        shutil.copytree(template, out)
        run = dataclasses.replace(new, output=str(out))
        assert in_child(lambda: Trainer(run, log=quiet).train(), kill_at=n) == "killed", label
        RunFolder(out, log=quiet).settle_leftover()  # what the next command does first
        assert not (out / SET_ASIDE).exists() and not (out / JOURNAL).exists(), label
        after = snapshot(out)
        if after != before:  # the new run is worth more: it has a checkpoint of its own
            ckpt = latest_checkpoint(out)
            assert ckpt is not None, label
            assert json.loads((ckpt / "state.json").read_text())["config"]["seed"] == 7, label
            assert not {b"old merged", b"old events", b"old plot"} & set(after.values()), label
            assert after["notes.txt"] == b"mine"
        finish(run)
        assert final_files(out) == reference, f"kill at {n} ({label})"
        assert (out / "notes.txt").read_text() == "mine"


def test_an_overwrite_stopped_before_its_first_checkpoint_puts_the_old_run_back(old_run):
    cfg, out = old_run
    before = snapshot(out)
    run = dataclasses.replace(cfg, overwrite=True, seed=7, max_steps=6, save_every=5)
    tr = Trainer(run, log=quiet)
    real, calls = tr.train_step, []

    def step(window):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(window)

    tr.train_step = step
    with pytest.raises(LeantuneError) as e:
        tr.train()
    assert str(e.value).startswith(f"interrupted (Ctrl-C) at step 3; the previous run in {out} "
                                   "is put back as it was; this run's 3 steps are dropped")
    assert "run the same command to start again" in str(e.value)
    assert snapshot(out) == before
    assert Trainer(run, log=quiet).train().steps == 6  # the command it names works


def test_an_overwrite_stopped_after_its_first_checkpoint_names_a_working_resume(old_run):
    cfg, out = old_run
    run = dataclasses.replace(cfg, overwrite=True, seed=7, max_steps=6, save_every=2)
    tr = Trainer(run, log=quiet)
    real, calls = tr.train_step, []

    def step(window):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(window)

    tr.train_step = step
    with pytest.raises(LeantuneError, match="continue with the same command with --resume in "
                                            "place of --overwrite"):
        tr.train()
    assert not (out / "merged").exists() and not (out / SET_ASIDE).exists()
    resumed = dataclasses.replace(run, overwrite=False, resume=True)
    assert Trainer(resumed, log=quiet).train().steps == 6


# --- an export's publish -----------------------------------------------------------------------

def test_a_kill_at_any_point_of_an_export_never_loses_it(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    from leantune.export import export_merged

    cfg = train_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=1)
    Trainer(cfg, log=quiet).train()
    template = tmp_path / "template"
    export_merged(tiny_ckpt, None, template, log=quiet)  # the previous export: the base
    (template / "notes.txt").write_text("mine")
    old = snapshot(template)

    def export(out):
        return lambda: export_merged(tiny_ckpt, tmp_path / "run", out, overwrite=True, log=quiet)

    shutil.copytree(template, tmp_path / "probe")
    points = kill_points(export(tmp_path / "probe"), tmp_path)
    new = snapshot(tmp_path / "probe")
    assert new != old and new["notes.txt"] == b"mine"
    assert sum(p.startswith("replace") for p in points) >= 2
    for n, label in enumerate(points, 1):
        out = tmp_path / f"out{n}"
        shutil.copytree(template, out)
        assert in_child(export(out), kill_at=n) == "killed", label
        from leantune.export.publish import recover_publish

        recover_publish(out)  # what the next export does first
        assert snapshot(out) in (old, new), f"kill at {n} ({label})"
        export(out)()
        assert snapshot(out) == new, label
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")
                     and "lock" not in p.name]
        assert leftovers == [], label


def test_stale_folders_of_an_older_export_are_recovered(tiny_ckpt, tmp_path):  # noqa: F811
    from leantune.export import export_merged

    out = tmp_path / "out"
    export_merged(tiny_ckpt, None, out, log=quiet)
    good = snapshot(out)
    os.replace(out, tmp_path / ".out.old-12345")  # killed between the renames (leantune 0.3)
    (tmp_path / ".out.tmp-12345").mkdir()
    (tmp_path / ".out.tmp-12345" / "model.safetensors").write_bytes(b"half")
    with pytest.raises(LeantuneError, match="output folder is not empty"):
        export_merged(tiny_ckpt, None, out, log=quiet)  # the export is back, and not clobbered
    assert snapshot(out) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_links_planted_at_the_export_stage_names_are_removed_not_followed(tiny_ckpt, tmp_path):  # noqa: F811
    """The fixed names beside the output (`.out.leantune-tmp`, `.out.leantune-old`) holding
    links to a user's folder: the export removes the links and writes nothing there."""
    from leantune.export import export_merged
    from leantune.export.publish import stage_names as _stage_names

    out = tmp_path / "out"
    export_merged(tiny_ckpt, None, out, log=quiet)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    for stage in _stage_names(out):
        stage.symlink_to(victim, target_is_directory=True)
    export_merged(tiny_ckpt, None, out, overwrite=True, log=quiet)
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert (victim / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")
                  and "lock" not in p.name) == []
    assert (out / "config.json").is_file() and not out.is_symlink()


# --- early stops: the retry is not refused ------------------------------------------------------

def test_a_retry_after_ctrl_c_before_the_first_step_needs_no_flag(tiny_ckpt, alpaca_file,  # noqa: F811
                                                                  tmp_path):
    cfg = train_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=2)
    tr = Trainer(cfg, log=quiet)

    def interrupted(window):
        raise KeyboardInterrupt

    tr.train_step = interrupted
    with pytest.raises(LeantuneError, match="nothing was saved; run the command again"):
        tr.train()
    assert (tmp_path / "run" / "run_config.json").exists()
    notes = []
    assert Trainer(cfg, log=notes.append).train().steps == 2
    assert any("holds a run stopped before its first checkpoint" in n for n in notes)


def test_a_retry_after_a_closed_stdout_pipe_needs_no_flag(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    cfg = train_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=3)

    def piped():  # `leantune train ... | head -1`: the reader is gone when progress prints
        tr = Trainer(cfg, log=quiet)
        r, w = os.pipe()
        os.close(r)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        sys.stdout = os.fdopen(w, "w", buffering=1)
        tr.train()

    assert in_child(piped) == 1
    assert (tmp_path / "run" / "metrics.jsonl").exists()
    assert latest_checkpoint(tmp_path / "run") is None
    assert Trainer(cfg, log=quiet).train().steps == 3
