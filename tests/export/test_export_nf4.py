"""Export from a 4-bit (bnb-4bit) base: the merged 16-bit model is the dequantised base plus the
LoRA term (what the adapter was trained on), or, with --merge-onto, the 16-bit original plus the
LoRA term; GGUF exports read the same merged weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import (EOS_TEMPLATE, cli_error, load_hf, make_tokenizer, max_abs,
                     one_torch_thread,  # noqa: F401  (autouse)
                     randomize_, save_bnb_checkpoint, save_random_adapter, tiny_config)

import leantune
from leantune import LeantuneError, export_merged
from leantune.lora import load_adapter


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """(16-bit base, its bnb-4bit copy, an adapter trained on the 4-bit one, that NF4 model with
    the adapter): a tiny Llama with a tokenizer (the GGUF writer needs one)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qlora_export")
    tok = make_tokenizer(EOS_TEMPLATE)
    cfg = tiny_config("llama")
    cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size = len(tok), 64, 128
    hf = AutoModelForCausalLM.from_config(cfg).float()
    randomize_(hf, seed=5, std=0.05)
    hf.save_pretrained(root / "base16")
    tok.save_pretrained(root / "base16")
    bnb = save_bnb_checkpoint(root / "base16", root / "bnb")
    model = save_random_adapter(bnb, root / "adapter", seed=6)
    assert model.layers[0].mlp.up_proj.nf4 is not None
    return root / "base16", bnb, root / "adapter", model


@pytest.fixture(scope="module")
def ids(qlora):
    return torch.randint(0, qlora[3].config.vocab_size, (2, 10),
                         generator=torch.Generator().manual_seed(2))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_merged_export_of_a_4bit_base_is_the_dequantised_base_plus_lora(qlora, ids, tmp_path):
    base16, bnb, adapter, model = qlora
    out = export_merged(bnb, adapter, tmp_path / "merged")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # a 16-bit checkpoint now
    merged = leantune.load_model(out, device="cpu")
    assert all(m.nf4 is None for m in merged.modules() if hasattr(m, "nf4"))
    ref = _logits(model, ids)
    assert max_abs(_logits(merged, ids), ref) < 1e-5
    assert max_abs(load_hf(out)(ids).logits, ref) < 1e-5  # transformers reads it as it is
    assert (out / "tokenizer.json").exists()


def test_merge_onto_the_16bit_original(qlora, ids, tmp_path):
    base16, bnb, adapter, model = qlora
    out = export_merged(bnb, adapter, tmp_path / "merged", merge_onto=base16)
    ref = leantune.load_model(base16, device="cpu")
    load_adapter(ref, adapter)
    merged = leantune.load_model(out, device="cpu")
    assert max_abs(_logits(merged, ids), _logits(ref.eval(), ids)) < 1e-5
    # not the dequantised base: the two merges differ by the 4-bit rounding
    assert max_abs(_logits(merged, ids), _logits(model, ids)) > 1e-3


def test_merge_onto_misuse_is_a_one_line_error(qlora, tmp_path, capsys):
    base16, bnb, adapter, _ = qlora
    with pytest.raises(LeantuneError, match="is a 16-bit checkpoint already"):
        export_merged(base16, adapter, tmp_path / "a", merge_onto=base16)
    with pytest.raises(LeantuneError, match="a quantised checkpoint; give the 16-bit original"):
        export_merged(bnb, adapter, tmp_path / "b", merge_onto=bnb)
    other = tmp_path / "other"
    cfg = json.loads((base16 / "config.json").read_text())
    from transformers import AutoModelForCausalLM, LlamaConfig

    AutoModelForCausalLM.from_config(LlamaConfig(**{**cfg, "intermediate_size": 192})) \
        .save_pretrained(other)
    capsys.readouterr()  # (transformers' progress bar)
    with pytest.raises(LeantuneError, match=r"down_proj.weight is of shape \(64, 192\) where "
                                            r".* has \(64, 128\); it is not the original"):
        export_merged(bnb, adapter, tmp_path / "c", merge_onto=other)
    for path in ("a", "b", "c"):
        assert not (tmp_path / path).exists()  # nothing written
    msg = cli_error(capsys, "export", "--model", bnb, "--adapter", adapter, "--output",
                    tmp_path / "d", "--format", "gguf-lora", "--merge-onto", base16)
    assert "--merge-onto applies to --format merged and gguf" in msg


def test_gguf_export_of_a_4bit_base_reads_the_merged_weights(qlora, tmp_path):
    gguf = pytest.importorskip("gguf")
    from leantune.export import export_gguf

    base16, bnb, adapter, _ = qlora
    merged = export_merged(bnb, adapter, tmp_path / "merged")
    pairs = [(export_gguf(bnb, adapter, tmp_path / "g4", quant="f32"),
              export_gguf(merged, None, tmp_path / "g16", quant="f32")),
             (export_gguf(bnb, adapter, tmp_path / "o4", quant="f32", merge_onto=base16),
              export_gguf(export_merged(bnb, adapter, tmp_path / "m2", merge_onto=base16), None,
                          tmp_path / "o16", quant="f32"))]
    for a, b in pairs:
        ta = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(a.gguf)).tensors}
        tb = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(b.gguf)).tensors}
        assert ta.keys() == tb.keys() and "blk.0.ffn_up.weight" in ta
        for name in ta:
            np.testing.assert_array_equal(ta[name], tb[name])


def test_cli_merge_onto(qlora, tmp_path, capsys):
    from helpers import run_cli

    base16, bnb, adapter, _ = qlora
    rc, out, _ = run_cli(capsys, "export", "--model", bnb, "--adapter", adapter, "--output",
                         tmp_path / "m", "--merge-onto", base16)
    assert rc == 0 and "merged checkpoint written" in out
    msg = cli_error(capsys, "export", "--model", base16, "--adapter", adapter, "--output",
                    tmp_path / "n", "--merge-onto", base16)
    assert "--merge-onto names the 16-bit original of a 4-bit (bnb-4bit) --model" in msg
