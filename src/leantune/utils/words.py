"""Counts in the lines a user reads: "1 document", "2 documents"."""

from __future__ import annotations


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, singular for exactly one ("1 document"), else the plural (default noun
    + "s"): "0 documents", "2 documents"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
