"""Reward functions for GRPO: `--reward FILE.py:FUNCTION` (repeatable) and `builtin:NAME`.

A reward function is called as TRL's GRPOTrainer calls one, so a function written for TRL runs
unchanged:

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **the rows' other fields)
        -> list of float or None (one per completion; None: this function does not score it)

Each list has one entry per completion: a prompt with G completions appears G times in a row.
`completions` are strings for text prompts, and `[{"role": "assistant", "content": text}]` for
conversational prompts (a list of messages). The rows' other fields (e.g. `answer`) come as
lists of the same length. Besides them, TRL passes `trainer_state`; we pass it too (an object
with `global_step` and `max_steps`) to functions that name it or take `**kwargs`. A function
without `**kwargs` gets only the arguments it names, and a name that no row field gives is one
line at start.

`--reward-weights` weighs the functions in the total (default 1 each); None counts as 0 in the
total, and a completion no function scored gets advantage 0 (as TRL).

A file is the user's own code, imported as it is (by design: nothing downloaded runs code). Its
errors, and a function that raises, returns the wrong number of rewards or returns NaN, give
`RewardError`: one line naming the function, the step and the row.

Built-ins (`builtin:NAME`):
    exact-answer   1.0 when the completion's final answer (GSM8K's `#### n`, else the last
                   `\\boxed{...}`, else the last number) equals the row's `answer` (read the same
                   way: GSM8K answers end in `#### n`), numbers compared as numbers; else 0.0
    format         1.0 when the completion matches a regex (re.search), else 0.0; by default
                   some text, then `#### <number>` or a `\\boxed{...}` at the end; another regex
                   as `builtin:format=REGEX`
    length-penalty -(completion tokens / max completion tokens): shorter is better, in [-1, 0]
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from ..errors import LeantuneError


class RewardError(LeantuneError):
    """A reward function failed: it raised, returned the wrong number of rewards, or NaN."""


# --------------------------------------------------------------------------------------------
# Built-ins
# --------------------------------------------------------------------------------------------

_NUMBER = r"-?[\d,]*\.?\d+"
_GSM8K = re.compile(r"####\s*(" + _NUMBER + ")")


def _boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def final_answer(text: str, last_number: bool = True) -> str | None:
    """The final answer in `text`: GSM8K's `#### n` (the last), else the last \\boxed{}, else
    (with `last_number`) the last number; None when there is none."""
    found = _GSM8K.findall(text)
    if found:
        return found[-1]
    boxed = _boxed(text)
    if boxed is not None:
        return boxed
    if last_number:
        nums = re.findall(_NUMBER, text)
        return nums[-1] if nums else None
    return None


def _normal(answer: str) -> str:
    """An answer for comparison: numbers as numbers (commas, $ and a trailing dot gone)."""
    a = answer.strip().strip("$").rstrip(".").replace(",", "")
    try:
        x = float(a)
    except ValueError:
        return " ".join(a.split())
    return repr(int(x)) if x.is_integer() else repr(x)


def _text_of(completion) -> str:
    """A completion's text: a string, or the content of assistant messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion if isinstance(m, dict)
                   and isinstance(m.get("content"), str))


