"""Prompts against the model's context (generate/context.py) and the KV cache against free
memory (generate/cache.py), on the tiny checkpoint (max_position_embeddings 256): a prompt that
leaves no room for a new token is one line naming it (file and line, --prompt, a chat template
that inflates it; before the weights load), one that leaves less than --max-new-tokens gets a
capped completion and a note, a chat that grows past the context says /reset (once) and goes
on; normal prompts unchanged."""

from __future__ import annotations

import io
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers import cli_error, one_torch_thread, run_cli, tiny_ckpt, write_jsonl  # noqa: F401

import leantune
from leantune.errors import LeantuneError
from leantune.generate.context import PromptTooLong, model_context
from leantune.generate.decode import decode
from leantune.generate.prompts import prompt_ids

CONTEXT = 256  # the tiny checkpoint's max_position_embeddings
GEN = ["--device", "cpu", "--max-new-tokens", "10"]
TEXT = ["--prompt-format", "text"]  # {"prompt": text} rows as they are (not a chat turn)


@pytest.fixture(scope="module")
def lm(tiny_ckpt):  # noqa: F811
    from transformers import AutoTokenizer

    model = leantune.load_model(tiny_ckpt, device="cpu", dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(tiny_ckpt)


def _count(tok, text: str) -> int:
    """Tokens of a text prompt (BOS in front, as prompts.prompt_ids makes them)."""
    return 1 + len(tok.encode(text, add_special_tokens=False))


def _near(tok, room: int) -> str:
    """A text prompt of CONTEXT - `room` tokens (`room` even: "hello" and " " are a token each,
    BOS in front)."""
    text = " ".join(["hello"] * ((CONTEXT - room) // 2))
    assert _count(tok, text) == CONTEXT - room
    return text


def test_a_long_row_of_a_prompts_file_is_one_line_naming_it(capsys, tmp_path, tiny_ckpt, lm):  # noqa: F811
    _, tok = lm
    huge = "hello " * 100000  # (once a 90 GB KV cache and an allocator traceback)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello world"}, {"prompt": huge}])
    n = _count(tok, huge)
    assert cli_error(capsys, "generate", "--model", tiny_ckpt, "--prompts", prompts, *TEXT, *GEN) == (
        f"{prompts}:2: the prompt is {n:,} tokens, and the model's context is 256 tokens (its "
        "max_position_embeddings), which must hold the prompt and its completion; shorten the "
        "prompt to at most 246 tokens to leave room for --max-new-tokens 10 (up to 255, its "
        "completion stops at the context)")
    # one that fills the context exactly leaves no room either
    full = write_jsonl(tmp_path / "full.jsonl", [{"prompt": _near(tok, 0)}])
    assert cli_error(capsys, "generate", "--model", tiny_ckpt, "--prompts", full, *TEXT, *GEN
                     ).startswith(f"{full}:1: the prompt is 256 tokens, and the model's context")


def test_a_long_prompt_is_refused_before_the_weights_load(capsys, monkeypatch, tmp_path,  # noqa: F811
                                                          tiny_ckpt, lm):
    """The tokenizer and config.json know the prompt's tokens and the context: a prompt past it
    is the same one line, and the weights are never read."""
    from leantune.generate.load import Located

    _, tok = lm
    loaded = []
    monkeypatch.setattr(Located, "load", lambda self: loaded.append(self) or 1 / 0)
    huge = "hello " * 300
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello world"}, {"prompt": huge}])
    assert cli_error(capsys, "generate", "--model", tiny_ckpt, "--prompts", prompts, *TEXT, *GEN) == (
        f"{prompts}:2: the prompt is {_count(tok, huge):,} tokens, and the model's context is "
        "256 tokens (its max_position_embeddings), which must hold the prompt and its "
        "completion; shorten the prompt to at most 246 tokens to leave room for "
        "--max-new-tokens 10 (up to 255, its completion stops at the context)")
    assert cli_error(capsys, "generate", "--model", tiny_ckpt, "--prompt", huge,
                     "--no-chat-template", *GEN).startswith(
        f"--prompt: the prompt is {_count(tok, huge):,} tokens, and the model's context is 256")
    assert loaded == []


def test_a_long_prompt_flag_is_one_line(capsys, tiny_ckpt, lm):  # noqa: F811
    _, tok = lm
    text = "hello " * 300
    err = cli_error(capsys, "generate", "--model", tiny_ckpt, "--prompt", text,
                    "--no-chat-template", "--device", "cpu")  # --max-new-tokens 256: no room
    assert err == (f"--prompt: the prompt is {_count(tok, text):,} tokens, and the model's "
                   "context is 256 tokens (its max_position_embeddings), which must hold the "
                   "prompt and its completion; shorten the prompt to fewer than 256 tokens (its "
                   "completion stops at the context: --max-new-tokens 256 alone would fill it)")
    # through the chat template (the default for --prompt), said so
    err = cli_error(capsys, "generate", "--model", tiny_ckpt, "--prompt", text, *GEN)
    assert err.startswith("--prompt: the prompt is ") and " tokens through the chat template, " \
        "and the model's context is 256 tokens" in err


@pytest.mark.parametrize("template", ["{{ ('x ' * 100000)|wordwrap(1) }}",
                                      "{{ strftime_now('%s' * 100000) }}"])
def test_a_chat_template_that_inflates_the_prompt_is_one_line(capsys, tmp_path, tiny_ckpt,  # noqa: F811
                                                               template):
    folder = tmp_path / "inflating"
    shutil.copytree(tiny_ckpt, folder)
    (folder / "chat_template.jinja").write_text(template)
    err = cli_error(capsys, "generate", "--model", folder, "--prompt", "hi", *GEN)
    assert err.startswith("--prompt: the prompt is ") and "tokens through the chat template, " \
        "and the model's context is 256 tokens" in err
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert cli_error(capsys, "generate", "--model", folder, "--prompts", prompts, *GEN
                     ).startswith(f"{prompts}:1: the prompt is ")


def test_a_prompt_near_the_context_gets_a_capped_completion_and_a_note(capsys, tmp_path,  # noqa: F811
                                                                        tiny_ckpt, lm):
    model, tok = lm
    near = _near(tok, 4)
    rows = [{"prompt": "hello world"}, {"prompt": near}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_ckpt, "--prompts", prompts, *TEXT, *GEN)
    assert rc == 0, err
    assert err.strip().splitlines() == [
        f"leantune: note: {prompts}:2 is 252 tokens, which leaves 4 of the model's 256-token "
        "context for its completion, fewer than --max-new-tokens 10: it stops there"]
    got = [json.loads(line) for line in out.splitlines()]
    # the short prompt is completed as on its own (the long one beside it changes nothing)
    alone = leantune.generate(model, tok, "hello world", max_new_tokens=10)[0]
    assert got[0]["completion"] == alone.text and got[0]["tokens"] == len(alone.token_ids)
    assert got[1]["tokens"] <= 4
    if got[1]["stopped"] != "eos":
        assert got[1] == {**rows[1], "completion": got[1]["completion"], "tokens": 4,
                          "stopped": "length"}
    # several: one note
    many = write_jsonl(tmp_path / "m.jsonl", [{"prompt": near}, {"prompt": _near(tok, 2)}])
    rc, _, err = run_cli(capsys, "generate", "--model", tiny_ckpt, "--prompts", many, *TEXT, *GEN)
    assert rc == 0 and err.strip().splitlines() == [
        "leantune: note: 2 prompts leave fewer than --max-new-tokens 10 of the model's "
        f"256-token context for their completions (the first, {many}:1: 252 tokens, leaves 4); "
        "they stop at the context"]


def test_normal_prompts_are_unchanged_and_say_nothing(capsys, tmp_path, tiny_ckpt, lm):  # noqa: F811
    model, tok = lm
    rows = [{"prompt": "hello world"}, {"prompt": "the quick brown fox"}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_ckpt, "--prompts", prompts, *TEXT, *GEN)
    assert rc == 0 and err == ""
    want = leantune.generate(model, tok, [r["prompt"] for r in rows], max_new_tokens=10)
    assert [json.loads(line)["completion"] for line in out.splitlines()] == [g.text for g in want]


def test_the_python_api_names_prompts_by_number(lm):
    model, tok = lm
    long = list(range(3, 303))
    with pytest.raises(PromptTooLong, match=r"^prompt 2: the prompt is 300 tokens, and the "):
        leantune.generate(model, tok, [[5, 6, 7], long], max_new_tokens=4)
    with pytest.raises(LeantuneError, match=r"^the prompt is 300 tokens, and the model's "):
        leantune.generate(model, tok, long, max_new_tokens=4)
    notes = []
    out = leantune.generate(model, tok, list(range(3, 253)), max_new_tokens=20,
                            eos_token_ids=[], log=notes.append)[0]
    assert len(out.token_ids) == 6 and out.stopped == "length"
    assert notes == ["leantune: note: the prompt is 250 tokens, which leaves 6 of the model's "
                     "256-token context for its completion, fewer than --max-new-tokens 20: it "
                     "stops there"]


def test_decode_takes_a_limit_per_row(lm):
    model, _ = lm
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    both = decode(model, prompts, 6, eos_ids=())
    rows = decode(model, prompts, [2, 6], eos_ids=())
    assert [len(r.token_ids) for r in rows] == [2, 6]
    assert rows[0].token_ids == both[0].token_ids[:2] and rows[1].token_ids == both[1].token_ids
    assert [r.stopped for r in rows] == ["length", "length"]
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode(model, prompts, [2], eos_ids=())


def test_a_kv_cache_larger_than_free_memory_is_one_line(capsys, monkeypatch, tmp_path,  # noqa: F811
                                                        tiny_ckpt):
    import leantune.generate.cache as cache

    monkeypatch.setattr(cache, "free_bytes", lambda device: 2**10)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello world"}] * 3)
    err = cli_error(capsys, "generate", "--model", tiny_ckpt, "--prompts", prompts, *TEXT, *GEN)
    assert err.startswith("generating 3 prompts together needs a KV cache of ")
    assert "cpu has 1 KiB free; give fewer prompts at a time (--batch-size)" in err


def test_the_usable_context_of_scaled_and_windowed_models():
    def cfg(n, scaling=None, window=None):
        return SimpleNamespace(max_position_embeddings=n, rope_scaling=scaling,
                               sliding_window=window)

    assert model_context(cfg(1024)) == (1024, "its max_position_embeddings")
    assert model_context(cfg(32768, window=4096))[0] == 32768  # a window bounds attention only
    # YaRN on Qwen's recipe: max_position_embeddings left at the original
    assert model_context(cfg(32768, {"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768})) == (
        131072, "original_max_position_embeddings 32,768 x yarn RoPE factor 4")
    # DeepSeek-V3's: already the scaled length
    assert model_context(cfg(163840, {"rope_type": "yarn", "factor": 40,
                                      "original_max_position_embeddings": 4096}))[0] == 163840
    # llama3, LongRoPE and Gemma 3's linear: max_position_embeddings is the scaled length
    for scaling in ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
                    {"rope_type": "longrope", "original_max_position_embeddings": 4096},
                    {"rope_type": "linear", "factor": 8.0}):
        assert model_context(cfg(131072, scaling))[0] == 131072


def _reader(lines):
    """chat's `read`: the lines, then end of input."""
    it = iter(lines)

    def read(_shown):
        for line in it:
            return line
        raise EOFError

    return read


def test_a_chat_past_the_context_says_reset_and_goes_on(monkeypatch, lm):
    import leantune.generate.chat as chat_module

    model, tok = lm
    asked = []
    real = chat_module.generate

    def recording(model, tokenizer, prompts, **kw):
        asked.append([m["content"] for m in prompts[0]])
        return real(model, tokenizer, prompts, **kw)

    monkeypatch.setattr(chat_module, "generate", recording)
    long = " ".join(["hello"] * 100)
    huge = " ".join(["hello"] * 300)
    out = io.StringIO()
    chat_module.chat(model, tok, read=_reader([huge, long, long, "/reset", "hello world"]),
                     out=out, max_new_tokens=10)
    lines = out.getvalue().splitlines()
    tokens = len(prompt_ids(tok, [{"role": "user", "content": huge}]))
    assert lines[1] == (f"(your message makes a prompt of {tokens:,} tokens through the chat "
                        "template, and the model's context holds 256 for the prompt and the "
                        "reply together; it was left out: shorten it)")
    grown = [line for line in lines if line.startswith("(with your message the conversation is ")]
    assert len(grown) == 1 and grown[0].endswith(
        "tokens, and the model's context holds 256 for the conversation and the reply "
        "together; it was left out: /reset starts a new conversation, or send a shorter "
        "message)")
    assert "(a new conversation)" in lines
    # a message left out joins no conversation: the next turn does not hold it (and one that
    # leaves no room is refused before generate runs)
    assert asked == [[long], ["hello world"]]


def test_a_chat_reply_cut_at_the_context_says_so(monkeypatch, lm):
    from leantune.generate.text import Generation

    import leantune.generate.chat as chat_module

    model, tok = lm
    monkeypatch.setattr(chat_module, "generate",
                        lambda *a, **kw: [Generation("hi", [5, 6, 7], "length")])
    out = io.StringIO()
    chat_module.chat(model, tok, read=_reader(["hello"]), out=out, max_new_tokens=10)
    assert ("(the reply reached the end of the model's context and was cut; /reset starts a new "
            "conversation)") in out.getvalue()


def test_a_chat_reply_cut_at_the_context_is_said_once(capsys, monkeypatch, lm):
    """A turn that leaves fewer than --max-new-tokens of the context: the reply stops there and
    one line after it says so with what to do (/reset); no note of generate's besides it."""
    import leantune.generate.chat as chat_module

    model, tok = lm
    replies = []
    real = chat_module.generate

    def recording(*a, **kw):
        replies.extend(real(*a, **kw))
        return replies[-1:]

    monkeypatch.setattr(chat_module, "generate", recording)
    n = next(n for n in range(80, 130)
             if 0 < CONTEXT - len(prompt_ids(tok, [{"role": "user",
                                                     "content": " ".join(["hello"] * n)}])) < 10)
    message = " ".join(["hello"] * n)
    room = CONTEXT - len(prompt_ids(tok, [{"role": "user", "content": message}]))
    notes, out = [], io.StringIO()
    chat_module.chat(model, tok, read=_reader([message]), out=out, max_new_tokens=10,
                     eos_token_ids=[], log=notes.append)
    said = out.getvalue()
    assert notes == [] and capsys.readouterr().err == ""
    assert said.count("was cut") == 1 and said.endswith(
        "(the reply reached the end of the model's context and was cut; /reset starts a new "
        "conversation)\n\n")
    # the reply took what the context left, no more
    assert [(len(r.token_ids), r.stopped) for r in replies] == [(room, "length")]
