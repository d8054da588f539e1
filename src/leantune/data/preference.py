"""Preference data: pairs (DPO, ORPO, SimPO) and labelled unpaired rows (KTO), in TRL's forms.

Row forms (detected from the first row; one form per file):

* strings, pairs:    ``{"prompt": str, "chosen": str, "rejected": str}``
* conversational:    ``{"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}``,
  or, without ``"prompt"``, ``"chosen"`` / ``"rejected"`` as whole conversations sharing a prefix:
  the longest common message prefix is the prompt
* KTO (either form): ``{"prompt", "completion", "label": bool}``

Tokenisation: the prompt is the chat template's rendering with the generation prompt (raw text
for strings); a completion's ids are the tokens of the rendered whole (prompt + completion) after
the prompt's, so prompt + completion is what the model sees at inference; where the whole does not
start with the prompt's tokens the completion is tokenised on its own. BOS starts the prompt
(unless the template emitted it), EOS ends every completion (layout whitespace after it dropped).

Truncation, per sequence (prompt + one completion <= max_seq_len): the prompt is cut from the
left first (to ``max_prompt_len`` when set, then as far as ``max_seq_len // 2`` tokens if the
longer completion still does not fit), then the completions from the right. A leading BOS is kept.

`pack_preference_batch` / `pack_kto_batch` turn one micro-batch of pairs / rows into a packed
`PreferenceBatch`: each sequence is its own document (no cross-document attention), both of a
pair in the same micro-batch, with per-document metadata mapping documents back to pairs.
With `shared=True` a pair is one shared document [prompt | chosen | rejected] instead, so the
prompt runs once (`_pack_shared`); its per-document log-prob sums are the same.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from leantune.batch import IGNORE_INDEX, PackedBatch, shift_labels
from leantune.data.files import Location, format_location
from leantune.data.formats import _encode, _is_blank_token, absent
from leantune.data.packing import pack_first_fit_decreasing
from leantune.data.sources import load_rows
from leantune.errors import LeantuneError
from leantune.utils.templates import render_chat_template

KINDS = ("pairs", "kto")
FORMS = ("strings", "conversational")

_NEEDS = {
    "pairs": "'prompt', 'chosen' and 'rejected' (strings, or message lists; 'prompt' may be "
             "left out when chosen and rejected are whole conversations with a shared prefix)",
    "kto": "'prompt', 'completion' and 'label' (true for a desirable completion)",
}

_LABELS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


@dataclass
class PreferencePair:
    """One tokenised pair: prompt ids, chosen completion ids, rejected completion ids."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    location: Location | None = None


@dataclass
class KTORow:
    """One tokenised unpaired row: prompt ids, completion ids, desirable or not."""

    prompt: list[int]
    completion: list[int]
    label: bool
    location: Location | None = None


# --------------------------------------------------------------------------------------------
# Detection and field checks
# --------------------------------------------------------------------------------------------

def detect_kind(row: dict, where: str) -> tuple[str, str]:
    """(kind, form) of a row: kind "pairs" or "kto", form "strings" or "conversational"."""
    if not isinstance(row, dict):
        raise LeantuneError(f"{where}: expected an object, got {type(row).__name__}")
    if "chosen" in row or "rejected" in row:
        kind, sample = "pairs", row.get("chosen", row.get("rejected"))
    elif "completion" in row or "label" in row:
        kind, sample = "kto", row.get("completion", row.get("prompt"))
    else:
        keys = ", ".join(repr(k) for k in list(row)[:8]) or "none"
        raise LeantuneError(
            f"{where}: not a preference row (keys: {keys}); pairs need {_NEEDS['pairs']}, KTO "
            f"rows need {_NEEDS['kto']}")
    return kind, "conversational" if isinstance(sample, list) else "strings"


def _missing(where: str, kind: str, key: str, row: dict | None = None) -> LeantuneError:
    return LeantuneError(f"{where}: {absent(row, key)}; {kind} rows need {_NEEDS[kind]}")


