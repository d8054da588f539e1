"""Embedding lookup from a table kept in pinned host memory.

A frozen input embedding (LoRA and QLoRA) is read once per step, a few rows per token: at
Llama-3.1-8B size (128256 x 4096 bf16) it is ~1 GiB of GPU memory for 64 MiB of reads a step. With
the table in pinned host memory the Triton kernel below gathers the rows straight over the host
link (pinned memory is addressable from the GPU): [N] ids on the GPU -> [N, H] on the GPU, ~1 ms
at 8192 tokens, with no host sync and no ids sent to the host.

No autograd: the table is frozen (the caller checks). Reference: torch.nn.functional.embedding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None

_BLOCK_H = 1024

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(IDS, W, OUT, V, H, stride_w, BLOCK_H: tl.constexpr):
        """OUT[row] = W[IDS[row]] for one row per program, H columns in BLOCK_H pieces. An id
        outside [0, V) reads nothing and gives a zero row (the Trainer rejects such ids up
        front; this only keeps the kernel from reading past the table)."""
        row = tl.program_id(0).to(tl.int64)
        idx = tl.load(IDS + row).to(tl.int64)
        readable = tl.where((idx >= 0) & (idx < V), H, 0)  # columns to read: H, or none
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = cols < H
            vals = tl.load(W + idx * stride_w + cols, mask=cols < readable, other=0.0)
            tl.store(OUT + row * H + cols, vals, mask=mask)


def embedding_reference(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids.to(weight.device), weight).to(ids.device)


def gather_rows(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The Triton gather: ids [...] (int) -> [..., H] on ids' device, weight [V, H] (rows
    contiguous) on that device or in pinned host memory."""
    out = torch.empty(*ids.shape, weight.shape[1], dtype=weight.dtype, device=ids.device)
    flat = ids.reshape(-1)
    if flat.numel():
        _gather_rows_kernel[(flat.numel(),)](flat, weight, out, weight.shape[0],
                                             weight.shape[1], weight.stride(0),
                                             BLOCK_H=_BLOCK_H, num_warps=4)
    return out


def embedding_lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ids [...] -> weight[ids] [..., H] on ids' device, for a frozen table `weight` [V, H].

    Same device: plain F.embedding. Table in pinned host memory, ids on the GPU: the Triton
    gather reads the rows over the host link (the reference copies ids to the host and back)."""
    if weight.device == ids.device:
        return F.embedding(ids, weight)
    if weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("the input embedding lives in host memory (offload_embedding), where "
                           "it cannot be trained: move it back to the GPU first, e.g. "
                           "model.model.embed_tokens.to(device)")
    if ids.is_cuda and weight.is_pinned() and weight.stride(1) == 1 and use_triton(ids):
        return gather_rows(ids, weight)
    return embedding_reference(ids, weight)
