"""Reading .jsonl / .json / .csv / .parquet rows and the one-line errors for bad files."""

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
    p = _write(tmp_path / "d.txt", "a,b\n")
    with pytest.raises(LeantuneError,
                       match=r"d\.txt: unknown data file extension '\.txt'; use .jsonl, .json, "
                             r"\.csv or \.parquet"):
        read_rows(p)


def test_csv_header_names_the_fields_and_lines_are_located(tmp_path):
    """Quoted commas, quotes and line breaks; blank lines skipped; spaces around header names
    dropped; a record's location is the line where it starts; every value is a string."""
    p = _write(tmp_path / "d.csv", 'instruction, input ,output\n'
                                   'Say hi,,"hello, world"\n'
                                   '\n'
                                   '"two\nlines",7,"say ""hi"""\n'
                                   'last,x,y\n')
    assert read_rows_located(p) == [
        (2, {"instruction": "Say hi", "input": "", "output": "hello, world"}),
        (4, {"instruction": "two\nlines", "input": "7", "output": 'say "hi"'}),
        (6, {"instruction": "last", "input": "x", "output": "y"}),
    ]


def test_csv_holds_long_documents(tmp_path):
    text = "word " * 40_000  # 200 KB: over the csv module's default field limit of 128 KiB
    p = _write(tmp_path / "d.csv", f'text\n"{text}"\n')
    assert read_rows(p) == [{"text": text}]


@pytest.mark.parametrize("text, expect", [
    ("a,b\n1,2\n1,2,3\n", r"d\.csv:3: 3 fields, but the header has 2 columns; put quotes"),
    ("a,b\n1\n", r"d\.csv:2: 1 fields, but the header has 2 columns"),
    ('text\nok\n"open\nquote\n', r"d\.csv:3: malformed CSV \(unexpected end of data\); quote"),
    ("text,,output\n", r"d\.csv:1: column 2 of the header has no name; the header must name"),
    ("\ntext,Text,text\n", r"d\.csv:2: column 'text' appears twice in the header"),
    ("messages\nhi\n", r"d\.csv:1: a CSV column 'messages' would hold text, not the list of "
                        r"turns the messages format needs; write the conversations as \.jsonl"),
    ("id,conversations\n1,hi\n", r"d\.csv:1: a CSV column 'conversations'"),
    ("instruction,output\n", r"d\.csv: file is empty \(no rows\)"),
    ("", r"d\.csv: file is empty \(no rows\)"),
])
def test_csv_errors_name_file_and_line(tmp_path, text, expect):
    p = _write(tmp_path / "d.csv", text)
    with pytest.raises(LeantuneError, match=expect) as ei:
        read_rows(p)
    assert "\n" not in str(ei.value)


def test_csv_rows_train(tmp_path):
    """An alpaca CSV goes through format detection and tokenization like JSON rows, and a bad
    row is reported at its line."""
    from helpers import make_tokenizer

    from leantune.data import SFTDataset

    tok = make_tokenizer()
    p = _write(tmp_path / "d.csv", "instruction,input,output\nSay hi,,hello world\n"
                                   "Add,1 2,3\n")
    ds = SFTDataset(p, tok, 64)
    assert ds.format == "alpaca" and ds.num_docs == 2 and ds.locations == [2, 3]
    text = _write(tmp_path / "t.csv", "text\nThe quick brown fox\n")
    assert SFTDataset(text, tok, 64).format == "text"
    with pytest.raises(LeantuneError, match=r"bad\.csv:3: missing field 'output'"):
        SFTDataset(_write(tmp_path / "bad.csv", "instruction,answer\n\nSay hi,hello\n"),
                   tok, 64, format="alpaca")


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
