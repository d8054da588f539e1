"""Chat templates rendered with a time and a size limit.

A chat template is Jinja code shipped with a checkpoint (tokenizer_config.json or
chat_template.jinja), so it is code we did not write running on every training row. Jinja's
sandbox already stops it from touching the system, but not from running for ever
(``{% for i in range(99999) %}{% for j in range(99999) %}...``) or from building a giant string in
one operation (``'x' * 10**12``, ``'x'|center(10**12)``, ``10**10**10``). `render_chat_template`
renders the template the way transformers' ``apply_chat_template(tokenize=False)`` does (same
sandbox, globals, filters and inputs, so the text is the same) in an environment that

* checks every ``*``, ``**`` and ``%`` and every width-like argument of the string filters and
  methods that can multiply a string's size, and refuses a result over the size limit before it
  is built;
* counts the rendered characters as they are produced and stops past the size limit;
* stops after a wall-time limit: a SIGALRM timer in the main thread (it interrupts any Python
  loop), and deadline checks in the operators, calls and output chunks everywhere (threads).

Every problem ends in one `LeantuneError` line naming the template's source and what to do.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from leantune.errors import LeantuneError

DEFAULT_TIMEOUT_S = 10.0
# Rendered characters allowed: this floor, or a multiple of the characters given to the template,
# whichever is larger (a template repeats its inputs a few times at most, plus a system prompt).
MIN_MAX_CHARS = 32 << 20
INPUT_FACTOR = 8
# Names of the message fields a reasoning trace travels under; transformers fills them all from
# whichever is set, so templates that read any of them see it.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MAX_POW_BITS = 1 << 16  # an integer power with a larger result is refused
MAX_JSON_INDENT = 64


class _Timeout(BaseException):
    """Raised inside the render when the time is up (a BaseException, so that no `except
    Exception` in the template's call chain swallows it)."""


class _TooLarge(Exception):
    """An operation in the template would build a value over the size limit."""


@dataclass
class _Limits:
    deadline: float  # time.monotonic() after which the render stops
    max_chars: int

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Timeout()

    def check_size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise _TooLarge(f"{what} would be {n} long, over the limit of {self.max_chars}")


_LIMITS: contextvars.ContextVar[_Limits | None] = contextvars.ContextVar("template_limits",
                                                                        default=None)


def _limits() -> _Limits:
    lim = _LIMITS.get()
    if lim is None:  # compiled templates are only ever run by render_chat_template
        raise RuntimeError("a bounded chat template ran outside render_chat_template")
    lim.check_time()
    return lim


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


# -- size checks of the operations that can blow a value up in one step ------------------------

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")


def _check_widths(spec_text: str, args: tuple, lim: _Limits, nested: str) -> None:
    """Widths and precisions written in a format string, and (when widths come from the
    arguments: `nested` appears in a spec) integer arguments, must stay under the limit."""
    for n in re.findall(r"\d+", spec_text):
        lim.check_size(int(n), "a format width")
    if nested in spec_text:
        for a in args:
            if isinstance(a, int):
                lim.check_size(abs(a), "a format width")


def _check_printf(fmt: str, args: Any, lim: _Limits) -> None:
    specs = "".join(m.group(0) for m in _PRINTF_SPEC.finditer(fmt))
    values = args if isinstance(args, tuple) else (args,)
    _check_widths(specs, values, lim, "*")


def _check_format(fmt: str, args: tuple, kwargs: dict, lim: _Limits) -> None:
    specs = "".join(m.group(0) for m in _FORMAT_SPEC.finditer(fmt) if ":" in m.group(0))
    _check_widths(specs, args + tuple(kwargs.values()), lim, "{")


def _check_binop(op: str, left: Any, right: Any, lim: _Limits) -> None:
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if _sized(seq) and isinstance(n, int):
                lim.check_size(len(seq) * max(n, 0), "a repeated string or list")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        bits = right * math.log2(abs(left))
        if bits > MAX_POW_BITS:
            raise _TooLarge(f"the power {left} ** {right} has over {MAX_POW_BITS} bits")
    elif op == "%" and isinstance(left, str):
        _check_printf(left, right, lim)


def _check_str_method(s: str, name: str, args: tuple, kwargs: dict, lim: _Limits) -> None:
    """Refuse calls of str methods whose result would exceed the limit."""
    if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
        lim.check_size(args[0], f"str.{name}()")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            lim.check_size(len(s) + s.count("\t") * size, "str.expandtabs()")
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        count = s.count(args[0]) if args[0] else len(s) + 1
        lim.check_size(len(s) + count * len(args[1]), "str.replace()")
    elif name == "join" and args:
        items = args[0]
        if isinstance(items, (list, tuple)):
            lim.check_size(len(s) * len(items) + sum(map(_sized, items)), "str.join()")
    elif name in ("format", "format_map"):
        _check_format(s, args, kwargs, lim)


# -- the environment ----------------------------------------------------------------------------

class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with it):
    renders its body unchanged; we find assistant spans ourselves (data/formats.py)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox transformers renders chat templates in, with every operator, call and
    attribute access first checked against the current render's limits."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right, _limits())
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        lim = _limits()
        for a in args + tuple(kwargs.values()):  # e.g. a macro calling itself on s ~ s
            lim.check_size(_sized(a), "an argument")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _check_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs, lim)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """The sandbox's str.format / format_map stand-in, with the widths checked first."""
        inner = super().wrap_str_format(value)
        if inner is None:
            return None
        fmt = value.__self__

        def bounded(*args, **kwargs):
            _check_format(fmt, args, kwargs, _limits())
            return inner(*args, **kwargs)

        return bounded

    def getattr(self, obj, attribute):
        _limits()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _limits()
        return super().getitem(obj, argument)


