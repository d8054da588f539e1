"""The Ollama Modelfile holds strings a checkpoint chose (the system prompt its chat template
writes, its stop tokens, its EOS token inside the Mistral TEMPLATE). None of them can add
directives (ADAPTER, FROM, LICENSE, ...): each is quoted so that Ollama's parser reads back
exactly it, or the export is refused in one line before anything is written.

`ollama_parse` below follows Ollama's Modelfile parser (parser/parser.go: a state machine over
the runes; no escapes; a value ends at the first line break where the text so far, trimmed,
unquotes), written here independently of the code under test.
"""

from __future__ import annotations

import pytest
from helpers import CHATML_SPECIALS, CHATML_TEMPLATE, make_tokenizer, save_tiny_checkpoint

from leantune.errors import LeantuneError
from leantune.export.gguf.modelfile import default_system_prompt, modelfile_text

COMMANDS = {"from", "license", "template", "system", "adapter", "draft", "renderer", "parser",
            "parameter", "message", "requires"}


def _unquote(s: str):
    if s[:3] == '"""':
        return (s[3:-3], True) if len(s) >= 6 and s[-3:] == '"""' else ("", False)
    if s[:1] == '"':
        return (s[1:-1], True) if len(s) >= 2 and s[-1] == '"' else ("", False)
    return s, True


def ollama_parse(text: str) -> list[tuple[str, str]]:
    """[(command, value)] as Ollama reads the Modelfile `text` ("model" for FROM; a PARAMETER's
    own name, e.g. "stop")."""
    NIL, NAME, VALUE, PARAM, COMMENT = range(5)
    space, newline = " \t", "\r\n"
    out, buf, name, curr = [], [], None, NIL
    for r in text:
        if curr == NIL:
            nxt, keep = (COMMENT, None) if r == "#" else \
                (NIL, None) if r in space + newline else (NAME, r)
        elif curr == NAME:
            if r.isascii() and r.isalpha():
                nxt, keep = NAME, r
            elif r in space:
                nxt, keep = VALUE, None
            else:
                raise ValueError(f"invalid command at {''.join(buf)!r}")
        elif curr == VALUE:
            nxt, keep = (NIL, r) if r in space + newline else (VALUE, r)
        elif curr == PARAM:
            if r.isascii() and (r.isalnum() or r == "_"):
                nxt, keep = PARAM, r
            elif r in space:
                nxt, keep = VALUE, None
            else:
                raise ValueError("bad parameter")
        else:  # comment
            nxt, keep = (NIL, None) if r in newline else (COMMENT, None)
        if nxt != curr:
            if curr == NAME:
                word = "".join(buf).lower()
                if word not in COMMANDS:
                    raise ValueError(f"invalid command {word!r}")
                name = "model" if word == "from" else word
                if word == "parameter":
                    nxt = PARAM
            elif curr == PARAM:
                name = "".join(buf)
            elif curr == VALUE:
                value, ok = _unquote("".join(buf).strip())
                if not ok or r in space:
                    buf.append(r)
                    continue
                out.append((name, value))
            buf, curr = [], nxt
        if keep is not None and keep.isprintable():
            buf.append(keep)
    if curr == VALUE:
        value, ok = _unquote("".join(buf).strip())
        if not ok:
            raise ValueError("unexpected end of file")
        out.append((name, value))
    elif curr not in (NIL, COMMENT):
        raise ValueError("unexpected end of file")
    return out


def test_the_parser_model_reads_an_injection_as_directives():
    """(The threat: naive triple quoting of a system prompt holding \"\"\" and a newline.)"""
    evil = 'Be brief."""\nADAPTER /tmp/evil.gguf\nLICENSE """pwned'
    assert ollama_parse(f'FROM ./m.gguf\nSYSTEM """{evil}"""\n') == [
        ("model", "./m.gguf"), ("system", "Be brief."), ("adapter", "/tmp/evil.gguf"),
        ("license", "pwned")]


CHATML_STOPS = ["<|im_end|>", "</s>"]


def commands(text: str) -> dict[str, list[str]]:
    parsed = ollama_parse(text)
    assert [n for n, _ in parsed if n in ("model", "adapter", "license", "draft", "message",
                                          "requires")] == ["model"], parsed
    found: dict[str, list[str]] = {}
    for name, value in parsed:
        found.setdefault(name, []).append(value)
    return found


@pytest.mark.parametrize("system", [
    'Say "hi".',
    "Two lines\nof system prompt.",
    'Ends in a quote: "done"',
    'Quote at a line end: "a"\nthen more',
    '"""leading triple',
    "  padded  ",
    'a """ triple quote mid-line',
])
def test_awkward_system_prompts_are_quoted_to_read_back_whole(system):
    text, _ = modelfile_text("m.gguf", CHATML_TEMPLATE, CHATML_STOPS, system=system)
    assert commands(text)["system"] == [system]


