"""Row formats and their tokenization into (token ids, loss mask).

Three row formats are understood:

* ``alpaca``: ``{"instruction", "output"}`` plus an optional ``"input"``. The prompt is rendered
  with the fixed `ALPACA_PROMPT` template; by default only the response is trained.
* ``messages``: ``{"messages": [{"role", "content"}, ...]}`` (``"conversations"`` is accepted as
  the key, and ShareGPT-style ``{"from", "value"}`` turns are normalized). Rendered with the
  tokenizer's chat template; by default only assistant turns are trained.
* ``text``: ``{"text"}``; every token is trained.

`encode_example` returns ``ids`` (list[int], length L) and ``loss_mask`` (list[bool], length L):
``loss_mask[i]`` says whether token i is a *target* the model must learn to produce. Labels are
derived later with `leantune.batch.shift_labels`, which reads ``loss_mask[i + 1]`` when predicting
token i + 1, so ``loss_mask[0]`` is never used.

Every sequence starts with the tokenizer's BOS (if it has one and the template did not already
emit it) and ends with EOS, trained whenever it closes a response so the model learns to stop.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from leantune.data.files import Location, format_location
from leantune.errors import LeantuneError
from leantune.utils.templates import render_chat_template

FORMATS = ("alpaca", "messages", "text")

# What each format needs, quoted in error messages.
FORMAT_NEEDS = {
    "alpaca": "'instruction' and 'output' (optional 'input')",
    "messages": "a 'messages' (or 'conversations') list of {'role', 'content'} objects",
    "text": "a 'text' string",
}

_FORMAT_ALIASES = {
    "chat": "messages", "conversations": "messages", "sharegpt": "messages",
    "instruction": "alpaca", "completion": "text", "raw": "text",
}

# ShareGPT speaker names -> chat-template roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "model": "assistant", "system": "system", "tool": "tool"}

ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA_PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


# --------------------------------------------------------------------------------------------
# Format detection
# --------------------------------------------------------------------------------------------

def validate_format(fmt: str) -> str:
    """Normalize an explicit ``--format`` value; raise `LeantuneError` for an unknown one."""
    name = str(fmt).strip().lower()
    name = _FORMAT_ALIASES.get(name, name)
    if name not in FORMATS:
        raise LeantuneError(
            f"unknown --format {fmt!r}; choose one of: {', '.join(FORMATS)} "
            "(or leave it unset to detect the format from the data)")
    return name


def _guess_format(row: dict) -> str | None:
    """The format a single row looks like, or None. Messages win over alpaca over text."""
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("messages"), list) or isinstance(row.get("conversations"), list):
        return "messages"
    if "instruction" in row and "output" in row:
        return "alpaca"
    if "text" in row:
        return "text"
    return None


def detect_format(rows: Sequence[dict], source: str | os.PathLike | None = None, *,
                  sample: int = 16) -> str:
    """Detect the row format from the keys of the first rows.

    The first row must match a format; the first `sample` rows must not match different formats
    (rows matching none are left to `encode_example`, which reports them with their location).

    Returns:
        "alpaca", "messages" or "text".
    Raises:
        LeantuneError: no rows, an unrecognized first row, or mixed formats.
    """
    src = str(source) if source is not None else "<rows>"
    if not rows:
        raise LeantuneError(f"{src}: no rows to detect the data format from")
    first = _guess_format(rows[0])
    if first is None:
        keys = ", ".join(repr(k) for k in list(rows[0])[:8]) or "none"
        raise LeantuneError(
            f"{src}: cannot detect the data format from the first row (keys: {keys}); expected "
            f"alpaca ({FORMAT_NEEDS['alpaca']}), messages ({FORMAT_NEEDS['messages']}) or text "
            f"({FORMAT_NEEDS['text']}); rename the fields or pass --format")
    for i, row in enumerate(rows[:sample]):
        other = _guess_format(row)
        if other is not None and other != first:
            raise LeantuneError(
                f"{src}: mixed data formats: row 1 looks like {first} but row {i + 1} looks like "
                f"{other}; use one format per file or pass --format")
    return first


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def absent(row: dict | None, field: str) -> str:
    """How a required field without a value is said: "missing field 'x'", or "field 'x' is
    null" where the row has it (a null in JSON; a dataset's rows share its columns)."""
    return (f"field {field!r} is null" if row is not None and field in row
            else f"missing field {field!r}")


