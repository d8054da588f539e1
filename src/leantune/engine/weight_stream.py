"""Frozen base weights streamed from pinned host memory: some decoder layers' weights live on the
host and come to the GPU one layer ahead of their use.

In LoRA training the base weights never change, so a host copy is all a layer needs between its
uses. Where the memory budget forces the planner to recompute activations (gate/up on most layers
at Llama-3.1-8B 17 GiB or Phi-4 31 GiB), giving up a layer's ~0.4-0.7 GiB of weights buys room to
keep gate/up on one or two layers; the weights cost host->device link time instead: in the
forward beside the offloaded activations going the other way (device->host), in backward beside
their prefetch. The planner (engine/planner.plan_streaming) picks how many layers stream, if
any, spaced evenly so each copy overlaps at least a layer of compute. The forward's two
directions do not run at full rate each at once: the planner counts the shared part at the rate
each way of both at once
(EngineOptions.link_duplex_gbs: 33.6 GB/s measured on an H100 host, 50.8 on an H200's).
Measured on an H200 (BENCHMARKS.md 2026-12-07): Phi-4 at 31 GiB streams 18 layers and runs 2.7%
faster (8,060 against 7,849 tok/s); at Llama-3.1-8B 17 GiB (SFT and DPO) the planner now streams
nothing, where streaming had run the same (SFT) or 1.7% slower (DPO, forced with a full-duplex
link rate). EngineOptions.stream_weights stays off by default.

A streamed layer's projections (q/k/v, gate/up, down packed as engine/weights.py packs them, and
o) live in pinned host buffers of the packed layout; their `weight` Parameters are views of those.
Two GPU slots (a buffer per group shape each) take turns: the streamed layers in model order use
slots 0, 1, 0, 1, ... While layer s_j runs, s_{j+1}'s weights (s_{j-1} going backward) are copied
into the other slot on a side stream, after the compute stream's work queued so far (the slot's
last user). With `fill_ahead` (EngineOptions.stream_fill_ahead), a layer that does not stream,
between s_{j-1} and s_j, already starts s_{j+1}'s copy into s_{j-1}'s slot (free: no slot is in
use while such a layer runs; the copy is ordered after s_{j-1}'s queued work, and behind s_j's
copy on the one side stream), so it overlaps from the first layer after s_{j-1} on, not only
from s_j. `using(layer, direction)` makes the layer's weights resident (waiting for its copy
only), points its modules' weights at the slot for the duration, starts the next copy, and on
exit points them back at the host buffers, so no module is ever left reading a slot another
layer has taken over. The engine wraps every layer's forward in it (module hooks: the fused path
and the plain no-grad path alike, e.g. a preference objective's reference pass) and the fused
executor its backward (engine/executor.py), which rewrites the packed GEMMs' LoRA columns, as
the slot's copy brings the host buffer's.

Only for layers on the fused path (a plain autograd layer would save slot views for a backward
that could find another layer's weights there: refused), with 16-bit dense projections (not NF4 /
FP8 bases, not MoE experts), one process (no DDP / FSDP2), and no generation inside a step
(GRPO's rollouts capture weights in CUDA graphs). `unstream` brings every weight back to the GPU
(the Trainer calls it when training ends, before export or generation).

On the CPU the "host" buffers are plain copies and the copies synchronous: the bookkeeping is the
same, so tests cover it without a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .weights import DenseWeights, layer_groups


def streamable(layer, weights: DenseWeights) -> str | None:
    """Why `layer`'s base weights cannot stream (None: they can)."""
    qkv, o, gu, down = layer_groups(layer)
    if not gu:
        return "a mixture-of-experts layer"
    for mods in (qkv, o, gu, down):
        for m in mods:
            if m.quantized is not None:
                return "a quantised (NF4 / FP8) base"
            if m.weight is None or m.weight.requires_grad:
                return "a trainable base weight"
        if mods is not o and not weights.packable(mods):
            return "projections that do not pack"
    return None


def stream_positions(num_layers: int, k: int) -> list[int]:
    """k layer indices spread evenly over num_layers (the j-th at the middle of its share), so
    each streamed layer's copy overlaps the compute of the layers between."""
    if k <= 0:
        return []
    k = min(k, num_layers)
    return sorted({min(num_layers - 1, int((j + 0.5) * num_layers / k)) for j in range(k)})


