"""`leantune generate`, `leantune chat` and `leantune train --sample-prompts` on the tiny
checkpoint: what they print and write, and their one-line errors."""

from __future__ import annotations

import builtins
import io
import json
import re

import pytest
from helpers import (  # noqa: F401  (autouse; fixtures)
    FAST,
    alpaca_file,
    cli_error,
    one_torch_thread,
    run_cli,
    save_checkpoint,
    save_random_adapter,
    tiny_ckpt,
    write_jsonl,
)

import leantune

GEN = ["--device", "cpu", "--max-new-tokens", "10"]


@pytest.fixture(scope="module")
def adapter(tiny_ckpt, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("adapter") / "a"
    save_random_adapter(tiny_ckpt, folder, seed=1)
    return folder


@pytest.fixture(scope="module")
def reference(tiny_ckpt, adapter):  # noqa: F811
    """Completions through the Python API, base + adapter: prompt -> Generation."""
    from transformers import AutoTokenizer

    model = leantune.load_model(tiny_ckpt, device="cpu")
    leantune.load_adapter(model, adapter)
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    return lambda prompt, **kw: leantune.generate(model, tok, prompt, max_new_tokens=10,
                                                  **kw)[0]


def _chat(content):
    return [{"role": "user", "content": content}]


def test_generate_one_prompt_prints_its_completion(capsys, tiny_ckpt, adapter, reference):  # noqa: F811
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_ckpt, "--adapter", adapter,
                           "--prompt", "hello world", *GEN)
    assert rc == 0, err
    assert out == reference(_chat("hello world")).text + "\n"  # a user turn of the template
    rc, out, _ = run_cli(capsys, "generate", "--model", tiny_ckpt, "--adapter", adapter,
                         "--prompt", "hello world", "--no-chat-template", *GEN)
    assert rc == 0 and out == reference("hello world").text + "\n"


def test_generate_a_prompts_file_writes_jsonl(capsys, tmp_path, tiny_ckpt, adapter, reference):  # noqa: F811
    rows = [{"prompt": "hello world", "id": 7}, {"messages": _chat("What is the capital?")},
            {"instruction": "Translate to French", "input": "hello world"}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    out_file = tmp_path / "out" / "done.jsonl"
    # the base named by the adapter (adapter_config.json), as --model is left out
    rc, out, err = run_cli(capsys, "generate", "--adapter", adapter, "--prompts", prompts,
                           "--output", out_file, "--stop", "zzz", *GEN)
    assert rc == 0, err
    assert f"model: {tiny_ckpt} (the base named by the adapter)" in err
    assert f"3 completions written to {out_file}" in err and out == ""
    got = [json.loads(line) for line in out_file.read_text().splitlines()]
    from leantune.data.formats import render_alpaca_prompt

    # (a {"prompt": text} row is asked as --prompt is: a user turn of the template here)
    expected = [reference(_chat("hello world")), reference(_chat("What is the capital?")),
                reference(render_alpaca_prompt("Translate to French", "hello world"))]
    for row, written, ref in zip(rows, got, expected):
        assert written == {**row, "completion": ref.text, "tokens": len(ref.token_ids),
                           "stopped": ref.stopped}
    assert all(w["stopped"] in ("eos", "length") for w in got)
    # to stdout without --output; an existing --output is kept unless --overwrite
    rc, out, _ = run_cli(capsys, "generate", "--adapter", adapter, "--prompts", prompts, *GEN)
    assert rc == 0 and [json.loads(line) for line in out.splitlines()] == got
    assert cli_error(capsys, "generate", "--adapter", adapter, "--prompts", prompts, "--output",
                     out_file, *GEN) == (f"{out_file}: output file exists; choose another "
                                         "--output or pass --overwrite")
    rc, _, _ = run_cli(capsys, "generate", "--adapter", adapter, "--prompts", prompts,
                       "--output", out_file, "--overwrite", "--max-new-tokens", "3",
                       "--device", "cpu")
    assert rc == 0 and all(r["tokens"] <= 3 for r in map(json.loads, out_file.open()))


def test_generate_errors(capsys, tmp_path, tiny_ckpt, adapter):  # noqa: F811
    def error(*args):
        return cli_error(capsys, "generate", *args)

    missing = tmp_path / "nope.jsonl"
    assert error("--model", tiny_ckpt, "--prompts", missing) == \
        f"{missing}: data file not found; check the path"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"text": "no prompt"}])
    assert error("--model", tiny_ckpt, "--prompts", bad) == (
        f"{bad}:2: a prompt row needs 'prompt' (a text), 'messages' (a list of {{'role', "
        "'content'}: the chat template) or 'instruction' (and 'input': the alpaca prompt); "
        "this one has 'text'")
    assert error("--model", tiny_ckpt, "--prompt", "hi", "--top-p", "0") == \
        "--top-p must be in (0, 1] (1: off), got 0.0"
    assert error("--model", tiny_ckpt, "--prompt", "hi", "--temperature", "-1") == \
        "--temperature must be 0 (greedy) or more, got -1.0"
    assert error("--model", tiny_ckpt, "--prompt", "hi", "--max-new-tokens", "0") == \
        "--max-new-tokens must be a positive integer, got 0"
    assert error("--prompt", "hi") == ("--model is required (or --adapter, whose "
                                      "adapter_config.json names its base model)")
    assert error("--adapter", tmp_path, "--prompt", "hi").startswith(
        f"{tmp_path}: not an adapter folder (no adapter_config.json), so its base model is "
        "unknown; give --model")
    # an adapter of another base model: its shapes do not fit
    other = tmp_path / "llama"
    save_checkpoint("llama", other)
    capsys.readouterr()
    assert re.search(r"do not fit the base weight \(\d+, \d+\); is it the adapter of another "
                     r"model\?$", error("--model", other, "--adapter", adapter, "--prompt", "hi",
                                        *GEN))


