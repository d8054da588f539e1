"""The tokenizer as GGUF metadata: tokens, token types, merges, the name of llama.cpp's
pre-tokenizer, special ids, the add-BOS flag and the chat template.

Two kinds of BPE tokenizer.json: byte-level (GPT-2 style: Llama 3, Qwen2/3, SmolLM, Mistral
Nemo), written as llama.cpp's "gpt2" model with the pre-tokenizer name read from tokenizer.json
(its split regex, digit splitting), not guessed from the model name; and SentencePiece-style BPE
with byte fallback ("▁" for spaces: Llama 2, Mistral 7B), written as llama.cpp's "llama" model,
whose merge order comes from token scores: a token made by merge number k scores -k.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import LeantuneError
from ..serving import chat_template_of, load_tokenizer, stop_token_ids, turn_end_ids

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")

# Split regexes of the tokenizer families llama.cpp knows by name (as their tokenizer.json
# files spell them).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_MARK = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"


@dataclass
class GGUFVocab:
    model: str  # llama.cpp's tokenizer model: "gpt2" (byte-level BPE) | "llama" (SentencePiece)
    pre: str  # llama.cpp's pre-tokenizer name
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "left right", in merge order
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    eot_id: int | None  # the chat template's end-of-turn token (e.g. <|im_end|>), if any
    add_bos: bool
    add_eos: bool
    chat_template: str | None
    scores: list[float] | None = None  # "llama" model: merge priority per token
    add_space_prefix: bool | None = None  # "llama" model: a "▁" before the text
    stop_ids: list[int] = field(default_factory=list)  # every id that ends generation
    warnings: list[str] = field(default_factory=list)

    @property
    def stop_strings(self) -> list[str]:
        return [self.tokens[i] for i in self.stop_ids if 0 <= i < len(self.tokens)]


def _flatten(pre: dict | None) -> list[dict]:
    if not pre:
        return []
    if pre.get("type") == "Sequence":
        return [p for sub in pre.get("pretokenizers", []) for p in _flatten(sub)]
    return [pre]


def pre_tokenizer_name(tokenizer_json: dict) -> str | None:
    """llama.cpp's name for the pre-tokenizer of a byte-level BPE tokenizer.json, or None."""
    steps = _flatten(tokenizer_json.get("pre_tokenizer"))
    kinds = [s.get("type") for s in steps]
    regexes = [(s.get("pattern") or {}).get("Regex") for s in steps if s.get("type") == "Split"]
    if regexes and kinds[-1:] == ["ByteLevel"] and len(regexes) == 1:
        if regexes[0] == LLAMA3_SPLIT:
            return "llama-bpe"
        if regexes[0] == QWEN2_SPLIT:
            return "qwen2"
        if regexes[0].startswith(TEKKEN_MARK + "|"):  # (GPT-4o-style splits go on differently)
            return "tekken"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") \
            and steps[1].get("use_regex", True):
        return "smollm"
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    return None


def _merge_strings(merges: list) -> list[str]:
    """tokenizer.json merges ("a b" strings, or [a, b] pairs in newer files) as "a b"."""
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def read_vocab(src: Path, vocab_size: int) -> GGUFVocab:
    """The GGUF vocabulary of the tokenizer saved in `src`, padded to the model's vocab_size."""
    tok = load_tokenizer(src)
    if tok is None or not hasattr(tok, "backend_tokenizer"):
        raise LeantuneError(f"{src}: no tokenizer (tokenizer.json) next to the weights; GGUF "
                            "export needs it; copy the base model's tokenizer files there")
    tj = json.loads(tok.backend_tokenizer.to_str())
    model = tj.get("model") or {}
    byte_level = any(s.get("type") == "ByteLevel" for s in _flatten(tj.get("pre_tokenizer")))
    spm = _sentencepiece_style(tj)
    if model.get("type") != "BPE" or not (byte_level or spm):
        kind = model.get("type") if model.get("type") != "BPE" else "BPE without byte-level"
        raise LeantuneError(f"{src}: tokenizer.json is a {kind} tokenizer; GGUF export supports "
                            "byte-level BPE (Llama 3, Qwen2/3, SmolLM, Mistral Nemo) and "
                            "SentencePiece-style BPE (Llama 2, Mistral 7B) tokenizers")
    warnings = []
    pre = "default" if spm else pre_tokenizer_name(tj)
    if pre is None:
        pre = "default"
        warnings.append(f"{src}: tokenizer.json's pre-tokenizer is not one llama.cpp knows by "
                        "name; wrote 'default' (llama.cpp may split text differently)")

    by_id: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in model["vocab"].items()}
    for added in tj.get("added_tokens", []):
        by_id[added["id"]] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    if by_id and max(by_id) >= vocab_size:
        raise LeantuneError(f"{src}: the tokenizer has token id {max(by_id)}, but the model's "
                            f"vocab_size is {vocab_size}; is it the tokenizer of another model?")
    tokens, types = [], []
    for i in range(vocab_size):  # ids the tokenizer lacks: padding rows of the embedding
        text, kind = by_id.get(i, (f"[PAD{i}]", UNUSED))
        if spm and kind == NORMAL and _BYTE_TOKEN.fullmatch(text):
            kind = BYTE
        tokens.append(text)
        types.append(UNKNOWN if spm and i == tok.unk_token_id else kind)
    merges = _merge_strings(model.get("merges", []))

    with_special = tok.encode("a", add_special_tokens=True)
    plain = tok.encode("a", add_special_tokens=False)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    stops = stop_token_ids(src, tok)
    if eos is None and stops:
        eos = stops[0]
    eot = next(iter(turn_end_ids(tok)), None)
    return GGUFVocab(
        model="llama" if spm else "gpt2", pre=pre, tokens=tokens, token_types=types, merges=merges,
        bos_id=bos, eos_id=eos, pad_id=tok.pad_token_id, unk_id=tok.unk_token_id, eot_id=eot,
        add_bos=bos is not None and with_special[:1] == [bos] and plain[:1] != [bos],
        add_eos=eos is not None and with_special[-1:] == [eos] and plain[-1:] != [eos],
        chat_template=chat_template_of(tok), stop_ids=stops, warnings=warnings,
        scores=_merge_scores(tokens, merges) if spm else None,
        add_space_prefix=_space_prefix(tj) if spm else None)


def _normalizers(tj: dict) -> list[dict]:
    norm = tj.get("normalizer") or {}
    return norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm]


def _sentencepiece_style(tj: dict) -> bool:
    """A BPE with byte fallback that writes spaces as "▁" (a normalizer or Metaspace)."""
    spaces = any(n.get("type") == "Replace" and n.get("content") == "\u2581"
                 for n in _normalizers(tj)) \
        or any(p.get("type") == "Metaspace" for p in _flatten(tj.get("pre_tokenizer")))
    return bool((tj.get("model") or {}).get("byte_fallback")) and spaces


def _space_prefix(tj: dict) -> bool:
    """Whether the tokenizer puts a "▁" before the text (Prepend normalizer or Metaspace)."""
    if any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in _normalizers(tj)):
        return True
    return any(p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
               for p in _flatten(tj.get("pre_tokenizer")))


def _merge_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """SentencePiece scores that replay the BPE merge order: the token made by merge k scores
    -k (llama.cpp merges the adjacent pair whose result scores highest); others score 0."""
    rank: dict[str, int] = {}
    for k, merge in enumerate(merges):
        rank.setdefault(merge.replace(" ", "", 1), k)
    return [-float(rank[t]) if t in rank else 0.0 for t in tokens]
