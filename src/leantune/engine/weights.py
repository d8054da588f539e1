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
dense weight from forward to backward. Dense weights are the packed buffer itself. A group with a
4-bit (NF4) base (QLoRA) reads a scratch buffer of the packed shape instead, one per shape and
dtype shared by every layer (`ScratchPool`): `get()` dequantises the group's weights into its left
columns (the Triton kernel writes the strided view directly) and writes s * B into its LoRA
columns, unless the buffer still holds them for this layer run. So no layer's 16-bit weight
lives between its forward and its backward (which dequantises again, except in the last layer,
whose weights are still in the buffers), and the GEMMs are those of the dense path.

A group with an FP8 base (--precision fp8, `FP8Source`) runs FP8 GEMMs reading the e4m3 codes
as stored: one each way over the members' codes stacked (`DenseWeights.fp8_packed`: the
members' buffers become views of one, as 16-bit weights do) where every output size is a
multiple of 128 (q/k/v and gate/up of the usual shapes), else each projection's own
(lora/base_weight.FP8Base). The LoRA columns stay out of the FP8 codes: the LoRA term is the
16-bit rank-r product beside the GEMM. Where dX's kernel reads the codes
transposed (kernels/fp8_gemm.py), it transposes them into a pooled e4m3 scratch buffer per
GEMM: one per weight shape, shared by every layer (no second resident copy). Where a forward
GEMM runs on cuBLAS, which quantises its input by a pass of its own, `quantized_input` gives
buffers for the input's codes instead, which the kernel producing the input (the norm, the
GLU: engine/executor.py) writes as it writes the input (kernels/fp8_quant.QuantizedRows).
"""

from __future__ import annotations

import functools

import torch

from ..kernels.fp8 import BLOCK as FP8_BLOCK
from ..kernels.fp8 import FP8_DTYPE, FP8View, fp8_mm, takes_quantized
from ..kernels.fp8_gemm import transposes
from ..kernels.fp8_quant import QuantizedRows, plain
from ..lora.base_weight import DenseBase
from .options import EngineOptions


def _lora_rank(m) -> int:
    return m.r if m.has_lora else 0


class WeightSource:
    """What one projection group's GEMMs read, for one layer run.

    packed: the packed weight [sum out, width] (LoRA columns as of the group's creation), or
    None where the group runs unpacked; `get()` returns it (the packed GEMMs call it each time);
    `dense(i)` is projection i's base weight [out_i, in] (a view into the packed buffer when
    packed). adds_residual_free: whether mm / mm_packed add a residual inside the GEMM at no
    extra pass (the FP8 kernels' epilogue); a 16-bit cuBLAS addmm copies it into `out` first."""

    adds_residual_free = False

    def __init__(self, mods, packed: torch.Tensor | None):
        self.mods = mods
        self.packed = packed

    @property
    def width(self) -> int | None:
        return None if self.packed is None else self.packed.shape[1]

    def get(self) -> torch.Tensor:
        return self.packed

    def mm_packed(self, X: torch.Tensor, out: torch.Tensor | None = None,
                  resid: torch.Tensor | None = None) -> torch.Tensor:
        """resid + X W_packed^T: the whole group in one GEMM (X: the packed input buffer)."""
        return DenseBase(self.get()).mm(X, out=out, resid=resid)

    def mm_t_packed(self, dy: torch.Tensor, in_f: int,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """dy W_cat [n, in]: the group's input gradient in one GEMM (K = sum out)."""
        return DenseBase(self.get()[:, :in_f]).mm_t(dy, out=out)

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

    def quantized_input(self, x: torch.Tensor) -> QuantizedRows | None:
        """Buffers for the codes of the group's input x [n, in] where its forward GEMMs would
        quantise x themselves (the cuBLAS FP8 path), for the kernel producing x to write;
        None here (16-bit GEMMs read x as it is)."""
        return None

    def quantized_grad(self, dy: torch.Tensor) -> QuantizedRows | None:
        """As quantized_input, for the input-gradient GEMM's dy [n, sum out] (the packed GEMM,
        or a group of one projection): None here."""
        return None

    def mm(self, i: int, x: torch.Tensor, out: torch.Tensor | None = None,
           resid: torch.Tensor | None = None) -> torch.Tensor:
        """resid + x W_i^T for projection i alone (the unpacked GEMMs), into `out`."""
        return DenseBase(self.dense(i)).mm(x, out=out, resid=resid)

    def mm_t(self, i: int, dy: torch.Tensor, out: torch.Tensor | None = None,
             accumulate: bool = False) -> torch.Tensor:
        """dy W_i for projection i alone, into `out` (added to it with `accumulate`)."""
        return DenseBase(self.dense(i)).mm_t(dy, out=out, accumulate=accumulate)


class ScratchPool:
    """Dequantised weights' buffers: one per (shape, dtype, device), shared by every layer, with
    the owner whose weights it holds now."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.owners: dict[tuple, tuple] = {}

    def buffer(self, shape: tuple[int, int], dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        if key not in self.buffers:
            self.buffers[key] = torch.empty(shape, dtype=dtype, device=device)
        return self.buffers[key]

    def claim(self, buf: torch.Tensor, owner: tuple) -> bool:
        """Make `owner` (a source object and a tag) the holder of `buf`; True when it was not
        already, so the caller must fill it."""
        key = (tuple(buf.shape), buf.dtype, buf.device)
        held = self.owners.get(key)
        if held is not None and held[0] is owner[0] and held[1:] == owner[1:]:
            return False
        self.owners[key] = owner
        return True

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class NF4Source(WeightSource):
    """A group with at least one 4-bit base weight, for one layer run: its packed weight, or
    each unpacked projection's weight, lives in the pool's scratch buffer of that shape, filled
    at `get()` / `dense(i)` (16-bit members of the group are copied in)."""

    def __init__(self, mods, pool: ScratchPool, dtype: torch.dtype,
                 shape: tuple[int, int] | None):
        packed = None if shape is None else pool.buffer(shape, dtype, mods[0].base_device)
        super().__init__(mods, packed)
        self.pool, self.dtype = pool, dtype
        self.lora = None  # (in_f, cols) once write_lora_columns was called

    def write_lora_columns(self, in_f: int, cols: list) -> None:
        self.lora = (in_f, cols)  # written at each fill: other groups share the buffer

    @torch.no_grad()
    def get(self) -> torch.Tensor:
        if self.pool.claim(self.packed, (self, "packed")):
            in_f = self.mods[0].in_features
            row = 0
            for m in self.mods:
                _dense_into(m, self.packed[row:row + m.out_features, :in_f])
                row += m.out_features
            if self.packed.shape[1] > in_f:
                self.packed[:, in_f:].zero_()  # LoRA columns off the diagonal, padding
            if self.lora is not None:
                super().write_lora_columns(*self.lora)
        return self.packed

    @torch.no_grad()
    def dense(self, i: int) -> torch.Tensor:
        m = self.mods[i]
        buf = self.pool.buffer((m.out_features, m.in_features), self.dtype, m.base_device)
        if self.pool.claim(buf, (self, i)):
            _dense_into(m, buf)
        return buf


class FP8Source(WeightSource):
    """A group with at least one FP8 base weight. The LoRA columns stay out of the FP8 codes
    (the adapter's rank-r products run in 16-bit beside the GEMMs). Packed (`packed`: an
    FP8View over its members' codes, made once by DenseWeights.fp8_packed), the group runs
    one FP8 GEMM each way; unpacked, each projection's GEMMs are its own base's (FP8 ones for
    FP8 members: lora/base_weight.FP8Base)."""

    adds_residual_free = True

    def __init__(self, mods, pool: ScratchPool, packed: FP8View | None = None):
        super().__init__(mods, packed)
        self.pool = pool

    def get(self):
        raise RuntimeError("an FP8 group runs its own GEMMs (mm_packed / mm_t_packed)")

    def quantized_input(self, x):
        """(WeightSource.quantized_input) where the packed GEMM, or an FP8 member's own,
        takes x pre-quantised (kernels/fp8.takes_quantized)."""
        ws = ([self.packed] if self.packed is not None
              else [m.fp8 for m in self.mods if m.fp8 is not None])
        return QuantizedRows.empty(x) if any(takes_quantized(x, w) for w in ws) else None

    def quantized_grad(self, dy):
        """(WeightSource.quantized_grad) where the packed input-gradient GEMM, or the one
        member's, takes dy pre-quantised (kernels/fp8.takes_quantized, transposed)."""
        w = self.packed if self.packed is not None else (
            self.mods[0].fp8 if len(self.mods) == 1 else None)
        if w is None or not takes_quantized(dy, w, transpose=True, switch=True):
            return None
        return QuantizedRows.empty(dy)

    def mm_packed(self, X, out=None, resid=None):
        """(X: the input, or its QuantizedRows)"""
        return fp8_mm(X, self.packed, out=out, resid=resid)

    def mm_t_packed(self, dy, in_f, out=None):
        """(dy: the output gradient, or its QuantizedRows)"""
        return fp8_mm(dy, self.packed, transpose=True, out=out,
                      scratch=fp8_dx_scratch(self.pool, self.packed.shape, self.packed.device))

    def dense(self, i: int) -> torch.Tensor:
        raise RuntimeError("an FP8 base runs its own GEMMs (mm / mm_t), not a dense weight's")

    def mm(self, i, x, out=None, resid=None):
        """(x: the input, or its QuantizedRows, which only FP8 bases read)"""
        base = self.mods[i].base
        return base.mm(x if base.kind == "fp8" else plain(x), out=out, resid=resid)

    def mm_t(self, i, dy, out=None, accumulate=False):
        """(dy: the output gradient, or its QuantizedRows where the base is FP8:
        quantized_grad)"""
        base = self.mods[i].base
        if base.kind != "fp8":
            return base.mm_t(dy, out=out, accumulate=accumulate)
        return base.mm_t(dy, out=out, accumulate=accumulate,
                         scratch=fp8_dx_scratch(self.pool, base.shape, base.device))


def fp8_dx_scratch(pool: ScratchPool, shape: tuple[int, int],
                   device: torch.device) -> torch.Tensor | None:
    """The shared e4m3 [in, out] buffer dX's kernel transposes an [out, in] weight's codes into,
    where it does (kernels/fp8_gemm.transposes), else None."""
    if not transposes(device):
        return None
    return pool.buffer((shape[1], shape[0]), FP8_DTYPE, device)


def _dense_into(m, out: torch.Tensor) -> None:
    """Projection m's base weight into `out` (dequantised, or copied if 16-bit)."""
    m.base.dequantize(out=out)


class DenseWeights:
    """The weight provider. 16-bit (or fp32) base weights: packs each group's weights once per
    layout (EngineOptions.pack_*), re-packing when the weights, their dtype/device or the LoRA
    ranks change. Groups with a 4-bit base: NF4Source over the shared scratch buffers."""

    def __init__(self, options: EngineOptions):
        self.options = options
        self.scratch = ScratchPool()  # (groups with a 4-bit base)

    def source(self, mods, dtype: torch.dtype, pack: bool) -> WeightSource:
        """The weights of projections `mods` (one input), packed where `pack` and possible."""
        if any(m.fp8 is not None for m in mods):
            return FP8Source(mods, self.scratch, self.fp8_packed(mods) if pack else None)
        if any(m.nf4 is not None for m in mods):
            shape = self.layout(mods)[0] if pack and self.packable(mods) else None
            return NF4Source(mods, self.scratch, dtype, shape)
        packed = self.packed(mods) if pack else None
        if packed is not None and packed.dtype != dtype:
            packed = None
        return WeightSource(mods, packed)

    def experts(self, experts, name: str) -> torch.Tensor:
        """The stacked base weight of a MoE layer's expert projection `name` as its grouped
        GEMMs read it, [E, in, out]: for 16-bit experts a view of the parameter (the seam for
        4-bit experts: they would be dequantised here, as `source` does for projections)."""
        return experts.weight_in_out(name)

    def packable(self, mods) -> bool:
        """Whether projections `mods` can share a packed weight: packing on, frozen bases of one
        input size, device and compute dtype."""
        from ..lora.layer import LoRALinear

        m0 = mods[0]
        return self.options.pack_projections and not any(
            type(m).base_weight is not LoRALinear.base_weight
            or (m.weight is not None and m.weight.requires_grad)
            or m.in_features != m0.in_features or m.base_dtype != m0.base_dtype
            or m.base_device != m0.base_device for m in mods)

    def fp8_packed(self, mods) -> FP8View | None:
        """The packed FP8 weight of projections reading one input: their codes [sum out, in]
        and block scales as one FP8View (made, or remade, on first use), or None where packing
        is off or impossible (a member not FP8, mixed input sizes or compute dtypes, an output
        size not a multiple of 128: its last scale block would straddle two projections).

        As for 16-bit weights, the members' buffers become views into the packed ones (no
        copy kept) and the modules hold only the layout; the view is rebuilt from their
        storage at each call."""
        m0 = mods[0]
        if not self.options.pack_projections or len(mods) < 2 or any(
                m.fp8 is None or m.in_features != m0.in_features or m.fp8.dtype != m0.fp8.dtype
                or m.out_features % FP8_BLOCK for m in mods):
            return None
        shape = (sum(m.out_features for m in mods), m0.in_features)
        parts = [(m.fp8.data, m.fp8.scale) for m in mods]
        if getattr(m0, "_lt_fp8_packed_layout", None) == shape:
            view = FP8View.over(parts, shape, m0.fp8.dtype)
            if view is not None:
                return view
        view = FP8View.packed(parts, shape, m0.fp8.dtype)
        row = 0
        for m in mods:  # (the old buffers are freed: no extra memory)
            m.fp8.data = view.data[row:row + m.out_features]
            m.fp8.scale = view.scale[row // FP8_BLOCK:(row + m.out_features) // FP8_BLOCK]
            row += m.out_features
        m0._lt_fp8_packed_layout = shape
        return view

    def layout(self, mods) -> tuple[tuple[int, int], tuple[int, ...]]:
        """The packed weight's shape [sum out, in + sum r (+ padding)] and each projection's
        LoRA columns (0 without LoRA, or where the LoRA columns are off)."""
        in_f = mods[0].in_features
        ranks = tuple(_lora_rank(m) if self.options.pack_lora else 0 for m in mods)
        width = in_f + sum(ranks)
        if width > in_f:
            width += -width % self.options.pack_align
        return (sum(m.out_features for m in mods), width), ranks

    def packed(self, mods) -> torch.Tensor | None:
        """The packed weight of projections reading one input (made, or remade, on first use),
        or None where packing is off or impossible (a quantised or trainable base, mixed input
        sizes or dtypes).

        The modules hold no reference to the buffer, only their weights' views of its storage
        (and the layout as plain numbers): after `.to()` gives the weights fresh storage,
        nothing keeps the old buffer alive."""
        if any(m.quantized is not None for m in mods) or not self.packable(mods):
            return None
        w0 = mods[0].weight
        in_f = mods[0].in_features
        layout = self.layout(mods)
        shape, width = layout[0], layout[0][1]
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


@functools.cache
def plain_weights() -> DenseWeights:
    """A DenseWeights with the default options, for stacking FP8 groups outside an engine
    (quantize_fp8_, plain decoding): it keeps no state of its own (the layout lives on the
    modules), so one serves every model."""
    return DenseWeights(EngineOptions())


def layer_groups(layer) -> tuple[list, list, list, list]:
    """A decoder layer's projections by shared input: q/k/v, o, gate/up, down (a MoE layer's
    experts are not projections: its gate/up and down groups are empty)."""
    a, m = layer.self_attn, layer.mlp
    if not hasattr(m, "gate_proj"):
        return [a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [], []
    return ([a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [m.gate_proj, m.up_proj], [m.down_proj])


def pack_layer(layer, weights: DenseWeights) -> None:
    """Pack a layer's q/k/v, gate/up and down weights now (as its first fused forward would),
    or, for a 4-bit base, allocate the scratch buffers its GEMMs will dequantise into, so that a
    training step never allocates them and memory is measured with them."""
    qkv, o, gu, down = layer_groups(layer)
    for mods in (qkv, o, gu, down):
        if not mods:
            continue
        if any(m.fp8 is not None for m in mods):
            # FP8 GEMMs read the codes as stored (packed where they can be); dX may transpose
            packed = weights.fp8_packed(mods) if mods is not o else None
            for q in [packed] if packed is not None else [m.fp8 for m in mods if m.fp8]:
                fp8_dx_scratch(weights.scratch, q.shape, q.device)
            continue
        if any(m.nf4 is not None for m in mods):
            pack = mods is not o and weights.packable(mods)  # (o runs unpacked)
            shapes = ([weights.layout(mods)[0]] if pack
                      else [(m.out_features, m.in_features) for m in mods])
            for shape in shapes:
                weights.scratch.buffer(shape, mods[0].base_dtype, mods[0].base_device)
        elif mods is not o:
            weights.packed(mods)