def test_generate_precision_fp8(capsys, monkeypatch, tiny_ckpt, adapter):  # noqa: F811
    """--precision fp8: refused in one line where FP8 cannot run; emulated, the base loads in
    e4m3 and generates what the Python API's FP8 model does."""
    from transformers import AutoTokenizer

    from leantune.generate.load import locate

    monkeypatch.delenv("LEANTUNE_FP8_EMULATE", raising=False)
    assert cli_error(capsys, "generate", "--model", tiny_ckpt, "--prompt", "hi",
                     "--precision", "fp8", *GEN).startswith(
        "--precision fp8: cpu: no FP8 matrix units; FP8 runs on CUDA GPUs")
    monkeypatch.setenv("LEANTUNE_FP8_EMULATE", "1")
    kinds = {getattr(getattr(m, "base", None), "kind", None) for m in
             locate(str(tiny_ckpt), str(adapter), "cpu", precision="fp8",
                    log=lambda *a: None).load().modules()}
    assert "fp8" in kinds
    model = leantune.load_model(tiny_ckpt, device="cpu", precision="fp8")
    leantune.load_adapter(model, adapter)
    want = leantune.generate(model, AutoTokenizer.from_pretrained(tiny_ckpt), "hello world",
                             max_new_tokens=10)[0].text
    rc, out, err = run_cli(capsys, "generate", "--model", tiny_ckpt, "--adapter", adapter,
                           "--prompt", "hello world", "--no-chat-template", "--precision", "fp8",
                           *GEN)
    assert rc == 0 and out == want + "\n", err


def test_messages_need_a_chat_template(capsys, tmp_path, tiny_ckpt):  # noqa: F811
    import shutil

    folder = tmp_path / "no-template"
    shutil.copytree(tiny_ckpt, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for f in folder.glob("chat_template*"):
        f.unlink()
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"messages": _chat("hi")}])
    assert cli_error(capsys, "generate", "--model", folder, "--prompts", prompts, *GEN) == (
        f"{prompts}:2: the tokenizer has no chat template, which a messages prompt needs; "
        "give the prompt as text instead")
    assert cli_error(capsys, "chat", "--model", folder, *GEN).startswith(
        "the tokenizer has no chat template, which `leantune chat` needs")
    rc, out, _ = run_cli(capsys, "generate", "--model", folder, "--prompt", "hello", *GEN)
    assert rc == 0 and out.strip()  # a --prompt without a template: the text as it is


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _script(monkeypatch, lines):
    """builtins.input answers `lines`, then end of input, as typed at a terminal (which echoes
    the prompt and the typed newline: chat writes neither); returns the prompts it was shown."""
    shown, it = [], iter(lines)
    monkeypatch.setattr("sys.stdin", _Terminal())

    def fake_input(prompt=""):
        shown.append(prompt)
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)
    return shown


