"""Bounded chat-template rendering (utils/templates.py): the same text as transformers'
apply_chat_template for ordinary templates, one LeantuneError line for resource bombs."""

from __future__ import annotations

import threading
import time

import pytest

from leantune.errors import LeantuneError
from leantune.utils.templates import render_chat_template
from tests.helpers import (CACHE, CHATML_SPECIALS, CHATML_TEMPLATE, END_TEMPLATE, EOS_TEMPLATE,
                           MISTRAL_TEMPLATE, make_spm_tokenizer, make_tokenizer)

# A Llama-3.1-like template: namespace, tojson with indent, strftime_now, raise_exception,
# loop controls, slicing, string concatenation and the {% generation %} tag.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}"
    "{% if messages[0]['role'] == 'system' %}{% set ns.sys = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% endif %}"
    "<|system|>\nToday: {{ strftime_now('%Y') | length }} {{ ns.sys }}"
    "{% if tools %}{% for t in tools %}{{ t | tojson(indent=4) }}\n{% endfor %}{% endif %}"
    "<|end|>\n{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% generation %}{{ m['content'] | trim }}{% endgeneration %}<|end|>\n"
    "{% else %}<|user|>\n{{ m['content'] ~ '' }}<|end|>\n{% endif %}"
    "{% if loop.index > 50 %}{% break %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": " Hello there! ", "reasoning_content": "greet"},
     {"role": "user", "content": "Bye", "tool_calls": None}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]


def _tokenizers():
    toks = {"eos": make_tokenizer(EOS_TEMPLATE), "end": make_tokenizer(END_TEMPLATE),
            "chatml": make_tokenizer(CHATML_TEMPLATE, CHATML_SPECIALS),
            "tools": make_tokenizer(TOOLS_TEMPLATE), "mistral": make_spm_tokenizer()}
    smol = CACHE / "smollm2-135m-instruct"
    if (smol / "tokenizer_config.json").exists():  # SmolLM2's real template, when cached
        from transformers import AutoTokenizer
        toks["smollm2"] = AutoTokenizer.from_pretrained(str(smol))
    return toks


TOKENIZERS = _tokenizers()


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_same_text_as_transformers(name, add_generation_prompt):
    tok = TOKENIZERS[name]
    for msgs in CONVERSATIONS:
        if name == "mistral" and msgs[0]["role"] == "system":
            continue  # that template has no system turn
        expected = tok.apply_chat_template(msgs, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        got = render_chat_template(tok, msgs, add_generation_prompt=add_generation_prompt)
        assert got == expected


def test_tools_and_extra_variables_reach_the_template():
    tok = TOKENIZERS["tools"]
    tools = [{"name": "add", "parameters": {"a": "int"}}]
    expected = tok.apply_chat_template(CONVERSATIONS[0], tools=tools, tokenize=False)
    got = render_chat_template(tok, CONVERSATIONS[0], tools=tools)
    assert got == expected and '    "name": "add"' in got


def _error(template: str, **kw) -> tuple[str, float]:
    tok = make_tokenizer(template)
    t = time.perf_counter()
    with pytest.raises(LeantuneError) as e:
        render_chat_template(tok, CONVERSATIONS[0], "data.jsonl:7", **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("data.jsonl:7: ") and "chat template" in msg
    return msg, time.perf_counter() - t


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}"
SIZE_BOMBS = {
    "string product": "{{ 'x' * 10**12 }}",
    "list product": "{{ ([1] * 10**10) | length }}",
    "power": "{{ 10 ** (10 ** 10) }}",
    "center filter": "{{ 'x' | center(10**11) }}",
    "indent filter": "{{ ('\n' * 1000) | indent(10**8) }}",
    "str method": "{{ 'x'.ljust(10**11) }}",
    "replace": "{{ ('a' * 10**6) | replace('a', 'b' * 10**6) }}",
    "printf width": "{{ '%99999999999d' % 1 }}",
    "format width": "{{ '{:>99999999999}'.format(1) }}",
    "tojson indent": "{{ messages | tojson(indent=10**9) }}",
    "doubling namespace": ("{% set ns = namespace(s='ab') %}{% for i in range(100) %}"
                           "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"),
    "doubling macro": ("{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s | length }}"
                       "{% endmacro %}{{ f('ab', 60) }}"),
    "long output": LOOP + "abcdefgh{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", SIZE_BOMBS)
def test_size_bombs_end_in_one_line(name):
    msg, seconds = _error(SIZE_BOMBS[name], max_chars=1 << 20)
    assert "too large" in msg and "shorten this conversation" in msg
    assert seconds < 5


@pytest.mark.parametrize("body", ["{% set x = i * j %}", "{{ '' }}"])
def test_endless_loops_stop_at_the_time_limit(body):
    msg, seconds = _error(LOOP + body + "{% endfor %}{% endfor %}", timeout_s=0.5)
    assert "took more than 0.5 s" in msg and "fix the chat template" in msg
    assert 0.4 < seconds < 6  # (headroom for a loaded CI machine running tests in parallel)


def test_time_limit_holds_outside_the_main_thread():
    """No SIGALRM there: the deadline checks in calls, operators and output stop it."""
    out = {}

    def run():
        try:
            _error(LOOP + "{% set x = i * j %}{% endfor %}{% endfor %}", timeout_s=0.5)
            out["ok"] = True
        except BaseException as e:  # reported to the test thread below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive() and out == {"ok": True}


def test_template_errors_are_one_line():
    msg, _ = _error("{{ raise_exception('only user turns') }}")
    assert "rejected this conversation" in msg and "only user turns" in msg
    msg, _ = _error("{% if %}")
    assert "not valid Jinja" in msg and "line 1" in msg


def test_the_sandbox_still_refuses_internals():
    msg, _ = _error("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    assert "rejected this conversation" in msg


def test_a_previous_alarm_is_left_alone():
    """A timer someone else set keeps running; ours then relies on its deadline checks."""
    import signal

    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        _error(LOOP + "{% set x = i %}{% endfor %}{% endfor %}", timeout_s=0.6)
        assert fired == [1]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
