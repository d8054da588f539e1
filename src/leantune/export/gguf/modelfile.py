"""An Ollama Modelfile for an exported GGUF: FROM the file, a TEMPLATE in Ollama's Go-template
syntax for the chat template's style, the default system prompt the template inserts (if any),
and a `PARAMETER stop` line for every end-of-generation string.

Styles recognised from the tokenizer's chat template: ChatML (`<|im_start|>`: Qwen2/3, SmolLM),
Llama 3 (`<|start_header_id|>`) and Mistral (`[INST]`). Another template gets no TEMPLATE line
(Ollama then uses the one it recognises from the GGUF's tokenizer.chat_template, if any) and a
warning.
"""

from __future__ import annotations

import re

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


def template_style(chat_template: str | None) -> str | None:
    """"chatml" | "llama3" | "mistral" for a Jinja chat template, or None."""
    if not chat_template:
        return None
    if "<|im_start|>" in chat_template:
        return "chatml"
    if "<|start_header_id|>" in chat_template:
        return "llama3"
    if "[INST]" in chat_template:
        return "mistral"
    return None


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def default_system_prompt(tokenizer, style: str | None) -> str | None:
    """The system prompt a ChatML template writes when the conversation has none (SmolLM2 and
    Qwen2.5 do), read off the template rendered for one user message."""
    if style != "chatml" or tokenizer is None:
        return None
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    except Exception:  # a template that needs other inputs: no default to report
        return None
    m = re.match(r"\s*<\|im_start\|>system\n(.*?)<\|im_end\|>", text, re.S)
    return m.group(1) if m else None


def modelfile_text(gguf_file: str, chat_template: str | None, stop_strings: list[str],
                   eos: str | None = None, system: str | None = None) -> tuple[str, list[str]]:
    """(Modelfile text, warnings) for `gguf_file` (a name in the same folder)."""
    style = template_style(chat_template)
    lines = [f"FROM ./{gguf_file}"]
    warnings = []
    template = {"chatml": CHATML, "llama3": LLAMA3,
                "mistral": MISTRAL.replace("{EOS}", eos or "</s>")}.get(style or "")
    if template is not None:
        lines.append(f'TEMPLATE """{template}"""')
    elif chat_template:
        warnings.append("the chat template is not a ChatML, Llama 3 or Mistral one: the "
                        "Modelfile has no TEMPLATE, so Ollama uses the GGUF's chat template "
                        "only if it recognises it")
    if system:
        lines.append(f'SYSTEM """{system}"""')
    stops = list(dict.fromkeys(stop_strings + (["[INST]"] if style == "mistral" else [])))
    lines += [f"PARAMETER stop {_quote(s)}" for s in stops]
    return "\n".join(lines) + "\n", warnings


def ollama_name(folder_name: str) -> str:
    """A model name Ollama accepts, from the output folder's name."""
    name = re.sub(r"[^a-z0-9._-]+", "-", folder_name.lower()).strip("-._")
    return name or "leantune-model"
