"""Choosing what each layer keeps for backward: the fastest plan that fits the memory allowed.

Per layer (model/fused_layer.py) a LayerPlan says what is kept (0 input, 1 attention state,
2 everything) and whether it is offloaded to pinned host memory. Speed order, fastest first:
keep 2 on the GPU (nothing but norms and the activation recomputed), keep 1 (gate/up
recomputed), keep 0 (everything but down recomputed). Offloading costs GPU time only when the
device->host copies outrun the forward pass, so a layer that does not fit on the GPU is offloaded
with keep 1 (its attention state, ~4.5 x the layer input), not recomputed from its input.

Sizes per token per layer, bf16 (exact: these are the tensors the fused layer keeps):
    input   2 * hidden
    keep 1  + 2 * (hidden + 2 * q_size + 2 * kv_size)       (h_mid, attention out, q, k, v)
    keep 2  + 2 * 2 * intermediate                         (gate, up)
The working set on top (a layer's backward: row-chunked MLP, a few [tokens, hidden] buffers, two
layers' offloaded state in flight, the fused cross-entropy chunk, allocator slack) is
HEADROOM_GIB + HEADROOM_HIDDEN [tokens, hidden] tensors + the MLP chunk's three [rows,
intermediate] tensors.
"""

from __future__ import annotations

import os

import torch

from ..model.activation_store import IN_FLIGHT_LAYERS
from ..model.fused_layer import LayerPlan

# Measured on an H200 (offload, 4 x 2048 tokens): the working set above weights, optimizer state
# and kept tensors peaked at 0.86 GiB for Llama-3.1-8B and 0.48 GiB for Llama-3.2-1B; this model
# gives 1.11 / 0.70 GiB.
HEADROOM_GIB = 0.2
HEADROOM_HIDDEN = 4
# The host link bounds offloading: when layers' state takes longer to copy than the forward takes
# to compute, the forward waits for the copies. Rates measured on an H200: pinned copies each way
# while the other direction runs (55 GB/s alone), and the fused layer's forward over its matmul
# FLOPs (Llama-3.1-8B offloads all 31 layers without waiting; Llama-3.2-1B ran slower offloading
# every layer than recomputing). LEANTUNE_LINK_GBS overrides the first.
LINK_BYTES_PER_S = float(os.environ.get("LEANTUNE_LINK_GBS", 50)) * 1e9
FWD_FLOPS_PER_S = 650e12

# The autograd path (no fused layers: q/k norm, LoRA dropout, full fine-tuning, --no-fused-layers)
# keeps what autograd saves: ~ACT_FACTOR * (8 hidden + 3 intermediate + 3 kv) values per token
# per layer (measured on an H200 for Llama-3.2-1B / 3.1-8B shapes), plus a working set of a fixed
# part and 2.5 layers' activations; layers it does not keep are recomputed from their input.
ACT_FACTOR = 0.8
AUTOGRAD_HEADROOM_GIB = 1.5
AUTOGRAD_HEADROOM_LAYERS = 2.5


def kept_bytes(cfg, tokens: int, keep: int, itemsize: int = 2, autograd: bool = False) -> int:
    """Bytes one layer keeps for backward at `keep`, for `tokens` tokens of `itemsize` bytes."""
    if autograd and keep == 2:
        return int(ACT_FACTOR * itemsize * tokens * (
            8 * cfg.hidden_size + 3 * cfg.intermediate_size + 3 * cfg.kv_size))
    per_token = cfg.hidden_size
    if keep >= 1:
        per_token += cfg.hidden_size + 2 * cfg.q_size + 2 * cfg.kv_size
    if keep >= 2:
        per_token += 2 * cfg.intermediate_size
    return itemsize * per_token * tokens


def layer_forward_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of one decoder layer's forward over `tokens` tokens (projections only)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    return 2.0 * tokens * (h * (2 * cfg.q_size + 2 * cfg.kv_size) + 3 * h * i)


def offload_capacity(cfg, tokens: int, itemsize: int = 2) -> int:
    """How many layers' attention state (keep 1) the host link takes during one forward without
    holding it up: all layers' forward time over one layer's copy time, plus the copies still
    allowed in flight when the forward ends."""
    forward_s = cfg.num_hidden_layers * layer_forward_flops(cfg, tokens) / FWD_FLOPS_PER_S
    copy_s = kept_bytes(cfg, tokens, 1, itemsize) / LINK_BYTES_PER_S
    return min(cfg.num_hidden_layers, int(forward_s / copy_s) + IN_FLIGHT_LAYERS)


def mlp_chunk_working_bytes(cfg, tokens: int, itemsize: int = 2) -> int:
    """GPU bytes of the fused layer's MLP row chunk in backward (gate | up and its gradient)."""
    from ..model import fused_layer

    one = tokens * cfg.intermediate_size * itemsize  # one [tokens, intermediate] tensor
    return 3 * min(one, int(fused_layer.MLP_CHUNK_BYTES))


def working_set_bytes(cfg, tokens: int, itemsize: int = 2, autograd: bool = False) -> float:
    """GPU bytes a step needs beside weights, optimizer state and kept tensors (module
    docstring): the fused path's working set, or the autograd path's."""
    if autograd:
        return (AUTOGRAD_HEADROOM_GIB * 2**30
                + AUTOGRAD_HEADROOM_LAYERS * kept_bytes(cfg, tokens, 2, itemsize, True))
    return (HEADROOM_GIB * 2**30 + HEADROOM_HIDDEN * itemsize * cfg.hidden_size * tokens
            + mlp_chunk_working_bytes(cfg, tokens, itemsize))


