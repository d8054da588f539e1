"""`--merge-at-end`: after a LoRA run, its base model with the adapter merged in, in OUTPUT/merged.

Written by `leantune.export.export_merged` from the base checkpoint (`--model`) and the adapter
the run has just saved in OUTPUT, so it is exactly what `leantune export` would write.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import LeantuneError

MERGED_DIR = "merged"


def check_merge_at_end(cfg) -> None:
    """Refuse what cannot be merged, and a merged folder that is in the way (before loading)."""
    if not cfg.merge_at_end:
        return
    if cfg.full:
        raise LeantuneError("--merge-at-end merges a LoRA adapter into its base, but a --full run "
                            "writes the whole model to --output already; drop --merge-at-end")
    if not cfg.model:
        raise LeantuneError("--merge-at-end needs --model (the base checkpoint the adapter is "
                            "merged into)")
    merged = Path(cfg.output) / MERGED_DIR
    if merged.exists() and not merged.is_dir():
        raise LeantuneError(f"{merged}: is a file, where --merge-at-end writes the merged model; "
                            "move it, or choose another --output")
    if merged.is_dir() and any(merged.iterdir()) and not (cfg.overwrite or cfg.resume):
        raise LeantuneError(f"{merged}: already exists and --merge-at-end would replace it; pass "
                            "--overwrite, or choose another --output")


def merge_at_end(cfg, log) -> Path:
    """Write OUTPUT/merged from --model and the adapter in OUTPUT; returns the folder."""
    from ..export import export_merged

    out = export_merged(cfg.model, cfg.output, Path(cfg.output) / MERGED_DIR, overwrite=True)
    log(f"merged model: {out}/ (loads with transformers AutoModelForCausalLM.from_pretrained)")
    return out
