"""Choosing how many layers to recompute: the fastest policy that fits the memory allowed.

Recomputing a layer's activations in backward costs about a third of a LoRA step; keeping them
costs memory. With a budget (the GPU's memory, or --max-memory-gib), keep the activations of as
many layers as fit and recompute the rest.

Kept activations per token per layer are estimated as
    ACT_FACTOR * 2 bytes * (8 * hidden + 3 * intermediate + 3 * kv_size)
(the bf16 tensors autograd saves: norm inputs/outputs, q, k, v, attention output, residuals,
gate, up, activation); ACT_FACTOR = 0.8 was measured on an H200 for Llama-3.2-1B and
Llama-3.1-8B shapes (0.52 / 0.97 GiB per layer at 8192 tokens, see BENCHMARKS.md).
"""

from __future__ import annotations

import torch

ACT_FACTOR = 0.8
# Transient memory on top of what is kept: a fixed part (fused CE chunk, allocator slack) and the
# working set of a layer being recomputed and back-propagated (~2.5 layers' activations; with
# 1.5 + 1 layer the 8B plan for a 40 GiB budget peaked at 42.1 GiB on an H200).
HEADROOM_GIB = 1.5
HEADROOM_LAYERS = 2.5


def kept_bytes_per_token_layer(cfg) -> float:
    return ACT_FACTOR * 2 * (8 * cfg.hidden_size + 3 * cfg.intermediate_size + 3 * cfg.kv_size)


def checkpoint_plan(cfg, tokens_per_micro_batch: int, budget_bytes: float,
                    fixed_bytes: float) -> list[bool]:
    """Per layer: True = recompute. Keeps the first layers' activations while they fit."""
    L = cfg.num_hidden_layers
    # every layer keeps at least its input when recomputed (bf16 [tokens, hidden])
    ckpt_input = 2 * cfg.hidden_size * tokens_per_micro_batch
    per_layer = kept_bytes_per_token_layer(cfg) * tokens_per_micro_batch
    headroom = HEADROOM_GIB * 2**30 + HEADROOM_LAYERS * per_layer
    free = budget_bytes - fixed_bytes - headroom - L * ckpt_input
    keep = int(max(0, min(L, free // max(per_layer - ckpt_input, 1))))
    return [i >= keep for i in range(L)]


def gpu_budget_bytes(device: torch.device, max_memory_gib: float | None) -> float:
    total = torch.cuda.get_device_properties(device).total_memory
    return min(total * 0.92, max_memory_gib * 2**30) if max_memory_gib else total * 0.92
