"""Where decoder layers keep tensors for backward: on the GPU, or offloaded to pinned host memory.

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

from collections import deque

import torch

IN_FLIGHT_LAYERS = 2  # device->host copies queued ahead of the compute stream


def _new_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _Handle:
    __slots__ = ("gpu", "host", "raw", "ready", "device")

    def __init__(self):
        self.gpu: dict | None = None      # name -> tensor on the compute device
        self.host: dict | None = None     # name -> pinned host tensor (offloaded)
        self.raw: list = []               # the pooled pinned buffers behind `host`
        self.ready = None                 # CUDA event: the host->device copy is done
        self.device = None


class ActivationStore:
    def __init__(self):
        self._stream = None
        self._pool: list[torch.Tensor] = []  # free pinned uint8 buffers, any sizes
        self._in_use = 0                     # pinned bytes held by live handles
        self._peak_use = 0                   # most pinned bytes ever held at once
        self._copies: deque = deque(maxlen=IN_FLIGHT_LAYERS)  # events: D2H copies done
        self.offloaded_bytes = 0  # bytes copied to the host so far (for reports and tests)

    def _side_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pinned(self, t: torch.Tensor, h: _Handle) -> torch.Tensor:
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

    def put(self, tensors: dict, offload: bool) -> _Handle:
        h = _Handle()
        if not offload:
            h.gpu = tensors
            return h
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

    def prefetch(self, h: _Handle | None) -> None:
        """Start bringing an offloaded layer's tensors back (no-op if resident or under way)."""
        if h is None or h.gpu is not None or h.host is None:
            return
        if h.device.type != "cuda":
            h.gpu = {k: t.clone() for k, t in h.host.items()}
            return
        dev = h.device
        # allocated in the compute stream's order, written by the side stream once the compute
        # stream reaches this point (the memory may have been in use just before)
        h.gpu = {k: torch.empty(t.shape, dtype=t.dtype, device=dev) for k, t in h.host.items()}
        stream = self._side_stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for k, t in h.host.items():
                h.gpu[k].copy_(t, non_blocking=True)
                # if the tensors are dropped without `get` (a backward that stops early), their
                # memory still is not reused before the copy ends
                h.gpu[k].record_stream(stream)
            h.ready = torch.cuda.Event()
            h.ready.record(stream)

    def get(self, h: _Handle) -> dict:
        self.prefetch(h)
        if h.ready is not None:
            torch.cuda.current_stream(h.device).wait_event(h.ready)
            h.ready = None
        return h.gpu

    def release(self, h: _Handle) -> None:
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
        h.gpu = h.host = h.ready = None

    def pooled_bytes(self) -> int:
        return sum(b.numel() for b in self._pool)
