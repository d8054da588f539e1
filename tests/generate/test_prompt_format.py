"""generate and chat ask in the prompt format the run was trained with (run_config.json),
--prompt-format overrides it, and chat templates are rendered in the sandbox with its limits."""

from __future__ import annotations

import builtins
import json
import shutil

import pytest
from helpers import (  # noqa: F401  (autouse; fixtures)
    FAST,
    alpaca_file,
    cli_error,
    one_torch_thread,
    run_cli,
    save_random_adapter,
    tiny_ckpt,
)

from leantune.data.formats import render_alpaca_prompt

GEN = ["--device", "cpu", "--max-new-tokens", "4"]


@pytest.fixture(scope="module")
def trained(tiny_ckpt, alpaca_file, tmp_path_factory):  # noqa: F811
    """A real (1-step) run on alpaca rows: its folder."""
    import io
    from contextlib import redirect_stdout

    from leantune.cli import main

    out = tmp_path_factory.mktemp("run") / "run"
    with redirect_stdout(io.StringIO()):
        assert main(["train", "--model", str(tiny_ckpt), "--data", str(alpaca_file),
                     "--output", str(out), "--max-steps", "1", *FAST]) == 0
    return out


def _as_trained(run, tmp_path, fmt):
    """A copy of run folder `run` whose run_config.json says the data was `fmt`."""
    folder = tmp_path / f"as-{fmt}"
    shutil.copytree(run, folder)
    settings = json.loads((folder / "run_config.json").read_text())
    settings["data_format"] = fmt
    (folder / "run_config.json").write_text(json.dumps(settings))
    return folder


def _recording(monkeypatch, module):
    asked = []
    real = module.generate

    def recording(model, tokenizer, prompts, **kw):
        p = prompts[0]
        asked.append([dict(m) for m in p] if isinstance(p, list) else p)  # (chat appends to it)
        return real(model, tokenizer, prompts, **kw)

    monkeypatch.setattr(module, "generate", recording)
    return asked


def _script(monkeypatch, lines):
    it = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)


def test_a_run_records_its_data_format(trained):
    assert json.loads((trained / "run_config.json").read_text())["data_format"] == "alpaca"


def test_generate_asks_in_the_runs_format(capsys, monkeypatch, trained, tmp_path):
    from transformers import AutoTokenizer

    import leantune.generate.prompts as prompts_module

    tok = AutoTokenizer.from_pretrained(trained)
    encoded = []
    real = prompts_module.prompt_ids

    def recording(tokenizer, prompt, where="prompt"):
        encoded.append(prompt)
        return real(tokenizer, prompt, where)

    monkeypatch.setattr(prompts_module, "prompt_ids", recording)
    rc, _, err = run_cli(capsys, "generate", "--adapter", trained, "--prompt", "w5 w6", *GEN)
    assert rc == 0, err
    assert "prompt format: the alpaca prompt (alpaca), as the run was trained" in err
    assert encoded == [render_alpaca_prompt("w5 w6")]
    # --prompt-format overrides the run's; a messages run asks through the chat template
    runs = {fmt: _as_trained(trained, tmp_path, fmt) for fmt in ("messages", "text")}
    runs["alpaca"] = trained
    for flags, fmt, want in ((["--prompt-format", "text"], "alpaca", "w5 w6"),
                             ([], "messages", [{"role": "user", "content": "w5 w6"}]),
                             ([], "text", "w5 w6"),
                             (["--no-chat-template"], "messages", "w5 w6")):
        encoded.clear()
        rc, _, err = run_cli(capsys, "generate", "--adapter", runs[fmt], "--prompt", "w5 w6",
                             *flags, *GEN)
        assert rc == 0, err
        assert encoded == [want], (flags, fmt)
    assert tok.chat_template  # (the chat template was there to take, and was not taken)