def _missing(where: str, fmt: str, field: str, row: dict | None = None) -> LeantuneError:
    return LeantuneError(f"{where}: {absent(row, field)}; the {fmt} format needs "
                         f"{FORMAT_NEEDS[fmt]}")


def _text_field(row: dict, key: str, fmt: str, where: str, required: bool = True) -> str:
    """Fetch a string field; numbers are stringified, null/missing optional fields become ""."""
    value = row.get(key)
    if value is None:
        if required:
            raise _missing(where, fmt, key, row)
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise LeantuneError(
        f"{where}: field {key!r} must be a string, got {type(value).__name__}; the {fmt} format "
        f"needs {FORMAT_NEEDS[fmt]}")


# Tokens tokenized past a cut text before the tokens kept: how far a cut can change tokens.
CUT_MARGIN_TOKENS = 64
_LONGEST_TOKEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int | None:
    """Characters of the longest vocabulary entry (an upper bound on the characters one token
    covers: byte-level entries spell one symbol a byte), or None when the vocabulary is not
    readable. Cached per tokenizer."""
    try:
        return _LONGEST_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=0) or None
    except Exception:  # no get_vocab (a custom tokenizer): no safe bound
        longest = None
    try:
        _LONGEST_TOKEN[tokenizer] = longest
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return longest


def cut_chars(tokenizer, max_tokens: int | None) -> int | None:
    """Characters that hold at least max_tokens + CUT_MARGIN_TOKENS tokens of any text: where a
    text (or a conversation's contents) may be cut, or None (no max_tokens, or no vocabulary to
    bound a token's characters by)."""
    longest = longest_token_chars(tokenizer) if max_tokens is not None else None
    return None if longest is None else (max_tokens + CUT_MARGIN_TOKENS) * longest


def _encode(tokenizer, text: str, max_tokens: int | None = None) -> list[int]:
    """Tokenize without the tokenizer adding BOS/EOS itself (we place them explicitly).

    With `max_tokens`, a text far longer than that many tokens is cut before tokenizing, so a
    line of tens of MB costs memory for the tokens kept, not for millions: the cut keeps
    (max_tokens + CUT_MARGIN_TOKENS) * longest_token_chars characters, which hold at least that
    many tokens; the first max_tokens are returned. A cut changes at most the tokens of the
    word it falls in, CUT_MARGIN_TOKENS after the kept ones, so they are the same as those of
    the whole text (tests/data/test_huge_lines.py checks it). Fewer tokens than the margin
    promises (a normalizer that merges characters) fall back to the whole text."""
    if not text:
        return []
    keep = cut_chars(tokenizer, max_tokens)
    if keep is not None:
        if len(text) > keep:
            ids = list(tokenizer.encode(text[:keep], add_special_tokens=False))
            if len(ids) >= max_tokens + CUT_MARGIN_TOKENS:
                return ids[:max_tokens]
    return list(tokenizer.encode(text, add_special_tokens=False))


def _is_blank_token(tokenizer, tok_id: int) -> bool:
    try:
        return tokenizer.decode([tok_id]).strip() == ""
    except Exception:  # an id the decoder cannot render is not whitespace
        return False


# `_finish` may drop this many layout tokens at the end before it appends EOS: a cut
# conversation keeps that many more than max_tokens, so the tokens kept still reach max_tokens.
_FINISH_TRIM = 4


