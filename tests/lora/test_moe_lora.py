"""LoRA on mixture-of-experts models: attention and expert adapters, and round trips with PEFT
(`target_parameters` on transformers 5.x's stacked experts) in both directions."""

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
)

import leantune
from leantune import LeantuneError, LoRAConfig, apply_lora, load_adapter, save_adapter
from leantune.lora.config import expert_layers
from leantune.lora.peft_io import from_peft, parse_key, peft_name, to_peft

TOL = 1e-4
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]
TARGETS = "q,k,v,o,gate,up,down,experts"
# (Qwen3-MoE's dense MLP layers take no LoRA: a PEFT adapter could not hold it)
FAMILY_TARGETS = {"qwen3_moe": "q,k,v,o,experts", "mixtral": TARGETS, "gpt_oss": TARGETS}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, fam in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(fam)
        save_checkpoint(fam, folder, seed=70 + i)
        out[fam] = folder
    return out


def _ids(seed=7):
    return torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(seed))



@torch.no_grad()
def _randomize_lora_B(model, seed=3, std=0.2):
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.copy_(std * torch.randn(p.shape, generator=g))


def _lora_model(folder, targets=TARGETS, r=4):
    model = leantune.load_model(folder, device="cpu")
    apply_lora(model, LoRAConfig(r=r, alpha=8, targets=targets), seed=0)
    _randomize_lora_B(model)
    return model.eval()


def test_apply_lora_on_experts(checkpoints):
    model = leantune.load_model(checkpoints["qwen3_moe"], device="cpu").eval()
    ids = _ids()
    base = logits_of(model, ids)
    names = apply_lora(model, LoRAConfig(r=4, alpha=8, targets="q,experts"))
    experts = dict(expert_layers(model))
    assert set(experts) == {"model.layers.0.mlp.experts", "model.layers.2.mlp.experts"}
    assert set(experts) <= set(names)
    for ex in experts.values():
        assert set(ex.lora_A) == {"gate_up_proj", "down_proj"}
        assert ex.lora_A["gate_up_proj"].shape == (6, 4, 48)  # [E, r, hidden]
        assert ex.lora_B["gate_up_proj"].shape == (6, 48, 4)  # [E, 2 * 24, r]
        assert ex.lora_A["down_proj"].shape == (6, 4, 24)
        assert ex.lora_B["down_proj"].shape == (6, 48, 4)
        assert torch.all(ex.lora_B["down_proj"] == 0) and ex.lora_A["down_proj"].abs().sum() > 0
        assert ex.scaling == 2.0
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in trainable)
    assert any("experts.lora_A.gate_up_proj" in n for n in trainable)
    assert not any(".gate.weight" in n for n in trainable)  # the router stays frozen
    assert max_abs(logits_of(model, ids), base) == 0.0  # B = 0: unchanged
    _randomize_lora_B(model)
    model(ids).logits.pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None and p.grad.abs().sum() > 0) == ("lora_" in name), name


def test_expert_target_errors(checkpoints, tmp_path):
    with pytest.raises(LeantuneError, match="--lora-dropout.*experts"):
        LoRAConfig(r=4, dropout=0.1, targets="q,experts")
    with pytest.raises(LeantuneError, match="dense MLP layers .*model.layers.1.mlp.up_proj"):
        _lora_model(checkpoints["qwen3_moe"], targets="q,up")
    with pytest.raises(LeantuneError, match="none of these projections .*add experts"):
        _lora_model(checkpoints["mixtral"], targets="gate,up,down")
    save_checkpoint("llama", tmp_path, seed=1)
    dense = leantune.load_model(tmp_path, device="cpu")
    with pytest.raises(LeantuneError, match="experts given, but the model has no experts"):
        apply_lora(dense, LoRAConfig(r=4, targets="q,experts"))


