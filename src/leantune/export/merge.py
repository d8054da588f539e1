"""Merged export: base checkpoint + LoRA adapter -> a sharded HF safetensors checkpoint.

Streams tensor by tensor through the base checkpoint's shards (host memory near one shard): each
adapted projection gets W + scaling * B @ A, computed in fp32 and cast to the output dtype; every
other tensor is copied. config.json, generation_config.json and tokenizer files come along, so
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` gives the fine-tuned model's logits.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import LeantuneError
from ..lora.peft_io import ADAPTER_WEIGHTS, parse_key, read_adapter_config
from ..model.config import ModelConfig
from ..lora.layer import lora_scaling
from ..model.loader import DTYPES, resolve_checkpoint, safetensors_files
from ..utils.io import atomic_write_json
from .full import copy_side_files, set_config_dtype
from .shards import write_sharded



def _lora_deltas(adapter_dir: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    from safetensors.torch import load_file

    cfg = read_adapter_config(adapter_dir)
    scaling = lora_scaling(cfg.r, cfg.alpha, cfg.use_rslora)
    path = adapter_dir / ADAPTER_WEIGHTS
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise LeantuneError(f"{path}: cannot read adapter weights ({type(e).__name__})") from None
    pairs: dict[str, list] = {}
    for key, t in tensors.items():
        mod, which = parse_key(key)
        pairs.setdefault(mod + ".weight", [None, None])[0 if which == "A" else 1] = t
    for k, (a, b) in pairs.items():
        if a is None or b is None:
            raise LeantuneError(f"{path}: {k} has only one of lora_A / lora_B")
    return {k: (a, b) for k, (a, b) in pairs.items()}, scaling


def export_merged(model: str | os.PathLike, adapter_dir: str | os.PathLike | None,
                  out_dir: str | os.PathLike, dtype: str | None = None,
                  overwrite: bool = False, max_shard_bytes: int = 4 << 30) -> Path:
    """Merge `adapter_dir` into `model` and write a HF checkpoint to `out_dir`.

    Args:
        model: base checkpoint folder or hub id.
        adapter_dir: PEFT-format adapter (None copies the base, re-sharded).
        out_dir: output folder (must be new or empty unless overwrite).
        dtype: "bfloat16" | "float16" | "float32"; default: the base tensors' own dtype.
        max_shard_bytes: size above which a new shard is started.
    """
    from safetensors import safe_open

    src = resolve_checkpoint(model)
    ModelConfig.from_file(src / "config.json")  # validates model_type
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LeantuneError(f"{out}: output folder is not empty; choose a new folder or pass "
                            "--overwrite")
    deltas, scaling = _lora_deltas(Path(adapter_dir)) if adapter_dir else ({}, 0.0)
    out_dtype = DTYPES[dtype] if dtype else None
    entries, shapes = [], {}
    for f in safetensors_files(src):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                sl = sf.get_slice(key)
                shapes[key] = tuple(sl.get_shape())
                is_float = sl.get_dtype().startswith(("F", "BF"))
                itemsize = (out_dtype.itemsize if out_dtype is not None and is_float
                            else _itemsize(sl.get_dtype()))
                entries.append((key, _numel(shapes[key]) * itemsize,
                                lambda f=f, key=key: _merged_tensor(f, key)))
    # Every adapter layer must fit a base weight before anything is written.
    for key, (a, b) in deltas.items():
        if key not in shapes:
            raise LeantuneError(f"{adapter_dir}: adapter layers not found in the base model "
                                f"(e.g. {key}); is it the adapter of another model?")
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != shapes[key] \
                or a.shape[0] != b.shape[1]:
            raise LeantuneError(f"{adapter_dir}: {key}: lora_A {tuple(a.shape)} and lora_B "
                                f"{tuple(b.shape)} do not fit the base weight {shapes[key]}; "
                                "is it the adapter of another model?")

    def _merged_tensor(f: Path, key: str) -> torch.Tensor:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            t = sf.get_tensor(key)
        if key in deltas:
            a, b = deltas[key]
            return (t.float() + (b.float() @ a.float()) * scaling).to(out_dtype or t.dtype)
        if out_dtype is not None and t.is_floating_point():
            return t.to(out_dtype)
        return t

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        if stale.exists():  # --overwrite: no shard of a previous export may survive
            stale.unlink()
    write_sharded(entries, out, max_shard_bytes)
    config = json.loads((src / "config.json").read_text())
    if out_dtype is not None:
        set_config_dtype(config, dtype)
    atomic_write_json(out / "config.json", config)
    copy_side_files(src, out)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(st_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
            "I16": 2, "U16": 2}.get(st_dtype, 1)
