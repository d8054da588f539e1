"""The tokenizer as GGUF metadata: a byte-level BPE's tokens, token types, merges, the name of
llama.cpp's pre-tokenizer for it, special ids, the add-BOS flag and the chat template.

The pre-tokenizer name tells llama.cpp how to split text before BPE; it is read from the
tokenizer.json pre-tokenizer (its split regex, digit splitting), not guessed from the model name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import LeantuneError
from ..serving import chat_template_of, load_tokenizer, stop_token_ids

# llama.cpp token types
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

# Split regexes of the tokenizer families llama.cpp knows by name (as their tokenizer.json
# files spell them).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_MARK = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"


@dataclass
class GGUFVocab:
    pre: str  # llama.cpp's pre-tokenizer name
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "left right", in merge order
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    eot_id: int | None  # a turn-end token other than EOS (e.g. <|eot_id|>), if the template has one
    add_bos: bool
    add_eos: bool
    chat_template: str | None
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
    if model.get("type") != "BPE" or not byte_level:
        kind = model.get("type") if model.get("type") != "BPE" else "BPE without byte-level"
        raise LeantuneError(f"{src}: tokenizer.json is a {kind} tokenizer; GGUF export supports "
                            "byte-level BPE tokenizers (Llama 3, Qwen2/3, SmolLM, Mistral Nemo)")
    warnings = []
    pre = pre_tokenizer_name(tj)
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
        tokens.append(text)
        types.append(kind)

    with_special = tok.encode("a", add_special_tokens=True)
    plain = tok.encode("a", add_special_tokens=False)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    stops = stop_token_ids(src, tok)
    if eos is None and stops:
        eos = stops[0]
    eot = next((i for i in stops if i != eos and types[i] == CONTROL), None)
    return GGUFVocab(
        pre=pre, tokens=tokens, token_types=types, merges=_merge_strings(model.get("merges", [])),
        bos_id=bos, eos_id=eos, pad_id=tok.pad_token_id, unk_id=tok.unk_token_id, eot_id=eot,
        add_bos=bos is not None and with_special[:1] == [bos] and plain[:1] != [bos],
        add_eos=eos is not None and with_special[-1:] == [eos] and plain[-1:] != [eos],
        chat_template=chat_template_of(tok), stop_ids=stops, warnings=warnings)
