"""Merged export: base checkpoint + LoRA adapter -> a sharded HF safetensors checkpoint.

Streams tensor by tensor through the base checkpoint's shards (host memory near one shard): each
adapted projection gets W + scaling * B @ A, computed in fp32 and cast to the output dtype; every
other tensor is copied. config.json, generation_config.json and tokenizer files come along, so
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` gives the fine-tuned model's logits.
`MergedWeights` is the same stream for the GGUF writer.

The adapter is a PEFT adapter folder, a training checkpoint (RUN/checkpoints/step-N), or a run
folder without a final adapter (an interrupted run: its latest checkpoint).

4-bit bases (QLoRA). A run that quantised a 16-bit checkpoint as it loaded (--load-in-4bit) has
that checkpoint as --model: the adapter is merged onto its 16-bit weights. A pre-quantised
`*-bnb-4bit` base is dequantised tensor by tensor (the weights the adapter was trained on, in
16-bit), or, with `merge_onto` (--merge-onto), the adapter goes onto the 16-bit original the
4-bit checkpoint was made from, checked to have the same tensors and shapes: a better base than
the dequantised one, where it is at hand. The export is written
into a hidden folder beside OUT and renamed into place at the end: a failed or interrupted export
leaves OUT as it was, and OUT may never be, contain or lie inside the base or adapter folder (a
subfolder of the adapter's folder is fine: a run's own merged/).
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
from ..kernels.nf4 import dequantize_nf4_reference, nf4_from_bnb_state
from ..model.config import ModelConfig
from ..model.loader import (DTYPES, bnb_compute_dtype, bnb_quant_states, resolve_checkpoint,
                            safetensors_files)
from ..train.checkpoint import latest_checkpoint
from ..utils import signals
from ..utils.io import atomic_write_json
from ..utils.paths import check_output_folder
from .full import TOKENIZER_FILES, copy_side_files, set_config_dtype
from .serving import write_generation_config
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


def read_lora_pairs(adapter: Path, log=print) -> tuple[
        dict[str, tuple[torch.Tensor, torch.Tensor]], float, int]:
    """{base weight name: (lora_A [r, in], lora_B [out, r])}, the scaling and the rank of
    --adapter `adapter` (`adapter_source`: an adapter folder, a checkpoint or a run folder)."""
    from safetensors.torch import load_file

    cfg, path = adapter_source(Path(adapter), log)
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
    return {k: (a, b) for k, (a, b) in pairs.items()}, scaling, cfg.r


class MergedWeights:
    """The base checkpoint's tensors with a LoRA adapter merged in, read one at a time (a 4-bit
    base: dequantised, or those of `merge_onto`, its 16-bit original; module docstring).

    Opening checks that every adapter layer fits a base weight (name and shapes), so a wrong
    adapter fails before anything is written.
    """

    def __init__(self, model: str | os.PathLike, adapter_dir: str | os.PathLike | None = None,
                 log=print, merge_onto: str | os.PathLike | None = None):
        self.src = resolve_checkpoint(model)
        self.config = ModelConfig.from_file(self.src / "config.json")  # validates model_type
        bnb_compute_dtype(self.config, self.src / "config.json")  # (a quantisation we don't read)
        self.adapter_dir = Path(adapter_dir) if adapter_dir else None
        self.deltas, self.scaling, self.rank = (read_lora_pairs(self.adapter_dir, log)
                                                if self.adapter_dir else ({}, 0.0, 0))
        self.files: dict[str, Path] = {}  # tensor name -> its shard
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.st_dtypes: dict[str, str] = {}  # safetensors dtype strings ("BF16", "F32", ...)
        self._scan(self.src)
        # a bnb-4bit base: {weight name: quant_state}; its tensors stand for the dense weight
        self.quant_states = bnb_quant_states(safetensors_files(self.src))
        for name, state in self.quant_states.items():
            for key in [k for k in self.shapes if k.startswith(name + ".")]:
                del self.shapes[key], self.st_dtypes[key]  # (their files stay known)
            self.shapes[name] = tuple(state["shape"])
            self.st_dtypes[name] = {"bfloat16": "BF16", "float16": "F16",
                                    "float32": "F32"}[state["dtype"]]
        self.onto = None
        if merge_onto is not None:
            self._merge_onto(resolve_checkpoint(merge_onto), model)
        for key, (a, b) in self.deltas.items():
            if key not in self.shapes:
                raise LeantuneError(f"{self.adapter_dir}: adapter layers not found in the base "
                                    f"model (e.g. {key}); is it the adapter of another model?")
            if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != self.shapes[key] \
                    or a.shape[0] != b.shape[1]:
                raise LeantuneError(f"{self.adapter_dir}: {key}: lora_A {tuple(a.shape)} and "
                                    f"lora_B {tuple(b.shape)} do not fit the base weight "
                                    f"{self.shapes[key]}; is it the adapter of another model?")

    def _scan(self, folder: Path) -> None:
        """Every tensor's shard, shape and dtype in checkpoint `folder` (headers only)."""
        from safetensors import safe_open

        for f in safetensors_files(folder):
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    sl = sf.get_slice(key)
                    self.files[key] = f
                    self.shapes[key] = tuple(sl.get_shape())
                    self.st_dtypes[key] = sl.get_dtype()

    def _merge_onto(self, onto: Path, model) -> None:
        """Read the tensors of `onto`, the 16-bit original of this 4-bit base, instead: it must
        hold the same tensors with the same shapes (the dequantised base's)."""
        if not self.quant_states:
            raise LeantuneError(f"--merge-onto {onto}: --model {model} is a 16-bit checkpoint "
                                "already, and the adapter is merged onto it; --merge-onto names "
                                "the 16-bit original of a 4-bit (bnb-4bit) --model")
        base = dict(self.shapes)
        self.files, self.shapes, self.st_dtypes = {}, {}, {}
        self._scan(onto)
        if bnb_quant_states(safetensors_files(onto)) or \
                ModelConfig.from_file(onto / "config.json").raw.get("quantization_config"):
            raise LeantuneError(f"--merge-onto {onto}: a quantised checkpoint; give the 16-bit "
                                f"original that {model} was quantised from")
        for key, shape in base.items():
            have = self.shapes.get(key)
            if have != shape:
                raise LeantuneError(f"--merge-onto {onto}: tensor {key} is "
                                    f"{'missing' if have is None else f'of shape {have}'} where "
                                    f"{model} has {shape}; it is not the original of this base")
        self.onto = onto

    def hf_config(self) -> dict:
        """The merged model's config.json: --merge-onto's, or the base's (a 4-bit base's without
        its quantization_config: the export is 16-bit)."""
        config = json.loads(((self.onto or self.src) / "config.json").read_text())
        config.pop("quantization_config", None)
        return config

    def names(self) -> list[str]:
        return list(self.shapes)

    def _read(self, key: str) -> torch.Tensor:
        """Tensor `key` of the base as stored (a 4-bit weight: dequantised to its own dtype)."""
        from safetensors import safe_open

        state = None if self.onto else self.quant_states.get(key)
        if state is None:
            with safe_open(str(self.files[key]), framework="pt", device="cpu") as sf:
                return sf.get_tensor(key)
        w = nf4_from_bnb_state(state)
        for part in w.bnb_parts():
            name = f"{key}.{part}".rstrip(".")
            if name not in self.files:
                raise LeantuneError(f"{self.src}: {name} is missing from the 4-bit checkpoint; "
                                    "re-download it")
            with safe_open(str(self.files[name]), framework="pt", device="cpu") as sf:
                w.load_bnb_(part, sf.get_tensor(name), name)
        return dequantize_nf4_reference(w, w.weight_dtype)

    def tensor(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `key`, merged with its adapter pair (in fp32) if it has one, cast to `dtype`
        (float tensors only; default: the base tensor's dtype)."""
        t = self._read(key)
        if key in self.deltas:
            a, b = self.deltas[key]
            return (t.float() + (b.float() @ a.float()) * self.scaling).to(dtype or t.dtype)
        if dtype is not None and t.is_floating_point():
            return t.to(dtype)
        return t


def export_merged(model: str | os.PathLike, adapter_dir: str | os.PathLike | None,
                  out_dir: str | os.PathLike, dtype: str | None = None,
                  overwrite: bool = False, max_shard_bytes: int = 4 << 30, log=print,
                  merge_onto: str | os.PathLike | None = None) -> Path:
    """Merge `adapter_dir` into `model` and write a HF checkpoint to `out_dir`.

    Args:
        model: base checkpoint folder or hub id (a bnb-4bit one is dequantised).
        adapter_dir: PEFT-format adapter, training checkpoint or run folder (`adapter_source`);
            None copies the base, re-sharded.
        out_dir: output folder (must be new or empty unless overwrite: then a previous export
            there is replaced, other files are kept).
        dtype: "bfloat16" | "float16" | "float32"; default: the base tensors' own dtype.
        max_shard_bytes: size above which a new shard is started.
        log: where a note on the adapter's source goes.
        merge_onto: for a 4-bit `model`, its 16-bit original to merge onto instead.
    """
    src = resolve_checkpoint(model)
    out = Path(out_dir)
    adapter = Path(adapter_dir) if adapter_dir else None
    onto = resolve_checkpoint(merge_onto) if merge_onto is not None else None
    check_output_folder(out, {"base model": src, "adapter": adapter, "original model": onto},
                        may_lie_inside=("adapter",))
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise LeantuneError(f"{out}: output folder is not empty; choose a new folder or pass "
                            "--overwrite")
    weights = MergedWeights(src, adapter, log, onto)  # checks the adapter fits this base
    out_dtype = DTYPES[dtype] if dtype else None
    entries = []
    for key, shape in weights.shapes.items():
        st_dtype = weights.st_dtypes[key]
        is_float = st_dtype.startswith(("F", "BF"))
        itemsize = (out_dtype.itemsize if out_dtype is not None and is_float
                    else _itemsize(st_dtype))
        entries.append((key, _numel(shape) * itemsize,
                        lambda key=key: weights.tensor(key, out_dtype)))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
        write_sharded(entries, tmp, max_shard_bytes)
        config = weights.hf_config()
        if out_dtype is not None:
            set_config_dtype(config, dtype)
        atomic_write_json(tmp / "config.json", config)
        copy_side_files(src, tmp)
        if adapter is not None and adapter.is_dir():  # a base without tokenizer files: the
            copy_side_files(adapter, tmp, only_missing=True)  # run saved them beside its adapter
        write_generation_config(src, tmp)
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
