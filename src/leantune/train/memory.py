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
From keep 1 on a layer also keeps its LoRA input products x A^T (2 * 6 r per token: 0.5% of
keep 1 at r = 16), left to the working set's slack.

A plan's peak (plan_peak_bytes) is the largest of the step's phases, not the sum of everything
a plan keeps: the forward of layer i holds what the layers below keep on the GPU, up to two
offloaded layers' copies in flight and a layer's working set; the loss holds everything kept
plus the fused cross-entropy's chunk; the backward of layer i holds what the layers below keep,
its own state (reloaded, if offloaded; rebuilt up to keep 1, if it kept only its input), the
next layer's state being prefetched, and the working set, less the gate/up it kept (it
backpropagates through them instead of recomputing them). The working set (a layer's
row-chunked MLP, a few [tokens, hidden] buffers, allocator slack) is HEADROOM_GIB +
HEADROOM_HIDDEN [tokens, hidden] tensors + the MLP chunk's three [rows, intermediate] tensors
(forward chunks are MLP_FWD_CHUNK_FACTOR times the backward's; a layer kept whole runs its MLP
in one piece).
Measured on an H200 (Llama-3.1-8B, 8192 tokens; GiB above weights and optimizer state, model in
brackets): offloading 1.47 (1.57), the last two layers kept whole 1.87 (2.04), recompute 3.06
(3.23).
"""

from __future__ import annotations

import math
import os

import torch

from ..model.activation_store import IN_FLIGHT_LAYERS
from ..model.fused_layer import LayerPlan

# Measured on an H200 (offload, 4 x 2048 tokens): the working set above weights, optimizer state
# (LoRA grads included) and kept tensors peaked at 0.91 GiB for Llama-3.1-8B (its backward:
# bench/memory_peak.py) and ~0.5 GiB for Llama-3.2-1B; this model gives 1.01 / 0.60 GiB.
HEADROOM_GIB = 0.1
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


def mlp_chunk_working_bytes(cfg, tokens: int, itemsize: int = 2, forward: bool = False) -> int:
    """GPU bytes of the fused layer's MLP row chunk: in backward gate | up and the down
    projection's input gradient, in forward gate | up and the down projection's input (whose
    chunks are MLP_FWD_CHUNK_FACTOR times larger)."""
    from ..model import fused_layer

    one = tokens * cfg.intermediate_size * itemsize  # one [tokens, intermediate] tensor
    limit = fused_layer.MLP_CHUNK_BYTES * (fused_layer.MLP_FWD_CHUNK_FACTOR if forward else 1)
    return 3 * min(one, int(limit))


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


def loss_working_bytes(cfg, tokens: int, itemsize: int = 2) -> float:
    """GPU bytes the loss needs beside kept tensors: the fused cross-entropy's logits chunk
    (kernels/cross_entropy.CHUNK_BYTES on CUDA), the final norm's output, the hidden states'
    gradient, slack."""
    from ..kernels.cross_entropy import CHUNK_BYTES

    chunk = min(CHUNK_BYTES["cuda"], tokens * cfg.vocab_size * itemsize)
    return HEADROOM_GIB * 2**30 + HEADROOM_HIDDEN * itemsize * cfg.hidden_size * tokens + chunk


def plan_peak_bytes(cfg, tokens: int, plans: list[LayerPlan], itemsize: int = 2,
                    autograd: bool = False) -> float:
    """GPU bytes beside weights and optimizer state at the step's peak under `plans`: the
    largest phase (module docstring). On the autograd path every layer's saved tensors live to
    the end of the forward, so it is all that is kept plus its working set."""
    kept = [kept_bytes(cfg, tokens, p.keep, itemsize, autograd) for p in plans]
    gpu = [0 if p.offload else k for p, k in zip(plans, kept)]
    ws = working_set_bytes(cfg, tokens, itemsize, autograd)
    if autograd:
        return sum(gpu) + ws
    k1 = kept_bytes(cfg, tokens, 1, itemsize)
    # the MLP's part of the working set: row chunks, except in a layer kept whole, which runs it
    # in one piece (its gate/up [tokens, 2 I] and one [tokens, I] tensor; in backward the kept
    # gate/up counts in its own state)
    one = tokens * cfg.intermediate_size * itemsize
    rest = ws - mlp_chunk_working_bytes(cfg, tokens, itemsize)
    mlp_fwd = mlp_chunk_working_bytes(cfg, tokens, itemsize, forward=True)
    mlp_bwd = mlp_chunk_working_bytes(cfg, tokens, itemsize)

    def in_flight(i):  # offloaded layers' copies that may still be under way at layer i
        return sum(kept[j] for j in range(max(0, i - IN_FLIGHT_LAYERS), i) if plans[j].offload)

    peak, below = 0.0, 0
    for i, p in enumerate(plans):
        whole = p.keep == 2
        forward = below + in_flight(i) + rest + (3 * one if whole else mlp_fwd)
        prefetch = kept[i - 1] if i > 0 and plans[i - 1].offload else 0
        own = max(kept[i], k1)  # keep 0 rebuilds its attention state first
        backward = below + own + prefetch + rest + (one if whole else mlp_bwd)
        peak = max(peak, forward, backward)
        below += gpu[i]
    loss = below + in_flight(len(plans)) + loss_working_bytes(cfg, tokens, itemsize)
    return max(peak, loss)


def _offloads(cfg, tokens: int, itemsize: int, host_bytes: float | None) -> int:
    """How many first layers offloading may take: what the host link carries, where the host has
    room (leaving it half its memory); never the last layer (needed right after the forward)."""
    L = cfg.num_hidden_layers
    host = host_memory_bytes() if host_bytes is None else host_bytes
    if host < 2 * L * kept_bytes(cfg, tokens, 1, itemsize):
        return 0
    return max(0, min(L - 1, offload_capacity(cfg, tokens, itemsize)))


def plan_layers(cfg, tokens: int, budget_bytes: float, fixed_bytes: float,
                host_bytes: float | None = None, itemsize: int = 2,
                autograd: bool = False) -> list[LayerPlan]:
    """Per layer, the fastest LayerPlan whose peak (plan_peak_bytes) fits `budget_bytes` beside
    `fixed_bytes` (weights, optimizer state). The first layers offload their attention state, as
    many as the host link takes (offload_capacity), unless that needs more memory than keeping
    inputs and the budget is too small for it; the later ones keep their attention state on the
    GPU, or only their input where that does not fit; then layers keep everything on the GPU
    from the last layer backwards while it fits (the last layers' tensors are needed first in
    backward, and they free gate/up before the layers below run). Without host memory for
    offloading (or on the autograd path, which cannot offload) layers keep their input, or
    everything."""
    L = cfg.num_hidden_layers
    room = budget_bytes - fixed_bytes

    def peak(ps):
        return plan_peak_bytes(cfg, tokens, ps, itemsize, autograd)

    plans = [LayerPlan(keep=0)] * L
    n_off = 0 if autograd else _offloads(cfg, tokens, itemsize, host_bytes)
    if n_off:
        # the most layers offloaded that fit, else the leanest count (the peak is not monotone
        # in it: the second-to-last layer's copy is still in flight at the loss)
        counts = [[LayerPlan(keep=1, offload=True)] * n + plans[n:] for n in range(n_off, 0, -1)]
        offload = next((c for c in counts if peak(c) <= room), min(counts, key=peak))
        n_off = sum(p.offload for p in offload)
        if peak(offload) <= max(room, peak(plans)):
            plans = offload
            for i in reversed(range(n_off, L)):
                trial = plans[:i] + [LayerPlan(keep=1)] + plans[i + 1:]
                if peak(trial) > room:
                    break
                plans = trial
    for i in reversed(range(L)):
        trial = plans[:i] + [LayerPlan(keep=2)] + plans[i + 1:]
        if peak(trial) > room:
            break
        plans = trial
    return plans


def least_plan_bytes(cfg, tokens: int, itemsize: int = 2, autograd: bool = False,
                     host_bytes: float | None = None) -> int:
    """GPU bytes beside weights and optimizer state that the leanest plan `plan_layers` can make
    needs (layers keep their input, or offload their state where the host has room): a budget
    below it will run out of memory."""
    L = cfg.num_hidden_layers
    inputs = [LayerPlan(keep=0)] * L
    least = plan_peak_bytes(cfg, tokens, inputs, itemsize, autograd)
    n_off = 0 if autograd else _offloads(cfg, tokens, itemsize, host_bytes)
    for n in range(1, n_off + 1):
        offload = [LayerPlan(keep=1, offload=True)] * n + inputs[n:]
        least = min(least, plan_peak_bytes(cfg, tokens, offload, itemsize))
    return math.ceil(least)


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
