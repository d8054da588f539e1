"""The README's first minutes: `leantune train` (the demo), then `leantune chat --adapter
leantune-demo` asked for capitals, answers them.

The demo trains on alpaca rows, so chat must ask in the alpaca prompt (the run's run_config.json
says so) rather than through the chat template. The demo is trained exactly as the CLI runs it
(no flags but --output and --device cpu): 120 steps, ~25 s on 2 quiet CPU cores, so the test is
marked slow. The questions are the 14 capital rows of the bundled eval file (no such
(instruction, input) pair occurs in training; 10 of them ask about a country no training row
names), asked one after the other in one chat session through chat's own code path (the CLI,
input() scripted).

Observed (torch 2.13 CPU, one thread): 14 of 14 right in the alpaca prompt, the run's format
(11 of 14 through the chat template, the format chat used before). The bar, 13 of 14, leaves
one answer for float differences of another CPU or torch build, and is above what the chat
template gets.
"""

from __future__ import annotations

import builtins
import json
import re

import pytest
from helpers import one_torch_thread, run_cli  # noqa: F401  (autouse)

from leantune import assets

pytestmark = pytest.mark.slow

BAR = 13


def _capital_rows() -> list[dict]:
    rows = [json.loads(line) for line in assets.path("data/tiny_sft_eval.jsonl").open()]
    return [r for r in rows if "capital" in r["instruction"]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo's run folder, trained as `leantune train` runs it."""
    out = tmp_path_factory.mktemp("demo") / "leantune-demo"
    from leantune.cli import main

    assert main(["train", "--output", str(out), "--device", "cpu", "--no-progress"]) == 0
    return out


def _chat_replies(capsys, monkeypatch, adapter, questions, *extra) -> tuple[list[str], str]:
    """`leantune chat --adapter ADAPTER` fed `questions`, one line each: (the replies, stderr)."""
    lines = iter(questions)

    def scripted(prompt=""):
        print(prompt, end="")
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", scripted)
    capsys.readouterr()
    rc, out, err = run_cli(capsys, "chat", "--adapter", adapter, "--device", "cpu",
                           "--max-new-tokens", "24", *extra)
    assert rc == 0, err
    # (stdin is no terminal here: chat ends each "> " line itself, as for a pipe)
    replies = [part.strip("\n").split("\n")[0] for part in out.split("> ")[1:]]
    return replies[:len(questions)], err


def test_the_demo_answers_held_out_capitals_in_chat(capsys, monkeypatch, demo):
    rows = _capital_rows()
    assert len(rows) == 14
    settings = json.loads((demo / "run_config.json").read_text())
    assert settings["data_format"] == "alpaca"  # what chat reads to pick the prompt format

    replies, err = _chat_replies(capsys, monkeypatch, demo, [r["instruction"] for r in rows])
    assert "prompt format: the alpaca prompt (alpaca), as the run was trained" in err
    right = []
    for row, reply in zip(rows, replies):
        capital = re.fullmatch(r"The capital of .+ is (.+)\.", row["output"])[1]
        right.append(capital in reply)
    print(f"demo chat: {sum(right)} of {len(rows)} capitals right: {replies}")
    assert sum(right) >= BAR, list(zip([r["instruction"] for r in rows], replies))
