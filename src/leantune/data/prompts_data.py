"""Prompt-only data for online RL (GRPO): rows ``{"prompt": text or [messages], ...}``, TRL's
prompt-only form, from a file, a dataset folder or the hub (`leantune.data.sources`).

A text prompt is encoded as it is, BOS in front (unless it starts with it); a conversational
prompt (a list of {"role", "content"} messages) goes through the tokenizer's chat template with
the assistant's turn opened, as preference prompts are (`data.preference`), so the policy
completes it as it would at inference. The form is detected from the first row; one form per
file. A prompt longer than `max_prompt_len` tokens is cut from the left (its BOS kept), counted.

The row's other fields (e.g. ``answer``) are kept as they are and handed to the reward
functions (`train.rewards`), one entry per completion.

`PromptLoader` yields shuffled, resumable batches of `batch_size` prompts (`PromptBatch`), with
the position protocol of the other loaders (iter_batches, state_dict / load_state_dict).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from leantune.data.files import Location, format_location
from leantune.data.sources import load_rows
from leantune.errors import LeantuneError

NEEDS = "a 'prompt' field: a text, or a list of {'role', 'content'} messages"
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")


@dataclass
class PromptItem:
    """One prompt: as the row gives it (text or messages), its token ids, the row's other
    fields, and where the row came from."""

    prompt: str | list
    ids: list[int]
    fields: dict = field(default_factory=dict)
    location: Location | None = None


def _prompt(row, where: str):
    """(prompt, form) of a row: form "strings" or "conversational"."""
    if not isinstance(row, dict):
        raise LeantuneError(f"{where}: expected an object with {NEEDS}, got "
                            f"{type(row).__name__}")
    if "prompt" not in row:
        keys = ", ".join(repr(k) for k in list(row)[:8]) or "none"
        raise LeantuneError(f"{where}: missing field 'prompt' (keys: {keys}); --objective grpo "
                            f"reads prompt-only rows with {NEEDS}")
    p = row["prompt"]
    if isinstance(p, str):
        if not p.strip():
            raise LeantuneError(f"{where}: field 'prompt' is empty")
        return p, "strings"
    if isinstance(p, list) and p:
        for j, m in enumerate(p):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                    m.get("content"), (str, list)):
                raise LeantuneError(f"{where}: prompt[{j}] must be an object with a string "
                                    "'role' and 'content'")
        return p, "conversational"
    raise LeantuneError(f"{where}: field 'prompt' must be a text or a non-empty list of "
                        f"messages, got {type(p).__name__ if p != [] else 'an empty list'}")


class PromptDataset:
    """Tokenised prompts (module docstring).

    Args:
        data: a data file, dataset folder or hub id, or row dicts.
        tokenizer: Hugging Face tokenizer (a chat template for conversational prompts).
        max_prompt_len: most prompt tokens (cut from the left); None: no cap.

    Attributes:
        form: "strings" or "conversational"; items: list of `PromptItem`;
        fields: the names of the other fields of the first row; num_prompt_truncated.
    """

    kind = "prompts"

    def __init__(self, data: str | os.PathLike | Sequence[dict], tokenizer,
                 max_prompt_len: int | None = None, *, split: str = "train",
                 subset: str | None = None, split_flag: str = "--data-split"):
        from leantune.data.preference import _cut_left, encode_prompt_completions

        if max_prompt_len is not None and (isinstance(max_prompt_len, bool) or not isinstance(
                max_prompt_len, int) or max_prompt_len <= 0):
            raise LeantuneError(f"--max-prompt-len must be a positive integer, got "
                                f"{max_prompt_len!r}")
        self.max_prompt_len = max_prompt_len
        from_file = isinstance(data, (str, os.PathLike))
        self.source, located = (load_rows(data, split, subset, split_flag=split_flag) if from_file
                                else ("<rows>", [(f"row {i}", r) for i, r in enumerate(data, 1)]))
        if not located:
            raise LeantuneError(f"{self.source}: no prompt rows; add at least one")
        self.tokenizer = tokenizer
        first_loc, first = located[0]
        _, self.form = _prompt(first, format_location(self.source, first_loc))
        self.fields = [k for k in first if k != "prompt"]
        bos = getattr(tokenizer, "bos_token_id", None)
        self.items: list[PromptItem] = []
        self.num_prompt_truncated = 0
        for loc, row in located:
            where = format_location(self.source, loc)
            prompt, form = _prompt(row, where)
            if form != self.form:
                raise LeantuneError(f"{where}: a {form} prompt in a file of {self.form} prompts "
                                    "(row 1); use one form per file")
            for k in RESERVED:
                if k in row:
                    raise LeantuneError(f"{where}: field {k!r} is the name of a reward "
                                        "function's own argument; rename the field")
            ids, _ = encode_prompt_completions(tokenizer, prompt, [], where)
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                ids = _cut_left(ids, max_prompt_len, bos)
                self.num_prompt_truncated += 1
            self.items.append(PromptItem(prompt, ids, {k: v for k, v in row.items()
                                                       if k != "prompt"}, loc))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    @property
    def format(self) -> str:
        """The SFT format name of the prompts' layout, for run_config.json (generate and chat
        then prompt as trained): "messages" (the chat template) or "text"."""
        return "messages" if self.form == "conversational" else "text"

    @property
    def longest(self) -> int:
        return max(len(i.ids) for i in self.items)

    def where(self, i: int) -> str:
        return format_location(self.source, self.items[i].location)

    def summary(self) -> str:
        s = f"{self.source}: {len(self)} prompts ({self.form})"
        if self.fields:
            s += f", fields {', '.join(self.fields)}"
        if self.num_prompt_truncated:
            s += (f", {self.num_prompt_truncated} cut from the left to --max-prompt-len "
                  f"{self.max_prompt_len}")
        return s


@dataclass
class PromptBatch:
    """A batch of prompts: the dataset indices and items (host only; generation makes the
    device tensors)."""

    items: list[PromptItem]
    indices: list[int]

    def to(self, device, non_blocking: bool = True) -> "PromptBatch":
        return self


def prompt_loader_class():
    """PromptLoader: `objectives.preference.PreferenceLoader`'s order, resume and state, its
    batches `PromptBatch`es."""
    from leantune.train.objectives.preference import PreferenceLoader

    class PromptLoader(PreferenceLoader):
        def pack(self, idx: list[int]) -> PromptBatch:
            return PromptBatch([self.dataset[i] for i in idx], list(idx))

    return PromptLoader


def inspect_prompts(dataset: PromptDataset, rows: int = 3, *, color: bool = False,
                    tokens: bool = False) -> str:
    """`leantune inspect-data` for prompt-only rows: each prompt as rendered (token ids
    decoded, special tokens shown), its token count and other fields; then the lengths."""
    import json
    import statistics

    from leantune.data.inspect import _indent, render_document

    if rows < 0:
        raise LeantuneError(f"--rows must be 0 or more, got {rows}")
    lines = [dataset.summary(), "each prompt as the model sees it before its completion (the "
                                "chat template's assistant turn opened)"]
    for k in range(min(rows, len(dataset))):
        item = dataset.items[k]
        extra = json.dumps(item.fields, ensure_ascii=False)
        lines += ["", f"prompt {k + 1} ({dataset.where(k)}): {len(item.ids)} tokens",
                  _indent(render_document(item.ids, [False] * len(item.ids), dataset.tokenizer,
                                          color=color, tokens=tokens))]
        if item.fields:
            lines.append(f"  fields: {extra[:300]}")
    lengths = [len(i.ids) for i in dataset.items]
    lines += ["", f"prompt lengths: {min(lengths)} to {max(lengths)} tokens, median "
                  f"{statistics.median(lengths):g}; truncated: {dataset.num_prompt_truncated}"]
    return "\n".join(lines)
