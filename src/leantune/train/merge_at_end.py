"""`--merge-at-end`: after a LoRA run, its base model with the adapter merged in, in OUTPUT/merged.

Written by `leantune.export.export_merged` from the base checkpoint (`--model`) and the adapter
the run has just saved in OUTPUT, so it is exactly what `leantune export` would write. A run
stopped before its merge was done is finished by `--resume` (`merge_outdated` says when).
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


def merge_outdated(output) -> str | None:
    """Why OUTPUT/merged must be written (again) to finish a --merge-at-end run, or None: it is
    missing, a merge into it was cut short, or it is older than the adapter it merges."""
    from ..export.publish import journal_path
    from ..export.shards import INDEX
    from ..lora.peft_io import ADAPTER_WEIGHTS

    merged = Path(output) / MERGED_DIR
    if journal_path(merged).exists():
        return "its merge was cut short"
    index, adapter = merged / INDEX, Path(output) / ADAPTER_WEIGHTS
    if not index.is_file():
        return f"{MERGED_DIR}/ is missing"
    if adapter.is_file() and index.stat().st_mtime < adapter.stat().st_mtime:
        return f"{MERGED_DIR}/ is older than {ADAPTER_WEIGHTS}"
    return None


def remove_stale_merge_lock(output) -> None:
    """The lock file beside OUTPUT/merged (utils/lock.py) that a merge killed mid-way left: taken
    and released, which removes it (the OS dropped the dead holder's flock); one that a live
    process holds (an export into OUTPUT/merged) or a link stays as it is."""
    from ..utils.lock import lock_beside, lock_path

    merged = Path(output) / MERGED_DIR
    path = lock_path(merged)
    if path.is_symlink() or not path.is_file():
        return
    try:
        with lock_beside(merged):
            pass
    except LeantuneError:  # held: not stale
        pass
