"""LoRA adapters in PEFT's on-disk format.

adapter_model.safetensors holds `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; adapter_config.json is PEFT's LoraConfig. Files written here load
with `peft.PeftModel.from_pretrained` on the transformers model, and PEFT-trained adapters load
here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..dist.tensors import full_tensor
from ..errors import LeantuneError
from .config import ALL_TARGETS, LoRAConfig, apply_lora, lora_layers

PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def parse_key(key: str) -> tuple[str, str]:
    """A PEFT adapter tensor name -> (module name as in the model, "A" or "B"), e.g.
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" ->
    ("model.layers.0.self_attn.q_proj", "A"); PEFT's in-memory adapter name (".default.")
    is dropped."""
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    mod, _, which = name.replace(".default.", ".").rpartition(".lora_")
    return mod, "A" if which.startswith("A") else "B"


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors (contiguous, on the CPU; whole where FSDP2 shards them: a
    collective, which every process calls)."""
    out = {}
    for name, layer in lora_layers(model):
        if layer.has_lora:
            for which, lin in (("A", layer.lora_A), ("B", layer.lora_B)):
                out[f"{PREFIX}{name}.lora_{which}.weight"] = (
                    full_tensor(lin.weight.detach()).cpu().contiguous())
    return out


def peft_config_dict(cfg: LoRAConfig, base_model_name: str | None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": list(cfg.targets),
        "use_rslora": cfg.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def save_adapter(model, out_dir: str | os.PathLike, base_model_name: str | None = None,
                 write: bool = True) -> None:
    """Write adapter_model.safetensors and adapter_config.json atomically into out_dir. Under
    torchrun every process calls this (FSDP2 gathers the adapters); only rank 0 (`write`)
    writes."""
    from safetensors.torch import save_file

    from ..utils.io import atomic_write_json, atomic_path

    out = Path(out_dir)
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise LeantuneError("the model has no LoRA adapter to save (trained with --full?)")
    tensors = adapter_state_dict(model)
    if not write:
        return
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / ADAPTER_WEIGHTS) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out / ADAPTER_CONFIG, peft_config_dict(cfg, base_model_name))


def read_adapter_config(adapter_dir: Path) -> LoRAConfig:
    path = adapter_dir / ADAPTER_CONFIG
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise LeantuneError(f"{path}: adapter_config.json not found; --adapter must be a folder "
                            "written by `leantune train` or PEFT") from None
    except json.JSONDecodeError as e:
        raise LeantuneError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise LeantuneError(f"{path}: expected a JSON object, got {type(d).__name__}")
    targets = d.get("target_modules") or ALL_TARGETS
    if isinstance(targets, str):  # PEFT allows a regex string; we take the simple names in it
        targets = [t for t in ALL_TARGETS if t in targets]
    try:
        return LoRAConfig(r=int(d["r"]), alpha=float(d.get("lora_alpha", d["r"])),
                          dropout=float(d.get("lora_dropout", 0.0)), targets=targets,
                          use_rslora=bool(d.get("use_rslora", False)))
    except KeyError as e:
        raise LeantuneError(f"{path}: required field {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise LeantuneError(f"{path}: a field has an invalid value ({e})") from None
    except LeantuneError as e:  # e.g. a target this model family has no LoRA layer for
        raise LeantuneError(f"{path}: {e}") from None


@torch.no_grad()
def load_adapter(model, adapter_dir: str | os.PathLike) -> LoRAConfig:
    """Attach the adapter stored in adapter_dir (PEFT format) to `model`."""
    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir)
    apply_lora(model, cfg)
    path = adapter_dir / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise LeantuneError(f"{path}: adapter weights not found") from None
    except Exception as e:
        raise LeantuneError(f"{path}: cannot read adapter weights ({type(e).__name__}); the file "
                            "is truncated or corrupt") from None
    layers = dict(lora_layers(model))
    filled = 0
    for key, t in tensors.items():
        mod_name, which = parse_key(key)
        layer = layers.get(mod_name)
        if layer is None or not layer.has_lora:
            raise LeantuneError(f"{path}: tensor {key} does not match any adapted layer of "
                                "this model; is it the adapter of another base model?")
        target = layer.lora_A if which == "A" else layer.lora_B
        if target.weight.shape != t.shape:
            raise LeantuneError(f"{path}: {key} has shape {tuple(t.shape)}, expected "
                                f"{tuple(target.weight.shape)}")
        target.weight.copy_(t)
        filled += 1
    if filled != 2 * sum(1 for l in layers.values() if l.has_lora):
        raise LeantuneError(f"{path}: adapter holds {filled} tensors, expected "
                            f"{2 * sum(1 for l in layers.values() if l.has_lora)}")
    return cfg