def test_peft_names_and_layouts():
    base = "model.layers.3.mlp.experts.gate_up_proj"
    assert peft_name(base, "A") == \
        "base_model.model.model.layers.3.mlp.experts.base_layer.lora_A.weight"
    assert peft_name("model.layers.3.mlp.experts.down_proj", "B") == \
        "base_model.model.model.layers.3.mlp.experts.lora_B.weight"
    for key in (peft_name(base, "B"), "model.layers.3.mlp.experts.lora_B.gate_up_proj"):
        assert parse_key(key)[:2] == (base, "B")
    assert parse_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        ("model.layers.0.self_attn.q_proj.weight", "A", False)
    a, b = torch.randn(5, 3, 8), torch.randn(5, 6, 3)
    pa, pb = to_peft(a, b)
    assert pa.shape == (15, 8) and pb.shape == (6, 15)
    assert torch.equal(pb[:, 1 * 5 + 2], b[2, :, 1])  # column j * E + e: rank j of expert e
    ra, rb = from_peft(pa, pb, r=3)
    assert torch.equal(ra, a) and torch.equal(rb, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_adapter_loads_in_peft(checkpoints, tmp_path, family):
    folder = checkpoints[family]
    model = _lora_model(folder, FAMILY_TARGETS[family])
    ids = _ids()
    got = logits_of(model, ids)
    base = logits_of(leantune.load_model(folder, device="cpu").eval(), ids)
    assert max_abs(got, base) > 1e-2
    # the experts' adapters alone change the output too
    experts_only = _lora_model(folder, targets="experts")
    assert max_abs(logits_of(experts_only, ids), base) > 1e-2
    save_adapter(model, tmp_path / "adapter", base_model_name=str(folder))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]  # no MLP modules
    assert config["lora_dropout"] == 0.0

    from peft import PeftModel

    peft = PeftModel.from_pretrained(load_hf(folder), str(tmp_path / "adapter")).eval()
    assert max_abs(logits_of(peft, ids), got) < TOL
    # and back: the adapter loads into a fresh leantune model
    again = leantune.load_model(folder, device="cpu").eval()
    cfg = load_adapter(again, tmp_path / "adapter")
    assert cfg.targets[-1] == "experts"
    assert max_abs(logits_of(again, ids), got) < TOL


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_peft_trained_expert_adapter_loads_here(checkpoints, tmp_path, family):
    from peft import LoraConfig, get_peft_model

    folder = checkpoints[family]
    hf = load_hf(folder)
    peft = get_peft_model(hf, LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    peft.eval().save_pretrained(tmp_path / "adapter")
    ids = _ids()
    ref = logits_of(peft, ids)
    model = leantune.load_model(folder, device="cpu").eval()
    load_adapter(model, tmp_path / "adapter")
    assert max_abs(logits_of(model, ids), ref) < TOL


def test_peft_adapter_on_other_parameters_is_refused(checkpoints, tmp_path):
    model = _lora_model(checkpoints["mixtral"])
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    config["target_parameters"] = ["mlp.experts.down_proj"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LeantuneError, match="gate_up_proj and down_proj together"):
        load_adapter(leantune.load_model(checkpoints["mixtral"], device="cpu"), tmp_path)


def test_adapter_of_separate_expert_modules_is_named(checkpoints, tmp_path):
    """A transformers 4.x-style adapter (LoRA on each expert's own gate_proj module) is refused
    with what it is."""
    from safetensors.torch import load_file, save_file

    save_adapter(_lora_model(checkpoints["qwen3_moe"], targets="q"), tmp_path)
    f = tmp_path / "adapter_model.safetensors"
    tensors = load_file(str(f))
    legacy = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_{}.weight"
    tensors[legacy.format("A")] = torch.zeros(4, 48)
    tensors[legacy.format("B")] = torch.zeros(24, 4)
    save_file(tensors, str(f))
    with pytest.raises(LeantuneError, match="separate expert modules .*transformers 4.x"):
        load_adapter(leantune.load_model(checkpoints["qwen3_moe"], device="cpu"), tmp_path)
