"""The decode loop: the prompts in one forward pass (prefill), then one token per step.

    prompts (token ids, any lengths) -> left-padded [B, P] -> prefill: fills the KV cache,
    logits of each prompt's last token -> sample -> step: the B new tokens -> logits -> ...

Rows with the same prompt share one prefill (`share_prompts`). Each row stops at the first of
its EOS ids, when its text holds a stop string (`stop_check`), or after max_new_tokens (its own
when given one per row: generate caps a row at the model's context, context.py); the batch runs
until every row has stopped. Finished rows keep being computed (the shapes stay static) and
what they produce is dropped.

Host syncs: the new tokens stay on the device; the host reads them back every `check_every`
steps to see which rows have stopped. On CUDA that is every 8 steps (a read-back waits for the
GPU, so the host cannot queue the next steps meanwhile; at most 7 steps are wasted after the last
row stops), every step on the CPU and when streaming.

Projections: the decode step runs LoRA projections packed or with the adapter precast once per
call (generate/projections.py), fewer kernels than the model's own forward, the same values.

CUDA graphs: on CUDA the decode step (the model's forward over the cache, 1 token a row) is
captured once per (rows, slots) and replayed; the sampling stays eager. A capture that fails
falls back to eager steps, with one line said. The graph and its cache are kept for the next
call with the same shapes (slots are rounded up to a multiple of 256 so that they repeat).
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.rope import longrope_original
from .cache import KVCache
from .projections import DecodeProjections, fp8_head_on, fp8_packing
from .sampling import Sampler, Sampling

EOS, STOP_STRING, LENGTH = "eos", "stop string", "length"
GRAPH_SLOTS = 256  # with CUDA graphs, cache slots are a multiple of this (graphs get reused)
CUDA_CHECK_EVERY = 8
# how many decode steps were made and CUDA graphs captured in this process (a graph kept for
# reuse is captured once per run: benchmarks check that no step re-captures)
COUNTS = {"steps": 0, "captures": 0}


@dataclass
class Decoded:
    """One row's result: the generated ids (ending with the EOS id when stopped by it) and why
    it stopped: "eos", "stop string" or "length"."""

    token_ids: list[int]
    stopped: str


class _Row:
    """A row's generated ids as the host has read them, and whether it has stopped (at the
    latest after `limit` ids)."""

    def __init__(self, limit: int):
        self.ids: list[int] = []
        self.stopped: str | None = None
        self.limit = limit

    def extend(self, new: list[int], eos: set[int], stop_check) -> list[int]:
        """Take the newly read ids up to the row's end; returns those it keeps, EOS left out."""
        kept = []
        for t in new:
            if self.stopped:
                break
            self.ids.append(t)
            if t in eos:
                self.stopped = EOS
                break
            kept.append(t)
            if stop_check is not None and stop_check(self.ids):
                self.stopped = STOP_STRING
            elif len(self.ids) >= self.limit:
                self.stopped = LENGTH
        return kept


