"""The static KV cache of one generation batch.

Rows are left-padded, so that every row's next token goes to the same slot: with P the longest
prompt, row b's prompt of n_b tokens fills slots pad[b] = P - n_b .. P - 1, and decode step i
writes slot P + i in every row. Slot j of row b holds position j - pad[b] (every prompt starts at
position 0). A query at slot i attends to the slots j with pad[b] <= j <= i (and i - j < window
on sliding-window layers); padding is never attended to (a padding query attends to itself
alone, which keeps its values finite).

The buffers are allocated once for B rows and S slots and never change shape; the slot being
written is a device tensor (`start`) that the caller sets before each forward. So a decode step
has static shapes and reads nothing back to the host: CUDA graphs can capture and replay it.

Every row has S slots: the batch's longest prompt and the most new tokens. Before the buffers
are allocated, a cache larger than the device's free memory (GPU: free plus what torch holds
unused; CPU: MemAvailable) is refused in one line (`check_fits`) rather than failing in the
allocator with a traceback. That line names the flags that make the cache smaller: generate's,
or those of a caller that decodes under `fit_hint` (GRPO's rollouts: its train flags).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import NamedTuple

import torch

from ..errors import LeantuneError
from ..model.attention import AttentionMeta
from ..model.config import ModelConfig


class FitHint(NamedTuple):
    """How a cache too large for free memory is said (`check_fits`): what its rows are, and
    what to do, naming the flags of the command that asked for it."""

    rows: str
    fix: str


GENERATE_FIT = FitHint("prompt", "give fewer prompts at a time (--batch-size), shorter prompts "
                                 "or fewer new tokens (--max-new-tokens)")
_HINT: ContextVar[FitHint] = ContextVar("kv_cache_fit_hint", default=GENERATE_FIT)


@contextmanager
def fit_hint(hint: FitHint) -> Iterator[None]:
    """The caches made inside (decode's, its shared prefill's too) are refused in `hint`'s
    words: a caller whose flags are not generate's (GRPO) names its own."""
    token = _HINT.set(hint)
    try:
        yield
    finally:
        _HINT.reset(token)


class KVCache:
    """k[l], v[l]: [B, S, Hk, D] per layer; pad: [B] (long) padding slots before each prompt.

    The buffers start zeroed and only ever hold computed values: a masked slot gets weight 0,
    and 0 * NaN (uninitialised memory) would still be NaN."""

    def __init__(self, cfg: ModelConfig, batch: int, slots: int, dtype: torch.dtype,
                 device: torch.device):
        check_fits(cfg, batch, slots, dtype, device)
        shape = (batch, slots, cfg.num_key_value_heads, cfg.head_dim)
        layers = range(cfg.num_hidden_layers)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in layers]
        self.windows = {cfg.window_for_layer(i) for i in layers}
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # first slot written next
        self.slot_ids = torch.arange(slots, device=device)
        self._write = self.start  # the slots of the tokens of the current forward, [T]

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, slots)."""
        return self.k[0].shape[0], self.k[0].shape[1]

    def meta(self, tokens: int) -> tuple[torch.Tensor, AttentionMeta]:
        """(position ids [B, T], attention metadata) for a forward of T = `tokens` new tokens
        per row at slots start .. start + T - 1. Device ops only."""
        q = self.start + torch.arange(tokens, device=self.start.device)  # [T]
        kv = self.slot_ids
        seen = (kv[None, None, :] >= self.pad[:, None, None]) & (kv[None, None, :] <= q[None, :, None])
        own = (kv[None, :] == q[:, None])[None]  # [1, T, S]
        masks = {}
        for w in self.windows:
            m = seen if w is None else seen & (q[:, None] - kv[None, :] < w)[None]
            masks[w] = (m | own)[:, None]  # [B, 1, T, S]
        self._write = q
        positions = (q[None, :] - self.pad[:, None]).clamp(min=0)
        return positions, AttentionMeta("cache", masks=masks, kv_cache=self)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write layer `layer`'s new k/v [B, T, Hk, D] at the current slots; returns its whole
        buffers [B, S, Hk, D] to attend over."""
        self.k[layer].index_copy_(1, self._write, k)
        self.v[layer].index_copy_(1, self._write, v)
        return self.k[layer], self.v[layer]


def check_fits(cfg: ModelConfig, batch: int, slots: int, dtype: torch.dtype,
               device: torch.device) -> None:
    """A one-line error when the buffers of a KVCache(cfg, batch, slots) cannot fit in the
    device's free memory (nothing said where that is unknown), naming the flags of the
    `fit_hint` in force (else generate's)."""
    from ..engine.planner import kv_cache_bytes

    need = kv_cache_bytes(cfg, batch, slots, dtype.itemsize)
    free = free_bytes(device)
    if free is None or need <= free:
        return
    hint = _HINT.get()
    raise LeantuneError(
        f"generating {batch} {hint.rows}{'s' if batch > 1 else ''} together needs a KV cache of "
        f"{_gib(need)} ({slots:,} positions a row: the longest prompt and its completion), and "
        f"{device} has {_gib(free)} free; {hint.fix}")


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new tensor can take on `device` now, or None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    from ..engine.planner import host_memory_bytes

    return host_memory_bytes() or None


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.0f} KiB"
