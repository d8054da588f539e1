"""Merged export of mixture-of-experts models: experts merged (W_e + scaling * B_e @ A_e) in the
base checkpoint's own expert layout (per expert, stacked, MXFP4 written dequantised), which
transformers loads to the fine-tuned model's logits."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    load_hf,
    logits_of,
    max_abs,
    one_torch_thread,  # noqa: F401  (autouse)
    save_checkpoint,
    save_mxfp4_gpt_oss,
    save_random_adapter,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from leantune import LeantuneError, export_merged

TOL = 1e-4



def _ids():
    return torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(8))


def _keys(folder) -> set[str]:
    out = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            out |= set(sf.keys())
    return out


def _base(family, layout, folder):
    if layout == "mxfp4":
        save_mxfp4_gpt_oss(folder, seed=60)
    else:
        save_checkpoint(family, folder, seed=60,
                        **({"save_original_format": False} if layout == "stacked" else {}))
    return folder


def _load_merged(folder):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    if "quantization_config" in json.loads((folder / "config.json").read_text()):
        return AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
            attn_implementation="eager").eval()
    return load_hf(folder)


CASES = [("qwen3_moe", "per_expert"), ("qwen3_moe", "stacked"), ("mixtral", "per_expert"),
         ("mixtral", "stacked"), ("gpt_oss", "stacked"), ("gpt_oss", "mxfp4")]


@pytest.mark.parametrize("family, layout", CASES)
def test_merged_experts_load_in_transformers(tmp_path, family, layout):
    base = _base(family, layout, tmp_path / "base")
    targets = "q,k,v,o,experts" if family == "qwen3_moe" else "q,k,v,o,gate,up,down,experts"
    model = save_random_adapter(base, tmp_path / "adapter", seed=61, targets=targets)
    ids = _ids()
    want = logits_of(model, ids)
    assert max_abs(want, logits_of(_load_merged(base), ids)) > 1e-2  # the adapter shows
    out = export_merged(base, tmp_path / "adapter", tmp_path / "merged", max_shard_bytes=50_000)
    keys, base_keys = _keys(out), _keys(base)
    config = json.loads((out / "config.json").read_text())
    if layout == "mxfp4":  # experts with LoRA: written dequantised, in the base's dtype
        assert not any(k.endswith(("_blocks", "_scales")) for k in keys)
        assert keys == {k.removesuffix("_blocks") for k in base_keys if not k.endswith("_scales")}
        assert "quantization_config" not in config
    else:  # the base's own layout
        assert keys == base_keys
    assert max_abs(logits_of(_load_merged(out), ids), want) < TOL


def test_mxfp4_base_without_expert_lora_keeps_its_blocks(tmp_path):
    base = _base("gpt_oss", "mxfp4", tmp_path / "base")
    model = save_random_adapter(base, tmp_path / "adapter", seed=62, targets="q,o")
    out = export_merged(base, tmp_path / "adapter", tmp_path / "merged")
    assert _keys(out) == _keys(base)
    assert "quantization_config" in json.loads((out / "config.json").read_text())
    key = "model.layers.0.mlp.experts.down_proj_blocks"
    merged = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert torch.equal(merged[key], load_file(str(base / "model.safetensors"))[key])
    ids = _ids()
    assert max_abs(logits_of(_load_merged(out), ids), logits_of(model, ids)) < TOL


def test_expert_adapter_of_another_model_writes_nothing(tmp_path):
    base = _base("mixtral", "per_expert", tmp_path / "base")
    save_random_adapter(base, tmp_path / "adapter", seed=63, targets="q,experts")
    f = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(f))
    key = next(k for k in tensors if k.endswith("experts.lora_A.weight"))
    tensors[key] = tensors[key][:, :-1].contiguous()  # another hidden size
    save_file(tensors, str(f))
    with pytest.raises(LeantuneError, match="do not fit the experts") as e:
        export_merged(base, tmp_path / "adapter", tmp_path / "merged")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "merged").exists()
