"""Attention backends of the hand-written layers: a forward that keeps what its backward needs.

On the varlen path (CUDA, half precision) the flash-attention aten ops are called directly, and
for rows of one document (full-window layers) cuDNN's: the forward's log-sum-exp is kept, so the
backward runs no attention forward again. cuDNN runs causal attention over whole rows about 1.8x
faster than flash attention 2 on an H200 (fwd+bwd, Llama-3.1-8B shapes). Elsewhere (CPU, fp32,
EngineOptions.attention == "sdpa") backward re-runs the model's plain attention under autograd.

Soft-capped scores (Gemma 2, `softcap`): query blocks with the log-sum-exp kept, forward and
backward (model/softcap_attention.py), on every path: no [T, T] scores.

Attention sinks (gpt-oss, `sinks` [Hq]): on the flash path they are added on top of flash's
log-sum-exp (model/sink_attention.py), the state keeping the sink-inclusive one, and backward
returns their gradient too (None for frozen sinks: not computed); cuDNN is not used for them. Elsewhere the model's attention with
sinks runs under autograd as without them.

Shared-prompt batches (meta.kv_index, model/attention.py): the flash path gathers k/v into the
key segments (k_flat[kv_index]), calls flash with separate query and key segments, and backward
gathers again (nothing more kept) and sums flash's dk/dv of the gathered rows back onto the token
rows (scatter_kv_grads). cuDNN is never used for them (one_document_rows is False).

All tensors are [B, T, H, D] (q: Hq heads, k/v: Hk heads); the metadata is the model's
AttentionMeta, built once per batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.attention import (SDPA_GQA, AttentionMeta, attention, check_shared, gather_kv,
                               repeat_kv_heads, scatter_kv_grads)
from ..model.flash import flash_backward, flash_forward, flash_ok
from ..model.sink_attention import add_sinks, sinks_grad
from ..model.softcap_attention import softcap_attention_backward, softcap_attention_forward
from .options import EngineOptions

_CUDNN_OPS = hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and hasattr(
    torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward")


def _bhtd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [B, T, H, D] <-> [B, H, T, D] (a view)


@dataclass
class FlashState:
    lse: torch.Tensor  # [Hq, N] fp32 log-sum-exp (with sinks: the sink-inclusive one)
    rng: torch.Tensor


@dataclass
class CudnnState:
    lse: torch.Tensor  # [B, Hq, T, 1] fp32 log-sum-exp
    rest: tuple        # the op's bookkeeping outputs
    repeated: bool     # k/v heads were repeated (no native GQA in this build)


@dataclass
class SoftcapState:
    lse: torch.Tensor  # [B, Hq, T] fp32 log-sum-exp of the soft-capped scores


@dataclass
class GraphState:
    """Attention run under autograd (a recompute right before backward): its graph."""
    out: torch.Tensor
    leaves: list


def _autograd_attention(q, k, v, sinks, meta, window, scale):
    """The model's attention under autograd over detached inputs -> (out, the inputs as leaves:
    q, k, v and sinks where given)."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks) if t is not None]
        return attention(*leaves[:3], meta, window, scale, *leaves[3:]), leaves


