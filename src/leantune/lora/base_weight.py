"""A projection's frozen base weight W [out, in] as one object, whatever its storage: its two
GEMMs, its dense value, what it supports and its bytes. LoRALinear (lora/layer.py) and the
engine's weight provider (engine/weights.py) call these instead of branching on the format.

    mm(x)     Y  = x W^T    x [n, in]   -> [n, out]     (the forward)
    mm_t(dy)  dX = dy W     dy [n, out] -> [n, in]      (the input gradient; W has none)

Kinds:
    DenseBase  a 16-bit (or fp32) Parameter: cuBLAS GEMMs; can be packed in place with its
               group's LoRA columns (engine/weights.py), can train (full fine-tuning).
    NF4Base    QLoRA's 4-bit codes (kernels/nf4.py): each GEMM dequantises W (Triton on CUDA,
               into the engine's scratch buffer there) and runs the 16-bit GEMM.
    FP8Base    e4m3 codes with 128 x 128 block scales (kernels/fp8.py): each GEMM runs in FP8,
               the activation quantised per 1 x 128 block inside it (kernels/fp8_gemm.py); on
               the CPU, the emulation. Never packed with LoRA columns: the adapter stays 16-bit.

The objects are views: cheap to make per call (LoRALinear.base), holding no tensor of their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import LeantuneError
from ..kernels.fp8 import FP8Weight, fp8_mm, fp8_unsupported
from ..kernels.nf4 import NF4Weight


class BaseWeight:
    """The interface (module docstring). `kind`: "dense", "nf4" or "fp8"; `quantized`: whether
    it is stored in a format other than its compute dtype; `packable`: whether the engine may
    make it a view of a packed [W_cat | s B] buffer; `lora_columns`: whether the LoRA columns
    may ride in its GEMM."""

    kind = ""
    quantized = True
    packable = False
    lora_columns = False

    def __init__(self, store):
        self.store = store  # the tensor, or the quantised container
        self.shape: tuple[int, int] = tuple(store.shape)

    @property
    def device(self) -> torch.device:
        return self.store.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (of the GEMMs' inputs and outputs)."""
        return self.store.dtype

    @property
    def nbytes(self) -> int:
        """Bytes the weight holds on its device."""
        return self.store.nbytes

    def dequantize(self, out: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [out, in] dense, in `dtype` (default the compute dtype), into `out` when given."""
        return self.store.dequantize(out=out, dtype=dtype)

    def mm(self, x: torch.Tensor, out: torch.Tensor | None = None,
           resid: torch.Tensor | None = None) -> torch.Tensor:
        """resid + x W^T: x [n, in] -> [n, out], into `out` when given. This default (dense,
        NF4): the dequantised weight's 16-bit GEMM."""
        w = self.dequantize(dtype=x.dtype)
        if resid is not None:
            return torch.addmm(resid, x, w.t(), out=out)
        return torch.mm(x, w.t(), out=out)

    def mm_t(self, dy: torch.Tensor, out: torch.Tensor | None = None,
             accumulate: bool = False) -> torch.Tensor:
        """dy W: dy [n, out] -> [n, in], into `out` (added to it with `accumulate`)."""
        w = self.dequantize(dtype=dy.dtype)
        if accumulate:
            return out.addmm_(dy, w)
        return torch.mm(dy, w, out=out)


class DenseBase(BaseWeight):
    """A 16-bit (or fp32) weight tensor (the layer's `weight` Parameter, or a view of it)."""

    kind = "dense"
    quantized = False
    packable = True
    lora_columns = True

    @property
    def weight(self) -> torch.Tensor:
        return self.store

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    def dequantize(self, out=None, dtype=None):
        if out is not None:
            return out.copy_(self.store)
        return self.store if dtype in (None, self.store.dtype) else self.store.to(dtype)


class NF4Base(BaseWeight):
    """A QLoRA 4-bit weight (kernels/nf4.NF4Weight)."""

    kind = "nf4"


class FP8Base(BaseWeight):
    """An e4m3 weight with 128 x 128 block scales (kernels/fp8.FP8Weight): FP8 GEMMs."""

    kind = "fp8"

    def mm(self, x, out=None, resid=None):
        """(x may be a kernels/fp8_quant.QuantizedRows: x with its codes, written by the kernel
        that produced x, which the cuBLAS GEMM reads instead of quantising x again)"""
        return fp8_mm(x, self.store, transpose=False, out=out, resid=resid)

    def mm_t(self, dy, out=None, accumulate=False, scratch=None):
        """(scratch: an e4m3 [in, out] buffer the kernel may transpose the codes into.)"""
        return fp8_mm(dy, self.store, transpose=True, out=out,
                      resid=out if accumulate else None, scratch=scratch)


def wrap(q: torch.Tensor | NF4Weight | FP8Weight) -> BaseWeight:
    """The BaseWeight over a dense tensor or a quantised container."""
    if isinstance(q, FP8Weight):
        return FP8Base(q)
    if isinstance(q, NF4Weight):
        return NF4Base(q)
    return DenseBase(q)


class _BaseLinear(torch.autograd.Function):
    """x W^T for a frozen quantised base: forward base.mm, backward base.mm_t (no 16-bit weight
    kept between them; no gradient for W)."""

    @staticmethod
    def forward(ctx, x, base: BaseWeight):
        ctx.base = base
        shape = x.shape
        return base.mm(x.reshape(-1, shape[-1])).view(*shape[:-1], base.shape[0])

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None
        shape = dy.shape
        dx = ctx.base.mm_t(dy.reshape(-1, shape[-1]).contiguous())
        return dx.view(*shape[:-1], ctx.base.shape[1]), None


def base_linear(x: torch.Tensor, base: BaseWeight) -> torch.Tensor:
    """x [..., in] -> x W^T [..., out] for a frozen base (the plain path's GEMMs; a dense base:
    F.linear, whose weight may train)."""
    if not base.quantized:
        return F.linear(x, base.weight)
    return _BaseLinear.apply(x, base)





@torch.no_grad()
def quantize_fp8_(model):
    """Quantise a model's decoder projections (those a 4-bit base quantises: q/k/v/o,
    gate/up/down) to FP8 in place, one weight at a time (each 16-bit weight is freed as its
    e4m3 copy is made). On a model built on the meta device: empty FP8 bases (meta), so that
    `to_empty` allocates e4m3 codes and scales, never the 16-bit weights, and the loader fills
    them as it reads (streaming, as --load-in-4bit does)."""
    from ..model.loader import nf4_projections

    for _, mod in nf4_projections(model):
        if mod.quantized is None:
            w = mod.weight
            q = FP8Weight(tuple(w.shape), w.dtype, device=w.device)
            mod.set_quantized_base(q if w.is_meta else q.quantize_(w))
    stack_fp8_groups(model)
    return model


def stack_fp8_groups(model) -> int:
    """Give each layer's FP8 q/k/v and gate/up one codes and one scales tensor, the members'
    FP8Weight buffers row-slice views of them (engine/weights.DenseWeights.fp8_packed: output
    sizes multiples of 128, so the block scales slice on rows too), so that one GEMM or decode
    GEMV reads a group with no copy kept; the members' own GEMMs read their contiguous slices.
    Skipped on the meta device (`to_empty` gives each buffer its own storage; the engine or the
    decode step stacks them on first use). Returns the groups stacked."""
    from ..engine.weights import layer_groups, plain_weights

    weights, n = plain_weights(), 0
    for layer in getattr(model, "layers", []):
        qkv, _, gu, _ = layer_groups(layer)
        for mods in (qkv, gu):
            if (mods and all(m.fp8 is not None and not m.fp8.data.is_meta for m in mods)
                    and weights.fp8_packed(mods) is not None):
                n += 1
    return n


def check_precision(precision: str, device: torch.device, prequantized: bool = False,
                    sharded: bool = False, resuming: bool = False) -> None:
    """The one-line refusal of a --precision the run cannot take (fp8: on a device without FP8
    matrix units unless emulating, on a 4-bit checkpoint, under FSDP2). `resuming`: a --resume
    must keep the run's precision, so the hint names what does run it instead of bf16."""
    if precision != "fp8":
        return
    why = fp8_unsupported(device)
    if why:
        if resuming:  # (--resume refuses another --precision: say what resumes this run)
            why = why.rsplit("; use --precision bf16", 1)[0] + (
                "; this run trained with --precision fp8 and resumes only with it: resume on "
                "an FP8 GPU, or with LEANTUNE_FP8_EMULATE=1 (slow)")
        raise LeantuneError(f"--precision fp8: {why}")
    if prequantized:
        raise LeantuneError("--precision fp8 quantises a 16-bit checkpoint's projections as they "
                            "load; this --model is 4-bit (bnb-4bit): use its 16-bit original, "
                            "or drop --precision fp8 (QLoRA)")
    if sharded:
        raise LeantuneError("--precision fp8 with FSDP2 is not supported yet; use --parallel ddp")


__all__ = ["BaseWeight", "DenseBase", "FP8Base", "NF4Base", "base_linear",
           "check_precision", "quantize_fp8_", "stack_fp8_groups", "wrap"]
