"""Which checkpoint tensors fill which model parameter: the map the loader, the pre-flight check
and the merged export share. Built from the safetensors headers alone (names and shapes), so a
checkpoint that does not fit its config.json fails before any weight is read.

Most parameters come from the tensor of the same name. Mixture-of-experts expert weights are
stacked parameters in the model (model/moe.py) and come in three checkpoint layouts (layer l,
E experts, I an expert's intermediate size, H hidden):
- stacked, the model's own names and shapes: transformers 5.x with `save_original_format=False`,
  and gpt-oss in bf16;
- per expert, 2-D [out, in] tensors: transformers 4.x, and what 5.x writes by default:
    Qwen3-MoE  model.layers.l.mlp.experts.e.{gate_proj, up_proj, down_proj}.weight
    Mixtral    model.layers.l.block_sparse_moe.experts.e.{w1, w3, w2}.weight (gate, up, down),
               and the router as model.layers.l.block_sparse_moe.gate.weight
  gate and up are rows [:I] and [I:] of expert e's slice of experts.gate_up_proj;
- MXFP4 (gpt-oss as released): experts.gate_up_proj_blocks [E, 2I, H/32, 16] and
  experts.gate_up_proj_scales [E, 2I, H/32] (down_proj likewise, [E, H, I/32, ...]), each
  expert [out, in]; dequantised (model/mxfp4.py) and transposed into the model's [in, out].
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LeantuneError
from ..utils.words import count
from .families import family
from .mxfp4 import BLOCK, dequantize_mxfp4

_LAYER_MODULE = re.compile(r"(model\.layers\.\d+)\.(.+)\.weight")
_EXPERTS = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_ROUTER = re.compile(r"(model\.layers\.\d+)\.mlp\.gate\.weight")


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor `key` (of `shape`) and the part of a parameter it fills:
    p[expert, rows[0]:rows[1]] (expert None: all of p; rows None: all rows of the expert).
    `fused_rows`: p is rows [a, b) of the checkpoint tensor `key` (Phi-3's qkv_proj and
    gate_up_proj, which hold several of our projections).
    `scales`: key holds MXFP4 blocks and this tensor their scales, of shape shape[:-1]
    (dequantised, each expert transposed from [out, in] to the parameter's [in, out])."""

    key: str
    shape: tuple[int, ...]
    expert: int | None = None
    rows: tuple[int, int] | None = None
    scales: str | None = None
    fused_rows: tuple[int, int] | None = None

    def target(self, p: torch.Tensor) -> torch.Tensor:
        """The view of parameter (or same-shaped tensor) `p` this piece fills."""
        if self.expert is None:
            return p
        t = p[self.expert]
        return t if self.rows is None else t[self.rows[0]:self.rows[1]]


def plan_weights(model_type: str, params: dict[str, tuple[int, ...]],
                 shapes: dict[str, tuple[int, ...]], file_of: dict[str, Path],
                 folder: Path) -> dict[str, list[Piece]]:
    """{parameter: the pieces that fill it} for the parameters `params` (name -> shape; LoRA
    left out) of a checkpoint whose tensors have `shapes` (in the files `file_of`). A tensor of
    the wrong shape or a parameter without pieces is a one-line LeantuneError."""
    plan, missing = {}, []
    fam = family(model_type)
    fused = fused_rows(fam, params)
    for name, shape in params.items():
        key = next((k for k in fam.checkpoint_names(name) if k in shapes), None)
        if key is not None:
            pieces = [Piece(key, shape)]
        elif name in fused and fused[name][0] in shapes:
            key, rows, whole = fused[name]
            pieces = [Piece(key, whole, fused_rows=rows)]
        else:
            pieces = _expert_pieces(model_type, name, shape, shapes)
        if pieces is None:  # (a fused family: the checkpoint tensor that holds it, once)
            missing.append(fused[name][0] if name in fused else name)
            continue
        for piece in pieces:
            tensors = [(piece.key, piece.shape)]
            if piece.scales:
                tensors.append((piece.scales, piece.shape[:-1]))
            for key, want in tensors:
                if key not in shapes:
                    missing.append(key)
                elif shapes[key] != want:
                    raise LeantuneError(
                        f"{file_of[key]}: tensor {key} has shape {shapes[key]}, config.json "
                        f"implies {want}; the weights do not belong to this config.json "
                        "(re-download the model, or restore its config.json)")
        plan[name] = pieces
    if missing:
        missing = sorted(set(missing))
        raise LeantuneError(f"{folder}: {count(len(missing), 'weight')} missing from the "
                            f"checkpoint (e.g. {missing[0]}); the download is incomplete: "
                            "re-download the model")
    return plan


