"""A --resume reads the same inputs the run started with: other base weights, or training rows
edited in place (same count, same token total), are refused in one line before training on;
metrics.jsonl stays strict JSON (a NaN metric is written as null); NaN in the base weights is
named as such, not blamed on the learning rate."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import alpaca_file, alpaca_rows, one_torch_thread, tiny_ckpt, write_jsonl  # noqa: F401
from safetensors.torch import load_file, save_file

from leantune.errors import LeantuneError
from leantune.train.config import TrainConfig
from leantune.train.metrics import MetricsWriter
from leantune.train.trainer import Trainer
from leantune.utils.digest import content_digest


def _cfg(model, data, out, **kw):
    base = dict(model=str(model), data=str(data), output=str(out), max_seq_len=64, batch_size=2,
                lora_r=4, lora_alpha=8.0, device="cpu", dtype="float32", progress=False,
                max_steps=1, save_every=1)
    return TrainConfig(**{k: v for k, v in {**base, **kw}.items() if v is not None})  # None: unset


def test_resume_on_other_base_weights_is_refused(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    Trainer(_cfg(tiny_ckpt, alpaca_file, tmp_path / "run"), log=lambda *a: None).train()
    other = tmp_path / "other"
    shutil.copytree(tiny_ckpt, other)
    [weights] = other.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("norm.weight"))
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, weights)
    with pytest.raises(LeantuneError, match="the run was trained on .* other weights"):
        Trainer(_cfg(other, alpaca_file, tmp_path / "run", max_steps=2, resume=True),
                log=lambda *a: None)
    # the same base resumes
    Trainer(_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=2, resume=True),
            log=lambda *a: None).train()


def test_resume_on_rows_edited_in_place_is_refused(tiny_ckpt, tmp_path):  # noqa: F811
    rows = alpaca_rows(16)
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    Trainer(_cfg(tiny_ckpt, data, tmp_path / "run"), log=lambda *a: None).train()
    # one character of one answer swapped for another: same rows, same token count
    edited = [dict(r) for r in rows]
    text = edited[3]["output"]
    edited[3]["output"] = text[:-1] + ("a" if text[-1] != "a" else "b")
    write_jsonl(data, edited)
    logs = []
    with pytest.raises(LeantuneError, match=r"training data \(its rows, or the tokenizer or "
                                            r"chat template\) changed since the checkpoint "
                                            r"\(data_digest"):
        Trainer(_cfg(tiny_ckpt, data, tmp_path / "run", max_steps=2, resume=True),
                log=logs.append)
    assert not any("trainable parameters" in line for line in logs), logs  # before the weights


def test_content_digest_sees_content_not_where_it_was_read():
    from dataclasses import dataclass

    @dataclass
    class Row:
        prompt: list
        label: bool
        location: object = None

    a = content_digest([Row([1, 2, 3], True, "f:1")])
    assert a == content_digest([Row([1, 2, 3], True, "f:7")])
    assert a != content_digest([Row([1, 2, 4], True, "f:1")])
    assert a != content_digest([Row([1, 2, 3], False, "f:1")])
    assert content_digest([([1, 2], [3])]) != content_digest([([1], [2, 3])])
    assert content_digest([([2**70, 1],)]) != content_digest([([2**70, 2],)])  # past int64
    big = torch.arange(5000)
    edited = big.clone()
    edited[2500] = -1
    assert content_digest([(big,)]) != content_digest([(edited,)])  # (str() abbreviates)


def test_metrics_write_nan_as_null(tmp_path):
    w = MetricsWriter(tmp_path / "metrics.jsonl")
    w.write({"step": 1, "reward": float("nan"), "loss": 0.5, "x": float("inf")})
    w.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line) == {"step": 1, "reward": None, "loss": 0.5, "x": None}


@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_nan_in_the_base_weights_is_named_not_blamed_on_the_lr(
        tiny_ckpt, alpaca_file, tmp_path, full):  # noqa: F811
    """LoRA: the weight is frozen, read at the NaN. --full: it trains, and the first update has
    made every weight NaN by then: it is named from the sums taken before that step."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    [weights] = bad.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("layers.0.mlp.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, weights)
    with pytest.raises(LeantuneError, match=r"^step 1: .*the model's weight "
                                            r"model\.layers\.0\.mlp\.down_proj\.weight holds NaN "
                                            r"or infinite values before training changed it; "
                                            r"--model .* is damaged"):
        Trainer(_cfg(bad, alpaca_file, tmp_path / "run",
                     **({"full": True, "lora_r": None, "lora_alpha": None} if full else {})),
                log=lambda *a: None).train()