def _finish(ids: list[int], mask: list[bool], tokenizer, eos_trained: bool
            ) -> tuple[list[int], list[bool]]:
    """Prepend BOS (untrained) unless present; append EOS unless the text already ends with it.

    "Already ends with EOS" ignores a few trailing whitespace tokens, so a chat template that
    closes each turn with ``EOS + "\\n"`` does not get a second EOS.
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
        mask = [False] + mask
    if eos is not None:
        k = len(ids) - 1
        while k > 0 and len(ids) - k <= 4 and ids[k] != eos and _is_blank_token(tokenizer, ids[k]):
            k -= 1
        if not ids or ids[k] != eos:
            if eos_trained:
                # Untrained layout whitespace after the response (e.g. "<|end|>\n") would sit
                # between the response and EOS; drop it so the model learns "<|end|>" -> EOS.
                j = len(ids)
                while (j > 1 and len(ids) - j < _FINISH_TRIM and not mask[j - 1]
                       and _is_blank_token(tokenizer, ids[j - 1])):
                    j -= 1
                if j < len(ids) and mask[j - 1]:
                    ids, mask = ids[:j], mask[:j]
            ids = ids + [eos]
            mask = mask + [eos_trained]
    return ids, mask


# --------------------------------------------------------------------------------------------
# alpaca / text
# --------------------------------------------------------------------------------------------

def render_alpaca_prompt(instruction: str, input: str = "") -> str:
    """The fixed alpaca prompt; the input section is omitted when `input` is empty."""
    if input.strip():
        return ALPACA_PROMPT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


def _encode_alpaca(row: dict, tokenizer, train_on_inputs: bool, where: str,
                   max_tokens: int | None = None):
    instruction = _text_field(row, "instruction", "alpaca", where)
    output = _text_field(row, "output", "alpaca", where)
    inp = _text_field(row, "input", "alpaca", where, required=False)
    # Prompt and response are tokenized separately so the mask boundary is exact.
    p_ids = _encode(tokenizer, render_alpaca_prompt(instruction, inp), max_tokens)
    r_ids = _encode(tokenizer, output, max_tokens)
    ids = p_ids + r_ids
    mask = [train_on_inputs] * len(p_ids) + [True] * len(r_ids)
    return _finish(ids, mask, tokenizer, eos_trained=True)


def _encode_text(row: dict, tokenizer, where: str, max_tokens: int | None = None):
    ids = _encode(tokenizer, _text_field(row, "text", "text", where), max_tokens)
    return _finish(ids, [True] * len(ids), tokenizer, eos_trained=True)


# --------------------------------------------------------------------------------------------
# messages
# --------------------------------------------------------------------------------------------

def normalize_messages(row: dict, where: str = "<rows>") -> list[dict]:
    """Validate a conversation and return it as a list of ``{"role", "content", ...}`` dicts.

    Accepts ``messages`` or ``conversations`` and ShareGPT ``{"from", "value"}`` turns. Extra keys
    on a turn (e.g. ``tool_calls``) are kept so the chat template can use them.
    """
    key = "messages" if "messages" in row else "conversations" if "conversations" in row else None
    if key is None:
        raise _missing(where, "messages", "messages")
    msgs = row[key]
    if not isinstance(msgs, list) or not msgs:
        raise LeantuneError(
            f"{where}: field {key!r} must be a non-empty list of {{'role', 'content'}} objects, "
            f"got {'an empty list' if isinstance(msgs, list) else type(msgs).__name__}")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise LeantuneError(
                f"{where}: {key}[{j}] is {type(m).__name__}, expected an object with 'role' and "
                f"'content'; the messages format needs {FORMAT_NEEDS['messages']}")
        m = dict(m)
        if "role" not in m and "from" in m:
            speaker = m.pop("from")
            m["role"] = _SHAREGPT_ROLES.get(str(speaker).lower(), speaker)
        if "content" not in m and "value" in m:
            m["content"] = m.pop("value")
        for field in ("role", "content"):
            if field not in m:
                raise LeantuneError(
                    f"{where}: {key}[{j}] is missing field {field!r}; the messages format needs "
                    f"{FORMAT_NEEDS['messages']}")
        if not isinstance(m["role"], str):
            raise LeantuneError(f"{where}: {key}[{j}]['role'] must be a string, "
                                f"got {type(m['role']).__name__}")
        if m["content"] is not None and not isinstance(m["content"], (str, list)):
            raise LeantuneError(f"{where}: {key}[{j}]['content'] must be a string, "
                                f"got {type(m['content']).__name__}")
        out.append(m)
    return out


def _render(tokenizer, msgs: list[dict], add_generation_prompt: bool, where: str) -> str:
    """The conversation as chat-template text, within a time and size limit (utils/templates)."""
    return render_chat_template(tokenizer, msgs, where,
                                add_generation_prompt=add_generation_prompt)


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the longest equal prefix
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def assistant_char_spans(tokenizer, msgs: list[dict], where: str = "<rows>"
                         ) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation and find the character span of each assistant turn.

    The span of assistant turn i starts where the rendering of ``msgs[:i]`` (with the generation
    prompt, i.e. the assistant header) stops agreeing with the full rendering, and ends where the
    rendering of ``msgs[:i + 1]`` does; trailing whitespace (template layout) is excluded. Using
    common prefixes instead of exact ``startswith`` keeps this robust to templates that render
    earlier turns slightly differently (dates, stripped reasoning): the span just shrinks.

    Returns:
        (full rendered text, sorted list of [start, end) character spans to train on).
    """
    full = _render(tokenizer, msgs, False, where)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start = 0
        if i > 0:
            start = max(_common_prefix_len(full, _render(tokenizer, msgs[:i], True, where)),
                        _common_prefix_len(full, _render(tokenizer, msgs[:i], False, where)))
        end = _common_prefix_len(full, _render(tokenizer, msgs[:i + 1], False, where))
        while end > start and full[end - 1].isspace():
            end -= 1
        if spans and start < spans[-1][1]:
            start = spans[-1][1]
        if end > start:
            spans.append((start, end))
    return full, spans


