"""transformers' warnings about a checkpoint's config.json, kept out of leantune's output where
transformers only reads the tokenizer: leantune reads the config itself (model/config.py) and
says what it does with it, so a note about a field transformers would treat differently (e.g.
LongRoPE's original_max_position_embeddings) is noise in every command."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def transformers_quiet():
    """transformers' logging at error level inside the block (restored after)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
