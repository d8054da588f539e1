"""`leantune train --adapter RUN`: continue from an existing (SFT) adapter.

The adapter is folded into the frozen 16-bit base weights at load, W <- W + scaling * B @ A, and
a fresh LoRA trains on top. So the model with its adapters switched off (`adapters_disabled`,
the preference objectives' reference) is base + SFT, the merged view of the adapter continued
from, with no second copy of the weights.

The run's final adapter is written for the original base, so that export, generate and chat take
it as they take any run: the SFT factors and the new ones side by side, one adapter of rank
r_sft + r_new whose scaling is 1 (lora_alpha = r, no rsLoRA):

    A = [A_sft ; A_new]  [r_sft + r_new, in]
    B = [s_sft B_sft, s_new B_new]  [out, r_sft + r_new]
    B @ A = s_sft B_sft A_sft + s_new B_new A_new   (exactly the sum of the two deltas)

A projection one of the two adapters leaves out gets zero rows / columns there. Checkpoints keep
only the new LoRA (a resume folds the SFT adapter again).

An NF4 (QLoRA) base cannot take the fold (its 4-bit codes would have to be requantised, which
changes the base); such a run is refused in one line: continue on the 16-bit base.
Experts' adapters (MoE) are not folded yet, also refused in one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import LeantuneError
from .config import ALL_TARGETS, LoRAConfig, lora_layers

# {module name: (A [r, in] fp32, scaling * B [out, r] fp32)} of the adapter folded in (CPU)
Folded = dict[str, tuple[torch.Tensor, torch.Tensor]]


def check_foldable(adapter: str | os.PathLike, four_bit: bool) -> tuple[LoRAConfig, Path]:
    """(LoRA settings, weights file) of --adapter, refused in one line where it cannot be
    folded (a 4-bit base)."""
    from ..export.merge import adapter_source
    from ..generate.load import check_adapter_path

    path = check_adapter_path(adapter)
    if four_bit:
        raise LeantuneError(f"--adapter {path}: continuing from an adapter folds it into the "
                            "base weights, which a 4-bit (NF4) base cannot take without "
                            "changing; train on the 16-bit base (drop --load-in-4bit, or give "
                            "the bnb-4bit checkpoint's 16-bit original as --model)")
    return adapter_source(path, log=lambda _: None)


@torch.no_grad()
def fold_adapter(model, adapter: str | os.PathLike, log=print) -> Folded:
    """Add --adapter's delta into `model`'s base weights (fp32 sums, stored in the weights'
    dtype). Returns its factors for `save_stacked_adapter`."""
    from ..export.merge import read_lora_pairs

    pairs, scaling, r = read_lora_pairs(Path(adapter), log=lambda _: None)
    layers = dict(lora_layers(model))
    folded: Folded = {}
    for base, (a, b) in pairs.items():
        mod = base[:-len(".weight")] if base.endswith(".weight") else base
        layer = layers.get(mod)
        if layer is None or a.dim() != 2:
            raise LeantuneError(f"--adapter {adapter}: {base} is not a projection leantune can "
                                "fold into the base (experts' adapters are not supported yet)")
        if layer.nf4 is not None:
            raise LeantuneError(f"--adapter {adapter}: the base is 4-bit (NF4); an adapter folds "
                                "into 16-bit weights only")
        w = layer.weight
        shape = (b.shape[0], a.shape[1])
        if shape != tuple(w.shape):
            raise LeantuneError(f"--adapter {adapter}: {base} is {shape} but the model's is "
                                f"{tuple(w.shape)}; is it the adapter of "
                                "another base model?")
        a32, b32 = a.float(), b.float() * scaling
        w.copy_((w.float() + (b32.to(w.device) @ a32.to(w.device))).to(w.dtype))
        folded[mod] = (a32.cpu(), b32.cpu())
    log(f"adapter: {adapter} folded into the base weights ({len(folded)} projections, r={r}); "
        "a new LoRA trains on top, and the base + this adapter is the reference")
    return folded


def save_stacked_adapter(model, folded: Folded, out_dir: str | os.PathLike,
                         base_model_name: str | None = None, write: bool = True) -> None:
    """Write the run's adapter for the original base: `folded` and the model's trained LoRA
    side by side (module docstring), in PEFT's format (atomically, as save_adapter)."""
    from safetensors.torch import save

    from ..dist.tensors import full_tensor
    from ..utils.io import atomic_path, atomic_write_json
    from .base_check import BASE_NAME_KEY, FINGERPRINT_KEY, model_fingerprint
    from .peft_io import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, _sorted_metadata, peft_config_dict,
                          peft_name)

    cfg = model.lora_config
    new = {}
    for name, layer in lora_layers(model):
        if layer.has_lora:
            a = full_tensor(layer.lora_A.weight.detach()).float().cpu()
            b = full_tensor(layer.lora_B.weight.detach()).float().cpu() * layer.scaling
            new[name] = (a, b)
    r_old = next(iter(folded.values()))[0].shape[0] if folded else 0
    r_new = cfg.r
    dims = {name: (layer.in_features, layer.out_features) for name, layer in lora_layers(model)}
    tensors = {}
    for name in sorted(set(folded) | set(new)):
        n_in, n_out = dims[name]
        a = torch.zeros(r_old + r_new, n_in)
        b = torch.zeros(n_out, r_old + r_new)
        if name in folded:
            a[:r_old], b[:, :r_old] = folded[name]
        if name in new:
            a[r_old:], b[:, r_old:] = new[name]
        tensors[peft_name(f"{name}.weight", "A")] = a.contiguous()  # fp32, as the masters
        tensors[peft_name(f"{name}.weight", "B")] = b.contiguous()
    if not write:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt"}
    fp = model_fingerprint(model)
    if fp is not None:
        metadata[FINGERPRINT_KEY] = fp
    if base_model_name:
        metadata[BASE_NAME_KEY] = str(base_model_name)
    with atomic_path(out / ADAPTER_WEIGHTS) as tmp:
        tmp.write_bytes(_sorted_metadata(save(tensors, metadata=metadata)))
    r = r_old + r_new
    stacked = LoRAConfig(r=r, alpha=float(r), dropout=cfg.dropout, targets=cfg.targets)
    modules = {name.rsplit(".", 1)[-1] for name in set(folded) | set(new)}
    atomic_write_json(out / ADAPTER_CONFIG, peft_config_dict(
        stacked, base_model_name, [t for t in ALL_TARGETS if t in modules]))
