"""Prompts: from a file's rows, and into token ids.

Prompts are tokenized as leantune's training tokenizes them (leantune.data.formats), so a
fine-tune sees at generation the layout it was trained on: a text is encoded without special
tokens and gets the tokenizer's BOS in front (unless it starts with it); a conversation goes
through the tokenizer's chat template with the assistant's turn opened
(add_generation_prompt), then likewise; an alpaca row is its instruction prompt.
"""

from __future__ import annotations

import os

from ..data.files import format_location, read_rows_located
from ..data.formats import normalize_messages, render_alpaca_prompt
from ..errors import LeantuneError

ROW_NEEDS = ("'prompt' (a text), 'messages' (a list of {'role', 'content'}: the chat template) "
             "or 'instruction' (and 'input': the alpaca prompt)")


def read_prompt_file(path: str | os.PathLike) -> list[tuple[dict, str | list[dict], str]]:
    """The rows of a .jsonl / .json / .csv file as (row, prompt, location): the prompt is a text
    or a conversation (module docstring). One-line errors name the file and line."""
    out = []
    for line, row in read_rows_located(path):
        where = format_location(path, line)
        if "messages" in row or "conversations" in row:
            prompt = normalize_messages(row, where)
        elif isinstance(row.get("prompt"), str):
            prompt = row["prompt"]
        elif isinstance(row.get("instruction"), str):
            extra = row.get("input") or ""
            if not isinstance(extra, str):
                raise LeantuneError(f"{where}: field 'input' must be a string, got "
                                    f"{type(extra).__name__}")
            prompt = render_alpaca_prompt(row["instruction"], extra)
        else:
            raise LeantuneError(f"{where}: a prompt row needs {ROW_NEEDS}; this one has "
                                f"{', '.join(map(repr, row)) or 'no fields'}")
        out.append((row, prompt, where))
    return out


def render_chat(tokenizer, messages: list[dict], where: str = "prompt") -> str:
    """A conversation as its chat-template text, the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise LeantuneError(f"{where}: the tokenizer has no chat template, which a messages "
                            "prompt needs; give the prompt as text instead")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise LeantuneError(f"{where}: the tokenizer's chat template rejected this "
                            f"conversation ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
                            ) from None
    return text if isinstance(text, str) else text[0]


def prompt_ids(tokenizer, prompt, where: str = "prompt") -> list[int]:
    """Token ids of one prompt: a text, a conversation (a list of {"role", "content"}), or
    token ids (kept as they are)."""
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt) and prompt:
        return list(prompt)
    if tokenizer is None:
        raise ValueError(f"{where}: without a tokenizer, prompts must be lists of token ids")
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) for m in prompt) and prompt:
        prompt = render_chat(tokenizer, list(prompt), where)
    if not isinstance(prompt, str):
        raise LeantuneError(f"{where}: a prompt is a text, a list of {{'role', 'content'}} "
                            f"messages or a list of token ids, got {type(prompt).__name__}")
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids[:1] != [bos]:
        ids = [bos] + ids
    if not ids:
        raise LeantuneError(f"{where}: the prompt is empty (and the tokenizer has no BOS token "
                            "to start from); give some text")
    return ids