def _bounded_filter(env: jinja2.Environment, name: str, check) -> None:
    """Wrap filter `name` so that `check(value, *args, **kwargs)` runs before it."""
    inner = env.filters[name]

    def bounded(*args, **kwargs):
        check(*args, **kwargs)
        return inner(*args, **kwargs)

    env.filters[name] = bounded


def _check_filter_width(value, width=80, *rest, **kwargs) -> None:  # center / indent
    lim = _limits()
    width = kwargs.get("width", width)
    if isinstance(width, int):
        lines = str(value).count("\n") + 1
        lim.check_size(len(str(value)) + lines * max(width, 0), "a centred or indented text")


def _check_filter_replace(value, old="", new="", *rest, **kwargs) -> None:
    if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
        _check_str_method(value, "replace", (old, new), {}, _limits())


def _check_filter_format(value, *args, **kwargs) -> None:
    if isinstance(value, str):
        _check_printf(value, args or kwargs, _limits())


def _check_filter_join(value, d="", *rest, **kwargs) -> None:
    if isinstance(value, (list, tuple)) and isinstance(d, str):
        _check_str_method(d, "join", ([str(v) if not _sized(v) else v for v in value],), {},
                          _limits())


def _check_filter_sum(iterable, attribute=None, start=0, **kwargs) -> None:
    lim = _limits()
    if isinstance(iterable, (list, tuple)):
        lim.check_size(_sized(start) + sum(map(_sized, iterable)), "a summed list")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson filter: json.dumps without Jinja's HTML escaping."""
    if isinstance(indent, int) and indent > MAX_JSON_INDENT:
        raise _TooLarge(f"tojson indent {indent} is over {MAX_JSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in templates, without the attributes of the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses names starting with an underscore (no way to CPython
    internals through a namespace)."""

    def __init__(*args, **kwargs):  # jinja's signature trick: `self` may be an attribute name
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        _limits().check_size(_sized(value), f"namespace attribute {name!r}")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with _")


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    for name in ("center", "indent"):
        _bounded_filter(env, name, _check_filter_width)
    _bounded_filter(env, "replace", _check_filter_replace)
    _bounded_filter(env, "format", _check_filter_format)
    _bounded_filter(env, "join", _check_filter_join)
    _bounded_filter(env, "sum", _check_filter_sum)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_Namespace)
    return env.from_string(template)


# -- inputs, as transformers hands them to the template -----------------------------------------

def _plain(value: Any) -> Any:
    """A JSON-like copy (dicts, lists, tuples, str, int, float, bool, None); anything else
    becomes a placeholder naming its type, so the template sees no foreign methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers passes them: fields holding None dropped, plain data, and a
    reasoning trace given under any of REASONING_FIELDS copied to "thinking" (when unset) and
    "reasoning_content"."""
    out = []
    for m in messages:
        m = {k: _plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _chars_in(value: Any) -> int:
    """Characters of text in a JSON-like value (what the template is given)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars_in(k) + _chars_in(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(map(_chars_in, value))
    return 0


def template_of(tokenizer, tools=None) -> str | None:
    """The tokenizer's chat template string (a named one when the tokenizer has several)."""
    get = getattr(tokenizer, "get_chat_template", None)
    if callable(get):
        try:
            return get(None, tools)
        except ValueError:  # several templates, none named "default"
            return None
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None


def template_source(tokenizer) -> str:
    """Where the tokenizer (and so its chat template) was loaded from, for messages."""
    name = getattr(tokenizer, "name_or_path", "") or ""
    return f"the chat template of {name}" if name else "the tokenizer's chat template"


# -- the time limit -----------------------------------------------------------------------------

class _Alarm:
    """A SIGALRM timer raising `_Timeout`, used only in the main thread and only when no other
    timer is running (the previous handler is put back afterwards)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.previous = None
        self.active = False

    def __enter__(self):
        usable = (hasattr(signal, "setitimer")
                  and threading.current_thread() is threading.main_thread()
                  and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))
        if usable:
            self.previous = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, max(self.seconds, 1e-3))
            self.active = True
        return self

    @staticmethod
    def _fire(signum, frame):
        raise _Timeout()

    def __exit__(self, *exc):
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        return False


# -- the one entry point ------------------------------------------------------------------------

def render_chat_template(tokenizer, messages: list[dict], what: str = "chat template", *,
                         add_generation_prompt: bool = False,
                         timeout_s: float = DEFAULT_TIMEOUT_S, max_chars: int | None = None,
                         **kwargs) -> str:
    """Render `messages` with the tokenizer's chat template, as
    ``tokenizer.apply_chat_template(messages, tokenize=False, ...)`` would, within limits.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: the conversation, a list of {"role", "content", ...} dicts.
        what: where the conversation came from (e.g. "data.jsonl:17"), the start of every
            error message.
        add_generation_prompt: open the assistant's turn at the end.
        timeout_s: wall-time limit of the render in seconds.
        max_chars: the most characters the text, or any value built on the way, may have;
            None: the larger of MIN_MAX_CHARS and INPUT_FACTOR times the characters given.
        **kwargs: more variables for the template (tools, documents, enable_thinking, ...);
            they override the special tokens (bos_token, eos_token, ...) like in transformers.

    Returns:
        The rendered text.
    Raises:
        LeantuneError: no template, a template that does not compile, rejects the conversation
            (raise_exception, errors), runs past `timeout_s` or builds more than `max_chars`.
    """
    source = template_source(tokenizer)
    template = template_of(tokenizer, kwargs.get("tools"))
    if not template:
        raise LeantuneError(f"{what}: the tokenizer has no chat template; use a chat model's "
                            "tokenizer or set its chat_template")
    variables = {**_plain(dict(getattr(tokenizer, "special_tokens_map", {}) or {})),
                 "tools": None, "documents": None, **_plain(kwargs),
                 "messages": _prepare_messages(messages),
                 "add_generation_prompt": add_generation_prompt}
    if max_chars is None:
        max_chars = max(MIN_MAX_CHARS, INPUT_FACTOR * _chars_in(variables))
    token = _LIMITS.set(_Limits(time.monotonic() + timeout_s, max_chars))
    try:
        with _Alarm(timeout_s):
            return _render(template, variables, max_chars)
    except _Timeout:
        raise LeantuneError(
            f"{what}: {source} took more than {timeout_s:g} s to render (a loop that does not "
            "end?); fix the chat template (chat_template in tokenizer_config.json or "
            "chat_template.jinja) or use another tokenizer") from None
    except _TooLarge as e:
        raise LeantuneError(
            f"{what}: {source} builds too large a text ({e}); fix the chat template or "
            "shorten this conversation") from None
    except jinja2.TemplateSyntaxError as e:
        raise LeantuneError(f"{what}: {source} is not valid Jinja (line {e.lineno}: {e.message});"
                            " fix the chat template or use another tokenizer") from None
    except Exception as e:  # TemplateError from raise_exception(), errors in the template
        raise LeantuneError(
            f"{what}: {source} rejected this conversation "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    finally:
        _LIMITS.reset(token)


def _render(template: str, variables: dict, max_chars: int) -> str:
    """Compile (cached) and render chunk by chunk, checking time and size between chunks."""
    lim = _limits()
    compiled = _compile(template)
    chunks, size = [], 0
    for chunk in compiled.generate(**variables):
        size += len(chunk)
        lim.check_size(size, "the rendered text")
        lim.check_time()
        chunks.append(chunk)
    return "".join(chunks)
