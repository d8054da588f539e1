"""Checks of a checkpoint that read no weights: config.json and the safetensors headers (a few
KiB per shard). Run before a training run touches its output folder, so that a truncated shard
or a config that does not match its weights fails in a second, not after minutes of loading."""

from __future__ import annotations

from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..model.loader import (CHECKPOINT_PATTERNS, bnb_compute_dtype, bnb_quant_states,
                            plan_checkpoint, read_headers, resolve_checkpoint,
                            safetensors_files)
from ..model.transformer import CausalLM


def check_weights(folder: Path) -> bool:
    """Every weight the model needs is in a readable shard, with the shape config.json implies
    (the loader's own weight plan, built from the headers; a 4-bit weight's shape is in its
    quant_state). Returns whether the checkpoint is pre-quantised (bnb-4bit)."""
    cfg = ModelConfig.from_file(folder / "config.json")
    bnb_compute_dtype(cfg, folder / "config.json")  # (a quantisation leantune does not read)
    with torch.device("meta"):
        model = CausalLM(cfg)
    files = safetensors_files(folder)
    states = bnb_quant_states(files)
    headers = read_headers(files)
    for name, state in states.items():  # the packed uint8 weight: its 16-bit shape is here
        headers.shapes[name] = tuple(state["shape"])
    plan_checkpoint(model, files, headers)
    return bool(states)


def locate_model(name: str) -> Path:
    """The checkpoint folder, for its config and tokenizer: a local folder as it is; for a hub id,
    a snapshot without the weights (`resolve_checkpoint` fetches them once the data is checked).
    Errors are `resolve_checkpoint`'s one-liners."""
    if not Path(name).expanduser().exists():
        try:
            from huggingface_hub import snapshot_download

            light = [p for p in CHECKPOINT_PATTERNS if not p.endswith(".safetensors")]
            return Path(snapshot_download(name, allow_patterns=light))
        except Exception:
            pass  # not a hub id, or not reachable: resolve_checkpoint says which
    return resolve_checkpoint(name)
