"""Writing a sharded Hugging Face safetensors checkpoint (shards + model.safetensors.index.json)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch

from ..utils.io import atomic_path, atomic_write_json

Entry = tuple[str, int, Callable[[], torch.Tensor]]  # (name, bytes, produce the tensor)

INDEX = "model.safetensors.index.json"
# the names of the shards `write_sharded` writes (and Hugging Face's own), nothing else
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def write_sharded(entries: list[Entry], out: Path, max_shard_bytes: int = 4 << 30) -> None:
    """Group entries into shards of at most max_shard_bytes (a bigger tensor gets its own), then
    produce and write each shard in turn, so memory holds one shard at a time."""
    from safetensors.torch import save_file

    plan: list[list[Entry]] = [[]]
    size = total = 0
    for e in entries:
        if plan[-1] and size + e[1] > max_shard_bytes:
            plan.append([])
            size = 0
        plan[-1].append(e)
        size += e[1]
        total += e[1]
    weight_map = {}
    for i, shard_entries in enumerate(plan):
        name = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        shard = {key: make().contiguous() for key, _, make in shard_entries}
        with atomic_path(out / name) as tmp:
            save_file(shard, str(tmp), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
        del shard
    atomic_write_json(out / INDEX,
                      {"metadata": {"total_size": total}, "weight_map": weight_map})
