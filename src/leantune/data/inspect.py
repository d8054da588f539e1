"""`leantune inspect-data`: a few documents as the model sees them, and how the data packs.

For each shown document: where its row came from, its tokens decoded with the trained ones (the
targets of the loss) marked, green in a terminal and ``[[...]]`` otherwise, and its token and
trained-token counts. Then the totals: document lengths, how many packed rows of --max-seq-len
they fill, documents per row, the share of row tokens that are real, and the truncated and
dropped rows. Only the tokenizer is loaded, never the model's weights.

Preference data (pairs for DPO / ORPO / SimPO, KTO rows; data/preference.py) is detected the
same way and shown as pairs: the prompt, then the chosen and the rejected completion, each as
the model sees it after the prompt, its trained tokens (the completion's: the log-probs the
objective sums) marked; and the totals: sequence lengths, truncated prompts and completions.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from leantune.batch import IGNORE_INDEX
from leantune.data.dataset import PackedLoader, SFTDataset
from leantune.data.files import format_location
from leantune.errors import LeantuneError

GREEN, RESET = "\x1b[32m", "\x1b[0m"
OPEN, CLOSE = "[[", "]]"
# Files a tokenizer can need from a hub repository; never the weights.
TOKENIZER_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def load_tokenizer_only(model: str):
    """The tokenizer of a checkpoint folder or hub id; from the hub only the tokenizer files
    are downloaded."""
    from leantune.train.trainer import load_tokenizer

    if Path(model).exists() or str(model).startswith((".", "/", "~")):
        return load_tokenizer(model)  # a local folder (or a missing path: its one-line error)
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(model, allow_patterns=TOKENIZER_PATTERNS)
    except Exception as e:  # offline, unknown repo, gated, ...
        raise LeantuneError(f"{model}: no local folder of that name, and its tokenizer could not "
                            f"be downloaded from the hub ({type(e).__name__}); check the path or "
                            "id, your network, or HF_TOKEN") from None
    return load_tokenizer(folder)


def trained_mask(labels: list[int]) -> list[bool]:
    """Which tokens of a document are loss targets: token j is when label j-1 (the prediction
    made after token j-1, see `leantune.batch.shift_labels`) is not ignored. [L] -> [L]."""
    return [False] + [lab != IGNORE_INDEX for lab in labels[:-1]]


def _runs(mask: list[bool]) -> list[tuple[int, int, bool]]:
    """Maximal [start, end) runs of equal mask values."""
    runs, start = [], 0
    for j in range(1, len(mask) + 1):
        if j == len(mask) or mask[j] != mask[start]:
            runs.append((start, j, mask[start]))
            start = j
    return runs


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def render_document(ids: list[int], mask: list[bool], tokenizer, *, color: bool,
                    tokens: bool = False) -> str:
    """The document's text with its trained spans marked.

    Args:
        ids, mask: token ids [L] and whether each is trained [L].
        color: ANSI green for trained spans, else ``[[...]]`` around them.
        tokens: show every token on its own, as a JSON string (quoted, newlines as ``\\n``),
            separated by spaces, instead of the running text.
    """
    opening, closing = (GREEN, RESET) if color else (OPEN, CLOSE)
    parts = []
    for start, end, trained in _runs(mask):
        if tokens:
            text = " ".join(json.dumps(_decode(tokenizer, [i]), ensure_ascii=False)
                            for i in ids[start:end])
        else:
            text = _decode(tokenizer, ids[start:end])
        parts.append(f"{opening}{text}{closing}" if trained else text)
    return (" " if tokens else "").join(parts)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.split("\n"))


def packing_summary(dataset: SFTDataset) -> str:
    """Rows of max_seq_len the documents pack into (first-fit decreasing, as in training)."""
    loader = PackedLoader(dataset, batch_size=1, max_seq_len=dataset.max_seq_len, shuffle=False)
    per_row = [len(row) for row in loader.epoch_rows(0)]
    from ..utils.words import count

    return (f"packing: {count(dataset.num_docs, 'document')} -> {count(loader.num_rows, 'row')} of "
            f"{dataset.max_seq_len} tokens, {dataset.num_docs / loader.num_rows:.1f} documents per "
            f"row ({min(per_row)} to {max(per_row)}), {100 * loader.packing_efficiency:.1f}% of "
            "the row tokens are real (the rest is padding)")


def inspect_dataset(dataset: SFTDataset, rows: int = 3, *, color: bool = False,
                    tokens: bool = False) -> str:
    """The report `leantune inspect-data` prints (see the module docstring)."""
    if getattr(dataset, "kind", None) == "prompts":  # prompt-only rows (GRPO)
        from leantune.data.prompts_data import inspect_prompts

        return inspect_prompts(dataset, rows, color=color, tokens=tokens)
    if not isinstance(dataset, SFTDataset):  # preference pairs or KTO rows
        return inspect_preference(dataset, rows, color=color, tokens=tokens)
    if rows < 0:
        raise LeantuneError(f"--rows must be 0 or more, got {rows}")
    tok = dataset.tokenizer
    lines = [dataset.summary(),
             f"trained tokens are shown {'in green' if color else 'inside ' + OPEN + ' ' + CLOSE}"]
    for k in range(min(rows, dataset.num_docs)):
        ids, labels = dataset.docs[k]
        mask = trained_mask(labels)
        cut = (f", truncated to --max-seq-len {dataset.max_seq_len}"
               if dataset.truncated[k] else "")
        where = format_location(dataset.source, dataset.locations[k])
        lines += ["", f"document {k + 1} ({where}): {len(ids)} tokens, {sum(mask)} trained{cut}",
                  _indent(render_document(ids, mask, tok, color=color, tokens=tokens))]
    lengths = dataset.lengths
    lines += ["", f"lengths: {min(lengths)} to {max(lengths)} tokens, median "
                  f"{statistics.median(lengths):g}, mean {statistics.fmean(lengths):.1f}",
              packing_summary(dataset),
              f"truncated: {dataset.num_truncated} of {dataset.num_rows} rows cut to "
              f"--max-seq-len {dataset.max_seq_len}; dropped: {dataset.num_dropped} rows with no "
              "trained token left"]
    return "\n".join(lines)


def open_dataset(data, tokenizer, max_seq_len: int, *, format=None, train_on_inputs=False,
                 split="train", subset=None, max_prompt_len=None):
    """The SFT dataset of `data`, or its PreferenceDataset when its rows are preference pairs
    or KTO rows (detected from the first row, as for training)."""
    try:
        return SFTDataset(data, tokenizer, max_seq_len, format=format,
                          train_on_inputs=train_on_inputs, split=split, subset=subset)
    except LeantuneError as e:
        msg = str(e)
        if format is None and _prompt_only(msg):  # {"prompt": ...} alone: GRPO's rows
            from leantune.data.prompts_data import PromptDataset

            return PromptDataset(data, tokenizer, max_prompt_len, split=split, subset=subset)
        if format is not None or "cannot detect the data format" not in msg or not (
                ("'chosen'" in msg or "'rejected'" in msg)
                or ("'completion'" in msg and "'label'" in msg)):
            raise
    from leantune.data.preference import PreferenceDataset

    ds = PreferenceDataset(data, tokenizer, max_seq_len, max_prompt_len=max_prompt_len,
                           split=split, subset=subset)
    ds.tokenizer = tokenizer  # (the report decodes with it)
    return ds


def _prompt_only(msg: str) -> bool:
    """Whether an undetectable SFT format's message names a prompt-only first row."""
    return ("cannot detect the data format" in msg and "'prompt'" in msg
            and not any(k in msg for k in ("'chosen'", "'rejected'", "'completion'")))


