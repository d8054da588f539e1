"""Nothing a user has is lost: every check runs before the output folder is touched, and
--overwrite keeps the previous run until the new one has its first checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, alpaca_rows, read_metrics, tiny_ckpt, write_jsonl  # noqa: F401
from helpers import quiet, train_cfg

from leantune.errors import LeantuneError
from leantune.train.config import TrainConfig
from leantune.train.output import JOURNAL, SET_ASIDE, RunFolder
from leantune.train.trainer import Trainer


def cfg_for(model, data, output, **kw) -> TrainConfig:
    return train_cfg(model, data, output, **{"batch_size": 4, "max_steps": 2, **kw})


def snapshot(folder) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def old_run(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    """A finished run in tmp_path/run; returns (its config, a snapshot of its files)."""
    cfg = cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run")
    Trainer(cfg, log=quiet).train()
    return cfg, snapshot(tmp_path / "run")


# --- checks before the output is touched ---------------------------------------------------------

def test_bad_data_with_overwrite_leaves_the_previous_run(old_run, tmp_path):
    cfg, before = old_run
    bad = tmp_path / "bad.jsonl"
    rows = [json.dumps(r) for r in alpaca_rows(6)]
    bad.write_text("\n".join(rows[:4] + ['{"instruction": "hi"'] + rows[4:]) + "\n")
    lacking = write_jsonl(tmp_path / "lacking.jsonl", alpaca_rows(3) + [{"instruction": "x"}])
    for data, expect in ((bad, f"{bad}:5: malformed JSON"),
                         (lacking, f"{lacking}:4: missing field 'output'")):
        with pytest.raises(LeantuneError, match=expect):
            Trainer(dataclasses.replace(cfg, data=str(data), overwrite=True), log=quiet)
        assert snapshot(tmp_path / "run") == before


def test_a_corrupt_or_mismatched_model_is_found_from_its_headers(old_run, tiny_ckpt, tmp_path,  # noqa: F811
                                                                 monkeypatch):
    """A truncated shard and a config.json that does not fit the weights fail before the output
    is touched, and before any weight is read (the headers say it)."""
    import leantune.train.trainer as trainer_mod

    cfg, before = old_run
    monkeypatch.setattr(trainer_mod, "load_model", lambda *a, **k: pytest.fail("weights read"))
    cut = tmp_path / "cut"
    shutil.copytree(tiny_ckpt, cut)
    blob = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(blob[: len(blob) - 100])
    wide = tmp_path / "wide"
    shutil.copytree(tiny_ckpt, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    short = tmp_path / "short"  # a weight missing from the shards
    shutil.copytree(tiny_ckpt, short)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(short / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(short / "model.safetensors"))
    for model, expect in ((cut, "model.safetensors: cannot read safetensors file .* truncated "
                                "or corrupt, re-download it"),
                          (wide, r"has shape .* config.json implies .* do not belong to this "
                                 r"config.json \(re-download the model, or restore its "
                                 r"config.json\)"),
                          (short, "1 weight missing from the checkpoint .e.g. model.norm.weight"
                                  "."
                                  "; the download is incomplete: re-download the model")):
        with pytest.raises(LeantuneError, match=expect):
            Trainer(dataclasses.replace(cfg, model=str(model), overwrite=True), log=quiet)
        assert snapshot(tmp_path / "run") == before


def test_resume_without_a_loadable_checkpoint_fails_before_the_weights(old_run, tmp_path,
                                                                       monkeypatch):
    import leantune.train.trainer as trainer_mod

    cfg, _ = old_run
    monkeypatch.setattr(trainer_mod, "load_model", lambda *a, **k: pytest.fail("weights read"))
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    for f in ("optimizer.safetensors", "optimizer.json"):
        (ckpt / f).unlink()
    (ckpt / "optimizer.pt").write_bytes(b"\x80\x04N.")  # a pickle of None
    with pytest.raises(LeantuneError, match=f"{ckpt}: optimizer.pt is a pickle"):
        Trainer(dataclasses.replace(cfg, resume=True), log=quiet)
    with pytest.raises(LeantuneError, match="no checkpoint found in .*; start without --resume"):
        Trainer(dataclasses.replace(cfg, output=str(tmp_path / "new"), resume=True), log=quiet)


def test_the_data_is_read_before_the_weights(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    logs = []
    Trainer(cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run"), log=logs.append)
    data = next(i for i, line in enumerate(logs) if line.startswith("data: "))
    model = next(i for i, line in enumerate(logs) if line.startswith("model: loading"))
    assert data < model


def test_output_must_not_be_the_model_folder(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    model = tmp_path / "model"
    shutil.copytree(tiny_ckpt, model)
    before = snapshot(model)
    cases = {model: "is the model folder", model / "run": "lies inside the model folder",
             tmp_path: "contains the model folder"}
    for output, expect in cases.items():
        cfg = cfg_for(model, alpaca_file, output, overwrite=True)
        with pytest.raises(LeantuneError) as e:
            Trainer(cfg, log=quiet)
        assert f"--output {output} {expect} {model}; write to a folder of its own" in str(e.value)
    assert snapshot(model) == before and not (model / "run").exists()


def test_output_naming_a_file_is_one_line(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(LeantuneError, match=r"--output .*notes.txt is a file; give a folder"):
        Trainer(cfg_for(tiny_ckpt, alpaca_file, tmp_path / "notes.txt"), log=quiet)
    assert (tmp_path / "notes.txt").read_text() == "mine"


# --- --overwrite: set aside, then deleted or put back ---------------------------------------------

def test_overwrite_replaces_the_run_and_keeps_other_files(old_run, tmp_path):
    cfg, before = old_run
    out = tmp_path / "run"
    (out / "notes.txt").write_text("mine")
    Trainer(dataclasses.replace(cfg, overwrite=True, seed=7), log=quiet).train()
    after = snapshot(out)
    assert after["notes.txt"] == b"mine"
    assert after["adapter_model.safetensors"] != before["adapter_model.safetensors"]
    assert not (out / SET_ASIDE).exists()
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


@pytest.mark.parametrize("how", ["error", "interrupt", "nan"])
def test_overwrite_puts_the_previous_run_back_when_the_new_one_fails_early(old_run, tmp_path,
                                                                           how):
    cfg, before = old_run
    tr = Trainer(dataclasses.replace(cfg, overwrite=True, seed=7), log=quiet)
    real = tr.train_step

    def failing(window):
        assert (tmp_path / "run" / SET_ASIDE).is_dir()  # set aside while the run is going
        if how == "error":
            raise RuntimeError("CUDA out of memory (simulated)")
        if how == "interrupt":
            raise KeyboardInterrupt
        loss, gnorm, n = real(window)
        return loss * float("nan"), gnorm, n

    tr.train_step = failing
    with pytest.raises((RuntimeError, LeantuneError)) as e:
        tr.train()
    if how == "interrupt":
        assert str(e.value) == (f"interrupted (Ctrl-C) before the first step finished; the "
                                f"previous run in {tmp_path / 'run'} is put back as it was "
                                "(--overwrite replaces it only from this run's first "
                                "checkpoint, --save-every); run the same command to start again")
    if how == "nan":
        assert "no checkpoint was written" in str(e.value)
    assert snapshot(tmp_path / "run") == before


def test_run_folder_settles_a_run_left_set_aside(tmp_path):
    """A process killed between setting the previous run aside and its first checkpoint: the
    next run puts it back; killed after its first checkpoint: the set-aside files go."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("old\n")
    (out / "adapter_model.safetensors").write_bytes(b"old")
    rf = RunFolder(out, log=quiet)
    rf.begin(overwrite=True)
    (out / "metrics.jsonl").write_text("new\n")  # the new run's first records, then SIGKILL
    notes = []
    RunFolder(out, log=notes.append).settle_leftover()
    assert snapshot(out) == {"metrics.jsonl": b"old\n", "adapter_model.safetensors": b"old"}
    assert "put back the previous run" in notes[0]

    RunFolder(out, log=quiet).begin(overwrite=True)
    (out / "checkpoints" / "step-00000001").mkdir(parents=True)  # got going, then SIGKILL
    RunFolder(out, log=quiet).settle_leftover()
    assert not (out / SET_ASIDE).exists() and (out / "checkpoints").is_dir()


