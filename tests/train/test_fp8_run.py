"""--precision fp8 runs (emulated on the CPU: LEANTUNE_FP8_EMULATE=1): a LoRA on an FP8 base,
quantised while loading, lowers the loss like the 16-bit run; the run records its precision,
exports onto the 16-bit model, and fp8 without FP8 hardware or with what it cannot go with is
one line."""

from __future__ import annotations

import json

import pytest
from helpers import (FAST, alpaca_file, cli_error, one_torch_thread,  # noqa: F401
                     quiet, read_metrics, run_cli, tiny_ckpt, train_cfg)

from leantune.lora.base_weight import FP8Base
from leantune.train.trainer import Trainer


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv("LEANTUNE_FP8_EMULATE", "1")


def _losses(output):
    return [r["loss"] for r in read_metrics(output) if "loss" in r]


def test_lora_on_an_fp8_base_learns_like_the_16bit_run(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                       emulate):
    """Tiny Llama, seed 42, 40 steps at lr 5e-3: both runs lower the mean loss of the last 5
    steps by more than 0.1 below the first 5 steps', and the curves stay within 0.01 of each
    other at every step (measured: at most 1.0e-3, 2.5e-4 on average)."""
    curves = {}
    for precision in ("bf16", "fp8"):
        out = tmp_path / precision
        cfg = train_cfg(tiny_ckpt, alpaca_file, out, max_steps=40, lr=5e-3, warmup_steps=2,
                        batch_size=4, precision=precision)
        trainer = Trainer(cfg, log=quiet)
        up = trainer.model.layers[0].mlp.up_proj
        assert isinstance(up.base, FP8Base) == (precision == "fp8")
        trainer.train()
        curves[precision] = _losses(out)
    for losses in curves.values():
        assert sum(losses[:5]) / 5 - sum(losses[-5:]) / 5 > 0.1
    gaps = [abs(a - b) for a, b in zip(curves["bf16"], curves["fp8"])]
    assert len(gaps) == 40 and max(gaps) < 0.01, max(gaps)


def test_cli_fp8_trains_records_and_exports_onto_the_16bit_model(tiny_ckpt, alpaca_file,  # noqa: F811
                                                                 tmp_path, capsys, emulate):
    out = tmp_path / "run"
    rc, stdout, _ = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file,
                            "--output", out, "--max-steps", "2", "--precision", "fp8", *FAST)
    assert rc == 0 and "FP8: quantising the decoder's linear weights" in stdout
    assert "emulated in PyTorch, LEANTUNE_FP8_EMULATE: slow" in stdout  # (said, and recorded)
    settings = json.loads((out / "run_config.json").read_text())
    assert settings["config"]["precision"] == "fp8" and settings["fp8_emulated"] is True
    rc, _, _ = run_cli(capsys, "export", "--model", tiny_ckpt, "--adapter", out,
                       "--output", tmp_path / "merged")
    assert rc == 0 and (tmp_path / "merged" / "config.json").exists()


def test_fp8_refusals_are_one_line(tiny_ckpt, alpaca_file, tmp_path, capsys, monkeypatch):  # noqa: F811
    monkeypatch.delenv("LEANTUNE_FP8_EMULATE", raising=False)
    base = ["train", "--model", tiny_ckpt, "--data", alpaca_file, "--max-steps", "1",
            "--precision", "fp8", "--device", "cpu"]
    with monkeypatch.context() as m:  # refused before the data is read
        m.setattr(Trainer, "_setup_data", lambda *a: pytest.fail("the data was read first"))
        msg = cli_error(capsys, *base, "--output", tmp_path / "a")
    assert "no FP8 matrix units" in msg and "LEANTUNE_FP8_EMULATE=1" in msg
    msg = cli_error(capsys, *base, "--output", tmp_path / "b", "--load-in-4bit")
    assert "--precision fp8" in msg and "--load-in-4bit" in msg
    msg = cli_error(capsys, *base, "--output", tmp_path / "c", "--full")
    assert "--full trains every weight" in msg
    assert not any((tmp_path / d).exists() for d in "abc")


def test_resume_keeps_the_precision(tiny_ckpt, alpaca_file, tmp_path, capsys, emulate):  # noqa: F811
    out = tmp_path / "run"
    args = ["train", "--model", tiny_ckpt, "--data", alpaca_file, "--output", out, *FAST]
    assert run_cli(capsys, *args, "--max-steps", "2", "--precision", "fp8")[0] == 0
    msg = cli_error(capsys, *args, "--max-steps", "3", "--resume")
    assert "started with --precision fp8, this command has bf16" in msg
    rc, _, err = run_cli(capsys, *args, "--max-steps", "3", "--resume", "--precision", "fp8")
    assert rc == 0, err


def test_resume_without_fp8_units_names_what_resumes(tiny_ckpt, alpaca_file, tmp_path, capsys,  # noqa: F811
                                                     monkeypatch, emulate):
    """An fp8 run resumed where FP8 cannot run: the refusal does not advise --precision bf16
    (which the resume check would then refuse), but an FP8 GPU or the emulation."""
    out = tmp_path / "run"
    args = ["train", "--model", tiny_ckpt, "--data", alpaca_file, "--output", out, *FAST]
    assert run_cli(capsys, *args, "--max-steps", "2", "--precision", "fp8")[0] == 0
    monkeypatch.delenv("LEANTUNE_FP8_EMULATE")
    msg = cli_error(capsys, *args, "--max-steps", "3", "--resume", "--precision", "fp8")
    assert "no FP8 matrix units" in msg and "resumes only with it" in msg
    assert "LEANTUNE_FP8_EMULATE=1" in msg and "use --precision bf16" not in msg
    msg = cli_error(capsys, *args, "--max-steps", "3", "--precision", "fp8", "--overwrite")
    assert "use --precision bf16" in msg  # (a new run may still change precision)


def test_load_model_refuses_what_the_cli_refuses(tiny_ckpt, monkeypatch):  # noqa: F811
    """The Python API checks `precision` as the CLI does: an unknown value, fp8 with
    load_in_4bit, and fp8 on a device without FP8 matrix units (not emulating) are one line
    each, not a model loaded some other way."""
    import leantune
    from leantune.errors import LeantuneError

    for bad in ("FP8", "fp16"):
        with pytest.raises(LeantuneError, match=r"precision must be one of bf16, fp8, got"):
            leantune.load_model(tiny_ckpt, device="cpu", precision=bad)
    with pytest.raises(LeantuneError, match="pass one of them"):
        leantune.load_model(tiny_ckpt, device="cpu", precision="fp8", load_in_4bit=True)
    monkeypatch.delenv("LEANTUNE_FP8_EMULATE", raising=False)
    with pytest.raises(LeantuneError, match="--precision fp8: cpu: no FP8 matrix units"):
        leantune.load_model(tiny_ckpt, device="cpu", precision="fp8")
    monkeypatch.setenv("LEANTUNE_FP8_EMULATE", "1")
    model = leantune.load_model(tiny_ckpt, device="cpu", precision="fp8")
    assert any(isinstance(getattr(m, "base", None), FP8Base) for m in model.modules())
