"""What serving engines need beside the weights: the tokenizer's end-of-turn ids (for
generation_config.json, GGUF metadata and Ollama stop strings) and the vLLM command line that
loads a LoRA adapter."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

from ..utils.io import atomic_write_json

# End-of-turn markers of the chat templates of the supported families (ChatML, Llama 3, Phi-3 /
# Zephyr style, Gemma). A template that writes one of these ends its turns with it, so it is a
# stop token even where the tokenizer's EOS is another.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")

# vLLM's --max-lora-rank takes one of these (vllm.config.lora, MaxLoRARanks; releases from 0.14
# also take 1). An adapter of rank r loads under the smallest value >= r; above 512 vLLM cannot
# serve it as a LoRA.
VLLM_MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)


def load_tokenizer(folder: str | os.PathLike):
    """The tokenizer saved in `folder` (transformers), or None when it has none.

    A tokenizer.json is read as it is (PreTrainedTokenizerFast): AutoTokenizer would rebuild
    some families' pipelines from their model type instead of the file. No Python code of the
    checkpoint's runs (trust_remote_code=False)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from ..utils.quiet import transformers_quiet

    cls = PreTrainedTokenizerFast if (Path(folder) / "tokenizer.json").exists() else AutoTokenizer
    try:
        # never the checkpoint's own code (an auto_map in tokenizer_config.json): without
        # trust_remote_code=False AutoTokenizer would even ask whether to run it
        with transformers_quiet():  # (its notes on config.json: leantune reads that itself)
            return cls.from_pretrained(str(folder), trust_remote_code=False)
    except Exception:  # no tokenizer files, ones transformers cannot read, or needing code
        return None


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def chat_template_of(tokenizer) -> str | None:
    """The default chat template (transformers keeps named templates in a dict)."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


def stop_token_ids(src: Path, tokenizer=None) -> list[int]:
    """Every id that ends generation: config.json's and generation_config.json's eos_token_id,
    the tokenizer's EOS, and the turn-end markers its chat template writes; first seen first."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(src) / name
        if path.exists():
            ids += _ids(json.loads(path.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        ids += _ids(tokenizer.eos_token_id) + turn_end_ids(tokenizer)
    return list(dict.fromkeys(ids))


def turn_end_ids(tokenizer) -> list[int]:
    """Ids of the TURN_END_TOKENS the tokenizer's chat template writes."""
    template = chat_template_of(tokenizer) or ""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in TURN_END_TOKENS if t in template and t in vocab]


def write_generation_config(src: Path, out: Path, tokenizer=None) -> None:
    """Give `out` a generation_config.json whose eos_token_id lists every stop id, so vLLM and
    SGLang stop at the end of a turn. The base's file (already copied, sampling defaults and
    all) is kept as it is unless it misses a stop id; without one a new file gets the ids."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(out)
    stops = stop_token_ids(src, tokenizer)
    path = out / "generation_config.json"
    gen = json.loads(path.read_text()) if path.exists() else {}
    if not stops or set(stops) <= set(_ids(gen.get("eos_token_id"))):
        return
    if not gen:
        config = json.loads((src / "config.json").read_text())
        gen = {k: config[k] for k in ("bos_token_id", "pad_token_id") if config.get(k) is not None}
    gen["eos_token_id"] = list(dict.fromkeys(_ids(gen.get("eos_token_id")) + stops))
    atomic_write_json(path, gen)


def vllm_lora_lines(base: str, adapter: str | os.PathLike, r: int) -> list[str]:
    """How to serve a LoRA adapter of rank r with vLLM: the `vllm serve` line, after a warning
    when vLLM has no --max-lora-rank of exactly r (or none at all)."""
    fit = next((m for m in VLLM_MAX_LORA_RANKS if m >= r), None)
    if fit is None:
        return [f"warning: LoRA rank {r} is above the largest rank vLLM serves (512); merge it "
                f"with `leantune export --model {shlex.quote(str(base))} --adapter "
                f"{shlex.quote(str(adapter))} --output DIR` "
                "and serve DIR"]
    lines = []
    if fit != r:
        lines.append(f"warning: vLLM accepts LoRA ranks {', '.join(map(str, VLLM_MAX_LORA_RANKS))}"
                     f"; this adapter (rank {r}) loads with --max-lora-rank {fit}")
    # (quoted for the shell: a folder name is the user's, or a shared checkpoint's, text)
    name = re.sub(r"[^\w.-]+", "-", Path(adapter).resolve().name).strip("-") or "adapter"
    lines.append(f"serve it with vLLM: vllm serve {shlex.quote(str(base))} --enable-lora "
                 f"--lora-modules {shlex.quote(f'{name}={adapter}')} --max-lora-rank {fit}")
    return lines
