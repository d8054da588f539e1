"""Merged export: base checkpoint + LoRA adapter -> a sharded HF safetensors checkpoint.

Streams tensor by tensor through the base checkpoint's shards (host memory near one shard): each
adapted projection gets W + scaling * B @ A, computed in fp32 and cast to the output dtype; every
other tensor is copied. config.json, generation_config.json and tokenizer files come along, so
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` gives the fine-tuned model's logits.

The adapter is a PEFT adapter folder, a training checkpoint (RUN/checkpoints/step-N), or a run
folder without a final adapter (an interrupted run: its latest checkpoint). The export is written
into a hidden folder beside OUT and renamed into place at the end: a failed or interrupted export
leaves OUT as it was, and OUT may never be, contain or lie inside the base or adapter folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from ..errors import LeantuneError
from ..lora import LoRAConfig
from ..lora.layer import lora_scaling
from ..lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, parse_key, read_adapter_config
from ..model.config import ModelConfig
from ..model.loader import DTYPES, resolve_checkpoint, safetensors_files
from ..train.checkpoint import latest_checkpoint
from ..utils import signals
from ..utils.io import atomic_write_json
from ..utils.paths import check_output_folder
from .full import TOKENIZER_FILES, copy_side_files, set_config_dtype
from .shards import write_sharded


def adapter_source(path: Path, log=print) -> tuple[LoRAConfig, Path]:
    """(LoRA settings, weights file) of --adapter `path`: a PEFT adapter folder, one training
    checkpoint, or a run folder without a final adapter (its latest checkpoint)."""
    if (path / ADAPTER_CONFIG).exists():
        return read_adapter_config(path), path / ADAPTER_WEIGHTS
    if (path / "state.json").exists() and (path / "trainable.safetensors").exists():
        return _checkpoint_lora(path), path / "trainable.safetensors"
    ckpt = latest_checkpoint(path) if path.is_dir() else None
    if ckpt is not None:
        log(f"{path} has no final adapter (the run was stopped before its end?): exporting its "
            f"latest checkpoint, {ckpt}")
        return _checkpoint_lora(ckpt), ckpt / "trainable.safetensors"
    raise LeantuneError(f"{path / ADAPTER_CONFIG}: adapter_config.json not found; --adapter must "
                        "be an adapter folder written by `leantune train` or PEFT, a run folder "
                        "with checkpoints, or one checkpoint (RUN/checkpoints/step-N)")


def _checkpoint_lora(ckpt: Path) -> LoRAConfig:
    """The LoRA settings a training checkpoint was written with (its state.json)."""
    try:
        cfg = json.loads((ckpt / "state.json").read_text())["config"]
        if cfg.get("full"):
            raise LeantuneError(f"{ckpt}: a checkpoint of a full fine-tune (--full) holds whole "
                                "weights, not an adapter to merge; finish the run (`leantune "
                                "train ... --resume`) to write its model")
        return LoRAConfig(r=int(cfg["lora_r"]), alpha=float(cfg["lora_alpha"]),
                          targets=cfg["lora_targets"], use_rslora=bool(cfg["use_rslora"]))
    except (ValueError, KeyError, TypeError) as e:
        raise LeantuneError(f"{ckpt / 'state.json'}: unreadable checkpoint state "
                            f"({type(e).__name__}: {e}); export another checkpoint") from None


def _lora_deltas(cfg: LoRAConfig, path: Path) -> tuple[dict[str, tuple[torch.Tensor, ...]], float]:
    """({base weight name: (lora_A [r, in], lora_B [out, r])}, scaling) from the weights file."""
    from safetensors.torch import load_file

    scaling = lora_scaling(cfg.r, cfg.alpha, cfg.use_rslora)
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
                  overwrite: bool = False, max_shard_bytes: int = 4 << 30, log=print) -> Path:
    """Merge `adapter_dir` into `model` and write a HF checkpoint to `out_dir`.

    Args:
        model: base checkpoint folder or hub id.
        adapter_dir: PEFT-format adapter, training checkpoint or run folder (`adapter_source`);
            None copies the base, re-sharded.
        out_dir: output folder (must be new or empty unless overwrite: then a previous export
            there is replaced, other files are kept).
        dtype: "bfloat16" | "float16" | "float32"; default: the base tensors' own dtype.
        max_shard_bytes: size above which a new shard is started.
        log: where a note on the adapter's source goes.
    """
    from safetensors import safe_open

    src = resolve_checkpoint(model)
    ModelConfig.from_file(src / "config.json")  # validates model_type
    out = Path(out_dir)
    adapter = Path(adapter_dir) if adapter_dir else None
    # (a subfolder of the adapter's folder is fine: the run's own merged/, --merge-at-end)
    check_output_folder(out, {"base model": src, "adapter": adapter}, may_lie_inside=("adapter",))
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LeantuneError(f"{out}: output folder is not empty; choose a new folder or pass "
                            "--overwrite")
    deltas, scaling = _lora_deltas(*adapter_source(adapter, log)) if adapter else ({}, 0.0)
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

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
        write_sharded(entries, tmp, max_shard_bytes)
        config = json.loads((src / "config.json").read_text())
        if out_dtype is not None:
            set_config_dtype(config, dtype)
        atomic_write_json(tmp / "config.json", config)
        copy_side_files(src, tmp)
        _publish(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _is_export_file(name: str) -> bool:
    return (name in ("config.json", "model.safetensors.index.json", *TOKENIZER_FILES)
            or re.fullmatch(r"model.*\.safetensors", name) is not None)


def _publish(tmp: Path, out: Path) -> None:
    """Put the finished export `tmp` in place of `out`. A previous `out` is renamed aside, the
    new one renamed in (so no stale shard of a previous export survives), then the files of the
    previous folder that are not an export's (a user's notes) move over and the rest is
    deleted."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    with signals.deferred():
        os.replace(out, old)
        os.replace(tmp, out)
    for f in old.iterdir():
        if not _is_export_file(f.name):
            os.replace(f, out / f.name)
    shutil.rmtree(old)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(st_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
            "I16": 2, "U16": 2}.get(st_dtype, 1)
