"""Prompts: from a file's rows, and into token ids.

Prompts are tokenized as leantune's training tokenizes them (leantune.data.formats), so a
fine-tune sees at generation the layout it was trained on: a text is encoded without special
tokens and gets the tokenizer's BOS in front (unless it starts with it); a conversation goes
through the tokenizer's chat template with the assistant's turn opened
(add_generation_prompt; rendered sandboxed, with a time and size limit), then likewise; an alpaca
row is its instruction prompt.

A typed prompt (`generate --prompt`, a `chat` line, a `{"prompt": text}` row of a prompts file:
`TypedText`) takes the *prompt format* the run was trained with (run_config.json,
`trained_prompt_format`): a run on alpaca rows is asked in the alpaca prompt, a run on messages
through the chat template, a run on text with the text as it is; `--prompt-format` overrides it. A
model fine-tuned on one layout answers poorly in another (the demo, trained on alpaca prompts,
answered no capital through the chat template).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..data.files import format_location, read_rows_located
from ..data.formats import normalize_messages, render_alpaca_prompt, validate_format
from ..errors import LeantuneError
from ..utils.templates import render_chat_template

# --prompt-format: "auto" is the run's own (else the chat template when the tokenizer has one)
PROMPT_FORMATS = ("auto", "chat", "alpaca", "text")
# a training data format -> the prompt format that asks a model trained on it
TRAINED_AS = {"alpaca": "alpaca", "messages": "chat", "text": "text"}
DESCRIBE = {"chat": "the chat template", "alpaca": "the alpaca prompt",
            "text": "the text as it is"}

ROW_NEEDS = ("'prompt' (a text), 'messages' (a list of {'role', 'content'}: the chat template) "
             "or 'instruction' (and 'input': the alpaca prompt)")


class TypedText(str):
    """A `{"prompt": text}` row's text: asked as a typed prompt (`in_format`), in the prompt
    format the run was trained with, as `--prompt` is; until then, the text as it is."""


def read_prompt_file(path: str | os.PathLike) -> list[tuple[dict, str | list[dict], str]]:
    """The rows of a .jsonl / .json / .csv file as (row, prompt, location): the prompt is a
    TypedText, a conversation or an alpaca prompt's text (module docstring). One-line errors
    name the file and line."""
    out = []
    for line, row in read_rows_located(path):
        where = format_location(path, line)
        if "messages" in row or "conversations" in row:
            prompt = normalize_messages(row, where)
        elif isinstance(row.get("prompt"), str):
            prompt = TypedText(row["prompt"])
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
    """A conversation as its chat-template text, the assistant's turn opened (rendered as
    training renders it: sandboxed, with a time and size limit; errors in one line)."""
    if not getattr(tokenizer, "chat_template", None):
        raise LeantuneError(f"{where}: the tokenizer has no chat template, which a messages "
                            "prompt needs; give the prompt as text instead")
    return render_chat_template(tokenizer, messages, where, add_generation_prompt=True)


def trained_prompt_format(*folders) -> str | None:
    """The prompt format ("chat", "alpaca" or "text") of the run that wrote the first of
    `folders` (an adapter or run folder, a checkpoint, a full fine-tune's folder) holding a
    run_config.json or state.json: the data format the run detected (its "data_format"), else
    its --format. None when no folder says (a PEFT adapter from elsewhere, a base model)."""
    for folder in folders:
        if folder is None:
            continue
        for name in ("run_config.json", "state.json"):
            path = Path(folder) / name
            if not path.is_file():
                continue
            try:
                settings = json.loads(path.read_text())
                fmt = settings.get("data_format") or (settings.get("config") or {}).get("format")
                return TRAINED_AS.get(validate_format(fmt)) if isinstance(fmt, str) else None
            except (ValueError, AttributeError, LeantuneError):
                return None  # unreadable or unknown: the tokenizer's default
    return None


def resolve_prompt_format(requested: str | None, trained: str | None, tokenizer,
                          untrained: str | None = None) -> str:
    """The prompt format typed prompts take: `requested` (--prompt-format) unless "auto" or None,
    else the run's (`trained`), else `untrained` when given (chat: "chat", so a model without a
    template is refused rather than chatted with as plain text), else the chat template when the
    tokenizer has one, else text."""
    if requested and requested != "auto":
        if requested not in PROMPT_FORMATS:
            raise LeantuneError(f"unknown --prompt-format {requested!r}; choose one of "
                                f"{', '.join(PROMPT_FORMATS)}")
        return requested
    if trained:
        return trained
    if untrained:
        return untrained
    return "chat" if getattr(tokenizer, "chat_template", None) else "text"


def typed_prompt(text: str, fmt: str, system: str | None = None):
    """A typed prompt in prompt format `fmt`: a one-turn conversation (chat; `system` first when
    given), the alpaca prompt with `text` as the instruction, or the text as it is."""
    if fmt == "chat":
        return [*([{"role": "system", "content": system}] if system else []),
                {"role": "user", "content": text}]
    if system:
        raise LeantuneError(f"a system message needs the chat template, and the prompt format is "
                            f"{fmt}; leave out --system, or pass --prompt-format chat")
    return render_alpaca_prompt(text) if fmt == "alpaca" else text


def has_typed(rows) -> bool:
    """Whether any of read_prompt_file's rows is a typed prompt (TypedText)."""
    return any(isinstance(prompt, TypedText) for _, prompt, _ in rows)


def in_format(rows, fmt: str) -> list:
    """read_prompt_file's rows with each TypedText asked in prompt format `fmt` (typed_prompt);
    conversations and alpaca rows say their own format."""
    return [(row, typed_prompt(str(p), fmt) if isinstance(p, TypedText) else p, where)
            for row, p, where in rows]


class PromptIds(list):
    """A prompt's token ids that remember where the prompt came from (`where`: a file and line,
    `--prompt`) and whether they went through the chat template (`templated`): a prompt too
    long for the model's context is named by them (context.py)."""

    def __init__(self, ids, where: str, templated: bool = False):
        super().__init__(ids)
        self.where, self.templated = where, templated


def prompt_ids(tokenizer, prompt, where: str = "prompt") -> PromptIds:
    """Token ids of one prompt: a text, a conversation (a list of {"role", "content"}), or
    token ids (kept as they are; ids from prompt_ids keep their `where`)."""
    if isinstance(prompt, PromptIds):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt) and prompt:
        return PromptIds(prompt, where)
    if tokenizer is None:
        raise ValueError(f"{where}: without a tokenizer, prompts must be lists of token ids")
    templated = (isinstance(prompt, (list, tuple)) and bool(prompt)
                 and all(isinstance(m, dict) for m in prompt))
    if templated:
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
    return PromptIds(ids, where, templated)


