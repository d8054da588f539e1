"""The small model and dataset bundled with leantune, for the no-argument `leantune train` demo.

    tiny-llama/                a ~1M-parameter Llama checkpoint (Hugging Face format) + tokenizer
    data/tiny_sft.jsonl        2400 alpaca rows (instruction, input, output)
    data/tiny_sft_eval.jsonl   160 held-out alpaca rows

`path(name)` returns the location of one of them. They are built by tools/make_tiny_assets.py;
see README.md in this folder.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent

MODEL = "tiny-llama"
TRAIN_DATA = "data/tiny_sft.jsonl"
EVAL_DATA = "data/tiny_sft_eval.jsonl"

# Short names accepted by `path` besides the relative paths themselves.
_ALIASES = {
    "model": MODEL,
    "tiny_sft": TRAIN_DATA,
    "tiny_sft.jsonl": TRAIN_DATA,
    "train": TRAIN_DATA,
    "tiny_sft_eval": EVAL_DATA,
    "tiny_sft_eval.jsonl": EVAL_DATA,
    "eval": EVAL_DATA,
}

NAMES = (MODEL, TRAIN_DATA, EVAL_DATA)


def path(name: str) -> Path:
    """The absolute path of a bundled asset.

    Args:
        name: "tiny-llama" (the checkpoint folder), "data/tiny_sft.jsonl",
            "data/tiny_sft_eval.jsonl", or a short alias ("model", "tiny_sft", "tiny_sft_eval",
            "train", "eval"). Any other relative path under the assets folder works too.

    Raises:
        ValueError: the name points outside the assets folder.
        LeantuneError: the asset is not there (a broken or partial install).
    """
    rel = _ALIASES.get(name, name)
    p = (ROOT / rel).resolve()
    if ROOT != p and ROOT not in p.parents:
        raise ValueError(f"asset name {name!r} points outside {ROOT}; known: {', '.join(NAMES)}")
    if not p.exists():
        from ..errors import LeantuneError

        raise LeantuneError(
            f"{p}: bundled asset {name!r} is missing (known: {', '.join(NAMES)}); reinstall "
            "leantune, or rebuild it with `python tools/make_tiny_assets.py` in a source checkout")
    return p