class AttentionBackend:
    """Forward/backward of causal attention within documents for the hand-written layers.

    Runtime state: whether cuDNN accepted the inputs so far (a refusal switches it off for the
    rest of the process) and whether this build's cuDNN takes GQA natively."""

    def __init__(self, options: EngineOptions):
        self.use_cudnn = options.attention == "auto"
        self.use_flash = options.attention in ("auto", "flash")
        self.cudnn_gqa = SDPA_GQA  # try native GQA first (enable_gqa)

    def _cudnn_ok(self, q: torch.Tensor, meta: AttentionMeta, window: int | None) -> bool:
        return (self.use_cudnn and _CUDNN_OPS and q.is_cuda and meta.path == "varlen"
                and meta.one_document_rows and window is None)

    def _cudnn_forward(self, q, k, v, scale):
        """cuDNN's causal attention through its aten op, keeping what its backward op needs;
        None if cuDNN refuses the inputs (then flash from now on)."""
        rep = q.shape[2] // k.shape[2]
        if rep > 1 and not self.cudnn_gqa:
            k, v = repeat_kv_heads(k, rep), repeat_kv_heads(v, rep)
        try:
            out, lse, *rest = torch.ops.aten._scaled_dot_product_cudnn_attention(
                _bhtd(q), _bhtd(k), _bhtd(v), None, True, 0.0, True, False, scale=scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            if rep > 1 and self.cudnn_gqa:  # no native GQA in this build: repeat heads from now
                self.cudnn_gqa = False
                return self._cudnn_forward(q, k, v, scale)
            self.use_cudnn = False
            return None
        cq, ck, mq, mk, seed, offset, _ = rest
        return _bhtd(out), CudnnState(lse, (cq, ck, mq, mk, seed, offset),
                                      rep > 1 and not self.cudnn_gqa)

    @staticmethod
    def _cudnn_backward(dout, q, k, v, out, state: CudnnState, scale):
        Hk = k.shape[2]
        rep = q.shape[2] // Hk
        if state.repeated:
            k, v = repeat_kv_heads(k, rep), repeat_kv_heads(v, rep)
        cq, ck, mq, mk, seed, offset = state.rest
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhtd(dout), _bhtd(q), _bhtd(k), _bhtd(v), _bhtd(out), state.lse, seed, offset,
            None, cq, ck, mq, mk, 0.0, True, scale=scale)
        dq, dk, dv = _bhtd(dq), _bhtd(dk), _bhtd(dv)
        if state.repeated:  # the repeated heads' gradients sum back onto their k/v head
            B, T, _, D = dk.shape
            dk = dk.reshape(B, T, Hk, rep, D).sum(3)
            dv = dv.reshape(B, T, Hk, rep, D).sum(3)
        return dq, dk, dv

    def forward(self, q, k, v, meta: AttentionMeta, window: int | None, scale: float,
                for_backward: bool = False, sinks: torch.Tensor | None = None,
                softcap: float | None = None):
        """-> (out [B, T, Hq, D], state for `backward`). state: flash's or cuDNN's softmax
        statistics, so backward runs no attention forward again; elsewhere None (backward
        re-runs attention under autograd) or, with `for_backward` (a recompute right before
        backward), the autograd graph of this call, so backward does not run it a third time.
        `sinks` [Hq]: attention sinks; `softcap`: soft-capped scores (module docstring)."""
        check_shared(meta, sinks, softcap)
        if softcap:
            out, lse = softcap_attention_forward(q, k, v, meta, window, scale, softcap)
            return out, SoftcapState(lse)
        if sinks is None and self._cudnn_ok(q, meta, window):
            res = self._cudnn_forward(q, k, v, scale)
            if res is not None:
                return res
        if meta.path == "varlen" and self.use_flash and flash_ok(q):
            if meta.kv_index is not None:  # shared prompts: the key segments, gathered
                kg, vg = gather_kv(k, v, meta.kv_index)
                out, lse, rng = flash_forward(q, kg, vg, meta.cu_seqlens, meta.max_seqlen,
                                              window, scale, meta.cu_seqlens_k,
                                              meta.max_seqlen_k)
                return out, FlashState(lse, rng)
            out, lse, rng = flash_forward(q, k, v, meta.cu_seqlens, meta.max_seqlen, window,
                                          scale)
            if sinks is not None:
                out, lse = add_sinks(out, lse, sinks.detach())
            return out, FlashState(lse, rng)
        if for_backward:
            out, leaves = _autograd_attention(q, k, v, sinks, meta, window, scale)
            return out.detach(), GraphState(out, leaves)
        with torch.no_grad():
            return attention(q, k, v, meta, window, scale, sinks), None

    def backward(self, dout, q, k, v, out, state, meta: AttentionMeta, window: int | None,
                 scale: float, sinks: torch.Tensor | None = None,
                 softcap: float | None = None) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv) for dout [B, T, Hq, D], given forward's inputs, output and state; with
        `sinks` (as forward had them) (dq, dk, dv, dsinks), dsinks [Hq] in the sinks' dtype."""
        if isinstance(state, SoftcapState):
            return softcap_attention_backward(dout, q, k, v, out, state.lse, meta, window,
                                              scale, softcap)
        if isinstance(state, CudnnState):
            try:
                return self._cudnn_backward(dout, q, k, v, out, state, scale)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError:  # cuDNN took the forward but refuses the backward: no cuDNN
                self.use_cudnn = False  # from now on; this once, attention under autograd
                state = None
        if isinstance(state, GraphState):
            return torch.autograd.grad(state.out, state.leaves, dout)
        if isinstance(state, FlashState) and meta.kv_index is not None:
            kg, vg = gather_kv(k, v, meta.kv_index)  # again: cheaper than keeping them
            dq, dkg, dvg = flash_backward(dout, q, kg, vg, out, state.lse, state.rng,
                                          meta.cu_seqlens, meta.max_seqlen, window, scale,
                                          meta.cu_seqlens_k, meta.max_seqlen_k)
            return (dq, *scatter_kv_grads(dkg, dvg, meta.kv_index, k.shape))
        if isinstance(state, FlashState):
            grads = flash_backward(dout, q, k, v, out, state.lse, state.rng, meta.cu_seqlens,
                                   meta.max_seqlen, window, scale)
            if sinks is None:
                return grads
            return (*grads, sinks_grad(dout, out, state.lse, sinks.detach())
                    if sinks.requires_grad else None)
        out, leaves = _autograd_attention(q, k, v, sinks, meta, window, scale)
        return torch.autograd.grad(out, leaves, dout)

    @staticmethod
    def state_bytes_per_token(num_heads: int) -> int:
        """Bytes per token of the softmax statistics forward keeps (fp32 per q head)."""
        return 4 * num_heads
