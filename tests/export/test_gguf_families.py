"""GGUF export of Gemma 2, Gemma 3 (text, and a multimodal checkpoint's language model) and
Phi-3: llama.cpp's architectures, tensor names by role (Gemma's post_attention_layernorm is its
attention-out norm), (1 + w) norms stored as 1 + w, Phi-3's fused qkv / gate-up and LongRoPE
factors, the metadata llama.cpp reads (soft-caps, windows, rotary dims); the Ollama template of
Gemma's and Phi's turn formats, and their stop tokens in the merged export's
generation_config.json. transformers reads the Phi-3 GGUF back with the merged model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_tokenizer, max_abs, one_torch_thread, randomize_, \
    save_random_adapter  # noqa: F401  (autouse)

gguf = pytest.importorskip("gguf")

from leantune.export import export_gguf, export_merged  # noqa: E402
from leantune.export.gguf.modelfile import modelfile_text, template_style  # noqa: E402
from leantune.export.merge import MergedWeights  # noqa: E402

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
    "else m['role'] %}<start_of_turn>{{ role }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _config(name: str, vocab: int):
    from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig, Phi3Config

    base = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "gemma2":
        return Gemma2Config(**base, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                            attn_logit_softcapping=20.0, final_logit_softcapping=15.0)
    text = dict(base, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"])
    if name == "gemma3_text":
        return Gemma3TextConfig(**text)
    if name == "gemma3":
        vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 40,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                  "patch_size": 14}
        return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                            image_token_index=vocab - 1, boi_token_index=vocab - 3,
                            eoi_token_index=vocab - 2)
    if name == "phi3_longrope":
        return Phi3Config(**base, partial_rotary_factor=0.75, original_max_position_embeddings=32,
                          rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.5, 2.0, 1.2, 3.0, 1.1],
            "long_factor": [2.0, 4.0, 1.5, 6.0, 3.0, 8.0],
            "original_max_position_embeddings": 32})
    return Phi3Config(**base)  # phi3


def _checkpoint(name: str, folder: Path) -> Path:
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    if name.startswith("gemma"):
        tok = make_tokenizer(GEMMA_TEMPLATE, extra_specials=("<start_of_turn>", "<end_of_turn>"))
    else:
        tok = make_tokenizer(PHI3_TEMPLATE)
    cfg = _config(name, len(tok) + 3)
    hf = (Gemma3ForConditionalGeneration(cfg) if name == "gemma3"
          else AutoModelForCausalLM.from_config(cfg, attn_implementation="eager"))
    randomize_(hf.float().eval(), seed=3)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf_families")


def _export(root, name):
    base = _checkpoint(name, root / name / "base")
    save_random_adapter(base, root / name / "adapter", seed=1)
    out = export_gguf(base, root / name / "adapter", root / name / "gguf", quant="f32")
    return base, out, gguf.GGUFReader(str(out.gguf))


def _tensors(reader) -> dict[str, torch.Tensor]:
    return {t.name: torch.from_numpy(np.array(t.data, np.float32)).reshape(
        tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}


def _field(reader, key):
    return reader.fields[key].contents()


@pytest.mark.parametrize("name, arch", [("gemma2", "gemma2"), ("gemma3_text", "gemma3"),
                                        ("gemma3", "gemma3"), ("phi3_longrope", "phi3")])
def test_gguf_tensors_and_metadata(root, name, arch):
    base, out, reader = _export(root, name)
    assert _field(reader, "general.architecture") == arch
    got = _tensors(reader)
    w = MergedWeights(base, root / name / "adapter")
    cfg = w.config
    lm = {k.split("model.", 2)[-1] if "language_model" in k else k[len("model."):]: k
          for k in w.names()}
    if arch.startswith("gemma"):
        # roles: attn_in, attn_out, mlp_in, mlp_out; stored as 1 + w
        for gname, module in [("attn_norm", "input_layernorm"),
                              ("post_attention_norm", "post_attention_layernorm"),
                              ("ffn_norm", "pre_feedforward_layernorm"),
                              ("post_ffw_norm", "post_feedforward_layernorm")]:
            want = w.tensor(lm[f"layers.1.{module}.weight"], torch.float32) + 1
            assert torch.equal(got[f"blk.1.{gname}.weight"], want)
        q = w.tensor(lm["layers.0.self_attn.q_proj.weight"], torch.float32)
        assert torch.equal(got["blk.0.attn_q.weight"], q)  # no llama row permutation
        assert "output.weight" not in got  # tied
        assert _field(reader, f"{arch}.attention.sliding_window") == 8
        assert not any("vision" in t or "mm" in t for t in got)
    if arch == "gemma2":
        assert _field(reader, "gemma2.attn_logit_softcapping") == pytest.approx(20.0)
        assert _field(reader, "gemma2.final_logit_softcapping") == pytest.approx(15.0)
    if arch == "phi3":
        assert torch.equal(got["blk.0.attn_qkv.weight"],
                           w.tensor("model.layers.0.self_attn.qkv_proj.weight", torch.float32))
        assert got["blk.0.ffn_up.weight"].shape == (2 * cfg.intermediate_size, cfg.hidden_size)
        assert _field(reader, "phi3.rope.dimension_count") == 12
        assert got["rope_factors_long.weight"].tolist() == [2.0, 4.0, 1.5, 6.0, 3.0, 8.0]
        assert _field(reader, "phi3.rope.scaling.original_context_length") == 32
    if name == "gemma3":
        assert any("vision" in m for m in out.warnings)


def test_transformers_reads_the_phi3_gguf(root, tmp_path):
    from transformers import AutoModelForCausalLM

    base, out, _ = _export(root, "phi3")
    export_merged(base, root / "phi3" / "adapter", tmp_path / "merged", log=lambda *a: None)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    back = AutoModelForCausalLM.from_pretrained(out.gguf.parent, gguf_file=out.gguf.name,
                                                dtype=torch.float32)
    ids = torch.randint(3, 300, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_abs(back(ids).logits, merged.eval()(ids).logits) < 1e-4


def test_gemma_and_phi_turn_formats_in_the_modelfile():
    assert template_style(GEMMA_TEMPLATE) == "gemma"
    assert template_style(PHI3_TEMPLATE) == "phi3"
    assert template_style("<|im_start|>{{ r }}<|im_sep|>") == "phi4"
    text, warnings = modelfile_text("model-f16.gguf", GEMMA_TEMPLATE, ["<end_of_turn>"],
                                    eos="<eos>", system="Be brief.")
    assert not warnings
    assert "<start_of_turn>user" in text and text.count("<start_of_turn>model") == 2
    assert 'PARAMETER stop "<end_of_turn>"' in text and 'SYSTEM ' in text
    text, warnings = modelfile_text("model-f16.gguf", PHI3_TEMPLATE, ["<|end|>"])
    assert not warnings and "<|assistant|>" in text and 'PARAMETER stop "<|end|>"' in text


def test_the_gemma_modelfile_and_stop_tokens(root, tmp_path):
    base = _checkpoint("gemma3_text", tmp_path / "base")
    out = export_gguf(base, None, tmp_path / "gguf", quant="f16")
    text = out.modelfile.read_text()
    assert "TEMPLATE" in text and "<end_of_turn>" in text
    export_merged(base, None, tmp_path / "merged", log=lambda *a: None)
    gen = json.loads((tmp_path / "merged" / "generation_config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    assert tok.convert_tokens_to_ids("<end_of_turn>") in gen["eos_token_id"]


def test_window_warning_follows_llama_cpp_patterns():
    """llama.cpp slides the window on gemma2's even layers and on five of every six gemma3
    layers, and on no phi3 / llama layer: the export warns only where that differs."""
    from types import SimpleNamespace

    from leantune.export.gguf.writer import window_warning

    def cfg(pattern, window=8, ctx=128):
        return SimpleNamespace(sliding_window=window, max_position_embeddings=ctx,
                               num_hidden_layers=len(pattern),
                               window_for_layer=lambda i: window if pattern[i] else None)

    assert window_warning(cfg([1, 0, 1, 0]), "gemma2") is None
    assert window_warning(cfg([1, 1, 1, 1, 1, 0, 1]), "gemma3") is None
    assert "i % 6 < 5" in window_warning(cfg([1, 0, 1, 1]), "gemma3")
    assert "i % 2 < 1" in window_warning(cfg([0, 1]), "gemma2")
    assert "whole context" in window_warning(cfg([1, 1]), "phi3")
    assert "whole context" in window_warning(cfg([1, 1]), "llama")
    assert window_warning(cfg([1, 1], window=128), "llama") is None  # the window spans it all
    assert window_warning(cfg([1, 1], window=None), "phi3") is None


def test_gemma2_export_does_not_warn_about_its_window(root):
    base = _checkpoint("gemma2", root / "g2w" / "base")
    out = export_gguf(base, None, root / "g2w" / "gguf", quant="f32")
    assert not any("window" in w for w in out.warnings), out.warnings
