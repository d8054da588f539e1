"""Linear + cross-entropy: loss = sum over targets of CE(hidden @ W^T, label).

Returns the SUM over target tokens (fp32); the trainer divides by the number of target tokens in
the whole accumulation window. The fused version never materialises [tokens x vocab] logits.

Fused algorithm (all in the forward pass, everything stays on the device, no host sync):
    for each chunk of rows of hidden [N, H]:
        logits = h_chunk @ W^T                       cuBLAS, [chunk, V] in hidden's dtype
        Triton kernel, one program per row:          per-row loss (fp32) and, IN PLACE in the
                                                     logits buffer, dloss/dlogits = softmax - onehot
        grad_hidden[chunk] = dlogits @ W             cuBLAS, stored for backward
        grad_W += dlogits^T @ h_chunk                only if W requires grad (full fine-tuning)
    loss = sum of the per-row losses (fp32)
Backward only scales the stored gradients by grad_output (a 0-dim tensor, read on the device),
in place (the stored gradients are consumed: a second backward through the same graph raises).

Memory held from forward to backward: grad_hidden [N, H] in hidden's dtype (instead of hidden
itself), plus grad_W [V, H] when W is trainable (fp32 when accumulated over chunks). Transient:
one [chunk, V] logits buffer and the [N] fp32 per-row losses.

Chunk size: as many rows as fit ~CHUNK_BYTES of logits (256 MiB on CUDA, 4 MiB elsewhere),
rounded to a multiple of 128 rows on CUDA for the matrix products; one [chunk, V] buffer is reused.
The gradient of W is accumulated in fp32 across chunks when W is bf16/fp16 and there is more than
one chunk (cuBLAS's fp32-output addmm on CUDA; elsewhere, and on older torch, through a temporary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..batch import IGNORE_INDEX
from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None


# Target size of one chunk's logits buffer, per device type (see the module docstring).
CHUNK_BYTES = {"cuda": 256 << 20, "default": 4 << 20}
# Vocabulary columns a program handles per step (the last step is masked).
MAX_BLOCK_V = 4096


def linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                   softcap: float | None = None,
                                   ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """hidden: [N, H], weight: [V, H], labels: [N] -> scalar fp32 loss sum."""
    logits = (hidden @ weight.t()).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if triton is not None:

    from .triton_math import tanh as _tanh

    @triton.jit
    def _ce_rows_kernel(LOGITS, stride_row, LABELS, LOSS, V, ignore_index, softcap,
                        BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        COMPUTE_GRAD: tl.constexpr):
        """One program per row of LOGITS [rows, V].

        Pass 1 (online softmax): running max m and sum d of exp(z - m) over BLOCK_V-wide steps,
        and the target's logit; loss = m + log(d) - z_target, written to LOSS[row] (fp32).
        Pass 2 (COMPUTE_GRAD): overwrite the row with dloss/dlogits = softmax(z) - onehot(label),
        times dz/dx = 1 - (z/c)^2 when the logits are soft-capped (z = c * tanh(x / c)).
        An ignored row (label == ignore_index) gets loss 0 and an all-zero gradient row.
        """
        row = tl.program_id(0).to(tl.int64)
        ptr = LOGITS + row * stride_row
        label = tl.load(LABELS + row).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        if label == ignore_index:
            tl.store(LOSS + row, 0.0)
            if COMPUTE_GRAD:
                zeros = tl.zeros((BLOCK_V,), dtype=LOGITS.dtype.element_ty)
                for start in range(0, V, BLOCK_V):
                    tl.store(ptr + start + cols, zeros, mask=start + cols < V)
        else:
            m = tl.full((), float("-inf"), tl.float32)
            d = tl.full((), 0.0, tl.float32)
            z_target = tl.full((), 0.0, tl.float32)
            for start in range(0, V, BLOCK_V):
                c = start + cols
                mask = c < V
                z = tl.load(ptr + c, mask=mask, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    z = softcap * _tanh(z / softcap)
                z = tl.where(mask, z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, axis=0))
                d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
                m = m_new
                z_target += tl.sum(tl.where(c == label, z, 0.0), axis=0)
            lse = m + tl.log(d)
            tl.store(LOSS + row, lse - z_target)
            if COMPUTE_GRAD:
                for start in range(0, V, BLOCK_V):
                    c = start + cols
                    mask = c < V
                    z = tl.load(ptr + c, mask=mask, other=0.0).to(tl.float32)
                    if HAS_SOFTCAP:
                        t = _tanh(z / softcap)
                        z = softcap * t
                    g = tl.exp(z - lse) - tl.where(c == label, 1.0, 0.0)
                    if HAS_SOFTCAP:
                        g = g * (1.0 - t * t)
                    tl.store(ptr + c, g.to(LOGITS.dtype.element_ty), mask=mask)

    @triton.jit
    def _scale_kernel(SRC, DST, SCALE, n, BLOCK: tl.constexpr):
        """DST = SRC * SCALE[0] in fp32 (DST may be SRC; may be another dtype)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(SCALE).to(tl.float32)
        x = tl.load(SRC + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DST + offs, (x * s).to(DST.dtype.element_ty), mask=mask)