@torch.no_grad()
def decode(model, prompts: list[list[int]], max_new_tokens: int | list[int],
           sampling: Sampling | None = None, eos_ids=(), stop_check: Callable | None = None,
           cuda_graphs: bool = True, check_every: int | None = None,
           on_tokens: Callable[[list[list[int]]], None] | None = None,
           log: Callable[[str], None] | None = None,
           min_slots: int | None = None, projections: str = "packed",
           share_prompts: bool = True) -> list[Decoded]:
    """Generate up to `max_new_tokens` tokens after each prompt (token id lists) in one batch.

    Args:
        model: a CausalLM (any mode; it runs in eval mode here and gets its mode back).
        max_new_tokens: the most new tokens of every row, or a list: each row's own (the cache
            is sized for the longest prompt + the most of them).
        sampling: greedy by default (`Sampling`).
        eos_ids: ids that end a row (the EOS is kept as its last token).
        stop_check: called with a row's ids after each new token; True stops the row (stop
            strings).
        cuda_graphs: capture the decode step in a CUDA graph (CUDA only).
        check_every: steps between reads of the new tokens to the host (module docstring).
        on_tokens: called at each read with each row's newly kept tokens (streaming).
        log: where a note goes (the CUDA graph fallback); default stderr.
        min_slots: the KV cache holds at least this many slots (a caller whose prompts vary
            sizes it for its longest prompt + max_new_tokens, so the cache and the CUDA graph
            of the decode step are made once and reused: GRPO's rollouts).
        projections: "packed" (default), "precast" or "plain": how the step runs the LoRA
            projections (generate/projections.py; the same tokens, fewer kernels).
        share_prompts: rows with the same prompt (GRPO's G completions of one prompt) share one
            prefill: the distinct prompts are prefilled, then their keys/values and logits are
            copied to the rows that repeat them (`_prefill`).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    limits = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
              else list(max_new_tokens))
    if len(limits) != len(prompts) or min(limits) < 1:
        raise ValueError(f"max_new_tokens must be at least 1 (one for every row, or one per "
                         f"row), got {max_new_tokens}")
    device = model.output_weight().device
    graphs = cuda_graphs and device.type == "cuda"
    B, P = len(prompts), max(len(p) for p in prompts)
    slots = max(P + max(limits), min_slots or 0)
    if graphs:
        slots = -(-slots // GRAPH_SLOTS) * GRAPH_SLOTS
    was_training = model.training
    if was_training:  # (a walk over every module: skipped for a model already in eval mode)
        model.eval()
    try:
        step = _step_for(model, B, slots, device, graphs, log, projections)
        step.proj.refresh()  # the adapter as trained since the graph was captured
        with step.proj.installed():
            return _run(model, step, prompts, limits, sampling, eos_ids, stop_check,
                        check_every, on_tokens, device, share_prompts)
    finally:
        if was_training:
            model.train()


def _left_padded(prompts: list[list[int]], P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P] left-padded with 0, pad [B]: each row's padding slots)."""
    ids = torch.zeros(len(prompts), P, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, P - len(p):] = torch.tensor(p)
    return ids, torch.tensor([P - len(p) for p in prompts])


def _prefill(model, cache: KVCache, prompts: list[list[int]], device, share: bool
             ) -> torch.Tensor:
    """Fill the cache's first P slots with the prompts' keys/values; returns the logits [B, V]
    of each row's last prompt token. With `share` and repeated prompts, only the U distinct
    ones run (in a temporary cache of U rows and P slots); row b then gets a copy of its
    prompt's keys/values and logits (2 x layers copies: the forward of B - U rows saved)."""
    P, B = max(len(p) for p in prompts), len(prompts)
    first: dict[tuple, int] = {}
    src = [first.setdefault(tuple(p), len(first)) for p in prompts]  # row -> distinct prompt
    ids, pad = _left_padded(prompts, P)
    cache.pad.copy_(pad)
    cache.start.fill_(0)
    if not share or len(first) == B:
        positions, meta = cache.meta(P)
        return model.forward_cached(ids.to(device), positions, meta)
    unique = [list(p) for p in first]
    tmp = KVCache(model.config, len(unique), P, cache.k[0].dtype, device)
    uids, upad = _left_padded(unique, P)
    tmp.pad.copy_(upad)
    positions, meta = tmp.meta(P)
    logits = model.forward_cached(uids.to(device), positions, meta)
    index = torch.tensor(src, device=device)
    for full, part in ((cache.k, tmp.k), (cache.v, tmp.v)):
        for layer, buf in enumerate(part):
            full[layer][:, :P].copy_(buf.index_select(0, index))
    return logits.index_select(0, index)


def _run(model, step, prompts, limits, sampling, eos_ids, stop_check, check_every,
         on_tokens, device, share_prompts: bool = True) -> list[Decoded]:
    """decode's loop (the model in eval mode, the step's projections installed); `limits`: each
    row's most new tokens."""
    cache = step.cache
    P, max_new_tokens = max(len(p) for p in prompts), max(limits)
    logits = _prefill(model, cache, prompts, device, share_prompts)
    sampler = Sampler(sampling or Sampling(), prompts, logits.shape[-1], device)
    out = torch.empty(len(prompts), max_new_tokens, dtype=torch.long, device=device)
    rows = [_Row(limit) for limit in limits]
    eos = set(int(i) for i in eos_ids)
    every = check_every or (1 if device.type != "cuda" or on_tokens else CUDA_CHECK_EVERY)
    recache_at = _recache_slot(model, P)
    read = 0
    for i in range(max_new_tokens):
        tokens = sampler(logits)
        out[:, i] = tokens
        last = i + 1 == max_new_tokens
        if last or (i + 1) % every == 0:
            new = out[:, read:i + 1].tolist()  # the host sync
            read = i + 1
            kept = [row.extend(n, eos, stop_check) for row, n in zip(rows, new)]
            if on_tokens is not None:
                on_tokens(kept)
            if all(row.stopped for row in rows):
                break
        if not last:
            if P + i == recache_at:  # LongRoPE's switch: every key again, with long factors
                logits = _recache(model, cache, prompts, out[:, :i + 1], device)
            else:
                cache.start.fill_(P + i)  # the slot of the token just chosen
                logits = step(model, tokens)
    return [Decoded(row.ids, row.stopped or LENGTH) for row in rows]


