"""A tampered or corrupt checkpoint is refused in one line naming the file and the field, never
a traceback, and never used (a step of -1 used to be taken, and dropped the metrics history);
a --resume with other settings is refused before the weights load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, tiny_ckpt  # noqa: F401
from helpers import quiet, train_cfg
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import leantune.train.trainer as trainer_mod
from leantune.errors import LeantuneError
from leantune.train.trainer import Trainer


@pytest.fixture(scope="module")
def finished(tiny_ckpt, alpaca_file, tmp_path_factory):  # noqa: F811
    """A finished 2-step run (a checkpoint at each step); tests tamper with copies of it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    cfg = train_cfg(tiny_ckpt, alpaca_file, out, max_steps=2, save_every=1)
    Trainer(cfg, log=quiet).train()
    return cfg


@pytest.fixture
def run(finished, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished.output, out)
    return dataclasses.replace(finished, output=str(out), resume=True, max_steps=4)


def ckpt_of(cfg):
    from pathlib import Path

    return Path(cfg.output) / "checkpoints" / "step-00000002"


def edit_state(cfg, change):
    f = ckpt_of(cfg) / "state.json"
    state = json.loads(f.read_text())
    change(state)
    f.write_text(json.dumps(state))
    return f


def _set(key, value):
    def change(state):
        state[key] = value
    return change


def _drop(key):
    return lambda state: state.pop(key)


def _data(key, value):
    def change(state):
        state["data"][key] = value
    return change


@pytest.mark.parametrize("change, expect", [
    (_set("step", -1), "step is -1, expected a positive integer"),
    (_set("step", 0), "step is 0, expected a positive integer"),
    (_set("step", 1.5), "step is 1.5, expected a positive integer"),
    (_set("step", "2"), 'step is "2", expected a positive integer'),
    (_set("step", True), "step is true, expected a positive integer"),
    (_set("step", 7), "step is 7, but the folder is step-00000002"),
    (_drop("step"), "the key 'step' is missing"),
    (_drop("data"), "the key 'data' is missing"),
    (_data("epoch", "x"), "data is .*, expected an object whose epoch and batch_index"),
    (_data("batch_index", -3), "data is .*, expected an object whose epoch and batch_index"),
    (lambda state: state["data"].pop("epoch"), "data has no 'epoch'"),
    (_set("tokens_seen", -5), "tokens_seen is -5, expected a non-negative integer"),
    (_set("total_steps", None), "total_steps is null, expected a positive integer"),
    (_set("first_eval_loss", "low"), 'first_eval_loss is "low", expected a number or null'),
    (_set("config", [1]), r"config is \[1\], expected an object"),
])
def test_a_tampered_state_json_is_one_line_and_never_used(run, change, expect, monkeypatch):
    metrics = (ckpt_of(run).parents[1] / "metrics.jsonl").read_bytes()
    f = edit_state(run, change)
    # state.json is read before the weights load
    monkeypatch.setattr(trainer_mod, "load_model", lambda *a, **k: pytest.fail("weights read"))
    with pytest.raises(LeantuneError, match=f"{f}: {expect}.*corrupt or was edited: delete it"):
        Trainer(run, log=quiet)
    assert (ckpt_of(run).parents[1] / "metrics.jsonl").read_bytes() == metrics


def test_a_state_json_that_is_no_object_or_no_json(run):
    f = ckpt_of(run) / "state.json"
    for text, expect in (("[2]", "expected a JSON object, got list"),
                         ('{"step": 2', "not valid JSON")):
        f.write_text(text)
        with pytest.raises(LeantuneError, match=f"{f}: {expect}"):
            Trainer(run, log=quiet)


def test_optimizer_tensors_of_the_wrong_shape(run):
    f = ckpt_of(run) / "optimizer.safetensors"
    tensors = load_file(str(f))
    key = next(k for k in tensors if k.endswith(".exp_avg"))
    tensors[key] = tensors[key].reshape(-1)[:-1].clone()  # a vector one short
    save_file(tensors, str(f))
    with pytest.raises(LeantuneError, match=rf"optimizer state {key} has shape \(\d+,\)"):
        Trainer(run, log=quiet)

    tensors = load_file(str(f))
    tensors[key] = torch.zeros(2, 3)
    step = next(k for k in tensors if k.endswith(".step"))
    save_file(tensors, str(f))
    with pytest.raises(LeantuneError, match=r"has shape \(2, 3\)"):
        Trainer(run, log=quiet)
    tensors.pop(key)
    tensors[step] = torch.tensor([-1.0, 2.0])
    save_file(tensors, str(f))
    with pytest.raises(LeantuneError, match=r"\.step is not one non-negative number"):
        Trainer(run, log=quiet)
    tensors.pop(step)
    tensors["no.such.param.exp_avg"] = torch.zeros(1)
    save_file(tensors, str(f))
    with pytest.raises(LeantuneError, match="holds state for no.such.param"):
        Trainer(run, log=quiet)


def test_rng_state_that_does_not_fit(run):
    f = ckpt_of(run) / "rng.safetensors"
    with safe_open(str(f), framework="pt") as s:
        meta, good = s.metadata(), s.get_tensor("torch")
    save_file({"torch": good[:100].clone()}, str(f), metadata=meta)
    with pytest.raises(LeantuneError, match=r"the torch RNG state has shape \(100,\)"):
        Trainer(run, log=quiet)
    save_file({"torch": good.float()}, str(f), metadata=meta)
    with pytest.raises(LeantuneError, match="torch.float32"):
        Trainer(run, log=quiet)
    save_file({"torch": good}, str(f), metadata={"python": json.dumps([3, [1, 2, 3], None])})
    with pytest.raises(LeantuneError, match="rng.safetensors: the RNG state does not fit"):
        Trainer(run, log=quiet)
    save_file({"torch": good}, str(f), metadata={"python": "[3, 4]"})
    with pytest.raises(LeantuneError, match="checkpoint is unreadable"):
        Trainer(run, log=quiet)


def test_resume_with_other_settings_is_refused_before_the_weights_load(run, monkeypatch):
    monkeypatch.setattr(trainer_mod, "load_model", lambda *a, **k: pytest.fail("weights read"))
    for change, flag in (({"lr": 5e-4}, "--lr 0.001, this command has 0.0005"),
                         ({"grad_accum": 2}, "--grad-accum 1, this command has 2"),
                         ({"lora_alpha": 3.0}, "--lora-alpha"),
                         ({"schedule": "constant"}, "--schedule")):
        with pytest.raises(LeantuneError, match=f"step-00000002: the run was started with {flag}"):
            Trainer(dataclasses.replace(run, **change), log=quiet)
    monkeypatch.undo()
    assert Trainer(run, log=quiet).train().steps == 4  # the same settings still resume