def inspect_preference(dataset, rows: int = 3, *, color: bool = False,
                       tokens: bool = False) -> str:
    """The report for preference data (module docstring): `dataset` a PreferenceDataset."""
    from ..utils.words import count

    if rows < 0:
        raise LeantuneError(f"--rows must be 0 or more, got {rows}")
    tok = dataset.tokenizer
    pairs = dataset.kind == "pairs"
    unit = "pair" if pairs else "row"
    lines = [dataset.summary(),
             f"trained tokens are shown {'in green' if color else 'inside ' + OPEN + ' ' + CLOSE}"
             " (each completion's, after the prompt)"]

    def shown(prompt, completion):
        ids = prompt + completion
        mask = [False] * len(prompt) + [True] * len(completion)
        return _indent(render_document(ids, mask, tok, color=color, tokens=tokens))

    for k in range(min(rows, len(dataset))):
        item = dataset.items[k]
        where = format_location(dataset.source, item.location)
        if pairs:
            lines += ["", f"pair {k + 1} ({where}): prompt {len(item.prompt)} tokens; chosen "
                          f"{len(item.chosen)} trained, rejected {len(item.rejected)} trained",
                      "  prompt:", _indent(render_document(item.prompt, [False] * len(item.prompt),
                                                          tok, color=color, tokens=tokens)),
                      "  chosen:", shown([], item.chosen), "  rejected:", shown([], item.rejected)]
        else:
            label = "desirable" if item.label else "undesirable"
            lines += ["", f"row {k + 1} ({where}, {label}): prompt {len(item.prompt)} tokens; "
                          f"completion {len(item.completion)} trained",
                      "  prompt:", _indent(render_document(item.prompt, [False] * len(item.prompt),
                                                          tok, color=color, tokens=tokens)),
                      "  completion:", shown([], item.completion)]
    seqs = ([len(i.prompt) + len(c) for i in dataset.items for c in (i.chosen, i.rejected)]
            if pairs else [len(i.prompt) + len(i.completion) for i in dataset.items])
    per = "2 per pair" if pairs else "1 per row, each packed as its own document"
    lines += ["", f"sequences: {count(len(seqs), 'sequence')} ({per}), {min(seqs)} to "
                  f"{max(seqs)} tokens, median {statistics.median(seqs):g}"]
    if pairs:  # the pair objectives' shared-prompt layout (objectives/preference.py)
        docs = [len(i.prompt) + len(i.chosen) + len(i.rejected) for i in dataset.items]
        lines += [f"DPO / ORPO / SimPO pack a pair as one document, the prompt once: [prompt | "
                  f"chosen | rejected], {min(docs)} to {max(docs)} tokens ({sum(docs):,} of the "
                  f"sequences' {sum(seqs):,}; with --no-shared-prompt, and for models with "
                  f"attention soft-capping or sinks: each sequence its own document)"]
    lines += [
              f"truncated: {dataset.num_prompt_truncated} prompts cut from the left, "
              f"{dataset.num_completion_truncated} {unit}s with completions cut to --max-seq-len "
              f"{dataset.max_seq_len}" + (f"; dropped: {dataset.num_dropped} pairs left identical"
                                          if pairs else "")]
    return "\n".join(lines)


def use_color(stream) -> bool:
    """Colour for a terminal, unless NO_COLOR is set (https://no-color.org)."""
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")
