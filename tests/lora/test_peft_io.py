"""LoRA: attaching adapters, and round trips with PEFT's on-disk format in both directions."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import (
    load_hf,
    max_abs,
    one_torch_thread,  # noqa: F401  (autouse)
    save_checkpoint,
)
from safetensors import safe_open

import leantune
from leantune import LeantuneError, LoRAConfig, apply_lora, load_adapter, save_adapter
from leantune.lora import ALL_TARGETS, LoRALinear, lora_layers

TOL = 1e-4
FAMILIES = ["llama", "qwen2"]  # untied, head_dim != hidden / heads; tied with q/k/v bias


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, fam in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(fam)
        save_checkpoint(fam, folder, seed=20 + i)
        out[fam] = folder
    return out


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(7))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@torch.no_grad()
def _randomize_lora_B(model, seed: int = 3, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.copy_(std * torch.randn(p.shape, generator=g))


def _lora_model(folder, cfg: LoRAConfig, seed: int = 0):
    model = leantune.load_model(folder, device="cpu")
    apply_lora(model, cfg, seed=seed)
    _randomize_lora_B(model)
    return model.eval()


def _peft_model(folder, adapter_dir):
    from peft import PeftModel

    return PeftModel.from_pretrained(load_hf(folder), str(adapter_dir)).eval()


@pytest.mark.parametrize("targets, expected", [
    ("q,v,down", ["q_proj", "v_proj", "down_proj"]),
    (None, ALL_TARGETS),
])
def test_apply_lora_targets_and_freezing(checkpoints, ids, targets, expected):
    model = leantune.load_model(checkpoints["llama"], device="cpu").eval()
    base = _logits(model, ids)
    cfg = LoRAConfig(r=4, alpha=8) if targets is None else LoRAConfig(r=4, alpha=8, targets=targets)
    assert cfg.targets == expected
    names = apply_lora(model, cfg)
    L = model.config.num_hidden_layers
    assert len(names) == len(expected) * L
    assert {n.rsplit(".", 1)[-1] for n in names} == set(expected)
    for name, layer in lora_layers(model):
        adapted = name.rsplit(".", 1)[-1] in expected
        assert layer.has_lora == adapted, name
        if adapted:
            assert layer.lora_A.weight.shape == (4, layer.in_features)
            assert layer.lora_B.weight.shape == (layer.out_features, 4)
            assert layer.scaling == pytest.approx(2.0)
            assert torch.all(layer.lora_B.weight == 0)
            assert layer.lora_A.weight.abs().sum() > 0
    for name, p in model.named_parameters():
        assert p.requires_grad == ("lora_" in name), name
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(names)
    assert sum(p.numel() for p in trainable) == sum(
        4 * (l.in_features + l.out_features) for _, l in lora_layers(model) if l.has_lora)
    # B = 0: the adapted model starts equal to the base model.
    assert max_abs(_logits(model, ids), base) == 0.0


def test_gradients_reach_only_lora(checkpoints, ids):
    model = leantune.load_model(checkpoints["qwen2"], device="cpu")
    apply_lora(model, LoRAConfig(r=2, alpha=4, targets="q,o,up"))
    _randomize_lora_B(model)
    model(ids).logits.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("targets", ["q,v,down", "q,k,v,o,gate,up,down"])
def test_saved_adapter_loads_in_peft(checkpoints, ids, tmp_path, family, targets):
    folder = checkpoints[family]
    model = _lora_model(folder, LoRAConfig(r=4, alpha=8, targets=targets))
    got = _logits(model, ids)
    base = _logits(leantune.load_model(folder, device="cpu").eval(), ids)
    assert max_abs(got, base) > 1e-2  # the adapter changes the output
    save_adapter(model, tmp_path / "adapter", base_model_name=str(folder))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert len(keys) == 2 * len(targets.split(",")) * model.config.num_hidden_layers
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)
    peft_model = _peft_model(folder, tmp_path / "adapter")
    assert max_abs(_logits(peft_model, ids), got) < TOL
    # ... and back into a fresh leantune model.
    fresh = leantune.load_model(folder, device="cpu")
    cfg = load_adapter(fresh, tmp_path / "adapter")
    assert cfg.targets == model.lora_config.targets
    assert max_abs(_logits(fresh.eval(), ids), got) < TOL


def test_rslora_scaling_matches_peft(checkpoints, ids, tmp_path):
    folder = checkpoints["llama"]
    model = _lora_model(folder, LoRAConfig(r=4, alpha=6, targets="q,k,gate", use_rslora=True))
    layers = [l for _, l in lora_layers(model) if l.has_lora]
    assert all(l.scaling == pytest.approx(6 / math.sqrt(4)) for l in layers)
    save_adapter(model, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["use_rslora"] is True
    peft_model = _peft_model(folder, tmp_path / "a")
    peft_scalings = [m.scaling["default"] for m in peft_model.modules()
                     if isinstance(getattr(m, "scaling", None), dict) and m.scaling]
    assert len(peft_scalings) == len(layers)
    assert all(s == pytest.approx(3.0) for s in peft_scalings)
    assert max_abs(_logits(peft_model, ids), _logits(model, ids)) < TOL


def test_dropout_is_identity_in_eval(checkpoints, ids, tmp_path):
    folder = checkpoints["qwen2"]
    model = _lora_model(folder, LoRAConfig(r=4, alpha=8, dropout=0.5, targets="q,v,up"))
    assert any(isinstance(l.lora_dropout, torch.nn.Dropout) for _, l in lora_layers(model))
    eval_logits = _logits(model, ids)
    assert max_abs(_logits(model, ids), eval_logits) == 0.0
    model.train()
    train_logits = _logits(model, ids)
    model.eval()
    assert max_abs(train_logits, eval_logits) > 1e-4  # dropout is live in training
    # Eval output is the dropout-free adapter: same as the same adapter with dropout 0 ...
    for _, layer in lora_layers(model):
        layer.lora_dropout = torch.nn.Identity()
    assert max_abs(_logits(model, ids), eval_logits) == 0.0
    # ... and as PEFT's model in eval mode.
    save_adapter(model, tmp_path / "a")
    assert max_abs(_logits(_peft_model(folder, tmp_path / "a"), ids), eval_logits) < TOL


@pytest.mark.parametrize("targets, bad", [
    ("q,vv", "vv"), (["q_proj", "lm_head"], "lm_head"), ("attn", "attn")])
def test_unknown_target_raises(targets, bad):
    with pytest.raises(LeantuneError) as e:
        LoRAConfig(targets=targets)
    assert repr(bad) in str(e.value)
    assert "q_proj" in str(e.value)  # says what the choices are


def test_invalid_rank_and_dropout_raise():
    with pytest.raises(LeantuneError, match="lora-r"):
        LoRAConfig(r=0)
    with pytest.raises(LeantuneError, match="lora-dropout"):
        LoRAConfig(dropout=1.0)


def test_save_adapter_without_lora_raises(checkpoints, tmp_path):
    model = leantune.load_model(checkpoints["llama"], device="cpu")
    with pytest.raises(LeantuneError, match="no LoRA adapter"):
        save_adapter(model, tmp_path / "a")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_trained_adapter_loads(checkpoints, ids, tmp_path, family, use_rslora):
    from peft import LoraConfig, get_peft_model

    folder = checkpoints[family]
    targets = ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]
    peft_cfg = LoraConfig(r=4, lora_alpha=16, lora_dropout=0.1, target_modules=targets,
                          use_rslora=use_rslora, task_type="CAUSAL_LM")
    peft_model = get_peft_model(load_hf(folder), peft_cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    peft_model.eval()
    ref = _logits(peft_model, ids)
    peft_model.save_pretrained(str(tmp_path / "peft"))

    model = leantune.load_model(folder, device="cpu")
    cfg = load_adapter(model, tmp_path / "peft")
    assert cfg.r == 4 and cfg.alpha == 16 and cfg.use_rslora == use_rslora
    assert cfg.targets == ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"]
    adapted = [l for _, l in lora_layers(model) if l.has_lora]
    assert len(adapted) == len(targets) * model.config.num_hidden_layers
    assert all(isinstance(l, LoRALinear) for l in adapted)
    expected_scaling = 16 / math.sqrt(4) if use_rslora else 16 / 4
    assert all(l.scaling == pytest.approx(expected_scaling) for l in adapted)
    assert max_abs(_logits(model.eval(), ids), ref) < TOL
    # Our own save of that adapter holds the same tensors under the same names.
    save_adapter(model, tmp_path / "ours")
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "ours" / "adapter_model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():  # noqa: SIM118  (a safetensors handle)
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_adapter_of_another_model_raises(checkpoints, tmp_path):
    model = _lora_model(checkpoints["llama"], LoRAConfig(r=4, alpha=8, targets="q"))
    save_adapter(model, tmp_path / "a")
    other = leantune.load_model(checkpoints["qwen2"], device="cpu")  # hidden 64, not 48
    with pytest.raises(LeantuneError, match="shape"):
        load_adapter(other, tmp_path / "a")


def test_missing_adapter_config_raises(tmp_path, checkpoints):
    model = leantune.load_model(checkpoints["llama"], device="cpu")
    with pytest.raises(LeantuneError, match="adapter_config.json"):
        load_adapter(model, tmp_path)


@pytest.mark.parametrize("config, culprit", [
    ({"lora_alpha": 8, "target_modules": ["q_proj"]}, "'r'"),
    ({"r": "four", "target_modules": ["q_proj"]}, "invalid value"),
    ({"r": 4, "target_modules": ["q_proj", "lm_head"]}, "'lm_head'"),
])
def test_bad_adapter_config_raises(checkpoints, tmp_path, config, culprit):
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    model = leantune.load_model(checkpoints["llama"], device="cpu")
    with pytest.raises(LeantuneError) as e:
        load_adapter(model, tmp_path)
    assert str(tmp_path / "adapter_config.json") in str(e.value) and culprit in str(e.value)
