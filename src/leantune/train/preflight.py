"""Checks of a checkpoint that read no weights: config.json and the safetensors headers (a few
KiB per shard). Run before a training run touches its output folder, so that a truncated shard
or a config that does not match its weights fails in a second, not after minutes of loading."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LeantuneError
from ..model.config import ModelConfig
from ..model.loader import (CHECKPOINT_PATTERNS, bnb_compute_dtype, bnb_quant_states,
                            resolve_checkpoint, safetensors_files)
from ..model.transformer import CausalLM


def check_weights(folder: Path) -> bool:
    """Every weight the model needs is in a readable shard, with the shape config.json implies
    (a 4-bit one: in its quant_state). Returns whether the checkpoint is pre-quantised
    (bnb-4bit)."""
    from safetensors import safe_open

    cfg = ModelConfig.from_file(folder / "config.json")
    bnb_compute_dtype(cfg, folder / "config.json")  # (a quantisation leantune does not read)
    with torch.device("meta"):
        want = {n: tuple(p.shape) for n, p in CausalLM(cfg).named_parameters()}
    files = safetensors_files(folder)
    states = bnb_quant_states(files)
    missing = set(want)
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                keys = list(sf.keys())
                shapes = {key: tuple(sf.get_slice(key).get_shape()) for key in keys}
        except Exception as e:
            raise LeantuneError(f"{f}: cannot read safetensors file ({type(e).__name__}: "
                                f"{str(e)[:120]}); the file is truncated or corrupt, "
                                "re-download it") from None
        for key, shape in shapes.items():
            shape = tuple(states[key]["shape"]) if key in states else shape
            if key in want and shape != want[key]:
                raise LeantuneError(f"{f}: tensor {key} has shape {shape}, config.json implies "
                                    f"{want[key]}; the weights do not belong to this config.json "
                                    "(re-download the model, or restore its config.json)")
            missing.discard(key)
    if missing:
        raise LeantuneError(f"{folder}: {len(missing)} weights missing from the checkpoint "
                            f"(e.g. {sorted(missing)[0]}); the download is incomplete: "
                            "re-download the model")
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
