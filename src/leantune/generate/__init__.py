"""Generation with leantune's own model: a static KV cache, a decode loop (prefill, then one
token per step; CUDA graphs on CUDA), greedy and sampling, stop on EOS ids and stop strings.

    from leantune.generate import generate
    out = generate(model, tokenizer, ["Hello", [{"role": "user", "content": "Hi"}]],
                   max_new_tokens=64)             # -> [Generation(text, token_ids, stopped)]

cache.py (the KV cache), sampling.py (the next token), decode.py (the loop), prompts.py (prompt
files, prompts into token ids), context.py (prompts against the model's context), text.py
(`generate`: text in, text out), load.py (a model, adapter and tokenizer from paths), chat.py
(the terminal chat).
"""

import sys
import types

from .sampling import Sampling
from .text import Generation, generate

__all__ = ["Generation", "Sampling", "generate"]


class _CallableModule(types.ModuleType):
    """`leantune.generate(model, tokenizer, prompts, ...)` is the function, but importing this
    package (leantune.generate.*) binds the name `generate` on leantune to the package; so the
    package itself calls `generate` when called."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
