"""Where decoder layers keep tensors for backward: on the GPU, or offloaded to pinned host memory.

Offload (CUDA): `put` queues device->host copies on one side stream right after the tensors are
produced, so they overlap the next layers' forward compute; the GPU memory is returned to the
caching allocator when the copy is done (record_stream). Backward calls `prefetch` for the layer
it will need next, which queues the host->device copy on the same side stream, overlapping the
current layer's backward; `get` makes the compute stream wait for that copy only. One side
stream for both directions keeps reuse of the pinned buffers (a pool, reused across steps) in
stream order without extra events.

On the CPU "offload" keeps separate copies (clones): the bookkeeping is the same, so tests cover
it without a GPU.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class _Handle:
    __slots__ = ("gpu", "host", "ready")

    def __init__(self):
        self.gpu: dict | None = None      # name -> tensor on the compute device
        self.host: dict | None = None     # name -> pinned host tensor (offloaded)
        self.ready = None                 # CUDA event: the host->device copy is done


class ActivationStore:
    def __init__(self):
        self._stream = None
        self._pool: dict[int, list[torch.Tensor]] = defaultdict(list)  # nbytes -> pinned buffers
        self.offloaded_bytes = 0  # bytes copied to the host so far (for reports and tests)

    def _side_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        free = self._pool[n]
        buf = free.pop() if free else torch.empty(n, dtype=torch.uint8, pin_memory=True)
        return buf.view(t.dtype).view(t.shape)

    def put(self, tensors: dict, offload: bool) -> _Handle:
        h = _Handle()
        if not offload:
            h.gpu = tensors
            return h
        dev = next(iter(tensors.values())).device
        self.offloaded_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if dev.type != "cuda":
            h.host = {k: t.clone() for k, t in tensors.items()}
            return h
        stream = self._side_stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))  # the tensors are complete
        h.host = {}
        with torch.cuda.stream(stream):
            for k, t in tensors.items():
                buf = self._pinned(t)
                buf.copy_(t, non_blocking=True)
                t.record_stream(stream)  # its memory is not reused before the copy ends
                h.host[k] = buf
        return h

    def prefetch(self, h: _Handle) -> None:
        """Start bringing an offloaded layer's tensors back (no-op if resident or under way)."""
        if h is None or h.gpu is not None:
            return
        first = next(iter(h.host.values()))
        if first.device.type == "cpu" and not first.is_pinned():
            h.gpu = {k: t.clone() for k, t in h.host.items()}
            return
        dev = torch.device("cuda", torch.cuda.current_device())
        # allocated in the compute stream's order, written by the side stream once the compute
        # stream reaches this point (the memory may have been in use just before)
        h.gpu = {k: torch.empty(t.shape, dtype=t.dtype, device=dev) for k, t in h.host.items()}
        stream = self._side_stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for k, t in h.host.items():
                h.gpu[k].copy_(t, non_blocking=True)
            h.ready = torch.cuda.Event()
            h.ready.record(stream)

    def get(self, h: _Handle) -> dict:
        self.prefetch(h)
        if h.ready is not None:
            torch.cuda.current_stream().wait_event(h.ready)
            h.ready = None
        return h.gpu

    def release(self, h: _Handle) -> None:
        """Drop a layer's tensors after its backward; pinned buffers go back to the pool."""
        if h.host is not None:
            for t in h.host.values():
                if t.is_pinned():
                    self._pool[t.numel() * t.element_size()].append(t.view(-1).view(torch.uint8))
        h.gpu = h.host = h.ready = None
