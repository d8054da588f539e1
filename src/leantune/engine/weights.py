"""Base weights as the hand-written layers' GEMMs read them: the weight provider.

Projections that share an input (q/k/v; gate/up) and the down projection run as one GEMM each
over a packed weight: the modules' base weights become row blocks of one buffer
[sum out, in + sum r (+ padding)] whose extra columns hold s * B (block-diagonal), and the input
buffer [n, in + sum r] carries x A_cat^T beside x, so the GEMM adds the LoRA term too:

    [x | x A_cat^T] @ [W_cat | s B_blockdiag]^T = x W_cat^T + s (x A^T) B^T per projection.

One wide GEMM runs faster than several narrow ones, and no pass over the output adds the LoRA
term. The modules' `weight` Parameters become views into the buffer: no copy of the weights (the
LoRA columns and padding add ~1%: 4.75 MiB a layer at Llama-3.1-8B). Off with
EngineOptions.pack_projections (separate GEMMs) or .pack_lora (packed without LoRA columns; the
LoRA term then comes from a rank-r product per projection: 2.7% slower at Llama-3.1-8B).

A group asks its provider for the weight at every GEMM (`WeightSource.get`), instead of holding a
dense weight from forward to backward. Dense weights are the packed buffer itself. This is the
seam for quantised bases (QLoRA): an NF4 provider dequantises into one scratch buffer reused by
every GEMM of that shape, so no layer's 16-bit weight lives between its forward and backward.
"""

from __future__ import annotations

import torch

from .options import EngineOptions


def _lora_rank(m) -> int:
    return m.r if m.has_lora else 0


class WeightSource:
    """What one projection group's GEMMs read, for one layer run.

    packed: the packed weight [sum out, width] (LoRA columns as of the group's creation), or
    None where the group runs unpacked; `get()` returns it (the packed GEMMs call it each time);
    `dense(i)` is projection i's base weight [out_i, in] (a view into the packed buffer when
    packed)."""

    def __init__(self, mods, packed: torch.Tensor | None):
        self.mods = mods
        self.packed = packed

    @property
    def width(self) -> int | None:
        return None if self.packed is None else self.packed.shape[1]

    def get(self) -> torch.Tensor:
        return self.packed

    @torch.no_grad()
    def write_lora_columns(self, in_f: int, cols: list) -> None:
        """Put s * B of each adapted projection into its own LoRA columns of the packed weight
        (once per layer run: B changes every step). cols: per projection a slice of the R
        LoRA columns, or None."""
        row = 0
        for m, c in zip(self.mods, cols):
            if c is not None:
                self.packed[row:row + m.out_features, in_f + c.start:in_f + c.stop].copy_(
                    m.lora_B.weight * m.scaling)
            row += m.out_features

    def dense(self, i: int) -> torch.Tensor:
        return self.mods[i].base_weight()


class DenseWeights:
    """The provider for 16-bit (or fp32) base weights: packs each group's weights once per
    layout (EngineOptions.pack_*), re-packing when the weights, their dtype/device or the LoRA
    ranks change."""

    def __init__(self, options: EngineOptions):
        self.options = options

    def source(self, mods, dtype: torch.dtype, pack: bool) -> WeightSource:
        """The weights of projections `mods` (one input), packed where `pack` and possible."""
        packed = self.packed(mods) if pack else None
        if packed is not None and packed.dtype != dtype:
            packed = None
        return WeightSource(mods, packed)

    def packed(self, mods) -> torch.Tensor | None:
        """The packed weight of projections reading one input (made, or remade, on first use),
        or None where packing is off or impossible (a quantised or trainable base, mixed input
        sizes or dtypes).

        The modules hold no reference to the buffer, only their weights' views of its storage
        (and the layout as plain numbers): after `.to()` gives the weights fresh storage,
        nothing keeps the old buffer alive."""
        from ..lora.layer import LoRALinear

        opts = self.options
        if not opts.pack_projections or any(
                type(m).base_weight is not LoRALinear.base_weight or m.weight.requires_grad
                for m in mods):
            return None
        w0 = mods[0].weight
        if any(m.in_features != mods[0].in_features or m.weight.dtype != w0.dtype
               or m.weight.device != w0.device for m in mods):
            return None
        in_f = mods[0].in_features
        ranks = tuple(_lora_rank(m) if opts.pack_lora else 0 for m in mods)
        width = in_f + sum(ranks)
        if width > in_f:
            width += -width % opts.pack_align
        shape = (sum(m.out_features for m in mods), width)
        layout = (shape, ranks)
        if getattr(mods[0], "_lt_packed_layout", None) == layout:
            storage, row, ok = w0.untyped_storage(), 0, True
            for m in mods:
                ok = ok and (m.weight.untyped_storage().data_ptr() == storage.data_ptr()
                             and m.weight.storage_offset() == row * width
                             and m.weight.stride() == (width, 1))
                row += m.out_features
            if ok and storage.nbytes() >= shape[0] * width * w0.element_size():
                return torch.empty(0, dtype=w0.dtype, device=w0.device).set_(
                    storage, 0, shape, (width, 1))
        buf = torch.zeros(shape, dtype=w0.dtype, device=w0.device)  # LoRA columns, padding: 0
        row = 0
        with torch.no_grad():
            for m in mods:
                view = buf[row:row + m.out_features, :in_f]
                view.copy_(m.weight)
                m.weight.data = view  # the old storage is freed: no extra memory
                row += m.out_features
        mods[0]._lt_packed_layout = layout
        return buf


def layer_groups(layer) -> tuple[list, list, list, list]:
    """A decoder layer's projections by shared input: q/k/v, o, gate/up, down."""
    a, m = layer.self_attn, layer.mlp
    return ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj])


def pack_layer(layer, weights: DenseWeights) -> None:
    """Pack a layer's q/k/v, gate/up and down weights now (as its first fused forward would),
    so that a training step never allocates them and memory is measured with them."""
    qkv, _, gu, down = layer_groups(layer)
    for mods in (qkv, gu, down):
        weights.packed(mods)