def _recache_slot(model, P: int) -> int | None:
    """The slot at which a LongRoPE model's decode rebuilds its cache, or None. The RoPE of a
    forward takes LongRoPE's long factors once a position reaches the original context
    (model/rope.py); the keys cached before it were rotated with the short ones. As
    transformers' Phi-3 does at that point (it drops its cache when the sequence first grows
    past the original context), the forward of the token at that slot runs over the whole
    sequence so far, so every key is rotated with the long factors. A prompt already past it
    was prefilled with them: nothing to do."""
    long_from = longrope_original(getattr(model.config, "rope_scaling", None))
    return long_from if long_from is not None and P <= long_from else None


def _recache(model, cache: KVCache, prompts, new: torch.Tensor, device) -> torch.Tensor:
    """The forward over the prompts and the `new` tokens [B, n] chosen so far, from slot 0
    (the cache rewritten): the logits [B, V] of each row's last token."""
    ids, _ = _left_padded(prompts, max(len(p) for p in prompts))
    full = torch.cat([ids.to(device), new], 1)
    cache.start.fill_(0)
    positions, meta = cache.meta(full.shape[1])
    return model.forward_cached(full, positions, meta)


class DecodeStep:
    """One decode step over a KV cache: tokens [B] (at slot cache.start) -> logits [B, V];
    eager, or as a CUDA graph captured on the first call and replayed after. (It holds no
    reference to the model, which keys the graphs kept for reuse.)"""

    def __init__(self, model, batch: int, slots: int, device: torch.device, graph: bool,
                 log=None, projections: str = "packed"):
        dtype = model.model.embed_tokens.weight.dtype
        self.proj = DecodeProjections(model, projections)  # (its buffers: read by the graph)
        COUNTS["steps"] += 1
        self.cache = KVCache(model.config, batch, slots, dtype, device)
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)  # static input
        self.want_graph = graph
        self.graph = None
        self.logits = None  # the graph's static output
        self.log = log or (lambda msg: print(msg, file=sys.stderr))

    def __call__(self, model, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens[:, None])
        if self.want_graph and self.graph is None:
            self.want_graph = False
            try:
                self._capture(model)
            except Exception as e:  # an op that cannot be captured: stay eager
                self.graph = None
                self.log(f"leantune: note: CUDA graph capture of the decode step failed "
                         f"({type(e).__name__}: {str(e)[:120]}); decoding without it (slower)")
        if self.graph is not None:
            self.graph.replay()
            return self.logits
        return self._forward(model)

    def _forward(self, model) -> torch.Tensor:
        positions, meta = self.cache.meta(1)
        return model.forward_cached(self.tokens, positions, meta)

    def _capture(self, model) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels; the step's
        writes to the cache are the real ones), then capture one step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(model)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        COUNTS["captures"] += 1
        with torch.cuda.graph(graph):
            self.logits = self._forward(model)
        self.graph = graph


# the last graphed step of each model, kept for its next call with the same shapes
_GRAPHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _step_for(model, batch: int, slots: int, device, graph: bool, log,
              projections: str = "packed") -> DecodeStep:
    """A DecodeStep for these shapes: with CUDA graphs the model's previous one when its shapes,
    projections mode and the model's weights (the graph reads them by address) are the same."""
    if not graph:
        return DecodeStep(model, batch, slots, device, False, log, projections)

    def key():  # (FP8 codes are buffers: their addresses count too; the switches the graph
        # bakes in: FP8 packing and head, the decode attention kernel)
        return (batch, slots, device, projections, fp8_packing(), fp8_head_on(),
                os.environ.get("LEANTUNE_DECODE_ATTENTION", "1") != "0",
                tuple(p.data_ptr() for p in model.parameters()),
                tuple(b.data_ptr() for b in model.buffers()))

    kept = _GRAPHED.get(model)
    if kept is not None and kept[0] == key():
        return kept[1]
    _GRAPHED.pop(model, None)  # free the old graph and cache first
    step = DecodeStep(model, batch, slots, device, True, log, projections)
    _GRAPHED[model] = (key(), step)  # (after the step: making it may pack the weights)
    return step
