"""Choosing what each layer keeps for backward: the fastest plan whose peak fits the budget.

Per layer a LayerPlan (engine/executor.py) says what is kept (Keep.INPUT, ATTENTION, ALL) and
whether it is offloaded to pinned host memory. Speed order, fastest first: ALL on the GPU
(nothing but norms and the activation recomputed), ATTENTION (gate/up recomputed), INPUT
(everything but down recomputed). Offloading costs GPU time only when the device->host copies
outrun the forward pass, so a layer that does not fit on the GPU is offloaded with its
attention state (~4.5 x its input) where the host link keeps up, else its input only.

The bytes come from the executor that runs the layers (FusedExecutor: what `Kept` holds at
each level, the MLP row chunk, the q/k-norm copies), not from a second description here. A
plan's peak (plan_peak_bytes) is the largest of the step's phases, not the sum of everything a
plan keeps: the forward of layer i holds what the layers below keep on the GPU, up to two
offloaded layers' copies in flight and a layer's working set; the loss holds everything kept
plus the fused cross-entropy's logits chunk; the backward of layer i holds what the layers below
keep, its own state (reloaded, if offloaded; rebuilt up to ATTENTION, if it kept only its
input), the next layer's state being prefetched (the next two where
EngineOptions.prefetch_layers says so: with streamed weights, by default), and the working set,
less the gate/up it kept (it back-propagates through them instead of recomputing them). Where the budget forces more
layers' state off the GPU than the host link carries during a forward (an FP8 forward runs
faster: FP8_FWD_FLOPS_PER_S), the fewest needed offload it without q/k/v (trim_for_link:
LayerPlan.keep_qkv=False, a third fewer bytes for one q/k/v GEMM again in backward), lowest
layers first, rather than the forward waiting on the copies. The working set (a layer's
row-chunked MLP, a few [tokens, hidden] buffers, allocator slack) is HEADROOM_GIB +
HEADROOM_HIDDEN [tokens, hidden] tensors + the MLP chunk (forward chunks are
mlp_forward_chunk_factor times the backward's; a layer kept whole runs its MLP in one piece).
Measured on an H200 (Llama-3.1-8B, 8192 tokens; GiB above weights and optimizer state, model in
brackets): offloading 1.47 (1.57), the last two layers kept whole 1.87 (2.04), recompute 3.06
(3.23).

Where memory is short, the cross-entropy's logits chunk shrinks too (plan_memory): it is the
loss phase's largest transient (256 MiB by default), and smaller chunks cost little time.

A 4-bit (NF4) base counts in the fixed bytes with its 4-bit size (packed codes and absmax, ~0.52
bytes a weight), and so do the scratch buffers its GEMMs dequantise into (one per packed shape,
shared by all layers: 0.41 GiB at Llama-3.1-8B): Engine.pack allocates them before the Trainer
measures what is allocated (engine/weights.py).

An FP8 base (--precision fp8) counts the same way: its e4m3 codes (1 byte a weight) and fp32
128 x 128 block scales (fp8_base_bytes), and the e4m3 scratch buffers dX's kernel transposes the
codes into (one per weight shape, shared by all layers: ~0.13 GiB at Llama-3.1-8B), which
Engine.pack allocates before memory is measured.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import torch

from .activation_store import IN_FLIGHT_LAYERS
from .executor import FusedExecutor, Keep, LayerPlan
from .options import EngineOptions

# Measured on an H200 (offload, 4 x 2048 tokens): the working set above weights, optimizer state
# (LoRA grads included) and kept tensors peaked at 0.91 GiB for Llama-3.1-8B (its backward:
# bench/memory_peak.py) and ~0.5 GiB for Llama-3.2-1B; this model gives 1.01 / 0.60 GiB.
HEADROOM_GIB = 0.1
HEADROOM_HIDDEN = 4
# The forward's matmul rate the planner assumes when it weighs copies against compute
# (Llama-3.1-8B offloads all 31 layers without waiting; Llama-3.2-1B ran slower offloading every
# layer's attention state than recomputing).
FWD_FLOPS_PER_S = 650e12
# The same with an FP8 base (--precision fp8), in the planner's units (copies at link_gbs):
# measured on an H200 (Llama-3.1-8B, 8192 tokens, 12 GiB), the FP8 forward's compute takes ~125
# ms (~910 TFLOP/s of projections), and at 810e12 the planner's copies (7.6 GB, ~55 GB/s) still
# held it ~12 ms a step (bench/profile_step.py's idle causes).
FP8_FWD_FLOPS_PER_S = 900e12

# The autograd path (no fused layers: LoRA dropout, full fine-tuning, --no-fused-layers,
# --compile) keeps what autograd saves: ~ACT_FACTOR * (8 hidden + 3 intermediate + 3 kv) values
# per token per layer (measured on an H200 for Llama-3.2-1B / 3.1-8B shapes), plus a working set
# of a fixed part and 2.5 layers' activations; layers it does not keep are recomputed from their
# input (torch.utils.checkpoint). For MoE layers on this path (the router's load-balancing loss,
# router jitter: engine/moe_layer.moe_unsupported; --no-fused-layers; not measured) the
# intermediate width is the top-k experts' together (ModelConfig.mlp_width) and each token's k
# routed copies of its input and output add 2 k hidden.
ACT_FACTOR = 0.8
AUTOGRAD_HEADROOM_GIB = 1.5
AUTOGRAD_HEADROOM_LAYERS = 2.5

# The cross-entropy's logits chunk shrinks to this at the least, halving from the default.
MIN_LOSS_CHUNK_BYTES = 32 << 20


@dataclass(frozen=True)
class Workload:
    """What a step runs: the model's config, tokens per micro-batch, bytes per activation value,
    the LoRA columns a layer carries (engine/executor.lora_ranks), the path (fused or autograd),
    the engine options, and whether a MoE model's experts carry LoRA.

    Preference objectives (train/objectives/preference.py): `tokens` counts both sequences of
    a pair (the trainer passes 2 x batch_size x max_seq_len); `reference_pass`: each step (or
    --precompute-reference's pass before training) also runs a no-grad forward for the
    reference log-probs (reference_pass_bytes); `reference_bytes`: full fine-tuning's frozen
    reference copy, already allocated (so inside the trainer's measured fixed bytes), named
    here so a budget it breaks can say so (BudgetTooSmall.reference_bytes)."""

    cfg: object
    tokens: int
    itemsize: int = 2
    lora_ranks: int = 0
    autograd: bool = False
    options: EngineOptions = field(default_factory=EngineOptions)
    expert_lora: bool = False  # MoE: LoRA on the experts (a larger working set)
    reference_pass: bool = False  # a no-grad reference forward each step (DPO, KTO)
    reference_bytes: int = 0  # full fine-tuning: the frozen reference copy (in the fixed bytes)
    # GRPO (train/objectives/grpo.py: GRPOObjective.generation_shape): the rollouts' decode,
    # (rows = batch_size x G, KV slots = longest prompt + max completion, prompt tokens of the
    # prefill); None: no generation inside the step
    generation: tuple[int, int, int] | None = None
    # shared-prompt pairs (data/preference.py): `tokens` still bounds a pass (a row holds at
    # most two sequences' worth), and attention gathers k/v per layer (gathered_kv_bytes)
    shared_prompt: bool = False
    fp8: bool = False  # an FP8 base (--precision fp8): a faster forward (FP8_FWD_FLOPS_PER_S)
    streaming: bool = False  # some layers' base weights stream (plan_streaming, k > 0): the
    # prefetch depth EngineOptions.prefetch_layers gives then


def gathered_kv_bytes(w: Workload) -> float:
    """Shared prompts: the per-layer temporaries of attention over gathered keys: k/v of the
    key segments [Nk, kv] (a prompt's rows twice: Nk <= 1.5 x tokens, the prompt at most half a
    pair's two sequences) and, in backward, their gradients before they are summed back."""
    if not w.shared_prompt:
        return 0.0
    return 4 * 1.5 * w.tokens * w.cfg.kv_size * w.itemsize


class BudgetTooSmall(Exception):
    """No plan fits the budget; `least_bytes`: the least budget one would fit."""

    def __init__(self, least_bytes: float, fixed_bytes: float, reference_bytes: int = 0):
        super().__init__(f"the least budget a plan fits is {least_bytes / 2**30:.2f} GiB")
        self.least_bytes, self.fixed_bytes = least_bytes, fixed_bytes
        self.reference_bytes = reference_bytes  # of fixed_bytes: a frozen reference copy


@dataclass
class MemoryPlan:
    """Per layer what it keeps (None: plain autograd, keeping everything), and the fused
    cross-entropy's logits chunk (None: its default)."""

    layers: list
    loss_chunk_bytes: int | None = None


def kept_bytes(w: Workload, keep: Keep, keep_qkv: bool = True) -> int:
    """Bytes one layer keeps for backward at `keep` (keep_qkv: LayerPlan's; the fused path
    only)."""
    if w.autograd:
        if keep == Keep.ALL:
            c = w.cfg
            routed = 2 * c.moe.top_k * c.hidden_size if c.moe else 0
            gathered = 3 * c.kv_size if w.shared_prompt else 0  # k/v of the key segments
            return int(ACT_FACTOR * w.itemsize * w.tokens * (
                8 * c.hidden_size + 3 * c.mlp_width + 3 * c.kv_size + routed + gathered))
        return w.tokens * w.itemsize * w.cfg.hidden_size  # torch.utils.checkpoint: its input
    return FusedExecutor.kept_bytes(w.cfg, w.tokens, keep, w.itemsize, w.lora_ranks, keep_qkv)


def plan_kept_bytes(w: Workload, p: LayerPlan) -> int:
    """Bytes the layer planned by `p` keeps for backward."""
    return kept_bytes(w, p.keep, p.keep_qkv)


def forward_seconds(w: Workload) -> float:
    """The forward's matmul time over all layers, at the rate the planner assumes: an FP8
    forward's with trimming on; with it off (--no-trim-offload) the 16-bit rate, as before
    trimming, whose plans let the FP8 forward wait on the copies rather than recompute layers
    from their input (measured on an H200, 8B at 12 GiB: 18,337 tok/s against 17,773 with the
    FP8 rate and no trimming)."""
    rate = FP8_FWD_FLOPS_PER_S if w.fp8 and w.options.trim_offload else FWD_FLOPS_PER_S
    return w.cfg.num_hidden_layers * FusedExecutor.forward_flops(w.cfg, w.tokens) / rate


def offload_capacity(w: Workload, keep: Keep = Keep.ATTENTION, keep_qkv: bool = True) -> int:
    """How many layers' state at `keep` the host link takes during one forward without holding
    it up: all layers' forward time over one layer's copy time, plus the copies still allowed in
    flight when the forward ends."""
    L = w.cfg.num_hidden_layers
    copy_s = kept_bytes(w, keep, keep_qkv) / w.options.link_bytes_per_s
    return min(L, int(forward_seconds(w) / copy_s) + IN_FLIGHT_LAYERS)


def link_budget_bytes(w: Workload) -> float:
    """Bytes the host link carries during one forward without holding it up, plus the copies
    still allowed in flight when it ends (IN_FLIGHT_LAYERS full attention states)."""
    return (forward_seconds(w) * w.options.link_bytes_per_s
            + IN_FLIGHT_LAYERS * kept_bytes(w, Keep.ATTENTION))


def trim_for_link(w: Workload, plans: list[LayerPlan]) -> list[LayerPlan]:
    """`plans` with q/k/v left to backward (keep_qkv=False) on as few offloaded layers as make
    their copies fit the host link's budget (link_budget_bytes), the lowest layers first (their
    copies start first); every other layer keeps its q/k/v. One GEMM a trimmed layer against the
    forward waiting on the copies: where the link keeps up, nothing is trimmed."""
    plans = [p if p is None or p.keep_qkv else replace(p, keep_qkv=True) for p in plans]
    if w.autograd or not w.options.trim_offload:
        return plans
    offloaded = [i for i, p in enumerate(plans)
                 if p is not None and p.offload and p.keep >= Keep.ATTENTION]
    full = sum(plan_kept_bytes(w, plans[i]) for i in offloaded)
    excess = full - link_budget_bytes(w)
    saved = kept_bytes(w, Keep.ATTENTION) - kept_bytes(w, Keep.ATTENTION, keep_qkv=False)
    for i in offloaded:
        if excess <= 0:
            break
        plans[i] = replace(plans[i], keep_qkv=False)
        excess -= saved
    return plans


def mlp_chunk_bytes(w: Workload, forward: bool = False) -> int:
    return FusedExecutor.mlp_chunk_bytes(w.cfg, w.tokens, w.options, w.itemsize, forward,
                                         w.expert_lora)


def working_set_bytes(w: Workload) -> float:
    """GPU bytes a layer's step needs beside weights, optimizer state and kept tensors (module
    docstring): the fused path's, or the autograd path's."""
    if w.autograd:
        return (AUTOGRAD_HEADROOM_GIB * 2**30
                + AUTOGRAD_HEADROOM_LAYERS * kept_bytes(w, Keep.ALL))
    return (HEADROOM_GIB * 2**30 + HEADROOM_HIDDEN * w.itemsize * w.cfg.hidden_size * w.tokens
            + mlp_chunk_bytes(w) + FusedExecutor.qk_norm_bytes(w.cfg, w.tokens, w.itemsize)
            + gathered_kv_bytes(w))


def loss_working_bytes(w: Workload, chunk_bytes: int | None = None) -> float:
    """GPU bytes the loss needs beside kept tensors: the fused cross-entropy's logits chunk
    (`chunk_bytes`, default kernels/cross_entropy.CHUNK_BYTES on CUDA), the final norm's
    output, the hidden states' gradient, slack."""
    from ..kernels.cross_entropy import CHUNK_BYTES

    limit = CHUNK_BYTES["cuda"] if chunk_bytes is None else chunk_bytes
    chunk = min(limit, w.tokens * w.cfg.vocab_size * w.itemsize)
    return (HEADROOM_GIB * 2**30 + HEADROOM_HIDDEN * w.itemsize * w.cfg.hidden_size * w.tokens
            + chunk)


def reference_pass_bytes(w: Workload, chunk_bytes: int | None = None) -> float:
    """GPU bytes beside weights and optimizer state of the no-grad reference forward: nothing
    is kept, so one layer's plain forward (its MLP whole: gate/up [tokens, 2 I] and the product
    [tokens, I]; a few [tokens, hidden] buffers) and the log-prob head's logits chunk. It runs
    before the policy's forward, so it adds to no other phase: the step's peak is the larger."""
    one = w.tokens * w.cfg.intermediate_size * w.itemsize
    layer = HEADROOM_HIDDEN * w.itemsize * w.cfg.hidden_size * w.tokens + 3 * one
    return layer + gathered_kv_bytes(w) / 2 + loss_working_bytes(w, chunk_bytes)


def kv_cache_bytes(cfg, rows: int, slots: int, itemsize: int) -> int:
    """The static KV cache of a generation batch (generate/cache.py): k and v [rows, slots,
    kv heads, head dim] per layer. With CUDA graphs it is made once and stays allocated for the
    run (the graph reads it by address), so it counts in every phase."""
    return (2 * cfg.num_hidden_layers * rows * slots * cfg.num_key_value_heads * cfg.head_dim
            * itemsize)


def decode_working_bytes(w: Workload) -> float:
    """GPU bytes of the generation phase besides the KV cache: the prefill of rows x prompt
    tokens (one layer's plain forward, as the no-grad reference pass: no graph, nothing kept;
    its attention masks [rows, 1, prompt, slots] per window kind), the last tokens' logits and
    the sampler's fp32 scores, softmax and sorted copies [rows, vocab]."""
    if w.generation is None:
        return 0.0
    rows, slots, prompt = w.generation
    one = rows * prompt * w.cfg.intermediate_size * w.itemsize
    layer = HEADROOM_HIDDEN * w.itemsize * w.cfg.hidden_size * rows * prompt + 3 * one
    masks = 2 * rows * prompt * slots  # bool, sliding window and full
    sampler = rows * w.cfg.vocab_size * (w.itemsize + 4 * 4)
    return HEADROOM_GIB * 2**30 + layer + masks + sampler


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


def plan_peak_bytes(w: Workload, plans: list[LayerPlan],
                    loss_chunk_bytes: int | None = None) -> float:
    """GPU bytes beside weights and optimizer state at the step's peak under `plans`: the
    largest phase (module docstring). On the autograd path every layer's saved tensors live to
    the end of the forward, so it is all that is kept plus its working set."""
    kept = [plan_kept_bytes(w, p) for p in plans]
    gpu = [0 if p.offload else k for p, k in zip(plans, kept)]
    ws = working_set_bytes(w)
    ref = reference_pass_bytes(w, loss_chunk_bytes) if w.reference_pass else 0.0
    if w.autograd:
        return with_generation(w, max(sum(gpu) + ws, ref))
    k1 = kept_bytes(w, Keep.ATTENTION)
    # the MLP's part of the working set: row chunks, except in a layer kept whole, which runs it
    # in one piece (its gate/up [tokens, 2 I] and one [tokens, I] tensor; in backward the kept
    # gate/up counts in its own state)
    one = w.tokens * w.cfg.intermediate_size * w.itemsize
    rest = ws - mlp_chunk_bytes(w)
    mlp_fwd, mlp_bwd = mlp_chunk_bytes(w, forward=True), mlp_chunk_bytes(w)
    whole_fwd, whole_bwd = 3 * one, one
    if w.cfg.moe is not None:  # a MoE block runs whole at every level; kept whole, its gate/up
        # counts in its own state in backward
        whole_fwd = max(whole_fwd, mlp_fwd)
        whole_bwd = max(whole_bwd, mlp_bwd - (kept_bytes(w, Keep.ALL) - k1))

    def in_flight(i):  # offloaded layers' copies that may still be under way at layer i
        return sum(kept[j] for j in range(max(0, i - IN_FLIGHT_LAYERS), i) if plans[j].offload)

    depth = w.options.prefetch_layers(w.streaming)  # offloaded layers below coming back at once
    peak, below = 0.0, 0
    for i, p in enumerate(plans):
        whole = p.keep == Keep.ALL
        forward = below + in_flight(i) + rest + (whole_fwd if whole else mlp_fwd)
        prefetch = sum(kept[j] for j in range(max(0, i - depth), i) if plans[j].offload)
        own = max(kept[i], k1)  # a layer that kept less than its attention state rebuilds it
        backward = below + own + prefetch + rest + (whole_bwd if whole else mlp_bwd)
        peak = max(peak, forward, backward)
        below += gpu[i]
    loss = below + in_flight(len(plans)) + loss_working_bytes(w, loss_chunk_bytes)
    return with_generation(w, max(peak, loss, ref))


def with_generation(w: Workload, train_peak: float) -> float:
    """A step's peak with GRPO's generation (w.generation): the KV cache in every phase, and
    the decode phase beside the training phases; `train_peak` as it is without one."""
    if w.generation is None:
        return train_peak
    kv = kv_cache_bytes(w.cfg, w.generation[0], w.generation[1], w.itemsize)
    return kv + max(train_peak, decode_working_bytes(w))


def recompute_flops(w: Workload, plans: list[LayerPlan]) -> float:
    """Matmul FLOPs a plan spends recomputing in backward: what the planner minimises.
    INPUT recomputes every projection but down; ATTENTION, gate and up; ALL, none; a layer
    without its q/k/v (keep_qkv=False) the q/k/v projection besides."""
    c = w.cfg  # (MoE: gate/up of the routed rows, mlp_width = k x the expert's width)
    per = {Keep.INPUT: 2.0 * w.tokens * c.hidden_size * (2 * c.q_size + 2 * c.kv_size
                                                         + 2 * c.mlp_width),
           Keep.ATTENTION: 2.0 * w.tokens * c.hidden_size * 2 * c.mlp_width,
           Keep.ALL: 0.0}
    qkv = FusedExecutor.qkv_flops(c, w.tokens)
    return sum(per[p.keep] + (0.0 if p.keep_qkv or p.keep == Keep.INPUT else qkv)
               for p in plans)


def _offloads(w: Workload, keep: Keep, host_bytes: float | None) -> int:
    """How many first layers may offload their state at `keep`: what the host link carries
    (attention state: with q/k/v left to backward where that is on, trim_for_link), where the
    host has room (leaving it half its memory); never the last layer (its state is needed right
    after the forward)."""
    L = w.cfg.num_hidden_layers
    host = host_memory_bytes() if host_bytes is None else host_bytes
    if w.autograd or host < 2 * L * kept_bytes(w, keep):
        return 0
    trim = keep >= Keep.ATTENTION and w.options.trim_offload
    return max(0, min(L - 1, offload_capacity(w, keep, keep_qkv=not trim)))


def _base_plans(w: Workload, room: float, host_bytes: float | None,
                loss_chunk: int | None) -> list[LayerPlan]:
    """The leanest useful start: every layer keeps its input, the first ones offloaded with
    their attention state as far as the host link takes it (the most that fit; the peak is not
    monotone in their number: the second-to-last offloaded layer's copy is still in flight at
    the loss); else, where even the inputs do not fit, the first ones' inputs offloaded (the
    most that fit); else, where nothing fits, the leanest of these."""
    L = w.cfg.num_hidden_layers

    def peak(ps):
        return plan_peak_bytes(w, ps, loss_chunk)

    inputs = [LayerPlan(Keep.INPUT)] * L
    offload_state = [trim_for_link(w, [LayerPlan(Keep.ATTENTION, offload=True)] * n + inputs[n:])
                     for n in range(_offloads(w, Keep.ATTENTION, host_bytes), 0, -1)]
    offload_inputs = [[LayerPlan(Keep.INPUT, offload=True)] * n + inputs[n:]
                      for n in range(_offloads(w, Keep.INPUT, host_bytes), 0, -1)]
    for plans in (*offload_state, inputs, *offload_inputs):
        if peak(plans) <= room:
            return plans
    return min((*offload_state, inputs, *offload_inputs), key=peak)

def plan_layers(w: Workload, budget_bytes: float, fixed_bytes: float,
                host_bytes: float | None = None,
                loss_chunk_bytes: int | None = None) -> list[LayerPlan]:
    """Per layer, the fastest LayerPlan whose peak (plan_peak_bytes) fits `budget_bytes` beside
    `fixed_bytes` (weights, optimizer state): from the leanest start (_base_plans), the layers
    that keep only their input and are not offloaded keep their attention state instead, from
    the last layer down, while it fits; then layers keep everything, from the last layer down
    (the last layers' tensors are needed first in backward, and they free gate/up before the
    layers below run). On the autograd path (which cannot offload) layers keep their input
    (torch.utils.checkpoint) or everything."""
    L = w.cfg.num_hidden_layers
    room = budget_bytes - fixed_bytes

    def fits(ps):
        return plan_peak_bytes(w, ps, loss_chunk_bytes) <= room

    plans = _base_plans(w, room, host_bytes, loss_chunk_bytes)
    if not w.autograd and any(p.keep == Keep.ATTENTION and p.offload for p in plans):
        for i in reversed(range(L)):
            if plans[i].offload:
                break
            trial = plans[:i] + [LayerPlan(Keep.ATTENTION)] + plans[i + 1:]
            if not fits(trial):
                break
            plans = trial
    for i in reversed(range(L)):
        trial = plans[:i] + [LayerPlan(Keep.ALL)] + plans[i + 1:]
        if not fits(trial):
            break
        plans = trial
    # (the layers kept on the GPU take no copies: the offloaded ones left may trim less, if the
    # larger copies still fit)
    final = trim_for_link(w, plans)
    return final if fits(final) or not fits(plans) else plans


def _loss_chunks(w: Workload) -> list[int | None]:
    """The cross-entropy chunk sizes to try: the default, then halves down to the least."""
    from ..kernels.cross_entropy import CHUNK_BYTES

    chunks, size = [None], CHUNK_BYTES["cuda"] // 2
    while size >= MIN_LOSS_CHUNK_BYTES:
        chunks.append(size)
        size //= 2
    return chunks


def plan_memory(w: Workload, budget_bytes: float, fixed_bytes: float,
                host_bytes: float | None = None) -> MemoryPlan:
    """The fastest plan (least recompute, then the largest loss chunk) whose peak fits
    `budget_bytes` beside `fixed_bytes`. The budget is a promise: where no plan fits, this
    raises BudgetTooSmall with the least budget that would do."""
    room = budget_bytes - fixed_bytes
    best = None
    for chunk in _loss_chunks(w):
        plans = plan_layers(w, budget_bytes, fixed_bytes, host_bytes, chunk)
        if plan_peak_bytes(w, plans, chunk) > room:
            continue
        key = recompute_flops(w, plans)
        if best is None or key < best[0]:
            best = (key, MemoryPlan(plans, chunk))
    if best is None:
        raise BudgetTooSmall(fixed_bytes + least_plan_bytes(w, host_bytes), fixed_bytes,
                             w.reference_bytes)
    return best[1]


def least_plan_bytes(w: Workload, host_bytes: float | None = None) -> int:
    """GPU bytes beside weights and optimizer state that the leanest plan `plan_memory` can make
    needs (layers keep their input, or offload their state where the host has room; the least
    loss chunk): a budget below it runs out of memory."""
    chunk = _loss_chunks(w)[-1]
    leanest = _base_plans(w, -1.0, host_bytes, chunk)  # (nothing fits: the leanest start)
    return math.ceil(plan_peak_bytes(w, leanest, chunk))


# Streamed base weights (engine/weight_stream.py): the planner streams k layers only where its
# time model gains at least this fraction of a step over streaming none.
STREAM_MIN_GAIN = 0.01


def both_ways_seconds(w: Workload, down: float, up: float) -> float:
    """Seconds the host link takes to copy `down` bytes device -> host and `up` bytes host ->
    device in one window: while both run, each at the duplex rate (link_duplex_gbs), the rest
    at the one-way rate (link_gbs)."""
    one, both = w.options.link_bytes_per_s, w.options.link_duplex_bytes_per_s
    shared = min(down, up)
    return shared / both + (max(down, up) - shared) / one


def stream_cost_seconds(w: Workload, plans: list[LayerPlan], k: int,
                        layer_bytes: float) -> float:
    """The planner's time model of a plan with k layers' base weights streamed: its recompute,
    plus any time the copies outrun the passes they overlap. Each forward copies k layers'
    weights up the link while the offloaded activations go down it (both at the duplex rate
    while both run: both_ways_seconds); a preference objective's reference pass copies the
    weights alone; backward copies them beside the offloaded activations coming back (one
    direction), over about twice a forward plus the recompute."""
    rate = FP8_FWD_FLOPS_PER_S if w.fp8 else FWD_FLOPS_PER_S
    recompute = recompute_flops(w, plans) / rate
    link = w.options.link_bytes_per_s
    fwd = forward_seconds(w)
    weights = k * layer_bytes
    offloaded = sum(plan_kept_bytes(w, p) for p in plans if p is not None and p.offload)
    over_fwd = max(0.0, both_ways_seconds(w, offloaded, weights) - fwd)
    if w.reference_pass:
        over_fwd += max(0.0, weights / link - fwd)
    over_bwd = max(0.0, (weights + offloaded) / link - (2 * fwd + recompute))
    return recompute + over_fwd + over_bwd


def plan_streaming(w: Workload, budget_bytes: float, fixed_bytes: float, layer_bytes: float,
                   streamable: list[int], host_bytes: float | None = None
                   ) -> tuple[MemoryPlan, list[int]]:
    """The fastest plan_memory plan with k of the `streamable` layers' base weights (each
    `layer_bytes`, what `fixed_bytes` holds now) streamed from pinned host memory: the fixed
    bytes lose k layers' weights and gain two slots. k = 0, 2, 4, ... up to half the layers
    (each copy then overlaps at least one other layer's compute; at most
    EngineOptions.stream_max_layers where set), where the host has room;
    streamed layers are spread evenly (weight_stream.stream_positions). Returns the plan and
    the streamed layers' indices ([] where streaming gains less than STREAM_MIN_GAIN of a step
    in stream_cost_seconds, or cannot run: autograd path, generation inside the step). Where
    no k fits the budget, BudgetTooSmall as plan_memory's (for k = 0)."""
    from .weight_stream import stream_positions

    L = w.cfg.num_hidden_layers
    host = host_memory_bytes() if host_bytes is None else host_bytes
    most = 0
    if not w.autograd and w.generation is None and layer_bytes > 0:
        most = min(len(streamable), L // 2)
        if w.options.stream_max_layers:
            most = min(most, w.options.stream_max_layers)
    first = None
    plans = {}  # k -> (cost, plan)
    for k in [0, *range(2, most + 1, 2)]:
        fixed = fixed_bytes - k * layer_bytes + (2 * layer_bytes if k else 0)
        wk = replace(w, streaming=k > 0)
        try:
            mem = plan_memory(wk, budget_bytes, fixed, host_bytes)
        except BudgetTooSmall as e:
            first = first or e
            continue
        # pinned host memory: the streamed weights beside the offloaded activations (each of
        # which plan_memory lets take up to half the host's)
        pinned = k * layer_bytes + sum(plan_kept_bytes(wk, p) for p in mem.layers
                                       if p is not None and p.offload)
        if k and pinned > 0.75 * host:
            break
        plans[k] = (stream_cost_seconds(wk, mem.layers, k, layer_bytes), mem)
    if not plans:
        raise first
    k = min(plans, key=lambda n: (plans[n][0], n))
    base = plans[0][0] if 0 in plans else math.inf
    if k and base - plans[k][0] < STREAM_MIN_GAIN * 3 * forward_seconds(w):
        k = 0
    return plans[k][1], [streamable[i] for i in stream_positions(len(streamable), k)]

POLICIES = ("auto", "keep", "recompute", "offload")


def policy_plans(policy: str, num_layers: int) -> list[LayerPlan]:
    """The fixed policies: keep (everything), recompute (inputs only), offload (attention state
    to the host; the last layer's stays on the GPU)."""
    if policy == "keep":
        return [LayerPlan(Keep.ALL)] * num_layers
    if policy == "recompute":
        return [LayerPlan(Keep.INPUT)] * num_layers
    if policy == "offload":
        return ([LayerPlan(Keep.ATTENTION, offload=True)] * (num_layers - 1)
                + [LayerPlan(Keep.ATTENTION)])
    raise ValueError(f"unknown activation policy {policy!r}")


def describe(plans: list) -> str:
    """Counts per kind, e.g. '30 offload attention state, 2 keep all'."""
    names = {(Keep.ALL, False): "keep all", (Keep.ATTENTION, True): "offload attention state",
             (Keep.ATTENTION, False): "keep attention state",
             (Keep.INPUT, False): "recompute from input", (Keep.INPUT, True): "offload input",
             (Keep.ALL, True): "offload all"}
    counts: dict[str, int] = {}
    for p in plans:
        what = "autograd" if p is None else names[(p.keep, p.offload)]
        if p is not None and not p.keep_qkv and p.keep >= Keep.ATTENTION:
            what += " without q/k/v"
        counts[what] = counts.get(what, 0) + 1
    return ", ".join(f"{n} {what}" for what, n in counts.items())


def gpu_budget_bytes(device: torch.device, max_memory_gib: float | None) -> float:
    total = torch.cuda.get_device_properties(device).total_memory
    return min(total * 0.92, max_memory_gib * 2**30) if max_memory_gib else total * 0.92


def fp8_base_bytes(model) -> int:
    """Bytes of a model's FP8 base weights (codes and block scales; 0 for a 16-bit base), as
    the fixed bytes hold them."""
    return sum(m.fp8.nbytes for m in model.modules() if getattr(m, "fp8", None) is not None)