class _Group:
    """One projection group of a streamed layer: its modules, the pinned host buffer (the packed
    layout, or o's [out, in]) and each module's row range in it."""

    __slots__ = ("mods", "host", "rows", "in_f", "key")

    def __init__(self, index: int, mods, host: torch.Tensor, in_f: int):
        self.mods, self.host, self.in_f = mods, host, in_f
        self.rows, r = [], 0
        for m in mods:
            self.rows.append((r, r + m.out_features))
            r += m.out_features
        # (by role too: two groups of one layer may have one shape, e.g. o and down where the
        # intermediate size equals the query width; each needs its own buffer in a slot)
        self.key = (index, tuple(host.shape), host.dtype)

    def point(self, buf: torch.Tensor) -> None:
        """The modules' weights become views of `buf` (the host buffer or a slot)."""
        for m, (a, b) in zip(self.mods, self.rows):
            m.weight.data = buf[a:b, :self.in_f]


class WeightStream:
    """The streamed layers of one model (module docstring)."""

    def __init__(self, device: torch.device, fill_ahead: bool = False):
        self.device = torch.device(device)
        self.fill_ahead = fill_ahead        # a layer that does not stream starts the copy two
        # streamed layers ahead too (module docstring)
        self.layers: list = []              # streamed layers in model order
        self.groups: dict[int, list] = {}   # id(layer) -> its _Groups
        self.order: dict[int, int] = {}     # id(layer) -> position among the streamed
        self.after: dict = {}               # (id(layer), direction) -> next streamed layer
        self.slots: list[dict] = [{}, {}]   # slot -> {group key: GPU buffer}
        self.holder: list = [None, None]    # slot -> the layer whose weights it holds
        self.ready: list = [None, None]     # slot -> CUDA event: its copy is done
        self.current = None                 # the layer whose modules point at a slot now
        self.copies = 0                     # layer copies made (tests, reports)
        self._stream = None
        self._hooks: list = []

    # --- set-up --------------------------------------------------------------------------------
    def offload(self, layers: list, all_layers: list, weights: DenseWeights) -> None:
        """Move `layers`' packed base weights to pinned host memory (their GPU memory is freed:
        nothing else holds it) and make the two slots. `all_layers`: the model's, in order."""
        pin = self.device.type == "cuda"
        for layer in layers:
            why = streamable(layer, weights)
            if why:
                raise ValueError(f"layer {all_layers.index(layer)}: its weights cannot stream "
                                 f"({why})")
            groups = []
            for index, mods in enumerate(layer_groups(layer)):
                src = layer_buffer(mods, weights, packed=index != 1)
                host = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
                host.copy_(src)
                g = _Group(index, mods, host, mods[0].in_features)
                g.point(host)
                groups.append(g)
                for slot in self.slots:
                    if g.key not in slot:
                        slot[g.key] = torch.empty(g.key[1], dtype=g.key[2], device=self.device)
                del src
            self.order[id(layer)] = len(self.layers)
            self.layers.append(layer)
            self.groups[id(layer)] = groups
        # the next streamed layer after each layer, each way
        self.after = {}
        for direction in (1, -1):
            nxt = None
            for layer in (reversed(all_layers) if direction > 0 else all_layers):
                self.after[(id(layer), direction)] = nxt
                if self.streams(layer):
                    nxt = layer

    def streams(self, layer) -> bool:
        return id(layer) in self.order

    # --- copies ----------------------------------------------------------------------------
    def _side(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _fill(self, layer) -> int:
        """Start copying `layer`'s weights into its slot (no-op where the slot holds them or
        their copy is under way). Returns the slot."""
        slot = self.order[id(layer)] % 2
        if self.holder[slot] is layer:
            return slot
        self.holder[slot] = layer
        self.copies += 1
        bufs = self.slots[slot]
        if self.device.type != "cuda":
            for g in self.groups[id(layer)]:
                bufs[g.key].copy_(g.host)
            self.ready[slot] = None
            return slot
        side = self._side()
        side.wait_stream(torch.cuda.current_stream(self.device))  # the slot's last user is done
        with torch.cuda.stream(side):
            for g in self.groups[id(layer)]:
                bufs[g.key].copy_(g.host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        self.ready[slot] = ev
        return slot

    def _next(self, layer, direction: int):
        """The streamed layer after `layer` (direction +1: forward order; -1: backward), not
        `layer` itself; None where there is none."""
        return self.after.get((id(layer), direction))

    def _point_back(self) -> None:
        if self.current is not None:
            for g in self.groups[id(self.current)]:
                g.point(g.host)
            self.current = None

    @contextmanager
    def using(self, layer, direction: int = 1):
        """`layer`'s weights resident on the GPU (its modules pointing at its slot) for the
        block; the next streamed layer's copy (in `direction`) started. A layer that does not
        stream only starts that copy."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a CUDA graph cannot capture a layer whose base weights stream "
                               "from the host (its replay would skip the copies); unstream "
                               "the model first (Engine.unstream)")
        self._point_back()
        if self.streams(layer):
            slot = self._fill(layer)
            if self.ready[slot] is not None:
                torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
            for g in self.groups[id(layer)]:
                g.point(self.slots[slot][g.key])
            self.current = layer
        nxt = self._next(layer, direction)
        if nxt is not None:  # (into the other slot, whose last user is queued already)
            self._fill(nxt)
            after = self._next(nxt, direction) if self.fill_ahead else None
            if after is not None and not self.streams(layer):
                # no slot is in use now: the one after nxt goes into the slot the last streamed
                # layer used (its work is queued), a gap of layers earlier than at nxt itself
                self._fill(after)
        try:
            yield
        finally:
            self._point_back()

    # --- hooks -----------------------------------------------------------------------------
    def hook(self, layers) -> None:
        """Wrap every layer's forward in `using(layer, +1)` (module hooks that run on errors
        too): the fused path, whose executor runs inside the forward, and the plain path."""
        for layer in layers:
            self._hooks.append(layer.register_forward_pre_hook(self._pre))
            self._hooks.append(layer.register_forward_hook(self._post, always_call=True))

    def _pre(self, layer, args):
        if (self.streams(layer) and torch.is_grad_enabled()
                and getattr(layer.executor, "kind", None) != "fused"):
            raise RuntimeError("a layer whose base weights stream from the host ran under "
                               "autograd outside the fused path (its saved weights would be a "
                               "shared GPU slot); unstream the model first (Engine.unstream)")
        ctx = self.using(layer, 1)
        ctx.__enter__()
        layer._lt_stream_ctx = ctx

    def _post(self, layer, args, output):
        ctx = layer.__dict__.pop("_lt_stream_ctx", None)
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def unstream(self) -> None:
        """Every streamed weight back in a GPU buffer of its own (the packed layout), the hooks
        and slots gone."""
        self._point_back()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_stream(self._side())
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.slots = [{}, {}]
        self.holder = [None, None]
        self.ready = [None, None]
        for gs in self.groups.values():
            for g in gs:
                g.point(g.host.to(self.device))
        self.layers, self.groups, self.order, self.after = [], {}, {}, {}


def layer_buffer(mods, weights: DenseWeights, packed: bool) -> torch.Tensor:
    """The GPU buffer a group's base weights live in: the packed weight [sum out, width] of a
    packed group (q/k/v, gate/up and down, even alone: its LoRA columns), or o's [out, in]."""
    if packed:
        return weights.packed(mods)
    w = mods[0].weight.data
    return w if w.is_contiguous() else w.contiguous()


def layer_weight_bytes(layer, weights: DenseWeights) -> int:
    """GPU bytes a streamed layer gives up (and one slot holds), from the layout: nothing is
    packed or allocated to count them."""
    total = 0
    for index, mods in enumerate(layer_groups(layer)):
        size = mods[0].weight.element_size()
        if index == 1:
            total += mods[0].out_features * mods[0].in_features * size
        else:
            (rows, width), _ = weights.layout(mods)
            total += rows * width * size
    return total


__all__ = ["WeightStream", "layer_buffer", "layer_weight_bytes", "stream_positions", "streamable"]
