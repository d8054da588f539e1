"""The nearest known name to a mistyped one (a flag, a config key), for one-line errors."""

from __future__ import annotations

import difflib


def nearest(word: str, names, n: int = 1, cutoff: float = 0.7) -> list[str]:
    """Up to `n` of `names` closest to `word`: those it abbreviates (`--max-seq` ->
    `--max-seq-len`) first, then the closest spellings (difflib, ratio >= 0.7; `_` and `-`
    count as the same; a lower `cutoff` for short names, where one swap is a third of them)."""
    names = sorted(set(names))
    word = word.replace("_", "-") if any("-" in name for name in names) else word
    starts = [name for name in names if name.startswith(word) and name != word]
    close = difflib.get_close_matches(word, names, n=n, cutoff=cutoff)
    return list(dict.fromkeys([*starts, *close]))[:n]


def did_you_mean(word: str, names, quote: bool = False, cutoff: float = 0.7) -> str:
    """"; did you mean X?" for the nearest of `names`, or "" when none is near."""
    found = nearest(word, names, cutoff=cutoff)
    if not found:
        return ""
    return f"; did you mean {found[0]!r}?" if quote else f"; did you mean {found[0]}?"
