"""Reading training rows from disk.

A data file is a list of JSON-like objects ("rows"). Three containers are accepted:

* ``.jsonl`` / ``.ndjson``: one JSON object per line; blank lines are skipped.
* ``.json``: a list of objects, or an object holding that list under ``"data"`` or ``"train"``.
* ``.csv``: a header row naming the fields, then one row per record; every value is a string.
  (The messages format needs lists of turns, which a CSV cell cannot hold: use JSON for it.)
* ``.parquet``: one row per record (needs the optional ``pyarrow`` dependency).

Every problem with the file is raised as a one-line `LeantuneError` that names the file (and, for
JSON Lines and CSV, the line number) so a user can jump straight to the culprit.

Rows carry a *location* so later stages (format detection, tokenization) can point at the exact
source of a bad row: an ``int`` line number for JSON Lines and CSV (where the record starts), a
``"row N"`` label (1-based) for containers that have no meaningful line numbers.
`format_location` turns it into text.
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any

from leantune.errors import LeantuneError

# Where a row came from: a 1-based line number (JSON Lines) or a label such as "row 5".
Location = int | str

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
CSV_SUFFIXES = (".csv",)
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + JSON_SUFFIXES + CSV_SUFFIXES + PARQUET_SUFFIXES
# A CSV cell may hold a whole document: allow far more than the csv module's 128 KiB default.
CSV_FIELD_LIMIT = 1 << 30
# A JSON Lines line longer than this is refused before parsing (parsing it would take many GiB).
MAX_LINE_CHARS = 1 << 30


def format_location(source: str | os.PathLike | None, line: Location | None) -> str:
    """Render a row's location for error messages: ``data.jsonl:17`` or ``data.json (row 5)``."""
    src = str(source) if source is not None else "<rows>"
    if line is None:
        return src
    if isinstance(line, int):
        return f"{src}:{line}"
    return f"{src} ({line})"


