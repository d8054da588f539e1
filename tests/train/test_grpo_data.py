"""Prompt-only rows for GRPO (data/prompts_data.py): text and conversational prompts, kept
fields, left truncation, the loader's resumable order, inspect-data's rendering, one-line errors."""

from __future__ import annotations

import pytest

from helpers import make_tokenizer, run_cli, save_tiny_checkpoint, write_jsonl
from leantune.data.prompts_data import PromptDataset, prompt_loader_class
from leantune.errors import LeantuneError


def test_text_and_conversational_prompts():
    tok = make_tokenizer()
    ds = PromptDataset([{"prompt": "What is the capital of France?", "answer": "#### 1"},
                        {"prompt": "hello world", "answer": "#### 2"}], tok)
    assert ds.form == "strings" and ds.fields == ["answer"] and ds.format == "text"
    first = ds[0]
    assert first.ids[0] == tok.bos_token_id and first.fields == {"answer": "#### 1"}
    assert tok.decode(first.ids[1:]) == "What is the capital of France?"
    conv = PromptDataset([{"prompt": [{"role": "user", "content": "hello"}]}], tok)
    text = tok.decode(conv[0].ids)
    assert conv.form == "conversational" and text.endswith("<|assistant|>\n")  # turn opened
    cut = PromptDataset([{"prompt": "The quick brown fox jumps over the lazy dog."}], tok,
                        max_prompt_len=4)
    assert len(cut[0].ids) == 4 and cut[0].ids[0] == tok.bos_token_id
    assert cut.num_prompt_truncated == 1


@pytest.mark.parametrize("rows, match", [
    ([{"question": "x"}], r"\(row 1\): missing field 'prompt' \(keys: 'question'\)"),
    ([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}],
     r"\(row 2\): a conversational prompt in a file of strings prompts"),
    ([{"prompt": 3}], "field 'prompt' must be a text or a non-empty list"),
    ([{"prompt": "a", "completions": "x"}], "field 'completions' is the name of a reward"),
])
def test_bad_rows(rows, match):
    with pytest.raises(LeantuneError, match=match):
        PromptDataset(rows, make_tokenizer())


def test_loader_order_and_resume():
    tok = make_tokenizer()
    ds = PromptDataset([{"prompt": f"hello {i}"} for i in range(5)], tok)
    Loader = prompt_loader_class()
    a = Loader(ds, 2, 64, seed=3)
    it = a.iter_batches()
    first = [next(it)[2].indices for _ in range(2)]
    state = a.state_dict()
    rest = [next(it)[2].indices for _ in range(3)]
    b = Loader(ds, 2, 64, seed=3)
    b.load_state_dict(state)
    it = b.iter_batches()
    assert [next(it)[2].indices for _ in range(3)] == rest
    assert sorted(sum(first, []) + rest[0]) == list(range(5))


def test_inspect_data_shows_rendered_prompts(tmp_path, capsys):
    tok = make_tokenizer()
    model = save_tiny_checkpoint(tmp_path / "m", tok)
    data = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": [{"role": "user", "content": "hello world"}], "answer": "#### 7"}])
    rc, out, _ = run_cli(capsys, "inspect-data", "--model", model, "--data", data)
    assert rc == 0
    assert "1 prompts (conversational), fields answer" in out
    assert "<|user|>\n    hello world</s>\n    <|assistant|>" in out and '"answer": "#### 7"' in out
