"""Settings that make no sense for the model or the device are refused in one line before any
weight loads (train/preflight.py check_settings): --lora-targets experts on a dense model,
--lora-r above a targeted layer's width, --max-memory-gib where nothing reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, cli_error, tiny_ckpt, tiny_config  # noqa: F401

import leantune.train.trainer as trainer_mod
from leantune.errors import LeantuneError
from leantune.model.config import ModelConfig
from leantune.train.config import TrainConfig
from leantune.train.preflight import check_settings

FAST = ["--max-seq-len", "128", "--batch-size", "4", "--no-progress", "--device", "cpu"]


@pytest.fixture
def no_weights(monkeypatch):
    """The weight loader fails the test if it is called."""
    def load_model(*_a, **_k):
        raise AssertionError("the weights were loaded before the settings were checked")

    monkeypatch.setattr(trainer_mod, "load_model", load_model)


def refused(capsys, model, data, tmp_path, *extra) -> str:
    out = tmp_path / "run"
    msg = cli_error(capsys, "train", "--model", model, "--data", data, "--output", out,
                    "--max-steps", 1, *FAST, *extra)
    assert not out.exists()  # refused before the output folder was touched
    return msg


def test_experts_on_a_dense_model(tiny_ckpt, alpaca_file, tmp_path, capsys, no_weights):  # noqa: F811
    msg = refused(capsys, tiny_ckpt, alpaca_file, tmp_path, "--lora-targets", "q,experts")
    assert msg == (f"--lora-targets experts: {tiny_ckpt} is a dense model (llama, no "
                   "mixture-of-experts layers), so it has no experts; leave experts out of "
                   "--lora-targets")


def test_lora_rank_above_the_layer_width(tiny_ckpt, alpaca_file, tmp_path, capsys, no_weights):  # noqa: F811
    # the tiny model: hidden 32, 2 kv heads of 8: k_proj and v_proj are 32 -> 16
    msg = refused(capsys, tiny_ckpt, alpaca_file, tmp_path, "--lora-r", 17)
    assert msg.startswith("--lora-r 17 is above the width of k_proj (32 inputs, 16 outputs): "
                          "its LoRA update has rank at most 16")
    assert "use --lora-r 16 or less (or leave k out of --lora-targets)" in msg


def test_max_memory_gib_on_the_cpu(tiny_ckpt, alpaca_file, tmp_path, capsys, no_weights):  # noqa: F811
    msg = refused(capsys, tiny_ckpt, alpaca_file, tmp_path, "--lora-r", 4,
                  "--max-memory-gib", 8)
    assert msg.startswith("--max-memory-gib 8 budgets GPU memory, and this run is on the CPU")


def cfg(**kw):
    return TrainConfig(model="m", data="d", **kw)


def test_what_fits_passes():
    dense = ModelConfig.from_dict(tiny_config("llama").to_dict())  # hidden 48, k/v 48 -> 32
    check_settings(cfg(lora_r=32), dense, torch.device("cpu"))
    check_settings(cfg(lora_r=48, lora_targets="q,o"), dense, torch.device("cpu"))  # 48 -> 64
    with pytest.raises(LeantuneError, match="above the width of k_proj"):
        check_settings(cfg(lora_r=33), dense, torch.device("cpu"))
    check_settings(cfg(full=True), dense, torch.device("cpu"))  # (--full: no rank)
    moe = ModelConfig.from_dict(tiny_config("qwen3_moe").to_dict())  # experts: 48 <-> 24
    check_settings(cfg(lora_r=24, lora_targets="q,experts"), moe, torch.device("cpu"))
    with pytest.raises(LeantuneError, match="the experts' (gate_up|down)_proj .* leave experts"):
        check_settings(cfg(lora_r=25, lora_targets="q,experts"), moe, torch.device("cpu"))


def test_max_memory_gib_needs_the_auto_plan():
    dense = ModelConfig.from_dict(tiny_config("llama").to_dict())
    meta_cuda = torch.device("cuda")  # (only its type is read)
    check_settings(cfg(lora_r=4, max_memory_gib=8), dense, meta_cuda)
    with pytest.raises(LeantuneError, match="--activations recompute"):
        check_settings(cfg(lora_r=4, max_memory_gib=8, activations="recompute"), dense,
                       meta_cuda)


@pytest.mark.parametrize("where", [".", "checkpoints/step-00000002", "merged"])
@pytest.mark.parametrize("flag", ["adapter", "model"])
def test_inputs_inside_what_the_output_writes_are_refused(tmp_path, monkeypatch, flag, where):
    """--adapter / --model that is the output folder, or inside its checkpoints/ or merged/:
    --overwrite would set it aside and delete it, a resume would read the new run's files as the
    old input. Refused in one line before anything is written."""
    from leantune.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run" / where).mkdir(parents=True, exist_ok=True)
    given = str(Path("run") / where)
    def config(**kw):
        return TrainConfig(**{"model": "m", "data": "d.jsonl", "output": "run", **kw})

    cfg = config(**{flag: given})
    if flag == "model" and where == ".":  # (refused by the trainer's output check: test_output)
        cfg.validate()
        return
    what = ("is the output folder" if where == "." else
            f"lies in the output folder's {where.split('/')[0]}/, which the run writes")
    with pytest.raises(LeantuneError, match=f"--{flag} .* {what} \\(run\\)"):
        cfg.validate()
    # beside the output, or the output inside the input folder: fine here
    (tmp_path / "sft").mkdir()
    config(**{flag: "sft"}).validate()
    config(output="sft/dpo", **{flag: "sft"}).validate()