def _scale(src: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out (default: src, in place) = src * scale, scale a 0-dim device tensor; fp32 math."""
    out = src if out is None else out
    n = src.numel()
    if n:
        block = 2048
        _scale_kernel[(triton.cdiv(n, block),)](src, out, scale.reshape(1).contiguous(), n,
                                                BLOCK=block, num_warps=8)
    return out


def _chunk_rows(n: int, v: int, elem_bytes: int, device: torch.device,
                chunk_bytes: int | None = None) -> int:
    """Rows per chunk: ~chunk_bytes (default CHUNK_BYTES) of logits, a multiple of 128 on CUDA
    when that large."""
    budget = chunk_bytes or CHUNK_BYTES.get(device.type, CHUNK_BYTES["default"])
    rows = max(1, budget // max(1, v * elem_bytes))
    if device.type == "cuda" and rows >= 256:
        rows -= rows % 128
    return max(1, min(rows, n))


_FP32_ADDMM_OK: dict[str, bool] = {}  # per device type: does addmm(out_dtype=fp32) exist?


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b for low-precision a, b: fp32-output addmm where the backend has one
    (CUDA, torch >= 2.8), else through a temporary in a's dtype."""
    key = acc.device.type
    ok = _FP32_ADDMM_OK.get(key)
    if ok:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return
    if ok is None:  # first use on this device type: probe whether the overload exists
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _FP32_ADDMM_OK[key] = True
            return
        except (TypeError, NotImplementedError, RuntimeError):
            _FP32_ADDMM_OK[key] = False
    acc.add_(a @ b)


def _flce_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  softcap: float | None, ignore_index: int, need_gh: bool, need_gw: bool,
                  chunk_bytes: int | None = None):
    """-> (loss_sum fp32 0-dim, grad_hidden [N, H] or None, grad_weight [V, H] or None).
    The grads are for grad_output = 1; grad_weight is fp32 when accumulated over chunks."""
    N = hidden.shape[0]
    V = weight.shape[0]
    h = hidden if hidden.is_contiguous() else hidden.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    lab = labels.reshape(-1)
    if lab.shape[0] != N:
        raise ValueError(f"labels has {lab.shape[0]} entries for {N} hidden rows")
    lab = lab.contiguous()
    dev = h.device
    loss_rows = torch.empty(N, dtype=torch.float32, device=dev)
    gh = torch.empty_like(h) if need_gh else None
    gw = None
    chunk = _chunk_rows(N, V, h.element_size(), dev, chunk_bytes)
    n_chunks = triton.cdiv(N, chunk) if N else 0
    # W's grad accumulates in fp32 over several chunks of a bf16/fp16 W; with one chunk it is a
    # single product in W's dtype, as unfused autograd computes it.
    gw_fp32 = need_gw and n_chunks > 1 and w.dtype in (torch.float16, torch.bfloat16)
    if need_gw and (gw_fp32 or N == 0):
        gw = torch.zeros(w.shape, dtype=torch.float32 if gw_fp32 else w.dtype, device=dev)
    if N == 0:
        return loss_rows.sum(), gh, gw
    logits_buf = torch.empty((chunk, V), dtype=h.dtype, device=dev)
    block_v = min(MAX_BLOCK_V, triton.next_power_of_2(V))
    num_warps = 8 if block_v >= 2048 else 4
    compute_grad = need_gh or need_gw
    for start in range(0, N, chunk):
        end = min(N, start + chunk)
        hc = h[start:end]
        lg = logits_buf[: end - start]
        torch.mm(hc, w.t(), out=lg)
        _ce_rows_kernel[(end - start,)](
            lg, lg.stride(0), lab[start:end], loss_rows[start:end], V, ignore_index,
            float(softcap) if softcap else 1.0,
            BLOCK_V=block_v, HAS_SOFTCAP=bool(softcap), COMPUTE_GRAD=compute_grad,
            num_warps=num_warps)
        if need_gh:
            torch.mm(lg, w, out=gh[start:end])
        if need_gw:
            if gw_fp32:
                _accumulate_fp32(gw, lg.t(), hc)
            elif gw is None:
                gw = lg.t() @ hc
            else:
                gw.addmm_(lg.t(), hc)
    return loss_rows.sum(), gh, gw