@pytest.mark.parametrize("system", [
    'Be brief."""\nADAPTER /tmp/evil.gguf',
    '"""\nFROM /tmp/other.gguf\nLICENSE pwned\nSYSTEM """',
    'x"""  \nLICENSE pwned',
    'quote "\n"""\nADAPTER x',
])
def test_a_system_prompt_that_cannot_be_quoted_is_refused_in_one_line(system):
    with pytest.raises(LeantuneError) as e:
        modelfile_text("m.gguf", CHATML_TEMPLATE, CHATML_STOPS, system=system)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the default system prompt of the chat template")
    assert "Modelfile" in msg


@pytest.mark.parametrize("stop", ['"', 'say "hi"', "\n\n", " User:", '</s>"\nADAPTER /tmp/x',
                                  "<|end|>\nFROM /tmp/y"])
def test_stop_strings_read_back_whole(stop):
    text, _ = modelfile_text("m.gguf", CHATML_TEMPLATE, ["<|im_end|>", stop])
    assert commands(text)["stop"] == ["<|im_end|>", stop]


def test_a_stop_string_that_cannot_be_quoted_is_refused():
    with pytest.raises(LeantuneError) as e:
        modelfile_text("m.gguf", CHATML_TEMPLATE, ['</s>"""\nADAPTER /tmp/x\n'])
    assert str(e.value).startswith("the stop string '</s>\"\"\"\\nADAPTER") \
        and "\n" not in str(e.value)


MISTRAL = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"


def test_the_mistral_eos_cannot_end_the_template_or_add_actions():
    text, _ = modelfile_text("m.gguf", MISTRAL, ["</s>"], eos="{{ .System }}</s>")
    template = commands(text)["template"][0]
    assert "{{ `{{ .System }}</s>` }}" in template
    with pytest.raises(LeantuneError) as e:
        modelfile_text("m.gguf", MISTRAL, ["</s>"], eos='</s>"""\nADAPTER /tmp/x')
    assert str(e.value).startswith("the Ollama TEMPLATE") and "\n" not in str(e.value)


def test_the_usual_modelfiles_parse_to_their_directives():
    llama3 = ("{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] }}<|eot_id|>{% endfor %}")
    for template, stops, eos in ((CHATML_TEMPLATE, CHATML_STOPS, None),
                                 (llama3, ["<|eot_id|>"], None), (MISTRAL, ["</s>"], "</s>")):
        text, _ = modelfile_text("m.gguf", template, stops, eos=eos, system="Be brief.")
        found = commands(text)
        assert found["model"] == ["./m.gguf"] and found["system"] == ["Be brief."]
        assert len(found["template"]) == 1 and found["stop"][:len(stops)] == stops


def test_default_system_prompt_renders_with_limits():
    """The template is rendered by utils/templates (time and size limits): a template that
    builds a 100 MB string (past the size limit) gives no default system prompt, and the
    string is never built (apply_chat_template would build and return it)."""
    bomb = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\n{{ 'x' * 10**8 }}"
            "<|im_end|>\n{% endif %}" + CHATML_TEMPLATE)
    tok = make_tokenizer(bomb, extra_specials=CHATML_SPECIALS)
    assert default_system_prompt(tok, "chatml") is None


def test_gguf_export_refuses_an_injecting_system_prompt_before_writing(tmp_path):
    """End to end: a checkpoint whose chat template writes an injecting default system prompt;
    the export fails in one line and writes nothing."""
    pytest.importorskip("gguf")
    from leantune.export.gguf import export_gguf

    evil = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.\"\"\"\n"
            "ADAPTER ./evil.gguf\n<|im_end|>\n{% endif %}" + CHATML_TEMPLATE)
    base = save_tiny_checkpoint(tmp_path / "base",
                                make_tokenizer(evil, extra_specials=CHATML_SPECIALS))
    out = tmp_path / "gguf"
    with pytest.raises(LeantuneError) as e:
        export_gguf(base, None, out, quant="f32")
    assert "\n" not in str(e.value) and "system prompt" in str(e.value)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["base"]


def test_gguf_export_quotes_a_tricky_system_prompt(tmp_path):
    pytest.importorskip("gguf")
    from leantune.export.gguf import export_gguf

    system = 'Answer "yes" or "no".\nNever say """ alone.'
    tmpl = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\n" + system +
            "<|im_end|>\n{% endif %}" + CHATML_TEMPLATE)
    base = save_tiny_checkpoint(tmp_path / "base",
                                make_tokenizer(tmpl, extra_specials=CHATML_SPECIALS))
    res = export_gguf(base, None, tmp_path / "gguf", quant="f32")
    found = commands(res.modelfile.read_text())
    assert found["system"] == [system] and "<|im_end|>" in found["stop"]
