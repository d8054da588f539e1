"""Data pipeline: read rows from files, detect the format, tokenize with loss masks, pack into
`leantune.batch.PackedBatch` es with first-fit decreasing, and resume exactly mid-epoch."""

from leantune.data.dataset import PackedLoader, SFTDataset
from leantune.data.files import read_rows, read_rows_located
from leantune.data.formats import (
    FORMATS,
    detect_format,
    encode_example,
    render_alpaca_prompt,
    validate_format,
)
from leantune.data.packing import pack_first_fit_decreasing

__all__ = [
    "FORMATS",
    "PackedLoader",
    "SFTDataset",
    "detect_format",
    "encode_example",
    "pack_first_fit_decreasing",
    "read_rows",
    "read_rows_located",
    "render_alpaca_prompt",
    "validate_format",
]