def test_chat_is_multi_turn_and_resets(capsys, monkeypatch, tiny_ckpt, adapter, reference):  # noqa: F811
    """Each reply is `generate` over the conversation so far (the replies included); /reset
    starts over, keeping --system."""
    import leantune.generate.chat as chat_module

    asked = []

    def recording(model, tokenizer, prompts, **kw):
        asked.append([dict(m) for m in prompts[0]])
        return real(model, tokenizer, prompts, **kw)

    real = chat_module.generate
    monkeypatch.setattr(chat_module, "generate", recording)
    shown = _script(monkeypatch, ["hello world", "", "the quick brown fox", "/reset",
                                  "the quick brown fox"])
    rc, out, err = run_cli(capsys, "chat", "--model", tiny_ckpt, "--adapter", adapter,
                           "--system", "Be brief.", *GEN)
    assert rc == 0, err
    system = {"role": "system", "content": "Be brief."}
    first = reference([system, *_chat("hello world")]).text
    second = [system, *_chat("hello world"), {"role": "assistant", "content": first},
              *_chat("the quick brown fox")]
    third = [system, *_chat("the quick brown fox")]
    assert asked == [[system, *_chat("hello world")], second, third]
    cut = "(the reply reached --max-new-tokens and was cut)\n"

    def shows(reply):
        return reply.text + "\n" + (cut if reply.stopped == "length" else "")

    assert out == ("chat: /reset starts over, /exit (or Ctrl-D) ends\n"
                   + shows(reference([system, *_chat("hello world")])) + shows(reference(second))
                   + "(a new conversation)\n" + shows(reference(third))
                   + "\n")  # (end of input: a newline)
    assert shown == ["> "] * 6


def test_chat_exit_and_ctrl_c(capsys, monkeypatch, tiny_ckpt):  # noqa: F811
    _script(monkeypatch, ["/exit", "never read"])
    rc, out, _ = run_cli(capsys, "chat", "--model", tiny_ckpt, *GEN)
    assert rc == 0 and out == "chat: /reset starts over, /exit (or Ctrl-D) ends\n"
    _script(monkeypatch, ["/reset", "/exit"])
    monkeypatch.setattr("sys.stdin", io.StringIO())  # a pipe: chat ends each "> " line itself
    rc, out, _ = run_cli(capsys, "chat", "--model", tiny_ckpt, *GEN)
    assert rc == 0 and out == ("chat: /reset starts over, /exit (or Ctrl-D) ends\n"
                               "\n(a new conversation)\n\n")

    def interrupt(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr(builtins, "input", interrupt)
    rc, out, err = run_cli(capsys, "chat", "--model", tiny_ckpt, *GEN)
    assert rc == 130 and out.endswith("ends\n\n")
    assert err.strip().splitlines() == ["leantune: interrupted (Ctrl-C); nothing was written"]


def test_train_sample_prompts(capsys, tmp_path, tiny_ckpt, alpaca_file):  # noqa: F811
    rows = [{"prompt": f"hello {w}"} for w in ("world", "fox", "dog", "you", "today")]
    prompts = write_jsonl(tmp_path / "samples.jsonl", rows)
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file,
                              "--output", out, "--max-steps", 3, "--eval-every", 2, "--lr", 0.05,
                              "--sample-prompts", prompts, "--sample-max-new-tokens", 5, *FAST)
    assert rc == 0, err
    got = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    # before training, at the evaluation of step 2, at the end; the first 4 prompts
    assert [r["step"] for r in got] == [0] * 4 + [2] * 4 + [3] * 4
    assert [r["prompt"] for r in got[:4]] == [r["prompt"] for r in rows[:4]]
    assert all(isinstance(r["completion"], str) for r in got)
    assert got[0]["completion"] != got[-4]["completion"]  # the model changed
    assert f"step 3: sample: {' '.join(got[-4]['completion'].split())[:100]!r}" in stdout
    # --overwrite sets the previous run's samples aside with the rest of it
    rc, _, err = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                         out, "--max-steps", 1, "--overwrite", "--sample-prompts", prompts,
                         "--sample-max-new-tokens", 5, *FAST)
    assert rc == 0, err
    again = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [0] * 4 + [1] * 4


def test_train_bad_sample_prompts_fail_before_the_run(capsys, tmp_path, tiny_ckpt, alpaca_file):  # noqa: F811
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "hi"}])
    out = tmp_path / "run"
    message = cli_error(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                        out, "--sample-prompts", bad, *FAST)
    assert message.startswith(f"{bad}:1: a prompt row needs 'prompt' (a text)")
    assert not out.exists()
    assert cli_error(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                     out, "--sample-prompts", bad, "--sample-max-new-tokens", 0, *FAST) == \
        "--sample-max-new-tokens must be a positive integer, got 0"