def exact_answer(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 where the completion's final answer equals the row's `answer` (module docstring);
    None for a row without an answer."""
    if answer is None:
        raise ValueError("the rows have no 'answer' field, which builtin:exact-answer compares "
                         "against")
    out = []
    for c, a in zip(completions, answer):
        if a is None:
            out.append(None)
            continue
        want = final_answer(str(a))
        got = final_answer(_text_of(c))
        out.append(float(got is not None and want is not None and _normal(got) == _normal(want)))
    return out


FORMAT_REGEX = r"(?s)^.*\S.*(####\s*" + _NUMBER + r"|\\boxed\{.+\})\s*$"


def format_reward(pattern: str = FORMAT_REGEX) -> Callable:
    """A reward of 1.0 where the completion matches `pattern` (re.search), else 0.0."""
    try:
        regex = re.compile(pattern)
    except re.error as e:
        raise LeantuneError(f"--reward builtin:format={pattern}: not a valid regular expression "
                            f"({e})") from None

    def format_match(completions, **kwargs) -> list[float]:
        return [float(regex.search(_text_of(c)) is not None) for c in completions]

    return format_match


def length_penalty(max_tokens: int) -> Callable:
    """-(completion tokens / max_tokens): in [-1, 0], shorter scores higher."""

    def length(completions, completion_ids, **kwargs) -> list[float]:
        return [-len(ids) / max_tokens for ids in completion_ids]

    return length


BUILTINS = ("exact-answer", "format", "length-penalty")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

@dataclass
class RewardFunction:
    """One reward: its name (for metrics and errors), the callable, its weight, and which
    keyword arguments it takes (None: any, it has **kwargs)."""

    name: str
    fn: Callable
    weight: float = 1.0
    accepts: frozenset | None = None

    def call(self, kwargs: dict) -> list:
        if self.accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepts}
        return self.fn(**kwargs)


def _accepts(fn: Callable) -> tuple[frozenset | None, list[str]]:
    """(the names `fn` takes, None with **kwargs; its required names)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None, []
    params = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        names = None
    else:
        names = frozenset(p.name for p in params
                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    required = [p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return names, required


def _import_file(path: Path, spec: str):
    """Import the user's reward file as a module of its own (its folder first on sys.path, so
    it may import its neighbours)."""
    name = f"leantune_reward_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise LeantuneError(f"--reward {spec}: {path} is not a Python file")
    module = importlib.util.module_from_spec(mod_spec)
    sys.path.insert(0, str(path.parent))
    try:
        mod_spec.loader.exec_module(module)
    except Exception as e:
        line = _user_line(e, path)
        raise LeantuneError(f"--reward {spec}: importing {path}{line} raised "
                            f"{type(e).__name__}: {_short(e)}") from None
    finally:
        sys.path.remove(str(path.parent))
    sys.modules[name] = module
    return module


def _user_line(e: BaseException, path: Path | None = None) -> str:
    """' (line N)' of the innermost traceback frame in `path` (or the last frame), or ''."""
    tb, line = e.__traceback__, None
    while tb is not None:
        if path is None or Path(tb.tb_frame.f_code.co_filename).resolve() == path.resolve():
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None and isinstance(e, SyntaxError):
        line = e.lineno
    return f" (line {line})" if line else ""


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or "no message"


def load_reward(spec: str, max_completion_tokens: int, format_regex: str | None = None
                ) -> RewardFunction:
    """The reward function `spec` names: `FILE.py:FUNCTION` or `builtin:NAME` (module
    docstring). One line for a missing file, a file that does not import, a missing or
    non-callable function, or an unknown built-in."""
    if not isinstance(spec, str) or not spec.strip():
        raise LeantuneError("--reward needs FILE.py:FUNCTION or builtin:NAME, got an empty value")
    if spec.startswith("builtin:"):
        name, _, arg = spec[len("builtin:"):].partition("=")
        if name == "exact-answer":
            fn = exact_answer
        elif name == "format":
            fn = format_reward(arg or format_regex or FORMAT_REGEX)
        elif name == "length-penalty":
            fn = length_penalty(max_completion_tokens)
        else:
            raise LeantuneError(f"--reward {spec}: no such built-in reward; the built-ins are "
                                f"{', '.join('builtin:' + b for b in BUILTINS)}")
        if arg and name != "format":
            raise LeantuneError(f"--reward {spec}: builtin:{name} takes no =value")
        accepts, _ = _accepts(fn)
        return RewardFunction(name, fn, accepts=accepts)
    file, sep, func = spec.rpartition(":")
    if not sep or not file or not func:
        raise LeantuneError(f"--reward {spec}: expected FILE.py:FUNCTION (e.g. "
                            "rewards.py:format_reward) or builtin:NAME (builtin:exact-answer, "
                            "builtin:format, builtin:length-penalty)")
    path = Path(file).expanduser()
    if not path.is_file():
        raise LeantuneError(f"--reward {spec}: file {path} not found")
    if path.suffix != ".py":
        raise LeantuneError(f"--reward {spec}: {path} is not a .py file")
    module = _import_file(path, spec)
    fn = getattr(module, func, None)
    if fn is None:
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        raise LeantuneError(f"--reward {spec}: {path} defines no {func!r}"
                            + (f"; it defines {', '.join(names)}" if names else ""))
    if not callable(fn):
        raise LeantuneError(f"--reward {spec}: {func!r} in {path} is not a function")
    accepts, _ = _accepts(fn)
    return RewardFunction(func, fn, accepts=accepts)


def load_rewards(specs, weights, max_completion_tokens: int,
                 format_regex: str | None = None) -> list[RewardFunction]:
    """The reward functions of --reward (in order) with their --reward-weights (default 1)."""
    specs = list(specs or [])
    if not specs:
        raise LeantuneError("--objective grpo needs at least one --reward: FILE.py:FUNCTION or "
                            f"builtin:NAME ({', '.join('builtin:' + b for b in BUILTINS)})")
    if weights is not None and len(weights) != len(specs):
        raise LeantuneError(f"--reward-weights gives {len(weights)} weights for {len(specs)} "
                            "--reward functions; give one weight per function, in order")
    out = []
    for i, spec in enumerate(specs):
        r = load_reward(spec, max_completion_tokens, format_regex)
        if weights is not None:
            w = weights[i]
            if not (isinstance(w, (int, float)) and math.isfinite(w)):
                raise LeantuneError(f"--reward-weights: weight {i + 1} is {w!r}, not a number")
            r.weight = float(w)
        out.append(r)
    seen = {}
    for r in out:  # unique names for the metrics
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name}_{seen[r.name]}"
    return out


def check_fields(rewards: list[RewardFunction], fields: set[str], source: str) -> None:
    """Each function's required arguments must be given: the standard ones or a field of the
    rows (`fields`); one line naming the function and the argument otherwise."""
    given = {"prompts", "completions", "completion_ids", "trainer_state"} | set(fields)
    for r in rewards:
        _, required = _accepts(r.fn)
        missing = [n for n in required if n not in given]
        if missing:
            raise LeantuneError(f"reward {r.name}: it needs the argument {missing[0]!r}, which "
                                f"the rows of {source} do not have (their fields: "
                                f"{', '.join(sorted(fields)) or 'none besides prompt'})")


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------

def score(rewards: list[RewardFunction], prompts: list, completions: list,
          completion_ids: list[list[int]], fields: dict[str, list], step: int,
          rows: list[str] | None = None, max_steps: int | None = None) -> list[list[float]]:
    """Call every reward function once over the N completions; returns [N][F] floats (NaN for
    None). `fields`: the rows' other fields, each a list of N; `rows`: where each completion's
    row came from (for errors); `step`: the optimizer step (1-based) being generated for.

    Raises RewardError (one line naming the function, the step and the row) for a function that
    raises, returns something that is not a list of N numbers or None, or returns NaN / inf."""
    n = len(completions)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
              **fields, "trainer_state": SimpleNamespace(global_step=step, max_steps=max_steps)}
    table = [[math.nan] * len(rewards) for _ in range(n)]

    def where(i: int | None) -> str:
        if i is None or rows is None:
            return ""
        return f", row {rows[i]}"

    for j, r in enumerate(rewards):
        try:
            out = r.call(kwargs)
        except Exception as e:
            row = _failing_row(r, kwargs, n)
            raise RewardError(f"reward {r.name} raised {type(e).__name__} at step {step}"
                              f"{where(row)}: {_short(e)}{_user_line(e)}") from None
        try:
            out = list(out)
        except TypeError:
            raise RewardError(f"reward {r.name} returned {type(out).__name__} at step {step}; "
                              f"it must return a list of {n} numbers (one per completion)") from None
        if len(out) != n:
            raise RewardError(f"reward {r.name} returned {len(out)} rewards at step {step} for "
                              f"{n} completions; return one per completion (None to skip one)")
        for i, v in enumerate(out):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
                raise RewardError(f"reward {r.name} returned {v!r} at step {step}{where(i)} "
                                  "(completion %d); rewards are numbers or None" % (i + 1))
            x = float(v)
            if not math.isfinite(x):
                raise RewardError(f"reward {r.name} returned {x} at step {step}{where(i)} "
                                  f"(completion {i + 1}); rewards must be finite (None skips "
                                  "a completion)")
            table[i][j] = x
    return table


def _failing_row(r: RewardFunction, kwargs: dict, n: int) -> int | None:
    """The first completion on which `r` alone raises (each called on its own), or None."""
    for i in range(n):
        one = {k: ([v[i]] if isinstance(v, list) and len(v) == n else v)
               for k, v in kwargs.items()}
        try:
            r.call(one)
        except Exception:
            return i
    return None


def totals(table: list[list[float]], rewards: list[RewardFunction]) -> list[float]:
    """Weighted sum per completion (None / NaN counts 0); NaN where no function scored it."""
    out = []
    for row in table:
        if all(math.isnan(x) for x in row):
            out.append(math.nan)
        else:
            out.append(sum(r.weight * x for r, x in zip(rewards, row) if not math.isnan(x)))
    return out
