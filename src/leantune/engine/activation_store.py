"""Where decoder layers keep tensors for backward: on the GPU, or offloaded to pinned host memory.

A layer's kept state is a dataclass whose fields are tensors or None (engine/executor.py: Kept);
`put` takes it, `get` gives it back with every tensor on the compute device. Handles are chained
in the order they were put: backward, which runs the layers in reverse, prefetches the handle put
just before the one it is working on (`get(h)` then `prefetch(h.prev)`).

Offload (CUDA): `put` queues device->host copies on one side stream right after the tensors are
produced, so they overlap the next layers' forward compute; the GPU memory is returned to the
caching allocator when the copy is done (record_stream). At most two layers' copies are in
flight: before queueing layer i's, the compute stream waits for layer i-2's to finish (bounded
GPU memory when the host link is slower than the forward). Backward calls `prefetch` for the
layer it will need next, which queues the host->device copy on the same side stream, overlapping
the current layer's backward; `get` makes the compute stream wait for that copy only. One side
stream for both directions keeps reuse of the pinned buffers (a pool, reused across steps) in
stream order without extra events.

On the CPU "offload" keeps separate copies (clones): the bookkeeping is the same, so tests cover
it without a GPU.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import torch

IN_FLIGHT_LAYERS = 2  # device->host copies queued ahead of the compute stream


def _new_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _tensors(state) -> dict:
    """The tensor fields of a kept-state dataclass, by field name."""
    return {f.name: v for f in dataclasses.fields(state)
            if isinstance(v := getattr(state, f.name), torch.Tensor)}


class Handle:
    """One layer's kept state in the store. `prev`: the handle put just before this one (the
    layer below, in a forward), until this one is released."""

    __slots__ = ("gpu", "host", "shell", "raw", "ready", "device", "prev")

    def __init__(self, prev: "Handle | None"):
        self.gpu = None     # the kept state with its tensors on the compute device
        self.host: dict | None = None  # field name -> pinned host tensor (offloaded)
        self.shell = None   # the kept state without its tensors (offloaded), refilled on load
        self.raw: list = []  # the pooled pinned buffers behind `host`
        self.ready = None   # CUDA event: the host->device copy is done
        self.device = None
        self.prev = prev


class ActivationStore:
    def __init__(self):
        self._stream = None
        self._pool: list[torch.Tensor] = []  # free pinned uint8 buffers, any sizes
        self._in_use = 0                     # pinned bytes held by live handles
        self._peak_use = 0                   # most pinned bytes ever held at once
        self._copies: deque = deque(maxlen=IN_FLIGHT_LAYERS)  # events: D2H copies done
        self._last: Handle | None = None     # the handle put last (the next one's `prev`)
        self.offloaded_bytes = 0  # bytes copied to the host so far (for reports and tests)

    def _side_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pinned(self, t: torch.Tensor, h: Handle) -> torch.Tensor:
        """A pinned host tensor shaped like `t`: the smallest pooled buffer that holds it, or a
        new one."""
        n = t.numel() * t.element_size()
        fits = [i for i, b in enumerate(self._pool) if b.numel() >= n]
        if fits:  # (indices: list.remove would compare tensors with ==)
            buf = self._pool.pop(min(fits, key=lambda i: self._pool[i].numel()))
        else:
            buf = _new_pinned(n)
        h.raw.append(buf)
        self._in_use += buf.numel()
        self._peak_use = max(self._peak_use, self._in_use)
        return buf[:n].view(t.dtype).view(t.shape)

    def put(self, state, offload: bool) -> Handle:
        """Keep `state` (a dataclass of tensors) for backward: as it is, or offloaded."""
        h = Handle(self._last)
        self._last = h
        if not offload:
            h.gpu = state
            return h
        tensors = _tensors(state)
        h.shell = dataclasses.replace(state, **{k: None for k in tensors})
        dev = next(iter(tensors.values())).device
        h.device = dev
        self.offloaded_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if dev.type != "cuda":
            h.host = {k: t.clone() for k, t in tensors.items()}
            return h
        stream = self._side_stream(dev)
        compute = torch.cuda.current_stream(dev)
        if len(self._copies) == IN_FLIGHT_LAYERS:
            compute.wait_event(self._copies[0])  # backpressure: layer i-2's copies are done
        stream.wait_stream(compute)  # the tensors are complete
        h.host = {}
        with torch.cuda.stream(stream):
            for k, t in tensors.items():
                buf = self._pinned(t, h)
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)  # its memory is not reused before the copy ends
                h.host[k] = buf
            done = torch.cuda.Event()
            done.record(stream)
        self._copies.append(done)
        return h

    def prefetch(self, h: Handle | None) -> None:
        """Start bringing an offloaded layer's tensors back (no-op if resident, under way or
        released)."""
        if h is None or h.gpu is not None or h.host is None:
            return
        if h.device.type != "cuda":
            h.gpu = dataclasses.replace(h.shell, **{k: t.clone() for k, t in h.host.items()})
            return
        dev = h.device
        # allocated in the compute stream's order, written by the side stream once the compute
        # stream reaches this point (the memory may have been in use just before)
        gpu = {k: torch.empty(t.shape, dtype=t.dtype, device=dev) for k, t in h.host.items()}
        stream = self._side_stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for k, t in h.host.items():
                gpu[k].copy_(t, non_blocking=True)
                # if the tensors are dropped without `get` (a backward that stops early), their
                # memory still is not reused before the copy ends
                gpu[k].record_stream(stream)
            h.ready = torch.cuda.Event()
            h.ready.record(stream)
        h.gpu = dataclasses.replace(h.shell, **gpu)

    def get(self, h: Handle):
        """The kept state with its tensors on the compute device (waits for its load only)."""
        self.prefetch(h)
        if h.ready is not None:
            torch.cuda.current_stream(h.device).wait_event(h.ready)
            h.ready = None
        return h.gpu

    def release(self, h: Handle) -> None:
        """Drop a layer's tensors after its backward; pinned buffers go back to the pool, which
        keeps no more than the most ever in use at once (smallest buffers dropped first)."""
        for buf in h.raw:
            self._in_use -= buf.numel()
            self._pool.append(buf)
        h.raw = []
        pooled = sum(b.numel() for b in self._pool)
        while self._pool and pooled + self._in_use > self._peak_use:
            small = min(range(len(self._pool)), key=lambda i: self._pool[i].numel())
            pooled -= self._pool.pop(small).numel()
        h.gpu = h.host = h.shell = h.ready = h.prev = None
        if self._last is h:
            self._last = None

    def pooled_bytes(self) -> int:
        return sum(b.numel() for b in self._pool)
