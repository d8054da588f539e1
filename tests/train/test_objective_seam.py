"""The training objective is a seam of the trainer (train/objectives, train/runner.py).

(a) SFT through the seam trains exactly as the trainer did before the split: the CPU fp32 loss
    curve (loss, gradient norm, learning rate, eval loss per step) and the trained weights are
    bit-identical to those recorded from commit fd9c0ae (sft_curve_fd9c0ae.json: `sft_curves`
    below, run against that commit's code, whose public API it alone uses).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, read_metrics, tiny_ckpt  # noqa: F401  (fixtures)

from leantune.train.config import TrainConfig
from leantune.train.trainer import Trainer

RECORDED = Path(__file__).with_name("sft_curve_fd9c0ae.json")
# what a logged step records that depends only on the arithmetic (not on the clock or memory)
CURVE_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_seen", "eval_loss")

RUNS = {
    # LoRA, two micro-batches a step (exact accumulation), clipping, evaluation every 3 steps
    "lora": dict(grad_accum=2, lora_r=4, lora_alpha=8.0, max_steps=6, eval_every=3,
                 eval_fraction=0.1, max_grad_norm=0.5),
    # full fine-tuning, weight decay, a linear schedule
    "full": dict(full=True, max_steps=4, weight_decay=0.01, schedule="linear"),
}


def quiet(*_a, **_kw):
    pass


def weights_digest(files) -> str:
    """sha256 over the tensors of safetensors files (names, dtypes, shapes, bytes), ignoring
    their metadata (which names the base model's folder)."""
    from safetensors.torch import load_file

    h = hashlib.sha256()
    tensors = {}
    for path in files:
        tensors.update(load_file(str(path)))
    assert tensors
    for name, t in sorted(tensors.items()):
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sft_curves(model, data, root: Path) -> dict:
    """Each run of RUNS: its metrics records (CURVE_KEYS only) and the digest of its result."""
    out = {}
    for name, kw in RUNS.items():
        run = root / name
        cfg = TrainConfig(model=str(model), data=str(data), output=str(run), max_seq_len=64,
                          batch_size=2, lr=1e-3, warmup_steps=2, device="cpu", dtype="float32",
                          progress=False, seed=42, **kw)
        Trainer(cfg, log=quiet).train()
        records = [{k: r[k] for k in CURVE_KEYS if k in r} for r in read_metrics(run)]
        result = sorted(run.glob("model*.safetensors" if kw.get("full") else
                                 "adapter_model.safetensors"))
        out[name] = {"records": records, "weights": weights_digest(result)}
    return out


def test_sft_curve_is_bit_identical_to_the_pre_split_trainer(tiny_ckpt, alpaca_file,  # noqa: F811
                                                              tmp_path):
    want = json.loads(RECORDED.read_text())
    got = sft_curves(tiny_ckpt, alpaca_file, tmp_path)
    for name in RUNS:
        assert [r["step"] for r in got[name]["records"]] == [r["step"] for r in
                                                              want[name]["records"]]
        assert got[name]["records"] == want[name]["records"]  # floats compared exactly
        assert got[name]["weights"] == want[name]["weights"]
    # teeth: the runs trained (the loss moved) and evaluated
    lora = want["lora"]["records"]
    assert sum("eval_loss" in r for r in lora) >= 2 and lora[1]["loss"] != lora[-2]["loss"]
