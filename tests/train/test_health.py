"""A run that stops learning is told (train/health.py StallWatch), and a NaN caused by
--weight-decay names it instead of --lr: real tiny CPU runs through the CLI."""

from __future__ import annotations

import json

import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_rows, cli_error, read_metrics, run_cli, tiny_ckpt, write_jsonl  # noqa: F401

from leantune.train.config import TrainConfig
from leantune.train.health import STALL_STEPS, StallWatch, diverged_advice

FAST = ["--max-seq-len", "128", "--batch-size", "2", "--lora-r", "4", "--no-progress",
        "--device", "cpu"]


def train(model, data, out, *extra):
    return ["train", "--model", model, "--data", data, "--output", out, *FAST, *extra]


def test_a_gradient_norm_stuck_at_zero_stops_the_run(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    """--lora-alpha 1e-45 scales the adapter by ~1e-46, 0 in float32: no gradient reaches it,
    while the loss moves from batch to batch. Without the watch the run says "done"."""
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_rows(40))
    out = tmp_path / "run"
    msg = cli_error(capsys, *train(tiny_ckpt, data, out, "--max-steps", 20, "--lora-alpha",
                                   "1e-45"))
    assert msg.startswith(f"steps 1-{STALL_STEPS}: the gradient norm was exactly 0 while the "
                          "loss stayed at ")
    assert "training stopped learning and was stopped (no final adapter was written" in msg
    assert "--lora-alpha 1e-45 scales the adapter by 2.5e-46" in msg
    records = [r for r in read_metrics(out) if "grad_norm" in r]
    assert [r["step"] for r in records] == list(range(1, STALL_STEPS + 1))  # stopped at once
    assert all(r["grad_norm"] == 0 for r in records)
    assert not (out / "adapter_model.safetensors").exists()


def test_a_loss_flat_to_the_last_digit_warns_once(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    """One document, so every step sees the same batch, and --lr 1e-30, too small to change a
    float32 weight: the loss repeats bit for bit. The run finishes, saying so once."""
    data = write_jsonl(tmp_path / "one.jsonl", alpaca_rows(1))
    rc, out, err = run_cli(capsys, *train(tiny_ckpt, data, tmp_path / "run", "--max-steps", 8,
                                          "--batch-size", 1, "--lr", "1e-30"))
    assert rc == 0, err
    warnings = [line for line in out.splitlines() if line.startswith("warning: steps")]
    assert len(warnings) == 1, out
    assert warnings[0].startswith(f"warning: steps 1-{STALL_STEPS}: the loss was ")
    assert warnings[0].endswith("to the last digit each step: the weights are not changing; "
                                "--lr 1e-30 is too small to move them (1e-4 to 2e-4 are usual "
                                "for LoRA, 1e-5 for --full)")
    losses = {r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r}
    assert len(losses) == 1  # (what the warning says)


def test_a_healthy_run_says_nothing(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_rows(40))
    rc, out, err = run_cli(capsys, *train(tiny_ckpt, data, tmp_path / "run", "--max-steps",
                                          STALL_STEPS + 2))
    assert rc == 0, err
    assert "warning: steps" not in out and "note: step" not in out


def test_a_nan_from_weight_decay_names_weight_decay_not_lr(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    """AdamW scales the weights by 1 - lr x wd = -999 a step: they overflow within ~15 steps,
    whatever the (ordinary) learning rate."""
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_rows(40))
    msg = cli_error(capsys, *train(tiny_ckpt, data, tmp_path / "run", "--max-steps", 40,
                                   "--warmup-steps", 0, "--schedule", "constant", "--lr", "1e-3",
                                   "--weight-decay", "1e6"))
    assert "training diverged and stopped" in msg
    assert ("--weight-decay 1e+06 is far too high: each step scales the weights by 1 - lr x "
            "weight decay = -999") in msg
    assert "--lr" not in msg


def test_diverged_advice_without_weight_decay_still_names_lr():
    assert diverged_advice(TrainConfig(lr=1e4, max_grad_norm=0)) == (
        "try a lower --lr (now 10000) or gradient clipping, --max-grad-norm 1.0")
    assert "--weight-decay 5 is also unusually high" in diverged_advice(
        TrainConfig(lr=1e-3, weight_decay=5))


def test_the_counters_follow_the_steps():
    """Device counters: consecutive zero norms and repeated losses, reset by any change."""
    w = StallWatch(torch.device("cpu"))
    seq = [(1.0, 0.0), (2.0, 0.0), (2.0, 0.0), (2.0, 1.0), (3.0, 0.0)]
    seen = []
    for loss, norm in seq:
        w.observe(torch.tensor(loss), torch.tensor(norm))
        w.seen(*(t.item() for t in w.tensors()))
        seen.append((w.zero_steps, w.flat_steps))
    assert seen == [(1, 1), (2, 1), (3, 2), (0, 3), (1, 1)]
    assert json.dumps(seen)  # (plain ints)