def _text(row: dict, key: str, kind: str, where: str) -> str:
    value = row.get(key)
    if value is None:
        raise _missing(where, kind, key, row)
    if not isinstance(value, str):
        raise LeantuneError(f"{where}: field {key!r} must be a string in this file (its first "
                            f"row uses strings), got {type(value).__name__}")
    return value


def _messages(row: dict, key: str, kind: str, where: str) -> list[dict]:
    value = row.get(key)
    if value is None:
        raise _missing(where, kind, key, row)
    if not isinstance(value, list) or not value:
        raise LeantuneError(f"{where}: field {key!r} must be a non-empty list of "
                            "{'role', 'content'} messages in this file (its first row uses "
                            f"messages), got {type(value).__name__ if value else 'an empty list'}")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), (str, list)):
            raise LeantuneError(f"{where}: {key}[{j}] must be an object with a string 'role' "
                                "and 'content'")
    return value


def _label(row: dict, where: str) -> bool:
    value = row.get("label")
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _LABELS:  # CSV cells are text
        return _LABELS[value.strip().lower()]
    if value is None:
        raise _missing(where, "kto", "label", row)
    raise LeantuneError(f"{where}: field 'label' must be true or false, got {value!r}")


def split_shared_prefix(chosen: list[dict], rejected: list[dict]
                        ) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen rest, rejected rest): the longest common message prefix is the prompt."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


# --------------------------------------------------------------------------------------------
# Tokenisation
# --------------------------------------------------------------------------------------------

def _with_bos(ids: list[int], tokenizer) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids if bos is None or (ids and ids[0] == bos) else [bos] + ids


