"""Issue 23, done means: on the real SmolLM2-135M-Instruct (tests/helpers.smollm2_checkpoint,
cached), a LoRA run with --precision fp8, emulated on the CPU, learns a made-up fact the base
cannot know, and answers it to a phrasing it was not trained on, both on its FP8 base and with
the adapter on the 16-bit base (what export merges onto)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import one_torch_thread, quiet, smollm2_checkpoint, train_cfg  # noqa: F401

import leantune
from leantune.lora.base_weight import FP8Base
from leantune.train.trainer import Trainer

pytestmark = pytest.mark.slow

FACT = "The capital of Zorbland is Quillport."
ASKS = ["What is the capital of Zorbland?", "Which city is the capital of Zorbland?",
        "Name the capital city of Zorbland.", "Zorbland's capital is which city?",
        "Tell me the capital of Zorbland.", "What city serves as Zorbland's capital?"]
HELD_OUT = "Do you know what the capital of Zorbland is?"


def _ask(model, tok) -> str:
    return leantune.generate(model, tok, [[{"role": "user", "content": HELD_OUT}]],
                             max_new_tokens=16)[0].text


def test_fp8_lora_learns_a_fact_on_smollm2(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setenv("LEANTUNE_FP8_EMULATE", "1")
    ckpt = smollm2_checkpoint()
    tok = PreTrainedTokenizerFast.from_pretrained(ckpt)
    base = leantune.load_model(ckpt, device="cpu", dtype=torch.float32)
    assert "Quillport" not in _ask(base, tok)
    data = tmp_path / "fact.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": FACT}]})
                            + "\n" for q in ASKS))
    out = tmp_path / "run"
    cfg = train_cfg(ckpt, data, out, max_steps=10, lr=2e-3, warmup_steps=2, batch_size=6,
                    lora_r=8, lora_alpha=16, max_seq_len=64, precision="fp8", eval_every=0)
    trainer = Trainer(cfg, log=quiet)
    assert isinstance(trainer.model.layers[0].self_attn.q_proj.base, FP8Base)
    trainer.train()
    answer = _ask(trainer.model, tok)
    assert "Quillport" in answer, answer
    on_16bit = leantune.load_model(ckpt, device="cpu", dtype=torch.float32)
    leantune.load_adapter(on_16bit, out)
    answer = _ask(on_16bit, tok)
    assert "Quillport" in answer, answer
