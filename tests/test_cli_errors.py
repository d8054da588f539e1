"""Flag mistakes: abbreviations are refused (never silently read as the flag they start), and
an unknown flag or YAML key names the nearest real one, in one line."""

from __future__ import annotations

import argparse

import pytest
from helpers import alpaca_file, tiny_ckpt  # noqa: F401

from leantune.cli import build_parser, main
from leantune.errors import LeantuneError
from leantune.train.config import load_yaml_config


def argparse_error(capsys, *argv) -> str:
    """`leantune ARGV` must stop in argparse: exit 2, one stderr line; returns it."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_an_abbreviated_flag_is_refused_and_named(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    line = argparse_error(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file,
                          "--output", out, "--max-seq", 64, "--device", "cpu")
    assert line == ("leantune train: error: unrecognized arguments: --max-seq 64 (--max-seq: "
                    "did you mean --max-seq-len?); see `leantune train --help`")
    assert not out.exists()  # nothing ran


@pytest.mark.parametrize("argv, flag, full", [
    (["train", "--lr=1e-4", "--max-step", "3"], "--max-step", "--max-steps"),
    (["train", "--lora_r", "8"], "--lora_r", "--lora-r"),
    (["train", "--lora-alpah", "8"], "--lora-alpah", "--lora-alpha"),
    (["generate", "--prompt", "hi", "--max-new", "5"], "--max-new", "--max-new-tokens"),
    (["chat", "--temp", "0.5"], "--temp", "--temperature"),
    (["export", "--output", "o", "--form", "gguf"], "--form", "--format"),
    (["inspect-data", "--data", "d", "--model", "m", "--max-seq=64"], "--max-seq",
     "--max-seq-len"),
])
def test_every_command_refuses_abbreviations(capsys, argv, flag, full):
    line = argparse_error(capsys, *argv)
    assert f"({flag}: did you mean {full}?)" in line, line


def test_a_flag_near_nothing_gets_no_guess(capsys):
    line = argparse_error(capsys, "train", "--learning-rate-warmup-ratio", "0.1")
    assert line == ("leantune train: error: unrecognized arguments: "
                    "--learning-rate-warmup-ratio 0.1; see `leantune train --help`")


def test_no_parser_allows_abbreviations():
    parsers, todo = [], [build_parser()]
    while todo:
        p = todo.pop()
        parsers.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    assert len(parsers) >= 8  # leantune and its seven commands
    assert not [p.prog for p in parsers if p.allow_abbrev]


def test_full_flag_names_still_work(capsys):
    args = build_parser().parse_args(["train", "--max-seq-len", "64", "--max-steps=3"])
    assert args.max_seq_len == 64 and args.max_steps == 3


@pytest.mark.parametrize("text, hint", [
    ("max_seq: 64\n", "'max_seq'; did you mean 'max_seq_len'?"),
    ("max-seq: 64\n", "'max-seq'; did you mean 'max-seq-len'?"),
    ("lora_dropuot: 0.1\n", "'lora_dropuot'; did you mean 'lora_dropout'?"),
    ("lerning_rate_sched: 3\n", "'lerning_rate_sched'"),  # near nothing: no guess
])
def test_an_unknown_yaml_key_names_the_nearest(tmp_path, text, hint):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(LeantuneError) as e:
        load_yaml_config(str(cfg))
    assert str(e.value) == (f"{cfg}: unknown option {hint}; options are the `leantune train` "
                            "flags without the leading dashes")


def test_every_argument_parser_in_the_repository_refuses_abbreviations():
    """The benchmarks and tools too: a source scan for parsers built without the setting."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [f for d in ("src", "bench", "tools") for f in (root / d).rglob("*.py")]
    made = [(f, m) for f in files for m in re.finditer(r"ArgumentParser\(([^)]*)",
                                                       f.read_text())]
    assert len(made) >= 10
    assert not [f"{f}: {m.group(0)}" for f, m in made if "allow_abbrev=False" not in m.group(1)
                and "self" not in m.group(1) and "*args" not in m.group(1)]
