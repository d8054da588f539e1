"""Saving a fully fine-tuned model as a Hugging Face checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..dist.tensors import full_tensor
from ..utils.io import atomic_copy, atomic_write_json, check_copy_sources
from .shards import write_sharded

TOKENIZER_FILES = ["generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json"]


def copy_side_files(src: Path | None, out: Path, only_missing: bool = False) -> None:
    """Copy generation config and tokenizer files that exist in `src` to `out` (only those
    `out` lacks, with only_missing). Every one is checked before any is copied: a side file that
    is a link out of the model folder is refused (utils/io.check_copy_sources), and each copy is
    written beside its destination and renamed over it, so a link at the destination is
    replaced, never written through."""
    if src is None:
        return
    for f in check_copy_sources(src, TOKENIZER_FILES):
        dst = out / f.name
        if only_missing and (dst.exists() or dst.is_symlink()):
            continue
        atomic_copy(f.resolve(), dst)


def set_config_dtype(config: dict, dtype: str) -> None:
    """Record the weights' dtype in a config.json dict. transformers >= 4.56 writes "dtype" and
    reads it before the legacy "torch_dtype" (which configs often carry too): update every one
    of the two keys present, "dtype" when neither is."""
    for key in [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]:
        config[key] = dtype


def save_full_model(model, out: Path, source: Path | None = None,
                    max_shard_bytes: int = 4 << 30, write: bool = True) -> None:
    """Write the model's weights (HF names) + config.json (+ side files from `source`). Weights
    that FSDP2 shards are gathered one at a time as they are written: under torchrun every
    process calls this, and only rank 0 (`write`) writes."""
    out = Path(out)
    entries = []
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        entries.append((name, p.numel() * p.element_size(),
                        lambda p=p: full_tensor(p.detach()).to("cpu")))
    if not write:  # take part in the gathers, in the writer's order
        for _, _, make in entries:
            make()
        return
    out.mkdir(parents=True, exist_ok=True)
    write_sharded(entries, out, max_shard_bytes)
    config = dict(model.config.raw)
    config.pop("quantization_config", None)  # the weights are written dense (MXFP4 dequantised)
    config.pop("auto_map", None)  # (no code of the base's comes along)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    set_config_dtype(config, dtype)
    atomic_write_json(out / "config.json", config)
    copy_side_files(source, out)
