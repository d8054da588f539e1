"""Serving-ready outputs: a merged export's generation_config.json lists every stop id, and the
vLLM line (with its rank warning) for a LoRA adapter."""

from __future__ import annotations

import json

from helpers import (
    CHATML_SPECIALS,
    CHATML_TEMPLATE,
    make_tokenizer,
    one_torch_thread,  # noqa: F401  (autouse)
    save_tiny_checkpoint,
)
from transformers import GenerationConfig

from leantune import export_merged
from leantune.export.serving import vllm_lora_lines


def _chatml_base(folder):
    tok = make_tokenizer(CHATML_TEMPLATE, extra_specials=CHATML_SPECIALS)
    save_tiny_checkpoint(folder, tok)
    return tok


def test_generation_config_lists_the_turn_end(tmp_path):
    """A base without generation_config.json whose template ends turns with <|im_end|> (not
    its EOS): the export gets one with both ids, which transformers reads."""
    tok = _chatml_base(tmp_path / "base")
    (tmp_path / "base" / "generation_config.json").unlink()
    out = export_merged(tmp_path / "base", None, tmp_path / "out")
    gen = json.loads((out / "generation_config.json").read_text())
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert gen["eos_token_id"] == [tok.eos_token_id, im_end]
    assert gen["bos_token_id"] == tok.bos_token_id and gen["pad_token_id"] == tok.pad_token_id
    assert GenerationConfig.from_pretrained(out).eos_token_id == [tok.eos_token_id, im_end]
    assert (out / "chat_template.jinja").read_text() == CHATML_TEMPLATE
    assert (out / "tokenizer.json").is_file()


def test_generation_config_keeps_the_bases_sampling(tmp_path):
    tok = _chatml_base(tmp_path / "base")
    base_gen = {"eos_token_id": tok.eos_token_id, "temperature": 0.6, "top_p": 0.9,
                "do_sample": True}
    (tmp_path / "base" / "generation_config.json").write_text(json.dumps(base_gen))
    out = export_merged(tmp_path / "base", None, tmp_path / "out")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {**base_gen, "eos_token_id": [tok.eos_token_id,
                                                tok.convert_tokens_to_ids("<|im_end|>")]}


def test_vllm_lines():
    assert vllm_lora_lines("org/base", "runs/my-run", 16) == [
        "serve it with vLLM: vllm serve org/base --enable-lora --lora-modules "
        "my-run=runs/my-run --max-lora-rank 16"]
    warn, serve = vllm_lora_lines("org/base", "runs/a", 4)
    assert warn.startswith("warning:") and "rank 4" in warn and serve.endswith("--max-lora-rank 8")
    too_big = vllm_lora_lines("org/base", "runs/a", 1024)
    assert len(too_big) == 1 and "above the largest rank vLLM serves" in too_big[0]
    assert "leantune export --model org/base --adapter runs/a" in too_big[0]
