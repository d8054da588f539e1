"""JSON nested deeper than Python's parser recurses (a hostile file) is a one-line error naming
the file, from the dataset, config.json and adapter_config.json readers, not a RecursionError
traceback."""

from __future__ import annotations

import pytest

from leantune.data.files import read_rows_located as read_rows
from leantune.errors import LeantuneError
from leantune.lora.peft_io import read_adapter_config
from leantune.model.config import ModelConfig

DEEP = "[" * 100_000 + "]" * 100_000


def test_deep_dataset_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok"}\n{"text": ' + DEEP + "}\n")
    with pytest.raises(LeantuneError, match=r"d\.jsonl:2: JSON nested too deeply"):
        read_rows(path)


def test_deep_config_and_adapter_config(tmp_path):
    (tmp_path / "config.json").write_text('{"a": ' + DEEP + "}")
    with pytest.raises(LeantuneError, match=r"config\.json: JSON nested too deeply"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "adapter_config.json").write_text(DEEP)
    with pytest.raises(LeantuneError, match=r"adapter_config\.json: JSON nested too deeply"):
        read_adapter_config(tmp_path)


def test_deep_json_file(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"text": ' + DEEP + "}]")
    with pytest.raises(LeantuneError, match=r"d\.json: JSON nested too deeply"):
        read_rows(path)


def test_the_cli_says_one_line_for_a_deep_file_it_reads_elsewhere(tmp_path, capsys):
    """`plot` reads metrics.jsonl without the readers above: the CLI's fallback line, exit 2;
    a RecursionError outside the json / yaml parsers keeps its traceback."""
    from leantune.cli import _in_a_parser, main

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": ' + DEEP + "}\n")
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("leantune: error: an input file nests its structure") and \
        "Traceback" not in err and err.count("\n") == 1, err

    def loop(n):
        return loop(n + 1)

    with pytest.raises(RecursionError) as e:
        loop(0)
    assert not _in_a_parser(e.value)