def host_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """Host memory available to this run now (Linux MemAvailable: free plus reclaimable cache),
    else the machine's physical memory, else 0. Other processes' use (e.g. one per GPU on a
    multi-GPU host) is already subtracted from MemAvailable."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def plan_layers(cfg, tokens: int, budget_bytes: float, fixed_bytes: float,
                host_bytes: float | None = None, itemsize: int = 2,
                autograd: bool = False) -> list[LayerPlan]:
    """Per layer, the fastest LayerPlan whose GPU memory fits `budget_bytes` beside
    `fixed_bytes` (weights, optimizer state). The first layers offload their attention state, as
    many as the host link takes (offload_capacity); the later ones keep it on the GPU, or only
    their input where that does not fit (the last layer's is needed right after the forward);
    then layers keep everything on the GPU from the last layer backwards while it fits (the
    last layers' tensors are needed first in backward). Without host memory for offloading (or
    on the autograd path, which cannot offload) layers keep their input, or everything."""
    L = cfg.num_hidden_layers
    k0, k1, k2 = (kept_bytes(cfg, tokens, k, itemsize, autograd) for k in (0, 1, 2))
    headroom = working_set_bytes(cfg, tokens, itemsize, autograd)
    if autograd:
        host_bytes = 0
    host = host_memory_bytes() if host_bytes is None else host_bytes
    plans = [LayerPlan(keep=0)] * L
    free = budget_bytes - fixed_bytes - headroom - L * k0
    n_off = min(L - 1, offload_capacity(cfg, tokens, itemsize))
    # offloaded layers hold nothing on the GPU, but up to two layers' copies are in flight
    off_delta = n_off * k0 - min(n_off, IN_FLIGHT_LAYERS) * k1
    # offload (faster than recomputing) where the host has room (leaving it half its memory),
    # unless it would take more GPU memory than keeping inputs and that would not fit
    can_offload = (host >= 2 * L * k1 and n_off > 0
                   and (off_delta >= 0 or free + off_delta >= 0))
    if can_offload:
        plans = [LayerPlan(keep=1, offload=True)] * n_off + plans[n_off:]
        free += off_delta
        for i in reversed(range(n_off, L)):
            if free < k1 - k0:
                break
            free -= k1 - k0
            plans[i] = LayerPlan(keep=1)
    for i in reversed(range(L)):
        cost = k2 - (0 if plans[i].offload else kept_bytes(cfg, tokens, plans[i].keep, itemsize,
                                                            autograd))
        if free < cost:
            break
        free -= cost
        plans[i] = LayerPlan(keep=2)
    return plans


def least_plan_bytes(cfg, tokens: int, itemsize: int = 2, autograd: bool = False,
                     host_bytes: float | None = None) -> int:
    """GPU bytes beside weights and optimizer state that the leanest plan `plan_layers` can make
    needs (layers keep their input, or offload their state where the host has room, plus the
    working set): a budget below it will run out of memory."""
    L = cfg.num_hidden_layers
    k0 = kept_bytes(cfg, tokens, 0, itemsize)
    headroom = working_set_bytes(cfg, tokens, itemsize, autograd)
    if autograd:
        return int(headroom + L * k0)
    kept = L * k0
    k1 = kept_bytes(cfg, tokens, 1, itemsize)
    host = host_memory_bytes() if host_bytes is None else host_bytes
    n_off = min(L - 1, offload_capacity(cfg, tokens, itemsize))
    if host >= 2 * L * k1 and n_off > 0:
        kept = min(kept, (L - n_off) * k0 + min(n_off, IN_FLIGHT_LAYERS) * k1)
    return int(headroom + kept)


def policy_plans(policy: str, num_layers: int) -> list[LayerPlan]:
    """The fixed policies: none (keep everything), recompute (keep inputs), offload (attention
    state to the host; the last layer's stays on the GPU)."""
    if policy == "none":
        return [LayerPlan(keep=2)] * num_layers
    if policy == "recompute":
        return [LayerPlan(keep=0)] * num_layers
    if policy == "offload":
        return [LayerPlan(keep=1, offload=True)] * (num_layers - 1) + [LayerPlan(keep=1)]
    raise ValueError(f"unknown checkpointing policy {policy!r}")


def describe(plans: list[LayerPlan]) -> str:
    """Counts per kind, e.g. '4 keep all, 28 offload attention state'."""
    names = {(2, False): "keep all", (1, True): "offload attention state",
             (1, False): "keep attention state", (0, False): "recompute from input",
             (0, True): "offload input", (2, True): "offload all"}
    counts: dict[str, int] = {}
    for p in plans:
        counts[names[(p.keep, p.offload)]] = counts.get(names[(p.keep, p.offload)], 0) + 1
    return ", ".join(f"{n} {what}" for what, n in counts.items())


def gpu_budget_bytes(device: torch.device, max_memory_gib: float | None) -> float:
    total = torch.cuda.get_device_properties(device).total_memory
    return min(total * 0.92, max_memory_gib * 2**30) if max_memory_gib else total * 0.92
