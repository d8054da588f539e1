"""Reading .jsonl / .json / .parquet rows and the one-line errors for bad files."""

import json
import sys

import pytest

from leantune.data import read_rows, read_rows_located
from leantune.errors import LeantuneError


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_jsonl_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    p = _write(tmp_path / "d.jsonl", '{"text": "a"}\n\n   \n{"text": "b"}\n')
    assert read_rows(p) == [{"text": "a"}, {"text": "b"}]
    assert [loc for loc, _ in read_rows_located(p)] == [1, 4]


@pytest.mark.parametrize("payload", [
    [{"text": "a"}, {"text": "b"}],
    {"data": [{"text": "a"}, {"text": "b"}]},
    {"train": [{"text": "a"}, {"text": "b"}]},
])
def test_json_list_or_wrapped(tmp_path, payload):
    p = _write(tmp_path / "d.json", json.dumps(payload))
    assert read_rows(p) == [{"text": "a"}, {"text": "b"}]
    assert [loc for loc, _ in read_rows_located(p)] == ["row 1", "row 2"]


def test_missing_file(tmp_path):
    with pytest.raises(LeantuneError, match=r"nope\.jsonl: data file not found"):
        read_rows(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("name,text", [("e.jsonl", ""), ("e.jsonl", "\n\n"), ("e.json", "[]"),
                                       ("e.json", "")])
def test_empty_file(tmp_path, name, text):
    p = _write(tmp_path / name, text)
    with pytest.raises(LeantuneError) as ei:
        read_rows(p)
    msg = str(ei.value)
    assert name in msg and "empty" in msg and "\n" not in msg


def test_malformed_line_names_line_number(tmp_path):
    lines = ['{"text": "ok"}'] * 16 + ['{"text": "broken"'] + ['{"text": "ok"}']
    p = _write(tmp_path / "data.jsonl", "\n".join(lines))
    with pytest.raises(LeantuneError) as ei:
        read_rows(p)
    msg = str(ei.value)
    assert msg.startswith(f"{p}:17: malformed JSON (")
    assert "\n" not in msg


def test_row_not_an_object(tmp_path):
    p = _write(tmp_path / "d.jsonl", '{"text": "a"}\n["x"]\n')
    with pytest.raises(LeantuneError, match=r"d\.jsonl:2: expected a JSON object, got a list"):
        read_rows(p)
    p = _write(tmp_path / "d.json", '[{"text": "a"}, 3]')
    with pytest.raises(LeantuneError, match=r"d\.json \(row 2\): expected a JSON object"):
        read_rows(p)


def test_json_wrong_container(tmp_path):
    p = _write(tmp_path / "d.json", '{"rows": []}')
    with pytest.raises(LeantuneError, match=r'"data" or "train"'):
        read_rows(p)


def test_unknown_extension(tmp_path):
    p = _write(tmp_path / "d.csv", "a,b\n")
    with pytest.raises(LeantuneError, match=r"d\.csv: unknown data file extension '\.csv'"):
        read_rows(p)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    p = _write(tmp_path / "d.parquet", "not really parquet")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(LeantuneError, match=r"d\.parquet: .*pip install pyarrow"):
        read_rows(p)


def test_parquet_roundtrip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), p)
    assert read_rows(p) == [{"text": "a"}, {"text": "b"}]