def _tokenize_with_spans(tokenizer, text: str, spans: Iterable[tuple[int, int]],
                         use_offsets: bool = True) -> tuple[list[int], list[bool]]:
    """Tokenize `text` once and mark tokens overlapping any character span as trained.

    With a fast tokenizer the whole string is tokenized in one go (identical ids to inference)
    and offsets map tokens to characters. Otherwise the text is cut at span boundaries and each
    piece is tokenized separately.
    """
    spans = list(spans)
    if use_offsets and getattr(tokenizer, "is_fast", False):
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        except (NotImplementedError, KeyError, TypeError, ValueError):
            ids = None
        if ids is not None:
            trained = [0] * (len(text) + 1)  # prefix sums of trained characters
            flags = bytearray(len(text))
            for s, e in spans:
                flags[s:e] = b"\x01" * (e - s)
            for c in range(len(text)):
                trained[c + 1] = trained[c] + flags[c]
            mask = []
            for s, e in offsets:
                if e > s:
                    mask.append(trained[e] - trained[s] > 0)
                else:  # zero-width token: trained if its position is
                    mask.append(s < len(text) and bool(flags[s]))
            return ids, mask
    ids, mask, pos = [], [], 0
    for s, e in spans:
        piece = _encode(tokenizer, text[pos:s])
        ids += piece
        mask += [False] * len(piece)
        piece = _encode(tokenizer, text[s:e])
        ids += piece
        mask += [True] * len(piece)
        pos = e
    piece = _encode(tokenizer, text[pos:])
    return ids + piece, mask + [False] * len(piece)


def _cut_messages(msgs: list[dict], bound: int) -> tuple[list[dict], bool]:
    """The conversation with its contents cut to `bound` characters in all, and whether any was.

    Contents are counted in order; the one that passes the bound keeps what is left of it, and
    every later turn keeps its role and other fields with an empty content. A template writes
    each content as it is, so the rendering then holds `bound` content characters (more than
    the tokens kept, `cut_chars`) before the first cut: all that is cut lies past the truncation
    point. Later turns are emptied rather than dropped because some templates look ahead
    (``loop.last``, the index of the last user turn) when rendering earlier ones.
    List contents (multimodal parts) are left as they are.
    """
    left, cut, out = bound, False, []
    for m in msgs:
        content = m["content"]
        if isinstance(content, str):
            if len(content) > left:
                m, cut = dict(m, content=content[:left]), True
            left -= len(m["content"])
        out.append(m)
    return out, cut


