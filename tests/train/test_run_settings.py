"""How a run executes travels with it: the engine options (from TrainConfig, YAML and flags,
environment overrides for benchmarks) are saved in run_config.json and every checkpoint, and a
setup the fused layers cannot take says so once."""

from __future__ import annotations

import json

import pytest
from helpers import alpaca_file, one_torch_thread, tiny_ckpt  # noqa: F401  (fixtures)

from leantune.engine import Engine, FusedExecutor
from leantune.errors import LeantuneError
from leantune.train.config import TrainConfig
from leantune.train.trainer import Trainer


def _cfg(tiny_ckpt, alpaca_file, out, **kw):  # noqa: F811
    base = dict(model=str(tiny_ckpt), data=str(alpaca_file), output=str(out), max_seq_len=64,
                batch_size=2, lora_r=4, lora_alpha=8.0, device="cpu", dtype="float32",
                progress=False, max_steps=2, save_every=1)
    return TrainConfig(**{**base, **kw})


def test_engine_options_are_saved_with_the_run(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    cfg = _cfg(tiny_ckpt, alpaca_file, tmp_path / "run", activations="recompute",
               mlp_chunk_mib=1.5, attention="flash", kernels="reference")
    trainer = Trainer(cfg, log=lambda *a: None)
    assert {type(layer.executor) for layer in trainer.model.layers} == {FusedExecutor}
    trainer.train()
    saved = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert saved["engine_options"]["mlp_chunk_mib"] == 1.5
    assert saved["engine_options"]["attention"] == "flash"
    assert saved["config"]["activations"] == "recompute"
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step-*/state.json")).read_text())
    assert state["engine_options"] == saved["engine_options"]


def test_environment_overrides_are_named(tiny_ckpt, alpaca_file, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("LEANTUNE_PACK_ALIGN", "8")
    lines = []
    trainer = Trainer(_cfg(tiny_ckpt, alpaca_file, tmp_path / "run"), log=lines.append)
    assert trainer.engine_options.pack_align == 8
    assert any(line == "engine options from the environment: pack_align=8" for line in lines)
    monkeypatch.setenv("LEANTUNE_MLP_CHUNK_MIB", "lots")
    with pytest.raises(LeantuneError, match="LEANTUNE_MLP_CHUNK_MIB='lots' is not a valid float"):
        Trainer(_cfg(tiny_ckpt, alpaca_file, tmp_path / "run2"), log=lines.append)


def test_bad_engine_options_are_one_line_errors(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    for kw, msg in (({"attention": "cudnn"}, "--attention must be one of auto, flash, sdpa"),
                    ({"kernels": "fast"}, "--kernels must be one of auto, triton, reference"),
                    ({"mlp_chunk_mib": 0.0}, "--mlp-chunk-mib must be positive"),
                    ({"link_gbs": float("nan")}, "--link-gbs must be positive")):
        with pytest.raises(LeantuneError, match=msg):
            _cfg(tiny_ckpt, alpaca_file, tmp_path / "x", **kw).validate()


def test_a_setup_off_the_fused_path_says_so_once(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    lines = []
    trainer = Trainer(_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", lora_dropout=0.05,
                           activations="recompute"), log=lines.append)
    notes = [line for line in lines if "not leantune's fused layers" in line]
    assert len(notes) == 1 and "(LoRA dropout)" in notes[0]
    assert "use --lora-dropout 0 for the fused path" in notes[0]
    assert {type(layer.executor).__name__ for layer in trainer.model.layers} == {
        "CheckpointExecutor"}
    lines.clear()
    Trainer(_cfg(tiny_ckpt, alpaca_file, tmp_path / "run2", activations="recompute"),
            log=lines.append)
    assert not [line for line in lines if "not leantune's fused layers" in line]
    assert Engine().fused_unsupported(trainer.model) == "LoRA dropout"
