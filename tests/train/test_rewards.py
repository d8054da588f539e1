"""Reward functions (train/rewards.py): loading FILE.py:FUNCTION and builtin:NAME, calling them
as TRL's GRPOTrainer does, and one-line errors naming the function, the step and the row."""

from __future__ import annotations

import math

import pytest

from leantune.errors import LeantuneError
from leantune.train.rewards import (RewardError, check_fields, exact_answer, final_answer,
                                    load_reward, load_rewards, score, totals)


def test_final_answer_forms():
    assert final_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert final_answer("the answer is \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert final_answer("first 3 then 1,234") == "1,234"
    assert final_answer("no digits", last_number=False) is None


def test_exact_answer_gsm8k_and_boxed():
    comps = ["think... #### 1,234", "\\boxed{1234.0}", "#### 12", "no answer"]
    answers = ["Janet ... #### 1234"] * 4
    assert exact_answer(prompts=[""] * 4, completions=comps, answer=answers) == [1, 1, 0, 0]
    conv = [[{"role": "assistant", "content": "#### 5"}]]
    assert exact_answer(prompts=[[{"role": "user", "content": "?"}]], completions=conv,
                        answer=["5"]) == [1.0]
    assert exact_answer(prompts=["q"], completions=["#### 5"], answer=[None]) == [None]


def test_builtin_format_and_length():
    fmt = load_reward("builtin:format", 8)
    assert fmt.call({"completions": ["reasoning #### 3", "#### 3 trailing words", "x \\boxed{2}"],
                     "prompts": [""] * 3}) == [1.0, 0.0, 1.0]
    custom = load_reward("builtin:format=^<think>", 8)
    assert custom.call({"completions": ["<think>a", "a<think>"]}) == [1.0, 0.0]
    length = load_reward("builtin:length-penalty", 8)
    assert length.call({"completions": ["a", "b"], "completion_ids": [[1, 2], [1] * 8],
                        "prompts": ["", ""]}) == [-0.25, -1.0]


def test_file_reward_called_as_trl(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "def with_kwargs(prompts, completions, completion_ids, **kw):\n"
        "    assert kw['trainer_state'].global_step == 3\n"
        "    return [float(len(c)) + len(kw['answer'][i]) for i, c in enumerate(completions)]\n"
        "def named_only(completions, answer):\n"
        "    return [1.0 if a in c else None for c, a in zip(completions, answer)]\n")
    rewards = load_rewards([f"{f}:with_kwargs", f"{f}:named_only"], [0.5, 2.0], 16)
    assert [r.name for r in rewards] == ["with_kwargs", "named_only"]
    table = score(rewards, ["p", "p"], ["ab", "xyz"], [[1, 2], [3]], {"answer": ["a", "q"]},
                  step=3)
    assert table[0] == [3.0, 1.0] and table[1][0] == 4.0 and math.isnan(table[1][1])
    assert totals(table, rewards) == [0.5 * 3 + 2.0, 0.5 * 4.0]
    check_fields(rewards, {"answer"}, "d.jsonl")
    with pytest.raises(LeantuneError, match="reward named_only: it needs the argument 'answer'"):
        check_fields(rewards, {"question"}, "d.jsonl")


@pytest.mark.parametrize("body, match", [
    ("def f(completions, **kw):\n    return [1.0 / (len(c) - 2) for c in completions]\n",
     r"reward f raised ZeroDivisionError at step 7, row d.jsonl:2: .*\(line 2\)"),
    ("def f(completions, **kw):\n    return [1.0]\n",
     "reward f returned 1 rewards at step 7 for 3 completions"),
    ("def f(completions, **kw):\n    return [1.0, float('nan'), 0.0]\n",
     r"reward f returned nan at step 7, row d.jsonl:2 \(completion 2\)"),
    ("def f(completions, **kw):\n    return [1.0, 'good', 0.0]\n",
     r"reward f returned 'good' at step 7, row d.jsonl:2"),
    ("def f(completions, **kw):\n    return 3\n", "reward f returned int at step 7"),
])
def test_reward_errors_are_one_line(tmp_path, body, match):
    f = tmp_path / "bad.py"
    f.write_text(body)
    r = load_rewards([f"{f}:f"], None, 8)
    with pytest.raises(RewardError, match=match) as e:
        score(r, ["p"] * 3, ["abc", "ab", "abcd"], [[1]] * 3, {}, step=7,
              rows=["d.jsonl:1", "d.jsonl:2", "d.jsonl:2"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("spec, match", [
    ("nofile.py:f", "file nofile.py not found"),
    ("builtin:exact", "no such built-in reward; the built-ins are builtin:exact-answer"),
    ("rewards_only", "expected FILE.py:FUNCTION"),
    ("builtin:length-penalty=3", "takes no =value"),
    ("builtin:format=(", "not a valid regular expression"),
])
def test_bad_reward_specs(spec, match):
    with pytest.raises(LeantuneError, match=match):
        load_reward(spec, 8)


def test_bad_files_and_weights(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("import math\n\ndef good(completions, **kw):\n    return [0.0] * len(completions)\n"
                 "NOT_A_FUNCTION = 3\n")
    with pytest.raises(LeantuneError, match="defines no 'missing'; it defines good"):
        load_reward(f"{f}:missing", 8)
    with pytest.raises(LeantuneError, match="'NOT_A_FUNCTION' in .* is not a function"):
        load_reward(f"{f}:NOT_A_FUNCTION", 8)
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\nraise RuntimeError('boom')\n")
    with pytest.raises(LeantuneError, match=r"importing .*broken.py \(line 2\) raised "
                                            "RuntimeError: boom"):
        load_reward(f"{broken}:f", 8)
    with pytest.raises(LeantuneError, match="--reward-weights gives 2 weights for 1"):
        load_rewards([f"{f}:good"], [1.0, 2.0], 8)
    with pytest.raises(LeantuneError, match="needs at least one --reward"):
        load_rewards([], None, 8)
