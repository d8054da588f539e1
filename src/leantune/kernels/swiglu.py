"""Gated MLP activations: SwiGLU silu(g) * u and GeGLU gelu(g) * u (exact or tanh).

The fused version is one elementwise Triton kernel each way, computing in fp32:
  forward   out = act(g) * u; saves only g and u (no activation tensor is kept);
  backward  recomputes act(g) and act'(g) and writes
                d_gate = dy * u * act'(g),   d_up = dy * act(g)
            IN PLACE into the saved g and u buffers, so backward allocates nothing.
In the model g and u are the fresh outputs of gate_proj / up_proj, which nothing else reads. A
buffer is only overwritten when it is an autograd intermediate (it has a grad_fn) or a copy this
op made (non-contiguous input); leaves and plain user tensors get fresh gradient tensors. After
backward the saved buffers hold gradients, so their version counters are bumped: a second backward
through the same graph (retain_graph=True) raises autograd's usual in-place error rather than
silently using overwritten values.

glu_fwd can also write its output's e4m3 codes and 1 x 128 block scales (`quant`: the buffers of
a kernels/fp8_quant.QuantizedRows, for the cuBLAS FP8 down projection that reads it next),
quantised in the same program from the rounded values it stores: equal to quantize_rows(out)
bit for bit, without that pass over out.

Both also take a low-rank term (`lora`: the gate/up projections' LoRA where it is not inside
their GEMM, as on an FP8 base): gate + xa Bg^T and up + xa Bu^T, xa [n, R] = x A^T, computed in
the kernel (one small tl.dot a tile, fp32) instead of two passes over gate and up that add it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton

try:
    import triton
    import triton.language as tl

    from .fp8_quant import quantize_block
except ImportError:  # the package works without Triton (reference path only)
    triton = None

_SILU, _GELU_TANH, _GELU_ERF = 0, 1, 2
ACTS = {"silu": _SILU, "gelu_tanh": _GELU_TANH, "gelu": _GELU_ERF}  # the kernels' codes
_BLOCK = 1024     # elements per program: 8 per thread at 4 warps -> 16-byte bf16 accesses
_NUM_WARPS = 4


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    return F.gelu(gate, approximate=approximate) * up


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if triton is not None:

    from .triton_math import tanh as _tanh

    @triton.jit
    def _act_and_grad(g, ACT: tl.constexpr):
        """act(g) and d act / d g, fp32 in and out."""
        if ACT == 0:  # silu: g * sigmoid(g)
            s = tl.sigmoid(g)
            a = g * s
            da = s * (1.0 + g * (1.0 - s))
        elif ACT == 1:  # gelu, tanh approximation
            k0: tl.constexpr = 0.7978845608028654  # sqrt(2 / pi)
            k1: tl.constexpr = 0.044715
            t = _tanh(k0 * (g + k1 * g * g * g))
            a = 0.5 * g * (1.0 + t)
            da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k0 * (1.0 + 3.0 * k1 * g * g)
        else:  # gelu, exact (erf)
            cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
            a = g * cdf
            da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327  # + g * pdf(g)
        return a, da

    @triton.jit
    def _glu_fwd_kernel(G, U, OUT, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        a, _ = _act_and_grad(g, ACT)
        tl.store(OUT + offs, (a * u).to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd_kernel(DY, G, U, DG, DU, n, ACT: tl.constexpr, BLOCK: tl.constexpr,
                        NEED_DG: tl.constexpr, NEED_DU: tl.constexpr):
        """DG/DU may alias G/U (in place): each element is read before it is written."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        a, da = _act_and_grad(g, ACT)
        if NEED_DG:
            tl.store(DG + offs, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
        if NEED_DU:
            tl.store(DU + offs, (dy * a).to(DU.dtype.element_ty), mask=mask)


    @triton.jit
    def _glu_fwd_rows_kernel(G, U, OUT, Q, ST, cols, stride_g, stride_u, stride_o, stride_s,
                             ACT: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                             ROUND_FP32: tl.constexpr):
        """One row block of out = act(g) * u over [rows, cols] with any row strides. QUANT:
        also out's e4m3 codes into Q [rows, cols] (uint8, contiguous) and its 1 x 128 block
        scales into ST [cols / 128, rows] (row stride stride_s), from out as stored (BLOCK a
        multiple of 128)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
        a, _ = _act_and_grad(g, ACT)
        h = (a * u).to(OUT.dtype.element_ty)
        tl.store(OUT + row * stride_o + offs, h, mask=mask)
        if QUANT:
            NB: tl.constexpr = BLOCK // 128
            q, sc = quantize_block(tl.reshape(h.to(tl.float32), (NB, 128)), 1, ROUND_FP32)
            tl.store(Q + row * cols + offs, tl.reshape(q, (BLOCK,)), mask=mask)
            kb = tl.program_id(1) * NB + tl.arange(0, NB)
            tl.store(ST + kb * stride_s + row, sc, mask=kb * 128 < cols)

    @triton.jit
    def _glu_bwd_rows_kernel(DY, G, U, H, cols, stride_dy, stride_g, stride_u, stride_h,
                             ACT: tl.constexpr, BLOCK: tl.constexpr, WRITE_H: tl.constexpr):
        """G <- d gate, U <- d up in place; with WRITE_H also H <- act(g) * u (H may alias DY:
        each element is read before it is written)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < cols
        dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
        a, da = _act_and_grad(g, ACT)
        tl.store(G + row * stride_g + offs, (dy * u * da).to(G.dtype.element_ty), mask=mask)
        tl.store(U + row * stride_u + offs, (dy * a).to(U.dtype.element_ty), mask=mask)
        if WRITE_H:
            tl.store(H + row * stride_h + offs, (a * u).to(H.dtype.element_ty), mask=mask)


if triton is not None:

    @triton.jit
    def _lora_tile(G, U, XA, BG, BU, rm, rn, rows, cols, R, stride_g, stride_u, stride_xa,
                   stride_bg, stride_bu, BLOCK_R: tl.constexpr, IEEE: tl.constexpr,
                   DOT16: tl.constexpr):
        """gate and up of the [rows rm, cols rn] tile with their low-rank terms, fp32:
        g + xa Bg^T, u + xa Bu^T (xa [rows, R], Bg / Bu [cols, R])."""
        rr = tl.arange(0, BLOCK_R)
        mm, mn, mr = rm < rows, rn < cols, rr < R
        mask = mm[:, None] & mn[None, :]
        xa = tl.load(XA + rm[:, None] * stride_xa + rr[None, :], mask=mm[:, None] & mr[None, :],
                     other=0.0)
        bg = tl.load(BG + rn[None, :] * stride_bg + rr[:, None], mask=mr[:, None] & mn[None, :],
                     other=0.0)
        bu = tl.load(BU + rn[None, :] * stride_bu + rr[:, None], mask=mr[:, None] & mn[None, :],
                     other=0.0)
        g = tl.load(G + rm[:, None] * stride_g + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + rm[:, None] * stride_u + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        # products summed in fp32: 16-bit operands as they are on the GPU (DOT16), else in fp32
        # (16-bit values are exact in TF32; fp32 inputs, IEEE, are not rounded to TF32; the
        # interpreter multiplies 16-bit operands wrongly)
        if IEEE:
            g += tl.dot(xa, bg, input_precision="ieee")
            u += tl.dot(xa, bu, input_precision="ieee")
        elif DOT16:
            g += tl.dot(xa, bg)
            u += tl.dot(xa, bu)
        else:
            xa, bg, bu = xa.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
            g += tl.dot(xa, bg, input_precision="tf32")
            u += tl.dot(xa, bu, input_precision="tf32")
        return g, u, mask

    @triton.jit
    def _glu_lora_fwd_kernel(G, U, OUT, XA, BG, BU, Q, ST, rows, cols, R, stride_g, stride_u,
                             stride_o, stride_xa, stride_bg, stride_bu, stride_s,
                             ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_R: tl.constexpr, IEEE: tl.constexpr, DOT16: tl.constexpr,
                             QUANT: tl.constexpr, ROUND_FP32: tl.constexpr):
        """out = act(g') * u' over one [BLOCK_M, BLOCK_N] tile, g' / u' with the low-rank
        terms (_lora_tile). QUANT (BLOCK_N a multiple of 128): the tile's 1 x 128 blocks, their
        codes into Q [rows, cols] and scales into ST [cols / 128, rows], as _glu_fwd_rows'."""
        rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        g, u, mask = _lora_tile(G, U, XA, BG, BU, rm, rn, rows, cols, R, stride_g, stride_u,
                                stride_xa, stride_bg, stride_bu, BLOCK_R, IEEE, DOT16)
        a, _ = _act_and_grad(g, ACT)
        h = (a * u).to(OUT.dtype.element_ty)
        tl.store(OUT + rm[:, None] * stride_o + rn[None, :], h, mask=mask)
        if QUANT:
            NB: tl.constexpr = BLOCK_N // 128
            q, sc = quantize_block(tl.reshape(h.to(tl.float32), (BLOCK_M, NB, 128)), 2,
                                   ROUND_FP32)
            tl.store(Q + rm[:, None] * cols + rn[None, :], tl.reshape(q, (BLOCK_M, BLOCK_N)),
                     mask=mask)
            kb = tl.program_id(1) * NB + tl.arange(0, NB)
            tl.store(ST + kb[None, :] * stride_s + rm[:, None], sc,
                     mask=(rm < rows)[:, None] & (kb * 128 < cols)[None, :])

    @triton.jit
    def _glu_lora_bwd_kernel(DY, G, U, H, XA, BG, BU, GA, AD, rows, cols, R, RD, stride_dy,
                             stride_g, stride_u, stride_h, stride_xa, stride_bg, stride_bu,
                             stride_ga, stride_ad, ACT: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_RD: tl.constexpr, IEEE: tl.constexpr, DOT16: tl.constexpr,
                             WRITE_H: tl.constexpr, GU_TERMS: tl.constexpr,
                             DY_TERM: tl.constexpr):
        """G <- d g', U <- d u' in place (the gradients of the gate / up outputs, with
        GU_TERMS their LoRA terms included in g', u'), H <- act(g') * u' with WRITE_H (H may
        alias DY: the tile is read first). DY_TERM: dy' = dy + GA AD, the down projection's
        input gradient with its LoRA term (GA [rows, RD], AD [RD, cols])."""
        rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        if GU_TERMS:
            g, u, mask = _lora_tile(G, U, XA, BG, BU, rm, rn, rows, cols, R, stride_g,
                                    stride_u, stride_xa, stride_bg, stride_bu, BLOCK_R, IEEE, DOT16)
        else:
            mask = (rm < rows)[:, None] & (rn < cols)[None, :]
            g = tl.load(G + rm[:, None] * stride_g + rn[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            u = tl.load(U + rm[:, None] * stride_u + rn[None, :], mask=mask,
                        other=0.0).to(tl.float32)
        dy = tl.load(DY + rm[:, None] * stride_dy + rn[None, :], mask=mask,
                     other=0.0).to(tl.float32)
        if DY_TERM:
            rr = tl.arange(0, BLOCK_RD)
            ga = tl.load(GA + rm[:, None] * stride_ga + rr[None, :],
                         mask=(rm < rows)[:, None] & (rr < RD)[None, :], other=0.0)
            ad = tl.load(AD + rr[:, None] * stride_ad + rn[None, :],
                         mask=(rr < RD)[:, None] & (rn < cols)[None, :], other=0.0)
            if IEEE:
                dy += tl.dot(ga, ad, input_precision="ieee")
            elif DOT16:
                dy += tl.dot(ga, ad)
            else:
                dy += tl.dot(ga.to(tl.float32), ad.to(tl.float32), input_precision="tf32")
        a, da = _act_and_grad(g, ACT)
        tl.store(G + rm[:, None] * stride_g + rn[None, :], (dy * u * da).to(G.dtype.element_ty),
                 mask=mask)
        tl.store(U + rm[:, None] * stride_u + rn[None, :], (dy * a).to(U.dtype.element_ty),
                 mask=mask)
        if WRITE_H:
            tl.store(H + rm[:, None] * stride_h + rn[None, :], (a * u).to(H.dtype.element_ty),
                     mask=mask)


# The most low-rank columns the kernels take (a tile holds [BLOCK_M, R] and 2 x [R, BLOCK_N]; the
# engine passes larger ranks' terms as before, in passes of their own)
MAX_LORA_RANK = 64
# 16-bit tl.dot operands on the GPU (False: cast to fp32 first, TF32; the bench compares: on the
# H200 at 8192 x 14336, R 32, the forward 0.279 ms against 0.385, the backward 0.511 / 0.523)
DOT16 = True
# The low-rank kernels' tiles: (BLOCK_M, BLOCK_N: a multiple of 128, the quantisation block;
# num_warps) of the forward and of the backward (bench/gpu_fp8.py --parts glu sweeps them)
LORA_TILES = {"fwd": (64, 128, 4), "bwd": (32, 128, 4)}


def _lora_launch(gate, R, which: str):
    """Grid and shared arguments of the low-rank kernel `which` ("fwd", "bwd") for gate [n, I]
    and R low-rank columns."""
    n, cols = gate.shape
    bm, bn, warps = LORA_TILES[which]
    if bn % 128:
        raise ValueError(f"LORA_TILES[{which!r}]: BLOCK_N must be a multiple of 128 (the "
                         f"quantisation block), got {bn}")
    grid = (triton.cdiv(n, bm), triton.cdiv(cols, bn))
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=max(16, triton.next_power_of_2(R)),
                IEEE=gate.dtype == torch.float32, DOT16=gate.is_cuda and DOT16,
                num_warps=warps)
    return grid, meta


def _check_lora(lora, gate) -> None:
    xa, bg, bu = lora
    n, cols = gate.shape
    R = xa.shape[1]
    if (xa.shape != (n, R) or bg.shape != (cols, R) or bu.shape != (cols, R)
            or xa.stride(1) != 1 or bg.stride(1) != 1 or bu.stride(1) != 1
            or not xa.dtype == bg.dtype == bu.dtype == gate.dtype or R > MAX_LORA_RANK):
        raise ValueError(f"lora: expected xa [{n}, R], bg / bu [{cols}, R] (R <= "
                         f"{MAX_LORA_RANK}) of gate's dtype with contiguous columns, got "
                         f"{tuple(xa.shape)}, {tuple(bg.shape)}, {tuple(bu.shape)}")


def _with_lora_reference(gate, up, lora):
    """(gate + xa bg^T, up + xa bu^T) in fp32 (or as they are without `lora`)."""
    g, u = gate.float(), up.float()
    if lora is None:
        return g, u
    xa, bg, bu = (t.float() for t in lora)
    return g + xa @ bg.t(), u + xa @ bu.t()


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(contiguous tensor, whether it is a copy made here)."""
    return (t, False) if t.is_contiguous() else (t.contiguous(), True)


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act):
        if gate.shape != up.shape:
            raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape")
        g, g_copied = _flat(gate)
        u, u_copied = _flat(up)
        out = torch.empty_like(g, dtype=torch.result_type(gate, up))
        n = g.numel()
        if n:
            _glu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](g, u, out, n, ACT=act, BLOCK=_BLOCK,
                                                       num_warps=_NUM_WARPS)
        ctx.save_for_backward(g, u)
        ctx.act = act
        # May backward overwrite the saved buffers? (module docstring)
        ctx.g_writable = g_copied or gate.grad_fn is not None
        ctx.u_writable = (u_copied or up.grad_fn is not None) and u.data_ptr() != g.data_ptr()
        return out

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        need_dg, need_du = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dy = dy.contiguous()
        # In place where allowed (and dtypes match: the grad has the input's dtype).
        dg = (g if ctx.g_writable else torch.empty_like(g)) if need_dg else None
        du = (u if ctx.u_writable else torch.empty_like(u)) if need_du else None
        n = g.numel()
        if n and (need_dg or need_du):
            _glu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](
                dy, g, u, dg if need_dg else g, du if need_du else u, n, ACT=ctx.act,
                BLOCK=_BLOCK, NEED_DG=need_dg, NEED_DU=need_du, num_warps=_NUM_WARPS)
            for t in (dg, du):
                if t is g or t is u:
                    torch.autograd.graph.increment_version(t)
        return dg, du, None


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused silu(gate) * up; gate/up: [..., I] (same shape). Backward is in place (docstring)."""
    return _GLUFunction.apply(gate, up, _SILU)


def geglu_triton(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """Fused gelu(gate) * up, approximate 'tanh' or 'none' (erf)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"approximate must be 'tanh' or 'none', got {approximate!r}")
    return _GLUFunction.apply(gate, up, _GELU_TANH if approximate == "tanh" else _GELU_ERF)


def act_code(hidden_act: str) -> int | None:
    """The GLU kernels' code for a config's `hidden_act` (silu; gelu, exact; gelu_pytorch_tanh
    and other tanh-approximated gelus), or None where there is none."""
    if not isinstance(hidden_act, str):
        return None
    if hidden_act == "silu":
        return ACTS["silu"]
    if hidden_act.startswith("gelu"):
        return ACTS["gelu_tanh"] if "tanh" in hidden_act else ACTS["gelu"]
    return None


def glu(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """act(gate) * up for an `act_code`, gate/up: [..., I] (autograd)."""
    if act == _SILU:
        return swiglu(gate, up)
    return geglu(gate, up, "tanh" if act == _GELU_TANH else "none")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate/up: [..., I]. Triton kernel or reference, per `dispatch.use_triton`."""
    if use_triton(gate):
        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate, approximate) * up, gate/up: [..., I]. Triton or reference, per `use_triton`."""
    if use_triton(gate):
        return geglu_triton(gate, up, approximate)
    return geglu_reference(gate, up, approximate)


# ------------------------------------------------------------------------------------------------
# Plain functions (no autograd), for the hand-written decoder-layer backward (leantune.engine)
# ------------------------------------------------------------------------------------------------


def _act_reference(g: torch.Tensor, act: int) -> torch.Tensor:
    if act == _SILU:
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if act == _GELU_TANH else "none")


def _check_rows(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(f"expected [rows, cols] with contiguous columns, got shape "
                             f"{tuple(t.shape)} strides {t.stride()}")


def glu_fwd(gate: torch.Tensor, up: torch.Tensor, act: int,
            out: torch.Tensor | None = None,
            quant: tuple[torch.Tensor, torch.Tensor] | None = None,
            lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """act(gate) * up for gate/up [n, I] -> out [n, I]; act: a value of ACTS.

    Rows may be strided (e.g. gate and up as the two column halves of one GEMM output, `out` the
    left columns of a wider buffer); columns must be contiguous. `quant`: (codes e4m3 [n, I]
    contiguous, scale_t fp32 [ceil(I / 128), n], unit column stride; a QuantizedRows' targets)
    written with out's 1 x 128 block quantisation, equal to quantize_rows(out) bit for bit.
    `lora`: (xa [n, R], bg [I, R], bu [I, R]): gate + xa bg^T and up + xa bu^T go in, in fp32
    (the LoRA terms, scalings in bg / bu; module docstring)."""
    out = torch.empty_like(gate, memory_format=torch.contiguous_format) if out is None else out
    _check_rows(gate, up, out)
    if quant is not None:
        from .fp8_quant import check_targets

        check_targets(quant, *out.shape, "glu_fwd")
    if lora is not None:
        _check_lora(lora, gate)
    if use_triton(gate) and lora is not None:
        if gate.numel():
            xa, bg, bu = lora
            codes, scale_t = quant if quant is not None else (out, out)
            R = xa.shape[1]
            grid, meta = _lora_launch(gate, R, "fwd")
            _glu_lora_fwd_kernel[grid](
                gate, up, out, xa, bg, bu,
                codes.view(torch.uint8) if quant is not None else codes, scale_t,
                gate.shape[0], gate.shape[1], R, gate.stride(0), up.stride(0), out.stride(0),
                xa.stride(0), bg.stride(0), bu.stride(0),
                scale_t.stride(0) if quant is not None else 0, ACT=act, QUANT=quant is not None,
                ROUND_FP32=not gate.is_cuda, **meta)
        return out
    if use_triton(gate):
        n, cols = gate.shape
        if n and cols:
            codes, scale_t = quant if quant is not None else (out, out)
            _glu_fwd_rows_kernel[(n, triton.cdiv(cols, _BLOCK))](
                gate, up, out, codes.view(torch.uint8) if quant is not None else codes, scale_t,
                cols, gate.stride(0), up.stride(0), out.stride(0),
                scale_t.stride(0) if quant is not None else 0, ACT=act, BLOCK=_BLOCK,
                QUANT=quant is not None, ROUND_FP32=not gate.is_cuda, num_warps=_NUM_WARPS)
        return out
    g, u = _with_lora_reference(gate, up, lora)
    out.copy_(_act_reference(g, act) * u)
    if quant is not None:
        from .fp8_quant import quantize_rows_reference

        quantize_rows_reference(out, *quant)
    return out


def glu_bwd_(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int,
             h_out: torch.Tensor | None = None,
             lora: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             dy_lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Backward of glu_fwd IN PLACE: gate <- d gate, up <- d up ([n, I], rows may be strided).

    With `h_out` also writes the forward value act(gate) * up there (bit-identical to glu_fwd),
    so a backward that needs it does not run glu_fwd first; h_out may be dy itself. `lora` as
    glu_fwd's: gate and up hold the outputs without their LoRA terms, which go in here too (the
    gradients written are those of the outputs with them, the same for both). `dy_lora`:
    (ga [n, Rd], a [Rd, I]): dy + ga a is the output's gradient (the down projection's input
    gradient, whose LoRA term ga A is added here instead of in a pass of its own)."""
    _check_rows(dy, gate, up, *([h_out] if h_out is not None else []))
    if lora is not None:
        _check_lora(lora, gate)
    if dy_lora is not None:
        ga, a = dy_lora
        if (ga.shape[0] != dy.shape[0] or a.shape != (ga.shape[1], dy.shape[1])
                or ga.stride(1) != 1 or a.stride(1) != 1 or ga.shape[1] > MAX_LORA_RANK
                or not ga.dtype == a.dtype == gate.dtype):
            raise ValueError(f"dy_lora: expected ga [{dy.shape[0]}, Rd], a [Rd, {dy.shape[1]}] "
                             f"(Rd <= {MAX_LORA_RANK}) of gate's dtype with contiguous columns, "
                             f"got {tuple(ga.shape)}, {tuple(a.shape)}")
    if use_triton(gate) and (lora is not None or dy_lora is not None):
        if gate.numel():
            xa, bg, bu = lora if lora is not None else (gate, gate, gate)
            ga, a = dy_lora if dy_lora is not None else (gate, gate)
            R = xa.shape[1] if lora is not None else 0
            RD = ga.shape[1] if dy_lora is not None else 0
            h = gate if h_out is None else h_out
            grid, meta = _lora_launch(gate, R, "bwd")
            _glu_lora_bwd_kernel[grid](
                dy, gate, up, h, xa, bg, bu, ga, a, gate.shape[0], gate.shape[1], R, RD,
                dy.stride(0), gate.stride(0), up.stride(0), h.stride(0), xa.stride(0),
                bg.stride(0), bu.stride(0), ga.stride(0), a.stride(0), ACT=act,
                BLOCK_RD=max(16, triton.next_power_of_2(RD)), WRITE_H=h_out is not None,
                GU_TERMS=lora is not None, DY_TERM=dy_lora is not None, **meta)
        return
    if use_triton(gate):
        n, cols = gate.shape
        if n and cols:
            h = gate if h_out is None else h_out
            _glu_bwd_rows_kernel[(n, triton.cdiv(cols, _BLOCK))](
                dy, gate, up, h, cols, dy.stride(0), gate.stride(0), up.stride(0), h.stride(0),
                ACT=act, BLOCK=_BLOCK, WRITE_H=h_out is not None, num_warps=_NUM_WARPS)
        return
    g0, uf = _with_lora_reference(gate, up, lora)
    with torch.enable_grad():
        g = g0.detach().requires_grad_()
        a = _act_reference(g, act)
        (da,) = torch.autograd.grad(a, g, torch.ones_like(a))
    a = a.detach()
    dyf = dy.float()
    if dy_lora is not None:
        dyf = dyf + dy_lora[0].float() @ dy_lora[1].float()
    h = (a * uf).to(gate.dtype) if h_out is not None else None
    gate.copy_(dyf * uf * da)
    up.copy_(dyf * a)
    if h is not None:
        h_out.copy_(h)
