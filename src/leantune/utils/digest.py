"""A short digest of a dataset's content, for a checkpoint to know its data again: --resume
with edited rows (same count, same token total) is refused instead of training on."""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import fields, is_dataclass
from typing import Iterable


def content_digest(records: Iterable, skip: tuple[str, ...] = ("location",)) -> str:
    """16 hex digits of sha1 over `records` in order. A record is a sequence of values, or a
    dataclass (its fields but `skip`: where a row was read does not change what it trains).
    Lists of ints hash as int64 bytes (fast for millions of tokens); other values as JSON."""
    h = hashlib.sha1()
    for record in records:
        values = ([getattr(record, f.name) for f in fields(record) if f.name not in skip]
                  if is_dataclass(record) else record)
        for v in values:
            if hasattr(v, "tolist"):  # a tensor or array: its values (str() would abbreviate)
                v = v.tolist()
            if isinstance(v, list) and all(isinstance(x, int) for x in v[:1]):
                try:
                    h.update(b"i%d:" % len(v) + array("q", v).tobytes())
                    continue
                except (TypeError, OverflowError):  # (not all ints after the first, or huge)
                    pass
            h.update(b"j" + json.dumps(v, sort_keys=True, default=str).encode())
        h.update(b"|")
    return h.hexdigest()[:16]


__all__ = ["content_digest"]
