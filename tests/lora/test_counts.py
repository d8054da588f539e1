"""Counts a user reads are right: QLoRA's "trainable of total parameters" counts the 4-bit
weights as the parameters they stand for; "1 document", not "1 documents"; an --adapter folder
that does not exist says so, in every command that takes one."""

from __future__ import annotations

import re

import pytest
from helpers import (  # noqa: F401  (autouse; fixtures)
    FAST,
    alpaca_file,
    alpaca_rows,
    cli_error,
    one_torch_thread,
    run_cli,
    tiny_ckpt,
    write_jsonl,
)

import leantune
from leantune.lora.params import count_parameters
from leantune.utils.words import count


def test_4bit_weights_count_as_their_parameters(tiny_ckpt):  # noqa: F811
    dense = leantune.load_model(tiny_ckpt, device="cpu")
    four = leantune.load_model(tiny_ckpt, device="cpu", load_in_4bit=True)
    total = sum(p.numel() for p in dense.parameters())
    assert count_parameters(dense) == (total, total)
    assert sum(p.numel() for p in four.parameters()) < total  # what the old count said
    assert count_parameters(four)[1] == total
    leantune.apply_lora(four, leantune.LoRAConfig(r=4, alpha=8))
    for n, p in four.named_parameters():
        p.requires_grad_("lora_" in n)
    lora = [p for n, p in four.named_parameters() if "lora_" in n]
    n_lora = sum(p.numel() for p in lora)
    assert n_lora > 0
    assert count_parameters(four, lora) == count_parameters(four) == (n_lora, total + n_lora)


def _trainable_line(out: str) -> tuple[int, int]:
    m = re.search(r"trainable parameters: ([\d,]+) of ([\d,]+) ", out)
    return tuple(int(g.replace(",", "")) for g in m.groups())


def test_qlora_reports_the_16bit_total(capsys, tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    lines = {}
    for name, extra in (("16bit", []), ("4bit", ["--load-in-4bit"])):
        rc, out, err = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file,
                               "--output", tmp_path / name, "--max-steps", "1", *FAST, *extra)
        assert rc == 0, err
        lines[name] = _trainable_line(out)
    assert lines["4bit"] == lines["16bit"]


def test_one_document_is_singular(capsys, tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    assert (count(1, "document"), count(0, "document"), count(2, "document")) == (
        "1 document", "0 documents", "2 documents")
    assert count(1, "packed batch", "packed batches") == "1 packed batch"
    one = write_jsonl(tmp_path / "one.jsonl", alpaca_rows(1, seed=3))
    rc, out, err = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", one, "--eval-data",
                           one, "--output", tmp_path / "run", "--max-steps", "1", *FAST)
    assert rc == 0, err
    assert "data: 1 document -> 1 packed batch per epoch; 1 optimizer step; eval: 1 document" \
        in out


@pytest.mark.parametrize("command", [["export", "--output", "OUT"], ["generate", "--prompt", "hi"],
                                     ["chat"]])
def test_an_adapter_that_does_not_exist_says_so(capsys, tmp_path, tiny_ckpt, command):  # noqa: F811
    missing = tmp_path / "leantune-demmo"
    args = [str(tmp_path / a) if a == "OUT" else a for a in command]
    for model in ([], ["--model", str(tiny_ckpt)]):
        msg = cli_error(capsys, args[0], *model, "--adapter", missing, *args[1:], "--device"
                        if args[0] != "export" else "--overwrite", *(["cpu"] if args[0] !=
                                                                     "export" else []))
        assert msg.startswith(f"--adapter {missing}: no such folder; give the output folder")
    a_file = tmp_path / "adapter.json"
    a_file.write_text("{}")
    assert "a file, not a folder" in cli_error(capsys, args[0], "--adapter", a_file, *args[1:])