def fused_rows(fam, params: dict) -> dict[str, tuple[str, tuple[int, int], tuple]]:
    """{parameter: (checkpoint tensor, its rows [a, b), that tensor's shape)} for the
    parameters a family's fused checkpoint tensors hold (Family.fused)."""
    out = {}
    for name in params:
        m = _LAYER_MODULE.fullmatch(name)
        if m is None:
            continue
        for theirs, ours in fam.fused.items():
            if m[2] == ours[0]:
                parts = [f"{m[1]}.{o}.weight" for o in ours]
                if not all(p in params for p in parts):
                    break
                rows = [params[p][0] for p in parts]
                whole = (sum(rows), *params[parts[0]][1:])
                start = 0
                for p, n in zip(parts, rows):
                    out[p] = (f"{m[1]}.{theirs}.weight", (start, start + n), whole)
                    start += n
    return out


def _expert_pieces(model_type, name, shape, shapes) -> list[Piece] | None:
    """The pieces of a stacked expert parameter (or a Mixtral router) in the per-expert or
    MXFP4 layouts (module docstring); None when the checkpoint has neither."""
    fam = family(model_type)
    router = _ROUTER.fullmatch(name)
    if router and fam.router_module:
        return [Piece(f"{router[1]}.{fam.router_module}.weight", shape)]
    m = _EXPERTS.fullmatch(name)
    if m is None:
        return None
    layer, proj = m[1], m[2]
    E = shape[0]
    if f"{name}_blocks" in shapes:  # MXFP4: [E, out, in / 32, 16]; the parameter is [E, in, out]
        n_in, n_out = shape[1], shape[2]
        return [Piece(f"{name}_blocks", (E, n_out, n_in // BLOCK, BLOCK // 2),
                      scales=f"{name}_scales")]
    if fam.per_expert is None:
        return None
    module, parts = fam.per_expert
    names = parts[proj]
    if f"{layer}.{module}.experts.0.{names[0]}.weight" not in shapes:
        return None
    rows = shape[1] // len(names)
    return [Piece(f"{layer}.{module}.experts.{e}.{part}.weight", (rows, shape[2]), e,
                  (j * rows, (j + 1) * rows) if len(names) > 1 else None)
            for e in range(E) for j, part in enumerate(names)]


def read_piece_into(dest: torch.Tensor, piece: Piece, handle, scales_handle=None) -> None:
    """Fill `piece.target(dest)` from the open safetensors `handle` (the MXFP4 scales from
    `scales_handle`, default `handle`): one tensor, or for MXFP4 one expert at a time."""
    if piece.fused_rows is not None:
        a, b = piece.fused_rows
        piece.target(dest).copy_(handle.get_slice(piece.key)[a:b])
        return
    if piece.scales is None:
        piece.target(dest).copy_(handle.get_tensor(piece.key))
        return
    blocks = handle.get_slice(piece.key)
    scales = (scales_handle or handle).get_slice(piece.scales)
    for e in range(piece.shape[0]):
        values = dequantize_mxfp4(blocks[e], scales[e])  # [out, in]
        dest[e].copy_(values.t())


def fused_state(model) -> dict[str, torch.Tensor]:
    """The model's base weights (no LoRA) under the checkpoint's names where its family fuses
    projections (Phi-3: q/k/v rows concatenated into qkv_proj, gate/up into gate_up_proj), for
    handing them to the transformers model (the benchmarks' baseline); other tensors as they
    are (shared, not copied)."""
    state = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    fused = model.config.family.fused
    for key in list(state):
        m = _LAYER_MODULE.fullmatch(key)
        for theirs, ours in fused.items():
            if m and m[2] == ours[0]:
                parts = [f"{m[1]}.{o}.weight" for o in ours]
                state[f"{m[1]}.{theirs}.weight"] = torch.cat([state.pop(p) for p in parts])
    return state
