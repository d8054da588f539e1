"""The model's context: how many positions a prompt and its completion share, checked after the
prompts are tokenized (chat template included) and before anything is allocated for them.

The context is the config's max_position_embeddings: a prompt past it made a KV cache and
attention masks sized for it (a prompt of 100,000 tokens asked for 90 GB) or, within memory,
ran at positions the model never learned. RoPE scaling that stretches the positions further
counts the stretched length: YaRN's original context times its factor where that is more (Qwen's
recipe leaves max_position_embeddings at the original; vLLM counts it so too), and linear
scaling's where rope_scaling names its original context; llama3, LongRoPE and Gemma 3 (linear)
checkpoints already give the stretched length there. A sliding window bounds what a layer
attends to, not the positions: it changes nothing.

A prompt that fills the context (no room for one new token) is refused in one line naming it
(its file and line, `--prompt`, or "prompt N"). A prompt that fits, but leaves fewer than
max_new_tokens, gets a completion capped at the context, said in one note: the default
--max-new-tokens is a ceiling, not a length the user asked for (as a chat nears the end of the
context, its replies get shorter rather than refused).
"""

from __future__ import annotations

from ..errors import LeantuneError


class PromptTooLong(LeantuneError):
    """A prompt that leaves no room in the model's context for one new token."""

    def __init__(self, message: str, tokens: int, context: int, how: str = ""):
        super().__init__(message)
        self.tokens, self.context, self.how = tokens, context, how  # how: " through the ..."


def model_context(cfg) -> tuple[int, str]:
    """(positions a prompt and its completion share, where that number comes from) for a
    ModelConfig (module docstring)."""
    n = int(cfg.max_position_embeddings)
    scaling = getattr(cfg, "rope_scaling", None) or {}
    rtype, factor = scaling.get("rope_type"), scaling.get("factor")
    if rtype in ("yarn", "linear") and isinstance(factor, (int, float)) and factor > 1:
        original = scaling.get("original_max_position_embeddings")
        if original is None and rtype == "yarn":  # (as transformers' YaRN reads it)
            original = n
        if original and int(original * factor) > n:
            return (int(original * factor),
                    f"original_max_position_embeddings {int(original):,} x {rtype} RoPE "
                    f"factor {factor:g}")
    return n, "its max_position_embeddings"


def fit_to_context(ids: list[list[int]], names: list[str | None], max_new_tokens: int, cfg,
                   log=None) -> list[int]:
    """Each prompt's most new tokens: max_new_tokens, or what the context leaves after a
    prompt that leaves less (said in one note through `log`, default stderr). A prompt that
    leaves nothing is a PromptTooLong error naming it (`names`: a file and line, `--prompt`,
    ...; None: "the prompt")."""
    context, source = model_context(cfg)
    m = max_new_tokens
    for p, where in zip(ids, names):
        if len(p) < context:
            continue
        fix = (f"shorten the prompt to at most {context - m:,} tokens to leave room for "
               f"--max-new-tokens {m} (up to {context - 1:,}, its completion stops at the "
               "context)" if context > m else
               f"shorten the prompt to fewer than {context:,} tokens (its completion stops at "
               f"the context: --max-new-tokens {m} alone would fill it)")
        how = " through the chat template" if getattr(p, "templated", False) else ""
        raise PromptTooLong(
            f"{where + ': ' if where else ''}the prompt is {len(p):,} tokens{how}, and the "
            f"model's context is {context:,} tokens ({source}), which must hold the prompt and "
            f"its completion; {fix}", len(p), context, how)
    limits = [min(m, context - len(p)) for p in ids]
    capped = [i for i, n in enumerate(limits) if n < m]
    if capped:
        first = capped[0]
        n, room, where = len(ids[first]), limits[first], names[first] or "the prompt"
        (log or _stderr)(
            f"leantune: note: {where} is {n:,} tokens, which leaves {room:,} of the model's "
            f"{context:,}-token context for its completion, fewer than --max-new-tokens {m}: "
            "it stops there" if len(capped) == 1 else
            f"leantune: note: {len(capped)} prompts leave fewer than --max-new-tokens {m} of "
            f"the model's {context:,}-token context for their completions (the first, {where}: "
            f"{n:,} tokens, leaves {room:,}); they stop at the context")
    return limits


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr)
