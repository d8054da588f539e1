"""An Ollama Modelfile for an exported GGUF: FROM the file, a TEMPLATE in Ollama's Go-template
syntax for the chat template's style, the default system prompt the template inserts (if any),
and a `PARAMETER stop` line for every end-of-generation string.

Styles recognised from the tokenizer's chat template: ChatML (`<|im_start|>`: Qwen2/3, SmolLM),
Phi-4's ChatML with `<|im_sep|>`, Llama 3 (`<|start_header_id|>`), Mistral (`[INST]`), Gemma's
turns (`<start_of_turn>user` ... `<end_of_turn>`, the reply as `model`, a system prompt at the
head of the first user turn) and Phi-3's (`<|user|>` ... `<|end|>`). Another template gets no TEMPLATE line
(Ollama then uses the one it recognises from the GGUF's tokenizer.chat_template, if any) and a
warning.

Quoting. Every value is written so that Ollama's Modelfile parser reads back exactly that
string and nothing more: the parser has no escapes; a value opened by three double quotes (or
one) ends at the first line break where the text so far, stripped, ends with the same quote. A checkpoint's
string (the system prompt its template writes, a stop token, the EOS token inside the Mistral
TEMPLATE) holding such a closing quote before a line break would end the value early and let the
rest of the line be read as new directives (`ADAPTER`, `FROM`, `LICENSE`, ...). `modelfile_value`
checks each quoted form against a model of that parser and takes one that reads back whole; when
none does, the export is refused in one line naming the string. A string spliced into the Go
TEMPLATE is written as a Go template string constant where it holds `{{` or `}}`, so it cannot
add template actions either.
"""

from __future__ import annotations

import re

from ...errors import LeantuneError

CHATML = """{{- range .Messages }}<|im_start|>{{ .Role }}
{{ .Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""

LLAMA3 = """{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}<|start_header_id|>assistant<|end_header_id|>

"""

# The system prompt goes before the first user turn; assistant turns end with EOS.
MISTRAL = """{{- range $i, $m := .Messages }}
{{- if eq $m.Role "user" }}[INST] {{ if and $.System (le $i 1) }}{{ $.System }}

{{ end }}{{ $m.Content }}[/INST]
{{- else if eq $m.Role "assistant" }} {{ $m.Content }}{EOS}
{{- end }}
{{- end }}"""


# Gemma 2 / 3: user and model turns; the system prompt opens the first user turn
GEMMA = """{{- range $i, $m := .Messages }}
{{- if eq $m.Role "user" }}<start_of_turn>user
{{ if and $.System (le $i 1) }}{{ $.System }}

{{ end }}{{ $m.Content }}<end_of_turn>
{{ else if eq $m.Role "assistant" }}<start_of_turn>model
{{ $m.Content }}<end_of_turn>
{{ end }}
{{- end }}<start_of_turn>model
"""

PHI3 = """{{- if .System }}<|system|>
{{ .System }}<|end|>
{{ end }}
{{- range .Messages }}
{{- if ne .Role "system" }}<|{{ .Role }}|>
{{ .Content }}<|end|>
{{ end }}
{{- end }}<|assistant|>
"""

PHI4 = """{{- range .Messages }}<|im_start|>{{ .Role }}<|im_sep|>{{ .Content }}<|im_end|>
{{- end }}<|im_start|>assistant<|im_sep|>"""


def template_style(chat_template: str | None) -> str | None:
    """"chatml" | "phi4" | "llama3" | "mistral" | "gemma" | "phi3" for a Jinja chat template,
    or None."""
    if not chat_template:
        return None
    if "<|im_sep|>" in chat_template:
        return "phi4"
    if "<start_of_turn>" in chat_template:
        return "gemma"
    if "<|assistant|>" in chat_template and "<|end|>" in chat_template:
        return "phi3"
    if "<|im_start|>" in chat_template:
        return "chatml"
    if "<|start_header_id|>" in chat_template:
        return "llama3"
    if "[INST]" in chat_template:
        return "mistral"
    return None


TRIPLE, SINGLE = '"""', '"'  # Ollama's two quotes


def _read_value(text: str) -> tuple[str, int] | None:
    """What Ollama's Modelfile parser reads as one directive's value from `text` (what follows
    the directive's name and a space): (value, characters consumed), or None when the value
    never closes. It keeps printable characters, spaces, tabs and line breaks, and ends the
    value at the first line break where the text so far, stripped, is closed (in triple or
    single double quotes, or unquoted)."""
    buf = []
    for i, ch in enumerate(text):
        if ch in "\r\n":
            closed = _unquote("".join(buf).strip())
            if closed is not None:
                return closed, i
            buf.append(ch)
        elif ch in " \t" or ch.isprintable():
            buf.append(ch)
    return None


