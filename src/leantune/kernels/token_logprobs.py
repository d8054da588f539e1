"""Per-token log-probabilities (and entropies) from the LM head, chunked over rows.

    token_logprobs(hidden [N, H], weight [V, H], targets [N]) -> logp [N] fp32
    token_logprobs(..., return_entropy=True)                  -> (logp [N], entropy [N]) fp32

with, per row i, x = hidden[i] @ W^T (in hidden's dtype, as the model's lm_head computes it),
z = softcap * tanh(x / softcap) / temperature (each step optional), p = softmax(z):
    logp[i] = log p[targets[i]]          entropy[i] = -sum_v p_v log p_v
A row whose target is ignore_index (-100) gets logp 0 and entropy 0 and receives no gradient.
This is the sibling of `cross_entropy.fused_linear_cross_entropy` (which is -sum logp); the
difference is the backward: GRPO-style losses give each token its own upstream gradient
(d logp [N], d entropy [N]) that depends on the forward's result, so the gradient cannot be
formed inside the forward pass as the loss does.

Fused algorithm (everything stays on the device, no host sync):
    forward, for each chunk of rows:
        x = h_chunk @ W^T                          cuBLAS, [chunk, V] in hidden's dtype
        Triton, one program per row:               online softmax in fp32 over BLOCK_V steps:
                                                   logp, lse (= log sum exp z), entropy
    backward, for each chunk of rows:
        x = h_chunk @ W^T                          recomputed (same product as the forward)
        Triton, one program per row, in place:     dz = dlogp * (onehot - p)
                                                      + dent * (-p * (log p + H))
                                                   dx = dz * (1 - tanh^2) / temperature
        grad_hidden[chunk] = dx @ W                cuBLAS
        grad_W += dx^T @ h_chunk                   only if W requires grad (frozen under LoRA)

Where the head is frozen (LoRA) and no entropy is asked for, the forward goes on, per chunk
while its logits are in the buffer, to dz with an upstream of ones and d logp / d h = dx @ W
(kept [N, H]); backward is then one row scaling, grad_hidden = dlogp[:, None] * (d logp / d h):
2 products per chunk instead of 3 (`grad_in_forward`; LEANTUNE_LOGP_GRAD_IN_FORWARD=0: off).

Memory / FLOP trade. Held from forward to backward: lse [N] fp32 (p = exp(z - lse) needs no
separate max: z <= lse, so the exponent never overflows) and entropy [N] fp32 when returned,
besides hidden and W themselves, which autograd holds anyway. Transient: one [chunk, V] logits
buffer. A plain log_softmax holds [N, V] fp32 logits and log-probs (2 x 4.2 GB at 8192 x 128256)
instead. The price is one extra logits product: forward 2NHV FLOPs, backward 2NHV (recompute) +
2NHV (grad_hidden) + 2NHV (grad_W, full fine-tuning only), i.e. 3 (LoRA with entropy) or 4
products where unfused autograd does 2 or 3; 2 with the gradient formed in the forward (LoRA,
no entropy), which holds dh [N, H] in hidden's dtype until backward. The softmax statistics and W's gradient accumulate in fp32;
logits are rounded to hidden's dtype first, as the unfused model computes them (bf16 in, fp32
accumulate in the matrix products).

Chunk size and vocabulary step are those of cross_entropy (CHUNK_BYTES, MAX_BLOCK_V there).
`segment_sum(values, cu_seqlens)` sums per-token values over the documents of packed rows.
"""

from __future__ import annotations

import os

import torch

from ..batch import IGNORE_INDEX
from . import cross_entropy as _ce
from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None


# Whether the Triton path forms d logp / d hidden in the forward where it can (a frozen head,
# no entropy): one [chunk, V] x H product less per chunk, dh [N, H] held until backward instead.
# LEANTUNE_LOGP_GRAD_IN_FORWARD=0 recomputes the logits in backward (benchmarks, debugging);
# read at each call (grad_in_forward_default).
GRAD_IN_FORWARD_ENV = "LEANTUNE_LOGP_GRAD_IN_FORWARD"


def grad_in_forward_default() -> bool:
    """On, unless LEANTUNE_LOGP_GRAD_IN_FORWARD says 0/false/off/no (1/true/on/yes: on; any
    other value is refused, so a typo cannot switch it silently)."""
    raw = os.environ.get(GRAD_IN_FORWARD_ENV)
    if raw is None:
        return True
    v = raw.strip().lower()
    if v not in ("1", "true", "on", "yes", "0", "false", "off", "no"):
        raise ValueError(f"{GRAD_IN_FORWARD_ENV}={raw!r}: use 1 or 0")
    return v in ("1", "true", "on", "yes")