def _conversation_tokens(tokenizer, msgs: list[dict], train_on_inputs: bool, where: str,
                         bound: int | None = None) -> tuple[list[int], list[bool], bool]:
    """Render and tokenize a conversation: (ids, mask, whether the rendering was cut).

    With `bound`, only the first `bound` characters of the rendering are tokenized (as `_encode`
    cuts a text), so a conversation of many turns costs tokens for what is kept."""
    if train_on_inputs:
        full, spans = _render(tokenizer, msgs, False, where), None
    else:
        full, spans = assistant_char_spans(tokenizer, msgs, where)
    cut = bound is not None and len(full) > bound
    if cut:
        full = full[:bound]
        spans = spans and [(s, min(e, bound)) for s, e in spans if s < bound]
    if spans is None:
        ids = _encode(tokenizer, full)
        return ids, [True] * len(ids), cut
    return *_tokenize_with_spans(tokenizer, full, spans), cut


def _encode_messages(row: dict, tokenizer, train_on_inputs: bool, where: str,
                     max_tokens: int | None = None):
    """A conversation's (ids, mask). With `max_tokens`, contents past `cut_chars` characters are
    cut before rendering and the rendering is cut there too (`_cut_messages`), keeping the
    tokens and mask of the whole conversation's first max_tokens (tests/data/test_huge_lines.py
    checks it). Fewer tokens than the cut promises fall back to the whole conversation."""
    msgs = normalize_messages(row, where)
    if not getattr(tokenizer, "chat_template", None):
        raise LeantuneError(
            f"{where}: the tokenizer has no chat template, which the messages format needs; use "
            "an instruct/chat model's tokenizer, set a chat template, or convert the data to the "
            "alpaca or text format")
    bound = cut_chars(tokenizer, max_tokens)
    short, cut = _cut_messages(msgs, bound) if bound is not None else (msgs, False)
    ids, mask, cut_text = _conversation_tokens(tokenizer, short, train_on_inputs, where, bound)
    if cut or cut_text:
        if len(ids) >= max_tokens + CUT_MARGIN_TOKENS:
            ids, mask = ids[:max_tokens + _FINISH_TRIM], mask[:max_tokens + _FINISH_TRIM]
        else:
            ids, mask, _ = _conversation_tokens(tokenizer, msgs, train_on_inputs, where)
    eos_trained = train_on_inputs or msgs[-1]["role"] == "assistant"
    return _finish(ids, mask, tokenizer, eos_trained=eos_trained)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------

def encode_example(row: dict[str, Any], fmt: str, tokenizer, *, train_on_inputs: bool = False,
                   source: str | os.PathLike | None = None, line: Location | None = None,
                   max_tokens: int | None = None) -> tuple[list[int], list[bool]]:
    """Tokenize one row.

    Args:
        row: the example (a dict as read by `leantune.data.files.read_rows`).
        fmt: "alpaca", "messages" or "text" (aliases are validated by `validate_format`).
        tokenizer: a Hugging Face tokenizer (fast tokenizers give exact chat-turn boundaries).
        train_on_inputs: train on every token (prompts, user turns, template) instead of only
            on responses.
        source, line: where the row came from, for error messages (`format_location`).
        max_tokens: the caller keeps only this many tokens (SFTDataset: max_seq_len + 1); rows
            far longer than that are cut before tokenizing (texts: `_encode`; conversations:
            `_encode_messages`), with the same kept tokens and mask. None: tokenize everything.

    Returns:
        (ids, loss_mask): two lists of equal length L; ``loss_mask[i]`` is True when token i is a
        target. BOS (if any) starts the sequence; EOS ends it.

    Raises:
        LeantuneError: a missing/ill-typed field (naming file, line, field and what the format
            needs), or a conversation the chat template rejects.
    """
    fmt = validate_format(fmt)
    where = format_location(source, line)
    if not isinstance(row, dict):
        raise LeantuneError(f"{where}: expected an object, got {type(row).__name__}")
    if fmt == "alpaca":
        return _encode_alpaca(row, tokenizer, train_on_inputs, where, max_tokens)
    if fmt == "messages":
        return _encode_messages(row, tokenizer, train_on_inputs, where, max_tokens)
    return _encode_text(row, tokenizer, where, max_tokens)
