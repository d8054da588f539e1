"""A tiny checkpoint folder and small data files for the trainer and CLI tests.

`tiny_ckpt` (session fixture) is a folder holding a randomly initialised 2-layer Llama (hidden 32)
saved by transformers, plus the offline BPE tokenizer of tests/data/conftest.py (chat template,
BOS/EOS/PAD); `alpaca_file` is a small alpaca .jsonl whose responses vary in length, so packed
rows and micro-batches hold different numbers of target tokens. Import the fixtures into a test
module to use them.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def make_tokenizer():
    """The BPE tokenizer of tests/data/conftest.py (loaded by path: every conftest module is named
    `conftest`)."""
    spec = importlib.util.spec_from_file_location("_leantune_data_conftest",
                                                  _HERE / "data" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_tokenizer()


def save_tiny_checkpoint(folder: Path, tokenizer, hidden: int = 32, seed: int = 0) -> Path:
    """A 2-layer Llama checkpoint (config.json + model.safetensors) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


WORDS = ["Paris", "is", "the", "capital", "of", "France", "hello", "world", "quick", "brown",
         "fox", "lazy", "dog", "today", "fine", "thank", "you"]


def alpaca_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14)))
        rows.append({"instruction": "What is the capital of France?", "input": f"{a} {b}",
                     "output": f"{answer} {a + b}"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", make_tokenizer())


@pytest.fixture(scope="session")
def alpaca_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", alpaca_rows(48))
