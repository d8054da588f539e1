"""Merged export: base checkpoint + LoRA adapter -> a sharded HF safetensors checkpoint.

Streams tensor by tensor through the base checkpoint's shards (host memory near one shard): each
adapted projection gets W + scaling * B @ A, computed in fp32 and cast to the output dtype; every
other tensor is copied. config.json, generation_config.json and tokenizer files come along, so
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` gives the fine-tuned model's logits.
`MergedWeights` is the same stream for the GGUF writer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import LeantuneError
from ..lora.layer import lora_scaling
from ..lora.peft_io import ADAPTER_WEIGHTS, PREFIX, read_adapter_config
from ..model.config import ModelConfig
from ..model.loader import DTYPES, resolve_checkpoint, safetensors_files
from ..utils.io import atomic_write_json, check_output_dir
from .full import copy_side_files, set_config_dtype
from .serving import write_generation_config
from .shards import write_sharded


def read_lora_pairs(adapter_dir: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                    float, int]:
    """{base weight name: (lora_A [r, in], lora_B [out, r])}, the scaling and the rank of a
    PEFT-format adapter folder."""
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
        name = key[len(PREFIX):] if key.startswith(PREFIX) else key
        mod, _, which = name.replace(".default.", ".").rpartition(".lora_")
        pairs.setdefault(mod + ".weight", [None, None])[0 if which.startswith("A") else 1] = t
    for k, (a, b) in pairs.items():
        if a is None or b is None:
            raise LeantuneError(f"{path}: {k} has only one of lora_A / lora_B")
    return {k: (a, b) for k, (a, b) in pairs.items()}, scaling, cfg.r


class MergedWeights:
    """The base checkpoint's tensors with a LoRA adapter merged in, read one at a time.

    Opening checks that every adapter layer fits a base weight (name and shapes), so a wrong
    adapter fails before anything is written.
    """

    def __init__(self, model: str | os.PathLike, adapter_dir: str | os.PathLike | None = None):
        from safetensors import safe_open

        self.src = resolve_checkpoint(model)
        self.config = ModelConfig.from_file(self.src / "config.json")  # validates model_type
        self.adapter_dir = Path(adapter_dir) if adapter_dir else None
        self.deltas, self.scaling, self.rank = (read_lora_pairs(self.adapter_dir)
                                                if self.adapter_dir else ({}, 0.0, 0))
        self.files: dict[str, Path] = {}  # tensor name -> its shard
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.st_dtypes: dict[str, str] = {}  # safetensors dtype strings ("BF16", "F32", ...)
        for f in safetensors_files(self.src):
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    sl = sf.get_slice(key)
                    self.files[key] = f
                    self.shapes[key] = tuple(sl.get_shape())
                    self.st_dtypes[key] = sl.get_dtype()
        for key, (a, b) in self.deltas.items():
            if key not in self.shapes:
                raise LeantuneError(f"{self.adapter_dir}: adapter layers not found in the base "
                                    f"model (e.g. {key}); is it the adapter of another model?")
            if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != self.shapes[key] \
                    or a.shape[0] != b.shape[1]:
                raise LeantuneError(f"{self.adapter_dir}: {key}: lora_A {tuple(a.shape)} and "
                                    f"lora_B {tuple(b.shape)} do not fit the base weight "
                                    f"{self.shapes[key]}; is it the adapter of another model?")

    def names(self) -> list[str]:
        return list(self.shapes)

    def tensor(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `key`, merged with its adapter pair (in fp32) if it has one, cast to `dtype`
        (float tensors only; default: the base tensor's dtype)."""
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt", device="cpu") as sf:
            t = sf.get_tensor(key)
        if key in self.deltas:
            a, b = self.deltas[key]
            return (t.float() + (b.float() @ a.float()) * self.scaling).to(dtype or t.dtype)
        if dtype is not None and t.is_floating_point():
            return t.to(dtype)
        return t


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
    out = Path(out_dir)
    check_output_dir(out, overwrite)
    weights = MergedWeights(model, adapter_dir)
    src = weights.src
    out_dtype = DTYPES[dtype] if dtype else None
    entries = []
    for key, shape in weights.shapes.items():
        st_dtype = weights.st_dtypes[key]
        is_float = st_dtype.startswith(("F", "BF"))
        itemsize = (out_dtype.itemsize if out_dtype is not None and is_float
                    else _itemsize(st_dtype))
        entries.append((key, _numel(shape) * itemsize,
                        lambda key=key: weights.tensor(key, out_dtype)))

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
    if weights.adapter_dir is not None:  # a base without tokenizer files: the run saved them
        copy_side_files(weights.adapter_dir, out, only_missing=True)
    write_generation_config(src, out)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(st_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
            "I16": 2, "U16": 2}.get(st_dtype, 1)