def _check_args(hidden, weight, targets, softcap, temperature) -> None:
    """Shape and value checks shared by both paths (no device reads)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"token_logprobs wants hidden [N, H] and weight [V, H], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.numel() != hidden.shape[0]:
        raise ValueError(f"targets has {targets.numel()} entries for {hidden.shape[0]} hidden "
                         f"rows")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be > 0 (or None/0 for none), got {softcap}")


def token_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             softcap: float | None = None, temperature: float = 1.0,
                             return_entropy: bool = False, ignore_index: int = IGNORE_INDEX):
    """Plain PyTorch over full [N, V] fp32 logits; same contract as `token_logprobs`."""
    _check_args(hidden, weight, targets, softcap, temperature)
    z = (hidden @ weight.t()).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    t = targets.reshape(-1)
    keep = t != ignore_index
    logp = logp_all.gather(1, torch.where(keep, t, 0)[:, None].long())[:, 0]
    logp = torch.where(keep, logp, 0.0)
    if not return_entropy:
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.where(keep, entropy, 0.0)


def segment_sum(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """values [N, ...], cu_seqlens [D + 1] (int, cumulative document lengths over the N tokens,
    cu_seqlens[0] = 0, cu_seqlens[-1] <= N) -> [D, ...] per-document sums, in values' dtype.

    A difference of prefix sums, gathered at the document bounds on the device (no .item(), no
    host sync); the prefix sums run in fp64, so long documents lose no precision and the result
    is deterministic (no atomics). Differentiable: each token's gradient is its document's.
    Tokens past cu_seqlens[-1] (padding) belong to no document.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [D + 1], got shape {tuple(cu_seqlens.shape)}")
    acc = torch.float64 if values.device.type != "mps" else torch.float32
    csum = torch.cumsum(values.to(acc), dim=0)
    csum = torch.cat([csum.new_zeros((1,) + values.shape[1:]), csum])
    cu = cu_seqlens.to(device=values.device, dtype=torch.long)
    return (csum[cu[1:]] - csum[cu[:-1]]).to(values.dtype)


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if triton is not None:

    from .triton_math import tanh as _tanh

    @triton.jit
    def _load_z(ptr, c, mask, softcap, inv_temp, HAS_SOFTCAP: tl.constexpr):
        """-> (z, t): logits at columns c in fp32 after soft-capping and temperature, and
        t = tanh(x / softcap) (for the chain rule; 0 without soft-capping)."""
        z = tl.load(ptr + c, mask=mask, other=0.0).to(tl.float32)
        t = tl.zeros_like(z)
        if HAS_SOFTCAP:
            t = _tanh(z / softcap)
            z = softcap * t
        return z * inv_temp, t

    @triton.jit
    def _logp_rows_kernel(LOGITS, stride_row, TARGETS, LOGP, LSE, ENT, V, ignore_index,
                          softcap, inv_temp, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                          WITH_ENTROPY: tl.constexpr):
        """One program per row of LOGITS [rows, V]; one online-softmax pass in fp32.

        Running max m, d = sum exp(z - m) and (WITH_ENTROPY) s = sum exp(z - m) * z, rescaled
        by exp(m_old - m_new) whenever the max grows; then lse = m + log d, logp = z_t - lse,
        entropy = lse - s / d (= -sum p log p). An ignored row writes 0 everywhere.
        """
        row = tl.program_id(0).to(tl.int64)
        ptr = LOGITS + row * stride_row
        target = tl.load(TARGETS + row).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        if target == ignore_index:
            tl.store(LOGP + row, 0.0)
            tl.store(LSE + row, 0.0)
            if WITH_ENTROPY:
                tl.store(ENT + row, 0.0)
        else:
            m = tl.full((), float("-inf"), tl.float32)
            d = tl.full((), 0.0, tl.float32)
            s = tl.full((), 0.0, tl.float32)
            z_target = tl.full((), 0.0, tl.float32)
            for start in range(0, V, BLOCK_V):
                c = start + cols
                mask = c < V
                z, _ = _load_z(ptr, c, mask, softcap, inv_temp, HAS_SOFTCAP)  # 0 if masked
                m_new = tl.maximum(m, tl.max(tl.where(mask, z, float("-inf")), axis=0))
                scale = tl.exp(m - m_new)
                e = tl.where(mask, tl.exp(z - m_new), 0.0)
                d = d * scale + tl.sum(e, axis=0)
                if WITH_ENTROPY:
                    s = s * scale + tl.sum(e * z, axis=0)
                m = m_new
                z_target += tl.sum(tl.where(c == target, z, 0.0), axis=0)
            lse = m + tl.log(d)
            tl.store(LOGP + row, z_target - lse)
            tl.store(LSE + row, lse)
            if WITH_ENTROPY:
                tl.store(ENT + row, lse - s / d)

    @triton.jit
    def _logp_grad_kernel(LOGITS, stride_row, TARGETS, LSE, ENT, DLOGP, DENT, V, ignore_index,
                          softcap, inv_temp, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                          HAS_DLOGP: tl.constexpr, HAS_DENT: tl.constexpr):
        """One program per row of LOGITS [rows, V] (the recomputed x = h @ W^T), overwritten IN
        PLACE with d(sum_i dlogp_i logp_i + dent_i H_i)/dx:
            dz = dlogp * (onehot(target) - p) - dent * p * (log p + H),   p = exp(z - lse)
            dx = dz * inv_temp * (1 - tanh(x / softcap)^2)
        An ignored row gets an all-zero gradient row.
        """
        row = tl.program_id(0).to(tl.int64)
        ptr = LOGITS + row * stride_row
        target = tl.load(TARGETS + row).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        if target == ignore_index:
            zeros = tl.zeros((BLOCK_V,), dtype=LOGITS.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                tl.store(ptr + start + cols, zeros, mask=start + cols < V)
        else:
            lse = tl.load(LSE + row)
            g_logp = 0.0
            g_ent = 0.0
            ent = 0.0
            if HAS_DLOGP:
                g_logp = tl.load(DLOGP + row).to(tl.float32)
            if HAS_DENT:
                g_ent = tl.load(DENT + row).to(tl.float32)
                ent = tl.load(ENT + row)
            for start in range(0, V, BLOCK_V):
                c = start + cols
                mask = c < V
                z, t = _load_z(ptr, c, mask, softcap, inv_temp, HAS_SOFTCAP)
                logp = z - lse
                p = tl.exp(logp)
                g = tl.zeros_like(z)
                if HAS_DLOGP:
                    g = g_logp * (tl.where(c == target, 1.0, 0.0) - p)
                if HAS_DENT:
                    g -= g_ent * p * (logp + ent)
                g = g * inv_temp
                if HAS_SOFTCAP:
                    g = g * (1.0 - t * t)
                tl.store(ptr + c, g.to(LOGITS.dtype.element_ty), mask=mask)


def _launch_params(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for rows of V columns; the vocabulary step is cross_entropy's."""
    block_v = min(_ce.MAX_BLOCK_V, triton.next_power_of_2(V))
    return block_v, (8 if block_v >= 2048 else 4)


def _chunks(h: torch.Tensor, V: int, chunk_bytes: int | None):
    """(start, end) row ranges of the chunks, and one reusable [chunk, V] logits buffer."""
    N = h.shape[0]
    chunk = _ce._chunk_rows(N, V, h.element_size(), h.device, chunk_bytes)
    buf = torch.empty((chunk, V), dtype=h.dtype, device=h.device)
    return [(s, min(N, s + chunk)) for s in range(0, N, chunk)], buf


def _logp_forward(h, w, tgt, softcap, temperature, ignore_index, with_entropy, chunk_bytes):
    """-> (logp [N], lse [N], entropy [N] or None), all fp32; h, w, tgt contiguous."""
    N, V = h.shape[0], w.shape[0]
    dev = h.device
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    lse = torch.empty(N, dtype=torch.float32, device=dev)
    ent = torch.empty(N, dtype=torch.float32, device=dev) if with_entropy else None
    if N == 0:
        return logp, lse, ent
    ranges, buf = _chunks(h, V, chunk_bytes)
    block_v, num_warps = _launch_params(V)
    for start, end in ranges:
        lg = buf[: end - start]
        torch.mm(h[start:end], w.t(), out=lg)
        _logp_rows_kernel[(end - start,)](
            lg, lg.stride(0), tgt[start:end], logp[start:end], lse[start:end],
            ent[start:end] if with_entropy else lse[start:end], V, ignore_index,
            float(softcap) if softcap else 1.0, 1.0 / float(temperature),
            BLOCK_V=block_v, HAS_SOFTCAP=bool(softcap), WITH_ENTROPY=with_entropy,
            num_warps=num_warps)
    return logp, lse, ent


def _logp_forward_with_grad(h, w, tgt, softcap, temperature, ignore_index, chunk_bytes):
    """-> (logp [N] fp32, dh [N, H] in h's dtype): the log-probs and, from the same logits
    chunk while it is still in the buffer, d logp_i / d h_i (the gradient kernel run with an
    upstream of ones, then its product with W). Backward then only scales dh's rows."""
    N, V = h.shape[0], w.shape[0]
    logp = torch.empty(N, dtype=torch.float32, device=h.device)
    lse = torch.empty(N, dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h)
    if N == 0:
        return logp, dh
    ranges, buf = _chunks(h, V, chunk_bytes)
    block_v, num_warps = _launch_params(V)
    ones = torch.ones(N, dtype=torch.float32, device=h.device)
    cap, inv_temp = float(softcap) if softcap else 1.0, 1.0 / float(temperature)
    for start, end in ranges:
        lg = buf[: end - start]
        torch.mm(h[start:end], w.t(), out=lg)
        _logp_rows_kernel[(end - start,)](
            lg, lg.stride(0), tgt[start:end], logp[start:end], lse[start:end], lse[start:end],
            V, ignore_index, cap, inv_temp, BLOCK_V=block_v, HAS_SOFTCAP=bool(softcap),
            WITH_ENTROPY=False, num_warps=num_warps)
        _logp_grad_kernel[(end - start,)](
            lg, lg.stride(0), tgt[start:end], lse[start:end], lse[start:end],
            ones[start:end], lse[start:end], V, ignore_index, cap, inv_temp,
            BLOCK_V=block_v, HAS_SOFTCAP=bool(softcap), HAS_DLOGP=True, HAS_DENT=False,
            num_warps=num_warps)
        torch.mm(lg, w, out=dh[start:end])
    return logp, dh


def _logp_backward(h, w, tgt, lse, ent, dlogp, dent, softcap, temperature, ignore_index,
                   need_gh, need_gw, chunk_bytes):
    """-> (grad_hidden [N, H] or None, grad_weight [V, H] or None) for the per-token upstream
    gradients dlogp [N] and dent [N] (either may be None: zero)."""
    N, V = h.shape[0], w.shape[0]
    dev = h.device
    gh = torch.empty_like(h) if need_gh else None
    if N == 0 or (dlogp is None and dent is None):
        gh = gh.zero_() if need_gh else None
        return gh, (torch.zeros_like(w) if need_gw else None)
    ranges, buf = _chunks(h, V, chunk_bytes)
    block_v, num_warps = _launch_params(V)
    # W's grad accumulates in fp32 over several chunks of a bf16/fp16 W (as cross_entropy).
    gw_fp32 = need_gw and len(ranges) > 1 and w.dtype in (torch.float16, torch.bfloat16)
    gw = torch.zeros(w.shape, dtype=torch.float32, device=dev) if gw_fp32 else None
    dlogp = dlogp.float().contiguous() if dlogp is not None else None  # may be an expand
    dent = dent.float().contiguous() if dent is not None else None
    for start, end in ranges:
        hc = h[start:end]
        lg = buf[: end - start]
        torch.mm(hc, w.t(), out=lg)  # recompute this chunk's logits
        _logp_grad_kernel[(end - start,)](
            lg, lg.stride(0), tgt[start:end], lse[start:end],
            (ent if dent is not None else lse)[start:end],
            (dlogp if dlogp is not None else lse)[start:end],
            (dent if dent is not None else lse)[start:end], V, ignore_index,
            float(softcap) if softcap else 1.0, 1.0 / float(temperature),
            BLOCK_V=block_v, HAS_SOFTCAP=bool(softcap), HAS_DLOGP=dlogp is not None,
            HAS_DENT=dent is not None, num_warps=num_warps)
        if need_gh:
            torch.mm(lg, w, out=gh[start:end])
        if need_gw:
            if gw_fp32:
                _ce._accumulate_fp32(gw, lg.t(), hc)
            elif gw is None:
                gw = lg.t() @ hc
            else:
                gw.addmm_(lg.t(), hc)
    if gw is not None and gw.dtype != w.dtype:
        gw = gw.to(w.dtype)
    return gh, gw


class _TokenLogprobsGradInForward(torch.autograd.Function):
    """logp only, the hidden states alone needing a gradient (a frozen head): d logp / d h is
    formed in the forward (`_logp_forward_with_grad`), so backward recomputes no logits and
    runs no GEMM: grad_hidden = dlogp[:, None] * dh. Holds dh [N, H] from forward to backward
    instead of lse [N]; saves one [chunk, V] x H product per chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, softcap, temperature, ignore_index, chunk_bytes):
        logp, dh = _logp_forward_with_grad(hidden, weight, targets, softcap, temperature,
                                           ignore_index, chunk_bytes)
        ctx.save_for_backward(dh)
        ctx.set_materialize_grads(False)
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogp):
        (dh,) = ctx.saved_tensors
        if dlogp is None:
            return torch.zeros_like(dh), None, None, None, None, None, None
        # (rounded once, into dh's dtype: no fp32 [N, H] temporary)
        gh = torch.mul(dh, dlogp.float()[:, None], out=torch.empty_like(dh))
        return gh, None, None, None, None, None, None


class _TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, softcap, temperature, with_entropy, ignore_index,
                chunk_bytes):
        logp, lse, ent = _logp_forward(hidden, weight, targets, softcap, temperature,
                                       ignore_index, with_entropy, chunk_bytes)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.args = (softcap, temperature, ignore_index, chunk_bytes)
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        return (logp, ent) if with_entropy else logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dlogp, dent=None):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        softcap, temperature, ignore_index, chunk_bytes = ctx.args
        gh, gw = _logp_backward(hidden, weight, targets, lse, ent, dlogp, dent, softcap,
                                temperature, ignore_index, ctx.needs_input_grad[0],
                                ctx.needs_input_grad[1], chunk_bytes)
        return gh, gw, None, None, None, None, None, None


def token_logprobs_triton(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          softcap: float | None = None, temperature: float = 1.0,
                          return_entropy: bool = False, ignore_index: int = IGNORE_INDEX,
                          chunk_bytes: int | None = None, grad_in_forward: bool | None = None):
    """Chunked per-token log-probs (module docstring); same contract as the reference.

    Through autograd when it will need gradients (grad mode on and hidden or weight requiring
    grad), keeping only the per-row softmax statistics; otherwise a plain forward. With
    `grad_in_forward` (default: grad_in_forward_default(), on), no entropy and a frozen weight,
    the forward forms d logp / d hidden [N, H] instead, and backward only scales it per row
    (one logits product less per chunk).
    """
    _check_args(hidden, weight, targets, softcap, temperature)
    h = hidden if hidden.is_contiguous() else hidden.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    tgt = targets.reshape(-1).contiguous()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        if grad_in_forward is None:
            grad_in_forward = grad_in_forward_default()
        if grad_in_forward and not return_entropy and not weight.requires_grad:
            return _TokenLogprobsGradInForward.apply(h, w, tgt, softcap, temperature,
                                                     ignore_index, chunk_bytes)
        return _TokenLogprobsFunction.apply(h, w, tgt, softcap, temperature, return_entropy,
                                            ignore_index, chunk_bytes)
    logp, _, ent = _logp_forward(h, w, tgt, softcap, temperature, ignore_index, return_entropy,
                                 chunk_bytes)
    return (logp, ent) if return_entropy else logp


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   softcap: float | None = None, temperature: float = 1.0,
                   return_entropy: bool = False, ignore_index: int = IGNORE_INDEX,
                   chunk_bytes: int | None = None, grad_in_forward: bool | None = None):
    """hidden: [N, H], weight: [V, H] (no bias), targets: [N] -> logp [N] fp32, or
    (logp [N], entropy [N]) fp32 with return_entropy. Logits are soft-capped
    (softcap * tanh(x / softcap)) then divided by temperature before the softmax; rows whose
    target is ignore_index give 0 and get no gradient. Targets must be in [0, V) otherwise.
    Triton path (chunked, no full logits) or reference, per `dispatch.use_triton`.
    grad_in_forward (Triton path): form d logp / d hidden in the forward where the weight is
    frozen and no entropy is asked for (token_logprobs_triton); None: the default, on."""
    if use_triton(hidden):
        return token_logprobs_triton(hidden, weight, targets, softcap, temperature,
                                     return_entropy, ignore_index, chunk_bytes, grad_in_forward)
    return token_logprobs_reference(hidden, weight, targets, softcap, temperature,
                                    return_entropy, ignore_index)