def _type_name(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


def _short(exc: Exception) -> str:
    """A one-line description of a parser exception (without positions we already report)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at column {exc.colno}"
    return " ".join(str(exc).split())[:200]


def _read_text(path: Path) -> str:
    try:
        # utf-8-sig: tolerate a byte-order mark written by some editors/exporters.
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise LeantuneError(
            f"{path}: not valid UTF-8 text (byte {e.start}); save the file as UTF-8") from None
    except OSError as e:
        raise LeantuneError(f"{path}: cannot read file ({e.strerror or e})") from None


def _read_jsonl(path: Path) -> list[tuple[Location, dict]]:
    out: list[tuple[Location, dict]] = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_CHARS:
            raise LeantuneError(
                f"{path}:{lineno}: a line of {len(line)} characters, over the limit of "
                f"{MAX_LINE_CHARS}; split the example or shorten it (rows are cut to "
                "--max-seq-len tokens anyway)")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise LeantuneError(
                f"{path}:{lineno}: malformed JSON ({_short(e)}); each line must be one JSON "
                "object") from None
        except RecursionError:
            raise LeantuneError(f"{path}:{lineno}: JSON nested too deeply to read; each line "
                                "must be one JSON object of a few levels") from None
        if not isinstance(obj, dict):
            raise LeantuneError(
                f"{path}:{lineno}: expected a JSON object, got {_type_name(obj)}; each line must "
                "be one JSON object such as {\"text\": ...}")
        out.append((lineno, obj))
    return out


def _read_json(path: Path) -> list[tuple[Location, dict]]:
    text = _read_text(path)
    if not text.strip():
        return []
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LeantuneError(
            f"{path}:{e.lineno}: malformed JSON ({_short(e)}); a .json file must hold a list of "
            "objects (use .jsonl for one object per line)") from None
    except RecursionError:
        raise LeantuneError(f"{path}: JSON nested too deeply to read; a .json file must hold a "
                            "list of objects of a few levels") from None
    if isinstance(obj, dict):
        for key in ("data", "train"):
            if isinstance(obj.get(key), list):
                obj = obj[key]
                break
        else:
            raise LeantuneError(
                f"{path}: expected a list of objects or an object with a \"data\" or \"train\" "
                f"list, got an object with keys {sorted(obj)[:8]}")
    if not isinstance(obj, list):
        raise LeantuneError(
            f"{path}: expected a list of objects, got {_type_name(obj)}")
    out: list[tuple[Location, dict]] = []
    for i, row in enumerate(obj, start=1):
        if not isinstance(row, dict):
            raise LeantuneError(
                f"{path} (row {i}): expected a JSON object, got {_type_name(row)}; the list must "
                "hold objects such as {\"text\": ...}")
        out.append((f"row {i}", row))
    return out


def _csv_header(path: Path, line: int, header: list[str]) -> list[str]:
    """Column names of a CSV header (surrounding spaces dropped), checked for use as row keys."""
    names = [h.strip() for h in header]
    for i, name in enumerate(names, start=1):
        if not name:
            raise LeantuneError(f"{path}:{line}: column {i} of the header has no name; the "
                                "header must name every column (e.g. instruction,input,output)")
        if names.index(name) != i - 1:
            raise LeantuneError(f"{path}:{line}: column {name!r} appears twice in the header; "
                                "give each column its own name")
    for name in ("messages", "conversations"):
        if name in names:
            raise LeantuneError(
                f"{path}:{line}: a CSV column {name!r} would hold text, not the list of turns the "
                "messages format needs; write the conversations as .jsonl, or use alpaca "
                "(instruction,input,output) or text columns")
    return names


def _read_csv(path: Path) -> list[tuple[Location, dict]]:
    reader = csv.reader(io.StringIO(_read_text(path), newline=""), strict=True)
    names: list[str] | None = None
    out: list[tuple[Location, dict]] = []
    old_limit = csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        start = 1  # the line where the next record starts
        for record in reader:
            line, start = start, reader.line_num + 1
            if not record:
                continue  # a blank line
            if names is None:
                names = _csv_header(path, line, record)
                continue
            if len(record) != len(names):
                raise LeantuneError(
                    f"{path}:{line}: {len(record)} fields, but the header has {len(names)} "
                    "columns; put quotes around values that hold commas (\"a, b\")")
            out.append((line, dict(zip(names, record))))
    except csv.Error as e:
        raise LeantuneError(f"{path}:{start}: malformed CSV ({_short(e)}); quote values that "
                            "hold commas, quotes or line breaks (\"say \"\"hi\"\"\")") from None
    finally:
        csv.field_size_limit(old_limit)
    return out


def _read_parquet(path: Path) -> list[tuple[Location, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise LeantuneError(
            f"{path}: reading .parquet files needs pyarrow; run `pip install pyarrow` "
            "(or `pip install leantune[parquet]`), or convert the file to .jsonl") from None
    try:
        rows = pq.read_table(str(path)).to_pylist()
    except Exception as e:  # pyarrow raises several unrelated exception types
        raise LeantuneError(f"{path}: cannot read parquet file ({_short(e)})") from None
    return [(f"row {i}", row) for i, row in enumerate(rows, start=1)]


def read_rows_located(path: str | os.PathLike) -> list[tuple[Location, dict]]:
    """Read a data file into ``[(location, row), ...]``; see the module docstring.

    Raises:
        LeantuneError: missing file, unknown extension, unreadable/malformed content, a row that
            is not an object, or a file without any rows.
    """
    p = Path(path)
    if not p.exists():
        raise LeantuneError(f"{p}: data file not found; check the path")
    if p.is_dir():
        raise LeantuneError(f"{p}: is a directory; pass a .jsonl, .json, .csv or .parquet file")
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        rows = _read_jsonl(p)
    elif suffix in JSON_SUFFIXES:
        rows = _read_json(p)
    elif suffix in CSV_SUFFIXES:
        rows = _read_csv(p)
    elif suffix in PARQUET_SUFFIXES:
        rows = _read_parquet(p)
    else:
        raise LeantuneError(
            f"{p}: unknown data file extension {suffix or '(none)'!r}; use .jsonl, .json, .csv "
            "or .parquet")
    if not rows:
        raise LeantuneError(f"{p}: file is empty (no rows); add at least one example")
    return rows


def read_rows(path: str | os.PathLike) -> list[dict]:
    """Read a .jsonl / .json / .csv / .parquet data file into a list of row dicts.

    Raises:
        LeantuneError: one line naming the file (and line number for JSON Lines and CSV).
    """
    return [row for _, row in read_rows_located(path)]