def _unquote(s: str) -> str | None:
    if s.startswith('"""'):
        return s[3:-3] if len(s) >= 6 and s.endswith('"""') else None
    if s.startswith('"'):
        return s[1:-1] if len(s) >= 2 and s.endswith('"') else None
    return s


def modelfile_value(value: str, what: str, prefer: str = TRIPLE) -> str:
    """`value` quoted for a Modelfile directive so that Ollama reads back exactly it, with
    `prefer` (TRIPLE or SINGLE) tried first. Raises LeantuneError (one line naming `what`) when
    no quoting reads back whole: the value would end early and its rest become directives."""
    printable = "".join(c for c in value if c in " \t\r\n" or c.isprintable())
    for quote in dict.fromkeys((prefer, TRIPLE, SINGLE)):
        text = quote + value + quote
        if _read_value(text + "\n") == (printable, len(text)):
            return text
    cut = next((m.start() for m in re.finditer(r'"[ \t]*[\r\n]', value)), 0)
    near = value[max(0, cut - 20):cut + 20]
    raise LeantuneError(f"{what} holds a quote before a line break ({near!r}), "
                        "which an Ollama Modelfile cannot quote (the value would end there and "
                        "the rest be read as Modelfile directives); fix that string in the "
                        "checkpoint's tokenizer files")


def _go_literal(s: str, what: str) -> str:
    """`s` for the inside of a Go TEMPLATE: as it is, or, where it holds `{{` or `}}` (which
    would open or close template actions), as a raw-string constant action."""
    if "{{" not in s and "}}" not in s:
        return s
    if "`" in s:
        raise LeantuneError(f"{what} {s!r} holds both template braces and a backquote, which "
                            "the Ollama TEMPLATE cannot hold as text; fix it in the checkpoint's "
                            "tokenizer files")
    return "{{ `" + s + "` }}"


def default_system_prompt(tokenizer, style: str | None) -> str | None:
    """The system prompt a ChatML template writes when the conversation has none (SmolLM2 and
    Qwen2.5 do), read off the template rendered for one user message (with the time and size
    limits of utils/templates.render_chat_template: the template is the checkpoint's code)."""
    from ...utils.templates import render_chat_template

    if style != "chatml" or tokenizer is None:
        return None
    try:
        text = render_chat_template(tokenizer, [{"role": "user", "content": "hi"}],
                                    "the Modelfile's default system prompt")
    except LeantuneError:  # a template that needs other inputs (or runs away): no default
        return None
    m = re.match(r"\s*<\|im_start\|>system\n(.*?)<\|im_end\|>", text, re.S)
    return m.group(1) if m else None


def modelfile_text(gguf_file: str, chat_template: str | None, stop_strings: list[str],
                   eos: str | None = None, system: str | None = None) -> tuple[str, list[str]]:
    """(Modelfile text, warnings) for `gguf_file` (a name in the same folder)."""
    style = template_style(chat_template)
    if not re.fullmatch(r"[\w.-]+", gguf_file):  # (leantune's own name: model-<quant>.gguf)
        raise LeantuneError(f"{gguf_file!r}: not a plain file name for the Modelfile's FROM")
    lines = [f"FROM ./{gguf_file}"]
    warnings = []
    mistral = MISTRAL.replace("{EOS}", _go_literal(eos or "</s>", "the EOS token"))
    template = {"chatml": CHATML, "llama3": LLAMA3, "mistral": mistral, "gemma": GEMMA,
                "phi3": PHI3, "phi4": PHI4}.get(style or "")
    if template is not None:
        lines.append("TEMPLATE " + modelfile_value(
            template, f"the Ollama TEMPLATE (with the EOS token {eos!r})"))
    elif chat_template:
        warnings.append("the chat template is not a ChatML, Llama 3, Mistral, Gemma or Phi "
                        "one: the "
                        "Modelfile has no TEMPLATE, so Ollama uses the GGUF's chat template "
                        "only if it recognises it")
    if system:
        lines.append("SYSTEM " + modelfile_value(
            system, "the default system prompt of the chat template"))
    turn_starts = {"mistral": ["[INST]"], "gemma": ["<start_of_turn>"], "phi3": ["<|user|>"]}
    stops = list(dict.fromkeys(stop_strings + turn_starts.get(style or "", [])))
    lines += ["PARAMETER stop " + modelfile_value(s, f"the stop string {s!r}", prefer=SINGLE)
              for s in stops if s]
    return "\n".join(lines) + "\n", warnings


def ollama_name(folder_name: str) -> str:
    """A model name Ollama accepts, from the output folder's name."""
    name = re.sub(r"[^a-z0-9._-]+", "-", folder_name.lower()).strip("-._")
    return name or "leantune-model"
