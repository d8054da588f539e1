"""Text in, text out: prompts (text, conversations or token ids) -> token ids (prompts.py) ->
the decode loop -> completions."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import LeantuneError
from .context import fit_to_context
from .decode import decode
from .prompts import PromptIds, prompt_ids
from .sampling import Sampling

MAX_NEW_TOKENS = 256  # generate's default


@dataclass
class Generation:
    """One completion: its text (special tokens and any stop string left out), the generated
    ids (ending with the EOS id when it stopped there), and why it stopped: "eos",
    "stop string" or "length"."""

    text: str
    token_ids: list[int]
    stopped: str


def default_eos_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: config.json's and generation_config.json's
    eos_token_id, the tokenizer's EOS and the end-of-turn markers its chat template writes."""
    from ..export.serving import stop_token_ids, turn_end_ids

    source = getattr(model, "source_path", None)
    if source is not None and Path(source, "config.json").exists():
        return stop_token_ids(Path(source), tokenizer)
    ids = model.config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [] if ids is None else [ids]
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        ids += turn_end_ids(tokenizer)
    return list(dict.fromkeys(int(i) for i in ids))


class StopStrings:
    """Whether a row's text holds a stop string (checked on the text of its last tokens, after
    each token), and the text cut before the first one."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.tail = max(len(s) for s in self.stops) + 8  # tokens: at least a character each

    def __call__(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids[-self.tail:], skip_special_tokens=True)
        return any(s in text for s in self.stops)

    def cut(self, text: str) -> str:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return text[:min(found)] if found else text


def generate(model, tokenizer, prompts, *, max_new_tokens: int = MAX_NEW_TOKENS,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             repetition_penalty: float = 1.0,
             seed: int | None = None, stop: Sequence[str] = (), eos_token_ids=None,
             batch_size: int = 16, cuda_graphs: bool = True, streamer=None,
             log=None) -> list[Generation]:
    """Complete each prompt with leantune's model (a base, base + adapter, or merged model).

    Args:
        model: a CausalLM (leantune.load_model; an adapter attached or not).
        tokenizer: its transformers tokenizer (None: prompts are token ids, texts are "").
        prompts: one prompt or a list of them; a prompt is a text, a conversation (a list of
            {"role", "content"} messages: the chat template, the assistant's turn opened) or a
            list of token ids.
        max_new_tokens: the most tokens generated per prompt (fewer where the prompt leaves
            less of the model's context, said in a note; a prompt that leaves none is refused:
            context.py).
        temperature: 0 greedy, > 0 sampling; top_k (0 off), top_p (1 off), repetition_penalty
            (1 off), seed: see `Sampling`.
        stop: strings that end a completion (cut from its text).
        eos_token_ids: ids that end a completion; default `default_eos_ids`.
        batch_size: prompts decoded together (the KV cache is sized for them: a cache that
            cannot fit in the device's free memory is refused in one line, cache.py).
        cuda_graphs: replay the decode step as a CUDA graph (CUDA only).
        streamer: an object with put(ids) and end(), fed the new tokens of a single prompt as
            they come (leantune.generate.chat.TextStreamer).
        log: where a note goes (default stderr).

    Returns:
        One Generation per prompt, in order.
    """
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], (dict, int))):
        prompts = [prompts]  # one text, conversation or id list
    sampling = Sampling(temperature, top_k, top_p, repetition_penalty, seed).check()
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise LeantuneError(f"--max-new-tokens must be a positive integer, got {max_new_tokens}")
    if streamer is not None and len(prompts) != 1:
        raise ValueError("a streamer follows one prompt; give one")
    ids = [prompt_ids(tokenizer, p, f"prompt {i + 1}") for i, p in enumerate(prompts)]
    # before any allocation: each prompt within the model's context, its completion capped
    # there; named by its file and line where it came from prompt_ids, else by its number
    names = [p.where if isinstance(p, PromptIds) else None if len(ids) == 1 else q.where
             for p, q in zip(prompts, ids)]
    limits = fit_to_context(ids, names, max_new_tokens, model.config, log)
    eos = default_eos_ids(model, tokenizer) if eos_token_ids is None else list(eos_token_ids)
    stops = StopStrings(tokenizer, stop) if stop else None
    on_tokens = (lambda rows: streamer.put(rows[0])) if streamer is not None else None
    results = []
    for b in range(math.ceil(len(ids) / batch_size)):
        part = slice(b * batch_size, (b + 1) * batch_size)
        for row in decode(model, ids[part], limits[part], sampling, eos, stops, cuda_graphs,
                          on_tokens=on_tokens, log=log):
            text = ""
            if tokenizer is not None:
                kept = row.token_ids[:-1] if row.stopped == "eos" else row.token_ids
                text = tokenizer.decode(kept, skip_special_tokens=True)
                text = stops.cut(text) if stops is not None else text
            results.append(Generation(text, row.token_ids, row.stopped))
    if streamer is not None:
        streamer.end()
    return results
