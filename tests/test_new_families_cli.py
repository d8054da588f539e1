"""A newcomer's path with each new family: a tiny Gemma 2, Gemma 3 (multimodal checkpoint) and
Phi-3 checkpoint through `leantune train` (LoRA on every projection, the fused layers), `export`
merged and GGUF, and `generate` with the adapter."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import alpaca_file, make_tokenizer, one_torch_thread, randomize_  # noqa: F401

from leantune.cli import main

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
    "else m['role'] %}<start_of_turn>{{ role }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def _checkpoint(name, folder):
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3Config,
                              Gemma3ForConditionalGeneration, Phi3Config)

    tok = make_tokenizer(GEMMA_TEMPLATE, extra_specials=("<start_of_turn>", "<end_of_turn>"))
    base = dict(vocab_size=len(tok) + 3, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "gemma2":
        hf = AutoModelForCausalLM.from_config(Gemma2Config(
            **base, head_dim=16, query_pre_attn_scalar=16, sliding_window=16))
    elif name == "gemma3":
        hf = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=dict(base, head_dim=16, query_pre_attn_scalar=16, sliding_window=16),
            vision_config={"model_type": "siglip_vision_model", "hidden_size": 32,
                           "intermediate_size": 40, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
            mm_tokens_per_image=4, image_token_index=len(tok) + 2,
            boi_token_index=len(tok), eoi_token_index=len(tok) + 1))
    else:
        hf = AutoModelForCausalLM.from_config(Phi3Config(**base, partial_rotary_factor=0.75))
    randomize_(hf.float(), seed=0)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_train_export_generate(name, alpaca_file, tmp_path, capsys):  # noqa: F811
    ckpt = _checkpoint(name, tmp_path / "base")
    run = tmp_path / "run"
    rc = main(["train", "--model", str(ckpt), "--data", str(alpaca_file), "--output", str(run),
               "--max-steps", "2", "--max-seq-len", "96", "--batch-size", "2", "--no-progress",
               "--device", "cpu", "--lora-r", "4"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert (run / "adapter_model.safetensors").is_file()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(torch.isfinite(torch.tensor(m["loss"])) for m in metrics if "loss" in m)
    rc = main(["export", "--model", str(ckpt), "--adapter", str(run), "--output",
               str(tmp_path / "merged")])
    assert rc == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["model_type"] == name
    rc = main(["export", "--model", str(ckpt), "--adapter", str(run), "--output",
               str(tmp_path / "gguf"), "--format", "gguf", "--quant", "q8_0"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert (tmp_path / "gguf" / "model-q8_0.gguf").is_file()
    rc = main(["generate", "--model", str(ckpt), "--adapter", str(run), "--prompt", "hello",
               "--max-new-tokens", "4", "--device", "cpu"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
