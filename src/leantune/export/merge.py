"""Merged export: base checkpoint + LoRA adapter -> a sharded HF safetensors checkpoint.

Streams tensor by tensor through the base checkpoint's shards (host memory near one shard): each
adapted projection gets W + scaling * B @ A, computed in fp32 and cast to the output dtype (MoE
experts: per expert, in the base's own expert layout); every other tensor is copied. config.json,
generation_config.json and tokenizer files come along, so
`transformers.AutoModelForCausalLM.from_pretrained(OUT)` gives the fine-tuned model's logits.
`MergedWeights` is the same stream for the GGUF writer.

The adapter is a PEFT adapter folder, a training checkpoint (RUN/checkpoints/step-N), or a run
folder without a final adapter (an interrupted run: its latest checkpoint).

4-bit bases (QLoRA). A run that quantised a 16-bit checkpoint as it loaded (--load-in-4bit) has
that checkpoint as --model: the adapter is merged onto its 16-bit weights. A pre-quantised
`*-bnb-4bit` base is dequantised tensor by tensor (the weights the adapter was trained on, in
16-bit), or, with `merge_onto` (--merge-onto), the adapter goes onto the 16-bit original the
4-bit checkpoint was made from, checked to have the same tensors and shapes: a better base than
the dequantised one, where it is at hand.

The export is written into a hidden folder beside OUT and put in its place at the end by
export/publish.py, as every export is: a journal file beside OUT proves which leftovers an
export made, and the next export mends what a killed one left (`recover_publish`), touching
nothing else. A failed, interrupted or killed export leaves OUT as it was, one export at a time
holds OUT (a lock file beside it), and OUT may never be, contain or lie inside the base or
adapter folder (a subfolder of the adapter's folder is fine: a run's own merged/).
`--overwrite` replaces the files an export writes (by their exact names:
`publish.is_merged_file`) and keeps every other file in OUT.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import LeantuneError
from ..lora import LoRAConfig
from ..lora.layer import lora_scaling
from ..lora.peft_io import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, EXPERT_PROJECTIONS, lora_pairs,
                            read_adapter_config, unmatched)
from ..model.config import ModelConfig
from ..kernels.nf4 import dequantize_nf4_reference, nf4_from_bnb_state
from ..model.loader import (DTYPES, Headers, bnb_compute_dtype, bnb_quant_states,
                            plan_checkpoint, read_headers, resolve_checkpoint, safetensors_files)
from ..model.transformer import CausalLM
from ..model.weight_map import read_piece_into
from ..train.checkpoint import latest_checkpoint
from ..utils.io import atomic_write_json, refuse_link_at
from ..utils.lock import lock_beside
from ..utils.paths import check_output_folder
from .full import copy_side_files, set_config_dtype
from .publish import open_output, publishing
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
        log(f"{path} has no final adapter (the run was stopped before its end?): using its "
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
        from ..train.config import TrainConfig

        return TrainConfig.from_dict(cfg).lora.build()  # (nested, or flat as older runs wrote)
    except (ValueError, KeyError, TypeError) as e:
        raise LeantuneError(f"{ckpt / 'state.json'}: unreadable checkpoint state "
                            f"({type(e).__name__}: {e}); export another checkpoint") from None


def read_lora_pairs(adapter: Path, log=print) -> tuple[
        dict[str, tuple[torch.Tensor, torch.Tensor]], float, int]:
    """{base tensor name: (lora_A, lora_B)} in the model's layout ([r, in] / [out, r]; a MoE
    layer's stacked experts [E, r, in] / [E, out, r]), the scaling and the rank of --adapter
    `adapter` (`adapter_source`: an adapter folder, a checkpoint or a run folder)."""
    from safetensors.torch import load_file

    cfg, path = adapter_source(Path(adapter), log)
    scaling = lora_scaling(cfg.r, cfg.alpha, cfg.use_rslora)
    try:
        tensors = load_file(str(path))
    except Exception as e:
        raise LeantuneError(f"{path}: cannot read adapter weights ({type(e).__name__})") from None
    return lora_pairs(tensors, cfg.r, path), scaling, cfg.r


ST_FLOATS = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
ST_NAMES = {v: k for k, v in ST_FLOATS.items()}


class MergedWeights:
    """The base checkpoint's tensors with a LoRA adapter merged in, read one at a time.

    Projections get W + scaling * B @ A. MoE experts are stacked parameters in the model and
    per-expert, stacked or MXFP4 tensors in a checkpoint (model/weight_map.py): each expert e gets
    scaling * B_e @ A_e in the base's own layout (its rows of a per-expert gate/up pair; gpt-oss's
    [in, out]). An MXFP4 base with LoRA on its experts is written dequantised (`dequantised`:
    all its experts, in the dtype of its embedding, and no quantization_config in config.json).
    A 4-bit (bnb-4bit) base is read dequantised, or, with `merge_onto`, its 16-bit original is
    read instead (module docstring).

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
        files = safetensors_files(self.src)
        headers = read_headers(files)
        # a bnb-4bit base: {weight name: quant_state}; its tensors stand for the dense weight
        self.quant_states = bnb_quant_states(files)
        for name, state in self.quant_states.items():
            for key in [k for k in headers.shapes if k.startswith(name + ".")]:
                del headers.shapes[key], headers.dtypes[key]  # (their files stay known)
            headers.shapes[name] = tuple(state["shape"])
            headers.dtypes[name] = {"bfloat16": "BF16", "float16": "F16",
                                    "float32": "F32"}[state["dtype"]]
        self.onto = None
        if merge_onto is not None:
            files, headers = self._merge_onto(resolve_checkpoint(merge_onto), model, headers)
        self.files = headers.files  # tensor name -> its shard
        with torch.device("meta"):
            base = CausalLM(self.config)
        self.plan, _ = plan_checkpoint(base, files, headers)
        params = {n: tuple(p.shape) for n, p in base.named_parameters()}
        for key, (a, b) in self.deltas.items():
            self._check_delta(key, a, b, headers.shapes, params)
        # deltas of parameters stored under another name (Gemma 3 multimodal's
        # model.language_model.) or as rows of a fused tensor (Phi-3's qkv_proj, gate_up_proj):
        # checkpoint key -> [(rows or None, the delta's name)]
        self.routed: dict[str, list] = {}
        for name in self.deltas:
            pieces = self.plan.get(name) or []
            if len(pieces) == 1 and pieces[0].expert is None and pieces[0].scales is None \
                    and (pieces[0].key != name or pieces[0].fused_rows):
                self.routed.setdefault(pieces[0].key, []).append((pieces[0].fused_rows, name))
        # MXFP4 expert weights, written dense under the parameter's name when any has LoRA
        mxfp4 = {piece.key: name for name, pieces in self.plan.items() for piece in pieces
                 if piece.scales}
        if not any(name in self.deltas for name in mxfp4.values()):
            mxfp4 = {}
        self.dequantised = bool(mxfp4)
        dense = ST_FLOATS.get(headers.dtypes.get("model.embed_tokens.weight"), torch.bfloat16)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.st_dtypes: dict[str, str] = {}  # safetensors dtype strings ("BF16", "F32", ...)
        self.dense: dict[str, torch.dtype] = {}  # parameter -> dtype, for dequantised MXFP4
        scales = {self.plan[name][0].scales for name in mxfp4.values()}
        for key, shape in headers.shapes.items():
            if key in mxfp4:
                name = mxfp4[key]
                self.shapes[name], self.dense[name] = params[name], dense
                self.st_dtypes[name] = ST_NAMES[dense]
            elif key not in scales:
                self.shapes[key], self.st_dtypes[key] = shape, headers.dtypes[key]
        # per-expert or stacked tensors of experts with LoRA: key -> (parameter, its piece)
        self.expert_pieces = {piece.key: (name, piece) for name, pieces in self.plan.items()
                              if name in self.deltas and name.endswith(EXPERT_PROJECTIONS)
                              and name not in self.dense for piece in pieces}

    def _check_delta(self, key, a, b, shapes, params) -> None:
        where = self.adapter_dir
        if key.endswith(EXPERT_PROJECTIONS):
            if key not in params:
                raise unmatched(where, key)
            E, d1, d2 = params[key]
            n_in, n_out = (d1, d2) if self.config.moe.transposed else (d2, d1)
            if (a.dim() != 3 or b.dim() != 3 or a.shape[0] != E or b.shape[0] != E
                    or a.shape[2] != n_in or b.shape[1] != n_out or a.shape[1] != b.shape[2]):
                raise LeantuneError(f"{where}: {key}: lora_A {tuple(a.shape)} and lora_B "
                                    f"{tuple(b.shape)} do not fit the experts {params[key]}; "
                                    "is it the adapter of another model?")
            return
        want = shapes.get(key, params.get(key))  # (a parameter stored under another name)
        if want is None:
            raise unmatched(where, key)
        if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != want \
                or a.shape[0] != b.shape[1]:
            raise LeantuneError(f"{where}: {key}: lora_A {tuple(a.shape)} and lora_B "
                                f"{tuple(b.shape)} do not fit the base weight {want}; "
                                "is it the adapter of another model?")

    def _merge_onto(self, onto: Path, model, base: "Headers"):
        """(files, headers) of `onto`, the 16-bit original of this 4-bit base, to read instead:
        it must hold the same tensors with the same shapes (the dequantised base's)."""
        if not self.quant_states:
            raise LeantuneError(f"--merge-onto {onto}: --model {model} is a 16-bit checkpoint "
                                "already, and the adapter is merged onto it; --merge-onto names "
                                "the 16-bit original of a 4-bit (bnb-4bit) --model")
        files = safetensors_files(onto)
        headers = read_headers(files)
        if bnb_quant_states(files) or \
                ModelConfig.from_file(onto / "config.json").raw.get("quantization_config"):
            raise LeantuneError(f"--merge-onto {onto}: a quantised checkpoint; give the 16-bit "
                                f"original that {model} was quantised from")
        for key, shape in base.shapes.items():
            have = headers.shapes.get(key)
            if have != shape:
                raise LeantuneError(f"--merge-onto {onto}: tensor {key} is "
                                    f"{'missing' if have is None else f'of shape {have}'} where "
                                    f"{model} has {shape}; it is not the original of this base")
        self.onto = onto
        return files, headers

    def hf_config(self) -> dict:
        """The merged model's config.json: --merge-onto's, or the base's (without its
        quantization_config where the export is 16-bit: a 4-bit base, or MXFP4 experts
        dequantised), and without an auto_map: the export is leantune's own weights of an
        architecture transformers knows, and carries no code of the base's)."""
        config = json.loads(((self.onto or self.src) / "config.json").read_text())
        config.pop("auto_map", None)
        if self.quant_states or self.dequantised:
            config.pop("quantization_config", None)
        return config

    def names(self) -> list[str]:
        return list(self.shapes)

    def _expert_delta(self, name: str, expert: int | None = None) -> torch.Tensor:
        """scaling * B_e @ A_e in the parameter's layout: all experts [E, ...], or one."""
        a, b = self.deltas[name]
        if expert is None:
            d = torch.bmm(b.float(), a.float())
        else:
            d = b[expert].float() @ a[expert].float()
        return (d.transpose(-1, -2) if self.config.moe.transposed else d) * self.scaling

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
        from safetensors import safe_open

        if key in self.dense:  # an MXFP4 expert parameter with LoRA, dequantised
            piece = self.plan[key][0]
            t = torch.empty(self.shapes[key], dtype=torch.float32)
            with safe_open(str(self.files[piece.key]), framework="pt", device="cpu") as sf, \
                    safe_open(str(self.files[piece.scales]), framework="pt", device="cpu") as sc:
                read_piece_into(t, piece, sf, sc)
            if key in self.deltas:
                t += self._expert_delta(key)
            return t.to(dtype or self.dense[key])
        t = self._read(key)
        if key in self.expert_pieces:
            name, piece = self.expert_pieces[key]
            if piece.expert is None:
                delta = self._expert_delta(name)
            else:
                delta = self._expert_delta(name, piece.expert)
                delta = delta if piece.rows is None else delta[piece.rows[0]:piece.rows[1]]
            return (t.float() + delta).to(dtype or t.dtype)
        if key in self.routed:
            merged = t.float()
            for rows, name in self.routed[key]:
                a, b = self.deltas[name]
                part = merged if rows is None else merged[rows[0]:rows[1]]
                part += (b.float() @ a.float()) * self.scaling
            return merged.to(dtype or t.dtype)
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
    refuse_link_at(out, "output folder")  # (a planted RUN/merged link: never written through)
    check_output_folder(out, {"base model": src, "adapter": adapter, "original model": onto},
                        may_lie_inside=("adapter",))
    with lock_beside(out):  # one export into `out` at a time (a second names its PID)
        open_output(out, overwrite, log)  # first, what an export killed in `out` left
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

        with publishing(out) as tmp:  # (export/publish.py)
            write_sharded(entries, tmp, max_shard_bytes)
            config = weights.hf_config()
            if out_dtype is not None:
                set_config_dtype(config, dtype)
            atomic_write_json(tmp / "config.json", config)
            copy_side_files(src, tmp)
            if adapter is not None and adapter.is_dir():  # a base without tokenizer files:
                copy_side_files(adapter, tmp, only_missing=True)  # the run saved them there
            write_generation_config(src, tmp)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(st_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
            "I16": 2, "U16": 2}.get(st_dtype, 1)
