"""`leantune.generate` with a tokenizer: prompts tokenized as training does (BOS, chat
template), stop strings and EOS, the streamer, the default EOS ids, one-line errors."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import one_torch_thread, tiny_ckpt  # noqa: F401  (autouse; fixture)

import leantune
from leantune.errors import LeantuneError
from leantune.generate.chat import TextStreamer
from leantune.generate.prompts import prompt_ids
from leantune.generate.text import default_eos_ids


@pytest.fixture(scope="module")
def lm(tiny_ckpt):  # noqa: F811
    from transformers import AutoTokenizer

    model = leantune.load_model(tiny_ckpt, device="cpu", dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_ckpt)


def test_prompts_are_tokenized_as_training_does(lm):
    _, tok = lm
    assert prompt_ids(tok, "hello world") == [tok.bos_token_id] + tok.encode(
        "hello world", add_special_tokens=False)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<s>") and rendered.endswith("<|assistant|>\n")
    assert prompt_ids(tok, chat) == tok.encode(rendered, add_special_tokens=False)  # one BOS
    assert prompt_ids(tok, [5, 6, 7]) == [5, 6, 7]


def test_leantune_generate_is_the_function(lm):
    model, tok = lm
    out = leantune.generate(model, tok, ["hello world", "the quick brown fox"],
                            max_new_tokens=12, eos_token_ids=[])
    assert [len(g.token_ids) for g in out] == [12, 12]
    assert all(g.stopped == "length" for g in out)
    assert out[0].text == tok.decode(out[0].token_ids, skip_special_tokens=True)
    one = leantune.generate(model, tok, "hello world", max_new_tokens=12, eos_token_ids=[])
    assert one == out[:1]  # one prompt alone, or in a batch: the same completion


def test_stop_strings_cut_the_text_and_end_the_row(lm):
    model, tok = lm
    free = leantune.generate(model, tok, "hello world", max_new_tokens=24, eos_token_ids=[])[0]
    text = free.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    got = leantune.generate(model, tok, "hello world", max_new_tokens=24, eos_token_ids=[],
                            stop=[stop, "never in it"])[0]
    assert got.stopped == "stop string"
    assert got.text == text[:text.find(stop)]
    assert len(got.token_ids) < 24 and got.token_ids == free.token_ids[:len(got.token_ids)]
    assert stop in tok.decode(got.token_ids)


def test_eos_ends_the_completion(lm):
    model, tok = lm
    free = leantune.generate(model, tok, "hello world", max_new_tokens=24, eos_token_ids=[])[0]
    eos = free.token_ids[6]
    got = leantune.generate(model, tok, "hello world", max_new_tokens=24, eos_token_ids=[eos])[0]
    end = free.token_ids.index(eos)
    assert got.stopped == "eos" and got.token_ids == free.token_ids[:end + 1]
    assert got.text == tok.decode(free.token_ids[:end], skip_special_tokens=True)


def test_default_eos_ids(lm, tiny_ckpt):  # noqa: F811
    model, tok = lm
    # config.json's and the tokenizer's EOS (the same id here), and the template's <|end|> is
    # not in this (EOS-closed) template
    assert default_eos_ids(model, tok) == [tok.eos_token_id]
    tok.chat_template = tok.chat_template.replace("{{ eos_token }}", "<|end|>")
    try:
        assert default_eos_ids(model, tok) == [tok.eos_token_id,
                                               tok.convert_tokens_to_ids("<|end|>")]
    finally:
        tok.chat_template = tok.chat_template.replace("<|end|>", "{{ eos_token }}")


def test_the_streamer_writes_the_completion_as_it_comes(lm):
    model, tok = lm
    buf = io.StringIO()
    pieces = []
    streamer = TextStreamer(tok, buf)
    write = buf.write
    buf.write = lambda s: pieces.append(s) or write(s)
    got = leantune.generate(model, tok, "hello world", max_new_tokens=16, eos_token_ids=[],
                            streamer=streamer)[0]
    assert buf.getvalue() == got.text + "\n"
    assert len([p for p in pieces if p]) > 3  # written piece by piece, not at the end


def test_bad_prompts_are_one_line_errors(lm):
    model, tok = lm
    with pytest.raises(LeantuneError, match=r"^prompt 2: a prompt is a text"):
        leantune.generate(model, tok, ["fine", 3.5])
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(LeantuneError, match=r"^prompt 1: the tokenizer has no chat template"):
            leantune.generate(model, tok, [[{"role": "user", "content": "hi"}]])
    finally:
        tok.chat_template = saved
    with pytest.raises(LeantuneError, match="--max-new-tokens must be a positive integer"):
        leantune.generate(model, tok, "hi", max_new_tokens=0)