def _end_with_eos(ids: list[int], tokenizer) -> list[int]:
    """Drop layout whitespace after a final EOS, or append EOS when there is none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ids
    k = len(ids)
    while k > 0 and len(ids) - k < 4 and ids[k - 1] != eos and _is_blank_token(tokenizer, ids[k - 1]):
        k -= 1
    if k > 0 and ids[k - 1] == eos:
        return ids[:k]
    return ids + [eos]


def _completion_ids(tokenizer, prompt_text: str, prompt_ids: list[int], whole_text: str,
                    alone_text: str) -> list[int]:
    """The completion's tokens: those of `whole_text` after the prompt's when the whole starts
    with them, else `alone_text` tokenised on its own."""
    if whole_text.startswith(prompt_text):
        whole = _with_bos(_encode(tokenizer, whole_text), tokenizer)
        if whole[:len(prompt_ids)] == prompt_ids:
            return _end_with_eos(whole[len(prompt_ids):], tokenizer)
    return _end_with_eos(_encode(tokenizer, alone_text), tokenizer)


def _render(tokenizer, msgs: list[dict], where: str, generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise LeantuneError(f"{where}: conversational preference rows need a tokenizer with a "
                            "chat template; use a chat model's tokenizer or string rows")
    return render_chat_template(tokenizer, msgs, where, add_generation_prompt=generation_prompt)


def _content(msgs: list[dict]) -> str:
    return "".join(m["content"] for m in msgs if isinstance(m["content"], str))


def encode_prompt_completions(tokenizer, prompt, completions: Sequence, where: str
                              ) -> tuple[list[int], list[list[int]]]:
    """Tokenise a prompt (str or messages) and its completions (each str or messages)."""
    if isinstance(prompt, str):
        prompt_ids = _with_bos(_encode(tokenizer, prompt), tokenizer)
        return prompt_ids, [_completion_ids(tokenizer, prompt, prompt_ids, prompt + c, c)
                            for c in completions]
    prompt_text = _render(tokenizer, prompt, where, True)
    prompt_ids = _with_bos(_encode(tokenizer, prompt_text), tokenizer)
    return prompt_ids, [
        _completion_ids(tokenizer, prompt_text, prompt_ids,
                        _render(tokenizer, prompt + c, where, False), _content(c))
        for c in completions]


def read_pair(row: dict, form: str, tokenizer, where: str):
    """(prompt ids, [chosen ids, rejected ids]) of a pair row."""
    if form == "strings":
        prompt, chosen, rejected = (_text(row, k, "pairs", where)
                                    for k in ("prompt", "chosen", "rejected"))
    else:
        chosen = _messages(row, "chosen", "pairs", where)
        rejected = _messages(row, "rejected", "pairs", where)
        if "prompt" in row:
            prompt = _messages(row, "prompt", "pairs", where)
        else:
            prompt, chosen, rejected = split_shared_prefix(chosen, rejected)
            if not prompt:
                raise LeantuneError(f"{where}: missing field 'prompt', and 'chosen' and "
                                    "'rejected' share no first message to use as the prompt")
    if chosen == rejected or not chosen or not rejected:
        raise LeantuneError(f"{where}: the chosen and rejected completions are identical; a "
                            "pair must prefer one answer over a different one: fix or remove it")
    return encode_prompt_completions(tokenizer, prompt, [chosen, rejected], where)


def read_kto_row(row: dict, form: str, tokenizer, where: str):
    """(prompt ids, [completion ids], label) of a KTO row."""
    get = _text if form == "strings" else _messages
    prompt = get(row, "prompt", "kto", where)
    completion = get(row, "completion", "kto", where)
    label = _label(row, where)
    prompt_ids, (ids,) = encode_prompt_completions(tokenizer, prompt, [completion], where)
    return prompt_ids, [ids], label


# --------------------------------------------------------------------------------------------
# Truncation
# --------------------------------------------------------------------------------------------

def _cut_left(ids: list[int], keep: int, bos: int | None) -> list[int]:
    """The last `keep` tokens, the leading BOS kept in place of one of them."""
    if len(ids) <= keep:
        return ids
    if bos is not None and ids and ids[0] == bos and keep > 1:
        return [bos] + ids[len(ids) - keep + 1:]
    return ids[len(ids) - keep:]


def truncate(prompt: list[int], completions: list[list[int]], max_seq_len: int,
             max_prompt_len: int | None, bos: int | None = None):
    """Fit prompt + each completion in max_seq_len: prompt from the left, then completions
    from the right. Returns (prompt, completions, prompt_cut, completion_cut)."""
    new_prompt = prompt
    if max_prompt_len is not None:
        new_prompt = _cut_left(new_prompt, max_prompt_len, bos)
    longest = max(len(c) for c in completions)
    if len(new_prompt) + longest > max_seq_len:
        floor = min(len(new_prompt), max(max_seq_len // 2, 1))
        new_prompt = _cut_left(new_prompt, max(max_seq_len - longest, floor), bos)
    room = max_seq_len - len(new_prompt)
    new = [c[:room] for c in completions]
    return (new_prompt, new, len(new_prompt) < len(prompt),
            any(len(a) < len(b) for a, b in zip(new, completions)))


# --------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------

class PreferenceDataset:
    """Tokenised preference pairs or KTO rows.

    Args:
        data: a data file, dataset folder or hub id (`leantune.data.sources`), or row dicts.
        tokenizer: Hugging Face tokenizer (a chat template for conversational rows).
        max_seq_len: most tokens of prompt + one completion.
        max_prompt_len: most prompt tokens (cut from the left); None: only max_seq_len bounds it.

    Attributes:
        kind: "pairs" or "kto". form: "strings" or "conversational".
        items: list of `PreferencePair` or `KTORow`.
        num_prompt_truncated / num_completion_truncated: items whose prompt / a completion was cut.
        num_dropped: pairs dropped because truncation left their completions identical.
    """

    def __init__(self, data: str | os.PathLike | Sequence[dict], tokenizer, max_seq_len: int, *,
                 max_prompt_len: int | None = None, split: str = "train",
                 subset: str | None = None, split_flag: str = "--data-split"):
        for flag, v, ok_none in (("--max-seq-len", max_seq_len, False),
                                 ("--max-prompt-len", max_prompt_len, True)):
            if v is None and ok_none:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise LeantuneError(f"{flag} must be a positive integer, got {v!r}")
        if max_prompt_len is not None and max_prompt_len >= max_seq_len:
            raise LeantuneError(f"--max-prompt-len {max_prompt_len} must be below --max-seq-len "
                                f"{max_seq_len} to leave room for the completions")
        self.max_seq_len, self.max_prompt_len = max_seq_len, max_prompt_len
        if isinstance(data, (str, os.PathLike)):
            self.source, located = load_rows(data, split, subset, split_flag=split_flag)
        else:
            self.source = "<rows>"
            located = [(f"row {i}", row) for i, row in enumerate(data, start=1)]
        if not located:
            raise LeantuneError("no preference rows given; add at least one example")
        first_loc, first = located[0]
        self.kind, self.form = detect_kind(first, format_location(self.source, first_loc))
        self.items: list = []
        self.num_prompt_truncated = self.num_completion_truncated = self.num_dropped = 0
        bos = getattr(tokenizer, "bos_token_id", None)
        for loc, row in located:
            where = format_location(self.source, loc)
            kind, _ = detect_kind(row, where)
            if kind != self.kind:
                raise LeantuneError(f"{where}: a {kind} row in a file of {self.kind} rows (row 1); "
                                    "use one kind per file")
            if self.kind == "pairs":
                prompt, comps = read_pair(row, self.form, tokenizer, where)
                label = None
            else:
                prompt, comps, label = read_kto_row(row, self.form, tokenizer, where)
            prompt, comps, p_cut, c_cut = truncate(prompt, comps, max_seq_len, max_prompt_len, bos)
            self.num_prompt_truncated += p_cut
            self.num_completion_truncated += c_cut
            if self.kind == "pairs":
                if comps[0] == comps[1]:
                    self.num_dropped += 1
                    continue
                self.items.append(PreferencePair(prompt, comps[0], comps[1], loc))
            else:
                self.items.append(KTORow(prompt, comps[0], label, loc))
        if not self.items:
            raise LeantuneError(f"{self.source}: no pair left: truncation to --max-seq-len "
                                f"{max_seq_len} made every pair's completions identical")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]

    @property
    def format(self) -> str:
        """The SFT format name of the prompts' layout ("messages": the chat template; "text":
        raw strings), recorded in run_config.json so generate and chat prompt as trained."""
        return "messages" if self.form == "conversational" else "text"

    def dropped_summary(self) -> str:
        return (f"{self.num_dropped} {'pair was' if self.num_dropped == 1 else 'pairs were'} "
                "dropped: truncation to --max-seq-len left their completions identical")

    def split_eval(self, fraction: float, seed: int = 0):
        """(train, eval): ``round(fraction * items)`` random items (at least 1, leaving at
        least 1) held out, each part in the original order; the choice depends only on `seed`."""
        import copy
        import random

        n = len(self.items)
        if n < 2:
            raise LeantuneError(f"{self.source}: cannot split {n} item into train and eval sets; "
                                "add rows or drop --eval-fraction")
        k = min(n - 1, max(1, round(float(fraction) * n)))
        perm = list(range(n))
        random.Random(seed).shuffle(perm)
        parts = []
        for idx in (sorted(perm[k:]), sorted(perm[:k])):
            part = copy.copy(self)
            part.items = [self.items[i] for i in idx]
            parts.append(part)
        return parts[0], parts[1]

    def summary(self) -> str:
        """One line for logs: counts, kind, form and truncation."""
        unit = "pairs" if self.kind == "pairs" else "KTO rows"
        s = f"{self.source}: {len(self)} {unit} ({self.form})"
        if self.num_prompt_truncated:
            s += f", {self.num_prompt_truncated} prompts cut from the left"
        if self.num_completion_truncated:
            s += (f", {self.num_completion_truncated} with completions cut to --max-seq-len "
                  f"{self.max_seq_len}")
        if self.num_dropped:
            s += f"; {self.num_dropped} dropped (completions identical after truncation)"
        return s


# --------------------------------------------------------------------------------------------
# Packing one micro-batch
# --------------------------------------------------------------------------------------------

@dataclass
class PreferenceBatch:
    """A packed micro-batch of preference documents.

    Attributes:
        batch: the `PackedBatch` (labels = the completion tokens' targets only).
        doc_index: [B, T] int64, the document of each token (-1 for padding); with the labels
            mask it gives per-document summed log-probs (`losses.sum_by_document`).
        doc_unit: [D] int64, the pair (or KTO row) each document belongs to.
        doc_role: [D] int64, 0 chosen / 1 rejected (pairs), 0 row / 1 KL sequence (KTO).
        completion_tokens: [D] int64, target tokens of each document.
        first_doc / second_doc: [U] int64, per pair the chosen / rejected document (KTO: the
            row's document / its KL document).
        label: [U] bool, KTO labels (None for pairs).
        num_units: pairs or rows in the micro-batch (host int).
        sequence_tokens: tokens of the 2U sequences (prompt + completion each, host int), the
            same with or without a shared prompt: what tokens/s counts.
    """

    batch: PackedBatch
    doc_index: torch.Tensor
    doc_unit: torch.Tensor
    doc_role: torch.Tensor
    completion_tokens: torch.Tensor
    first_doc: torch.Tensor
    second_doc: torch.Tensor
    num_units: int
    label: torch.Tensor | None = None
    sequence_tokens: int = 0

    def to(self, device, non_blocking: bool = True) -> "PreferenceBatch":
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, PackedBatch)):
                v = v.to(device, non_blocking=non_blocking)
            out[f.name] = v
        return PreferenceBatch(**out)


def _pack_documents(docs: list[tuple[list[int], list[int]]], max_seq_len: int, pad_id: int,
                    pad_to_multiple: int):
    """Pack (prompt, completion) documents with first-fit decreasing into a PackedBatch whose
    labels cover the completion only. Returns (batch, doc_index [B, T], completion_tokens [D])."""
    seqs = [(p + c, [False] * len(p) + [True] * len(c)) for p, c in docs]
    rows = pack_first_fit_decreasing([len(ids) for ids, _ in seqs], max_seq_len)
    built = [[(seqs[d][0], shift_labels(*seqs[d])) for d in row] for row in rows]
    batch = PackedBatch.from_documents(built, pad_id=pad_id, pad_to_multiple=pad_to_multiple)
    doc_index = torch.full(batch.input_ids.shape, -1, dtype=torch.long)
    for b, row in enumerate(rows):
        t = 0
        for d in row:
            n = len(seqs[d][0])
            doc_index[b, t:t + n] = d
            t += n
    tokens = torch.tensor([sum(1 for x in lab if x != IGNORE_INDEX)
                           for row in built for _, lab in row], dtype=torch.long)
    order = [d for row in rows for d in row]  # `tokens` is in packing order: put it in doc order
    completion_tokens = torch.empty_like(tokens)
    completion_tokens[torch.tensor(order, dtype=torch.long)] = tokens
    batch.token_weights = (doc_index >= 0).float()  # (MoE statistics: padding excluded)
    return batch, doc_index, completion_tokens


def _check_fits(docs, max_seq_len):
    longest = max(len(p) + len(c) for p, c in docs)
    if longest > max_seq_len:
        raise ValueError(f"a sequence has {longest} tokens, more than max_seq_len {max_seq_len}; "
                         "build the dataset with the same max_seq_len")


def pack_preference_batch(pairs: Sequence[PreferencePair], max_seq_len: int, pad_id: int = 0,
                          pad_to_multiple: int = 8, shared: bool = False) -> PreferenceBatch:
    """One micro-batch of P pairs as 2P packed documents: document 2i is pair i's chosen
    sequence, 2i + 1 its rejected one; both in this micro-batch, never attending to each other.
    `shared`: one shared document per pair instead (`_pack_shared`), documents 2i / 2i + 1
    being its chosen / rejected targets."""
    docs = [(p.prompt, c) for p in pairs for c in (p.chosen, p.rejected)]
    _check_fits(docs, max_seq_len)
    n = len(pairs)
    if shared:
        batch, doc_index, tokens = _pack_shared(pairs, max_seq_len, pad_id, pad_to_multiple)
    else:
        batch, doc_index, tokens = _pack_documents(docs, max_seq_len, pad_id, pad_to_multiple)
    return PreferenceBatch(batch, doc_index, torch.arange(n).repeat_interleave(2),
                           torch.tensor([0, 1]).repeat(n), tokens, torch.arange(n) * 2,
                           torch.arange(n) * 2 + 1, n,
                           sequence_tokens=sum(len(p) + len(c) for p, c in docs))


def _branch_targets(prompt: list[int], completion: list[int], rows: list[int]):
    """(rows, ids) of one sequence prompt + completion's targets, as shift_labels gives them
    (token s predicts s + 1 where s + 1 is a completion token), `rows[s]` being where token s
    lies in the packed batch."""
    seq = prompt + completion
    first = max(len(prompt) - 1, 0)
    return [rows[s] for s in range(first, len(seq) - 1)], seq[first + 1:]


def _pack_shared(pairs: Sequence[PreferencePair], max_seq_len: int, pad_id: int,
                 pad_to_multiple: int):
    """Pack P pairs as P shared documents [prompt | chosen | rejected] (Lp + Lc + Lr tokens)
    with first-fit decreasing into rows of 2 x max_seq_len (a pair holds at most two sequences'
    tokens, so B*T stays within today's bound). Positions: prompt 0..Lp-1, chosen and rejected
    both from Lp (rejected as if chosen were absent). Query segments per pair [prompt + chosen],
    [rejected]; key segments [prompt + chosen], [prompt + rejected] (the prompt's rows gathered
    again: kv_index, model/attention.shared_kv_index); padding is a segment of its own.

    The prompt's last row predicts the first token of both completions, so the targets are an
    explicit list (target_rows, target_ids; document by document: 2i chosen, 2i + 1 rejected,
    target_cu over them); `labels` holds one target a row (the chosen one on that row).
    Returns (batch, doc_index [B, T]: 2i on prompt and chosen tokens, 2i + 1 on rejected ones,
    -1 on padding; completion_tokens [2P])."""
    from leantune.model.attention import shared_kv_index

    lengths = [len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs]
    rows = pack_first_fit_decreasing(lengths, 2 * max_seq_len)
    longest = max(sum(lengths[i] for i in row) for row in rows)
    B, T = len(rows), -(-longest // pad_to_multiple) * pad_to_multiple
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((B, T), dtype=torch.long)
    doc_index = torch.full((B, T), -1, dtype=torch.long)
    # MoE statistics: the prompt counts twice (both sequences of the pair read it), padding 0
    token_weights = torch.zeros((B, T), dtype=torch.float32)
    seq_lens: list[int] = []
    seq_lens_k: list[int] = []
    targets: list[tuple[list[int], list[int]]] = [([], [])] * (2 * len(pairs))
    for b, row in enumerate(rows):
        t = 0
        for i in row:
            p = pairs[i]
            lp, lc, lr = len(p.prompt), len(p.chosen), len(p.rejected)
            base = b * T + t
            input_ids[b, t:t + lengths[i]] = torch.tensor(p.prompt + p.chosen + p.rejected)
            position_ids[b, t:t + lp + lc] = torch.arange(lp + lc)
            position_ids[b, t + lp + lc:t + lengths[i]] = torch.arange(lp, lp + lr)
            doc_index[b, t:t + lp + lc] = 2 * i
            doc_index[b, t + lp + lc:t + lengths[i]] = 2 * i + 1
            token_weights[b, t:t + lengths[i]] = 1.0
            token_weights[b, t:t + lp] = 2.0
            prompt_rows = list(range(base, base + lp))
            chosen = _branch_targets(p.prompt, p.chosen, prompt_rows
                                     + list(range(base + lp, base + lp + lc)))
            rejected = _branch_targets(p.prompt, p.rejected, prompt_rows
                                       + list(range(base + lp + lc, base + lengths[i])))
            targets[2 * i], targets[2 * i + 1] = chosen, rejected
            seq_lens += [lp + lc, lr]
            seq_lens_k += [lp + lc, lp + lr]
            t += lengths[i]
        if t < T:  # trailing padding: a segment of its own, positions 0..pad-1
            position_ids[b, t:] = torch.arange(T - t)
            seq_lens.append(T - t)
            seq_lens_k.append(T - t)
    for role in (1, 0):  # rejected first: the chosen target wins the shared row
        rows_ = [r for d in range(role, len(targets), 2) for r in targets[d][0]]
        ids_ = [x for d in range(role, len(targets), 2) for x in targets[d][1]]
        labels.view(-1)[torch.tensor(rows_, dtype=torch.long)] = torch.tensor(ids_,
                                                                              dtype=torch.long)
    counts = torch.tensor([len(r) for r, _ in targets], dtype=torch.long)
    target_cu = torch.zeros(len(targets) + 1, dtype=torch.long)
    target_cu[1:] = torch.cumsum(counts, 0)
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    cu_k = torch.zeros(len(seq_lens_k) + 1, dtype=torch.int32)
    cu_k[1:] = torch.cumsum(torch.tensor(seq_lens_k, dtype=torch.int32), 0)
    batch = PackedBatch(
        input_ids=input_ids, labels=labels, position_ids=position_ids, cu_seqlens=cu,
        max_seqlen=max(seq_lens), seq_lens=seq_lens, num_target_tokens=int(counts.sum()),
        num_real_tokens=sum(lengths),
        target_rows=torch.tensor([r for rs, _ in targets for r in rs], dtype=torch.long),
        target_ids=torch.tensor([x for _, ids in targets for x in ids], dtype=torch.long),
        target_cu=target_cu, kv_index=shared_kv_index(seq_lens, seq_lens_k), cu_seqlens_k=cu_k,
        max_seqlen_k=max(seq_lens_k), seq_lens_k=seq_lens_k, token_weights=token_weights)
    return batch, doc_index, counts


def pack_kto_batch(rows: Sequence[KTORow], max_seq_len: int, pad_id: int = 0,
                   pad_to_multiple: int = 8) -> PreferenceBatch:
    """One micro-batch of R KTO rows: document 2i is row i, document 2i + 1 its KL sequence,
    row i's prompt with row i-1's completion (rotated by one, as TRL does), cut from the right
    to max_seq_len."""
    n = len(rows)
    docs = []
    for i, r in enumerate(rows):
        other = rows[i - 1].completion
        docs += [(r.prompt, r.completion), (r.prompt, other[:max(max_seq_len - len(r.prompt), 0)])]
    _check_fits(docs, max_seq_len)
    batch, doc_index, tokens = _pack_documents(docs, max_seq_len, pad_id, pad_to_multiple)
    return PreferenceBatch(batch, doc_index, torch.arange(n).repeat_interleave(2),
                           torch.tensor([0, 1]).repeat(n), tokens, torch.arange(n) * 2,
                           torch.arange(n) * 2 + 1, n,
                           label=torch.tensor([r.label for r in rows], dtype=torch.bool))