def test_a_prompts_files_text_rows_ask_as_prompt_does(capsys, monkeypatch, trained, tmp_path):
    """{"prompt": text} rows of --prompts (and of train's --sample-prompts) are typed prompts:
    the run's format (alpaca here), --prompt-format overriding it; a messages row and an alpaca
    row say their own."""
    from transformers import AutoTokenizer

    import leantune.generate.prompts as prompts_module
    from leantune.generate.prompts import prompt_ids
    from leantune.train.samples import SampleWriter

    encoded = []
    real = prompts_module.prompt_ids
    monkeypatch.setattr(prompts_module, "prompt_ids", lambda tokenizer, prompt, where="prompt":
                        encoded.append(prompt) or real(tokenizer, prompt, where))
    chat = [{"role": "user", "content": "w7"}]
    rows = [{"prompt": "w5 w6"}, {"messages": chat}, {"instruction": "w8"}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, out, err = run_cli(capsys, "generate", "--adapter", trained, "--prompts", prompts, *GEN)
    assert rc == 0, err
    assert "prompt format: the alpaca prompt (alpaca), as the run was trained" in err
    assert encoded == [render_alpaca_prompt("w5 w6"), chat, render_alpaca_prompt("w8")]
    assert [json.loads(line)["prompt"] for line in out.splitlines()[:1]] == ["w5 w6"]
    encoded.clear()
    rc, _, err = run_cli(capsys, "generate", "--adapter", trained, "--prompts", prompts,
                         "--prompt-format", "text", *GEN)
    assert rc == 0 and encoded == ["w5 w6", chat, render_alpaca_prompt("w8")], err
    # train --sample-prompts: the format of the data being trained on
    tok = AutoTokenizer.from_pretrained(trained)
    writer = SampleWriter(str(prompts), tok, tmp_path, 4, trained_as="alpaca")
    assert writer.ids[0] == real(tok, render_alpaca_prompt("w5 w6"))
    assert writer.prompts[0] == "w5 w6"  # (samples.jsonl shows the row's text)
    assert SampleWriter(str(prompts), tok, tmp_path, 4, trained_as="text").ids[0] == \
        prompt_ids(tok, "w5 w6")


def test_prompt_format_errors(capsys, trained, tmp_path):
    messages = tmp_path / "m.jsonl"
    messages.write_text(json.dumps({"messages": [{"role": "user", "content": "w5"}]}) + "\n")
    for flag, name in ((["--prompt-format", "alpaca"], "--prompt-format"),
                       (["--no-chat-template"], "--chat-template / --no-chat-template")):
        assert cli_error(capsys, "generate", "--adapter", trained, "--prompts", messages, *flag,
                         *GEN) == (
            f"{name} applies to --prompt and to {{\"prompt\": text}} rows; {messages} has none "
            "('messages' rows use the chat template, alpaca rows its prompt): leave it out")
    # auto is the default: said or not, nothing to refuse
    rc, _, err = run_cli(capsys, "generate", "--adapter", trained, "--prompts", messages,
                         "--prompt-format", "auto", *GEN)
    assert rc == 0, err
    assert "not both" in cli_error(capsys, "generate", "--adapter", trained, "--prompt", "w5",
                                   "--prompt-format", "alpaca", "--chat-template", *GEN)
    # a system message needs turns: refused (after the notes) before the weights load
    rc, _, err = run_cli(capsys, "chat", "--adapter", trained, "--system", "Be brief.", *GEN)
    assert rc == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("leantune: error: a system message needs the chat "
                                           "template, and the prompt format is alpaca")


def test_chat_asks_each_line_on_its_own_in_alpaca(capsys, monkeypatch, trained, tmp_path):
    import leantune.generate.chat as chat_module

    asked = _recording(monkeypatch, chat_module)
    _script(monkeypatch, ["w5 w6", "w7"])
    rc, out, err = run_cli(capsys, "chat", "--adapter", trained, *GEN)
    assert rc == 0, err
    assert asked == [render_alpaca_prompt("w5 w6"), render_alpaca_prompt("w7")]  # no history
    assert "(each line is asked on its own, in the alpaca prompt" in out
    # --prompt-format chat: the chat template, multi-turn
    asked.clear()
    _script(monkeypatch, ["w5 w6", "w7"])
    rc, out, err = run_cli(capsys, "chat", "--adapter", trained, "--prompt-format", "chat", *GEN)
    assert rc == 0, err
    assert [len(a) for a in asked] == [1, 3] and asked[1][2] == {"role": "user", "content": "w7"}


def test_chat_templates_render_in_the_sandbox(capsys, trained, tmp_path):
    """A template that would build a terabyte string ends in one line, not in memory."""
    folder = tmp_path / "bomb"
    shutil.copytree(trained, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'x' * 10**12 }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for f in folder.glob("chat_template*"):
        f.write_text("{{ 'x' * 10**12 }}")
    base = tmp_path / "base"
    shutil.copytree(json.loads((trained / "run_config.json").read_text())["config"]["model"],
                    base)
    for f in base.glob("tokenizer*"):
        f.unlink()
    for f in base.glob("chat_template*"):
        f.unlink()
    (base / "special_tokens_map.json").unlink(missing_ok=True)
    msg = cli_error(capsys, "generate", "--model", base, "--adapter", folder, "--prompt", "w5",
                    "--prompt-format", "chat", *GEN)
    assert "builds too large a text" in msg


def test_a_base_with_only_tokenizer_config_takes_the_runs_tokenizer(trained, tiny_ckpt, tmp_path):  # noqa: F811
    """A base folder whose tokenizer_config.json has no vocabulary file beside it: generate takes
    the copy the run folder keeps, as for a base without tokenizer files."""
    from leantune.generate.load import locate

    base = tmp_path / "base"
    shutil.copytree(tiny_ckpt, base)
    (base / "tokenizer.json").unlink()
    assert (base / "tokenizer_config.json").is_file()
    src = locate(str(base), str(trained), "cpu", None, log=lambda _: None)
    assert src.tokenizer("w5 w6").input_ids and len(src.tokenizer) > 100