def test_a_full_run_is_replaced_whole(tmp_path):
    """A full fine-tune's config.json and shards are part of the run; with fewer shards next
    time none of the old ones may survive."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                 "model.safetensors.index.json", "config.json"):
        (out / name).write_text("old")
    (out / "my_config.json").write_text("mine")
    rf = RunFolder(out, log=quiet)
    rf.begin(overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [JOURNAL, SET_ASIDE, "my_config.json"]
    rf.commit()
    assert sorted(p.name for p in out.iterdir()) == ["my_config.json"]


def test_resume_and_overwrite_together_are_refused():
    with pytest.raises(LeantuneError, match="--resume continues the run in --output and "
                                            "--overwrite replaces it; give one of them"):
        TrainConfig(resume=True, overwrite=True).validate()


def test_injected_model_and_data_need_no_model_path(tiny_ckpt, tmp_path):  # noqa: F811
    """The benchmarks' way: a ready model and token documents, no --model and no tokenizer."""
    from leantune.model.loader import load_model

    model = load_model(str(tiny_ckpt), dtype=torch.float32)
    docs = [([1, 2, 3, 4, 5], [2, 3, 4, 5, -100])] * 8
    cfg = TrainConfig(output=str(tmp_path / "run"), max_seq_len=16, batch_size=2, max_steps=2,
                      lora_r=4, device="cpu", progress=False)
    result = Trainer(cfg, model=model, train_data=docs, log=quiet).train()
    assert result.steps == 2 and (tmp_path / "run" / "adapter_model.safetensors").is_file()
    with pytest.raises(LeantuneError, match="no model given: set --model"):
        Trainer(cfg, train_data=docs, log=quiet)