class _FusedLinearCEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, softcap, ignore_index, chunk_bytes):
        need_gh, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, gh, gw = _flce_forward(hidden, weight, labels, softcap, ignore_index,
                                     need_gh, need_gw, chunk_bytes)
        ctx.save_for_backward(gh, gw)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        gh, gw = ctx.saved_tensors
        scale = grad_output.float()  # 0-dim, stays on the device
        if gh is not None:
            _scale(gh, scale)  # in place: the stored gradient is consumed
            torch.autograd.graph.increment_version(gh)
        if gw is not None:
            if gw.dtype == ctx.weight_dtype:
                _scale(gw, scale)
                torch.autograd.graph.increment_version(gw)
            else:  # fp32 accumulator -> W's dtype, scaled in the same pass
                gw = _scale(gw, scale, torch.empty(gw.shape, dtype=ctx.weight_dtype,
                                                    device=gw.device))
        return gh, gw, None, None, None, None


def fused_linear_cross_entropy_triton(hidden: torch.Tensor, weight: torch.Tensor,
                                      labels: torch.Tensor, softcap: float | None = None,
                                      ignore_index: int = IGNORE_INDEX,
                                      chunk_bytes: int | None = None) -> torch.Tensor:
    """Chunked linear + CE (module docstring); same contract as the reference.

    Gradients are computed during the forward pass when autograd will need them (grad mode on
    and hidden or weight requiring grad); otherwise only the loss is computed.
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearCEFunction.apply(hidden, weight, labels, softcap, ignore_index,
                                            chunk_bytes)
    return _flce_forward(hidden, weight, labels, softcap, ignore_index, False, False,
                         chunk_bytes)[0]


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               softcap: float | None = None, ignore_index: int = IGNORE_INDEX,
                               chunk_bytes: int | None = None) -> torch.Tensor:
    """hidden: [N, H], weight: [V, H], labels: [N] -> scalar fp32 SUM of CE over non-ignored rows.
    Triton path (chunked, no full logits; chunks of ~chunk_bytes of logits) or reference, per
    `dispatch.use_triton`."""
    if use_triton(hidden):
        return fused_linear_cross_entropy_triton(hidden, weight, labels, softcap, ignore_index,
                                                 chunk_bytes)
    return linear_cross_entropy_reference(hidden, weight, labels, softcap, ignore_index)
