"""The model and dataset bundled for the no-argument `leantune train` demo."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from leantune import assets
from leantune.errors import LeantuneError

MODEL = assets.path("tiny-llama")
TRAIN = assets.path("data/tiny_sft.jsonl")
EVAL = assets.path("data/tiny_sft_eval.jsonl")
SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_assets.py"


def _rows(p):
    with open(p, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_paths_and_aliases():
    assert MODEL.is_dir() and TRAIN.is_file() and EVAL.is_file()
    assert assets.path("model") == MODEL
    assert assets.path("tiny_sft") == TRAIN == assets.path("train")
    assert assets.path("tiny_sft_eval") == EVAL == assets.path("eval")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (MODEL / f).is_file(), f
    assert (assets.ROOT / "README.md").is_file()
    with pytest.raises(ValueError):
        assets.path("../errors.py")
    with pytest.raises(LeantuneError, match="missing"):
        assets.path("data/nope.jsonl")


def test_small_enough_to_ship():
    total = sum(p.stat().st_size for p in assets.ROOT.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts)
    assert total < 6 * 2**20, f"assets are {total / 2**20:.1f} MiB"


def test_config_is_a_small_gqa_llama():
    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert cfg["hidden_size"] == cfg["num_attention_heads"] * cfg["head_dim"]
    # leantune's own config reader accepts it
    from leantune.model.config import ModelConfig

    mc = ModelConfig.from_file(MODEL / "config.json")
    assert mc.model_type == "llama" and mc.num_key_value_heads == cfg["num_key_value_heads"]
    assert mc.num_params() < 3_000_000


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(MODEL, local_files_only=True, dtype=torch.float32)
    return m.eval()


def test_tokenizer_special_tokens_and_template(tok):
    assert tok.eos_token and tok.eos_token_id is not None
    assert tok.bos_token_id is not None and tok.pad_token_id is not None
    assert len({tok.eos_token_id, tok.bos_token_id, tok.pad_token_id}) == 3
    assert tok.chat_template
    cfg = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] and cfg["eos_token"] == tok.eos_token
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text.startswith(tok.bos_token)
    assert text.count(tok.eos_token) == 3 and text.endswith(tok.eos_token)
    assert "What is the capital of France?" in text and "Paris." in text
    gen = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|assistant|>\n")
    ids = tok.apply_chat_template(msgs[:2], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=False) == gen


def test_tokenizer_round_trips(tok):
    s = "### Instruction:\nAdd the two numbers.\n\n### Input:\n12 + 7\n\n### Response:\n19"
    ids = tok.encode(s, add_special_tokens=False)
    assert tok.decode(ids) == s
    assert len(ids) < len(s) / 2  # BPE merges, not bytes
    assert tok.encode("é ü 日本", add_special_tokens=False)  # byte-level: anything encodes
    assert len(tok) <= 2048


def test_model_loads_and_is_pretrained(model, tok):
    assert model.config.model_type == "llama"
    n = sum(p.numel() for p in model.parameters())
    assert n < 3_000_000
    text = "The capital of France is Paris. A cow says moo. The opposite of hot is cold."
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 3.0, loss  # a random init scores ~log(2048) = 7.6
    prompt = tok("The capital of Italy is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert "Rome" in tok.decode(out[0, prompt.input_ids.shape[1]:])


def test_dataset_rows_are_alpaca():
    train, ev = _rows(TRAIN), _rows(EVAL)
    assert 1500 <= len(train) <= 3000 and 100 <= len(ev) <= 200
    for r in train + ev:
        assert set(r) == {"instruction", "input", "output"}
        assert all(isinstance(v, str) for v in r.values())
        assert r["instruction"] and r["output"]
    train_q = {(r["instruction"], r["input"]) for r in train}
    assert not any((r["instruction"], r["input"]) in train_q for r in ev)
    assert len({r["instruction"].split()[0] for r in train}) >= 5  # a family of tasks


def test_dataset_is_what_the_script_generates():
    """The shipped rows are exactly the seeded output of tools/make_tiny_assets.py."""
    if not SCRIPT.is_file():
        pytest.skip("not a source checkout")
    spec = importlib.util.spec_from_file_location("make_tiny_assets", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["make_tiny_assets"] = mod
    try:
        spec.loader.exec_module(mod)
        args = mod.build_parser().parse_args([])
        train, ev = mod.make_sft_splits(args.seed, args.n_train, args.n_eval)
    finally:
        sys.modules.pop("make_tiny_assets", None)
    assert train == _rows(TRAIN)
    assert ev == _rows(EVAL)
