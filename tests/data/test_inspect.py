"""`leantune inspect-data`: documents as the model sees them (trained tokens marked), lengths,
packing, truncated and dropped rows; the tokenizer alone is loaded."""

from __future__ import annotations

import io
import re
import shutil

import pytest
from helpers import alpaca_rows, cli_error, make_tokenizer, run_cli, write_jsonl
from helpers import tiny_ckpt  # noqa: F401  (fixture)

from leantune.batch import IGNORE_INDEX
from leantune.data import PackedLoader, SFTDataset
from leantune.data.inspect import (
    CLOSE,
    GREEN,
    OPEN,
    RESET,
    TOKENIZER_PATTERNS,
    render_document,
    trained_mask,
    use_color,
)

LONG_PROMPT = {"instruction": "What is the capital of France? " * 6, "input": "",
               "output": "Paris"}  # fills --max-seq-len 48: nothing left to train, dropped
LONG_OUTPUT = {"instruction": "Say", "input": "", "output": "hello world " * 20}  # truncated


def inspect(capsys, *args):
    return run_cli(capsys, "inspect-data", *args)


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def test_trained_mask_reads_the_shifted_labels():
    # labels[i] is the target after token i: tokens 2 and 3 are trained
    assert trained_mask([IGNORE_INDEX, 7, 8, IGNORE_INDEX]) == [False, False, True, True]


def test_render_marks_trained_spans(tokenizer):
    ds = SFTDataset(alpaca_rows(1), tokenizer, 128)
    ids, labels = ds.docs[0]
    mask = trained_mask(labels)
    start = mask.index(True)
    assert all(mask[start:]) and not any(mask[:start])  # the response and EOS, at the end
    prompt = tokenizer.decode(ids[:start])
    response = tokenizer.decode(ids[start:])
    assert response == alpaca_rows(1)[0]["output"] + "</s>"

    assert render_document(ids, mask, tokenizer, color=False) == f"{prompt}{OPEN}{response}{CLOSE}"
    assert render_document(ids, mask, tokenizer, color=True) == f"{prompt}{GREEN}{response}{RESET}"

    shown = render_document(ids, mask, tokenizer, color=False, tokens=True)
    pieces = re.findall(r'"(?:[^"\\]|\\.)*"', shown)  # one JSON string per token
    assert len(pieces) == len(ids)
    assert pieces[0] == '"<s>"' and pieces[-1] == '"</s>"' and '"\\n"' in pieces
    assert shown.endswith(" " + OPEN + " ".join(pieces[start:]) + CLOSE)


def test_use_color_only_for_a_terminal(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(Tty()) and not use_color(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())


def test_inspect_data_report(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    from transformers import AutoTokenizer

    rows = [LONG_PROMPT, LONG_OUTPUT] + alpaca_rows(6)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    rc, out, err = inspect(capsys, "--data", data, "--model", tiny_ckpt, "--max-seq-len", 48,
                           "--rows", 2)
    assert rc == 0, err
    assert "\x1b[" not in out  # not a terminal: plain markers

    ds = SFTDataset(data, AutoTokenizer.from_pretrained(tiny_ckpt), 48)
    assert (ds.num_truncated, ds.num_dropped, ds.locations[:2]) == (1, 1, [2, 3])
    lines = out.splitlines()
    assert lines[0] == ds.summary()
    assert lines[1] == "trained tokens are shown inside [[ ]]"
    for k in range(2):
        ids, labels = ds.docs[k]
        n_trained = sum(lab != IGNORE_INDEX for lab in labels)
        cut = ", truncated to --max-seq-len 48" if k == 0 else ""
        header = f"document {k + 1} ({data}:{k + 2}): {len(ids)} tokens, {n_trained} trained{cut}"
        assert header in lines
        body = out.split(header + "\n")[1].split("\n\n")[0]
        assert all(line.startswith("    ") for line in body.splitlines())
        marked = re.findall(r"\[\[(.*?)\]\]", body, flags=re.S)
        start = len(ids) - n_trained  # the trained tokens are the document's tail
        assert marked == [ds.tokenizer.decode(ids[start:])]
    assert "document 3 " not in out  # --rows 2

    loader = PackedLoader(ds, 1, 48, shuffle=False)
    per_row = [len(r) for r in loader.epoch_rows(0)]
    lengths = ds.lengths
    assert f"lengths: {min(lengths)} to {max(lengths)} tokens, median " in out
    assert (f"packing: 7 documents -> {loader.num_rows} rows of 48 tokens, "
            f"{7 / loader.num_rows:.1f} documents per row ({min(per_row)} to {max(per_row)}), "
            f"{100 * loader.packing_efficiency:.1f}% of the row tokens are real") in out
    assert lines[-1] == ("truncated: 1 of 8 rows cut to --max-seq-len 48; dropped: 1 rows with "
                         "no trained token left")


def test_inspect_data_tokens_and_train_on_inputs(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_rows(3))
    rc, out, err = inspect(capsys, "--data", data, "--model", tiny_ckpt, "--rows", 1,
                           "--tokens", "--train-on-inputs")
    assert rc == 0, err
    doc = out.split("\n\n")[1].splitlines()
    n_tokens, n_trained = map(int, re.search(r"(\d+) tokens, (\d+) trained", doc[0]).groups())
    assert n_trained == n_tokens - 1  # everything but BOS
    assert doc[1].startswith('    "<s>" [["') and doc[1].endswith('"</s>"]]')


def test_only_the_tokenizer_is_loaded(tiny_ckpt, tmp_path, capsys, monkeypatch):  # noqa: F811
    """A folder without weights is enough; a hub id downloads the tokenizer files only."""
    tok_only = tmp_path / "tokenizer-only"
    shutil.copytree(tiny_ckpt, tok_only, ignore=shutil.ignore_patterns("*.safetensors"))
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_rows(2))
    rc, out, err = inspect(capsys, "--data", data, "--model", tok_only, "--rows", 0)
    assert rc == 0, err
    assert "document 1" not in out and "packing: 2 documents -> 1 row of" in out

    import huggingface_hub

    calls = []

    def snapshot_download(repo_id, allow_patterns=None):
        calls.append((repo_id, allow_patterns))
        return str(tok_only)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    rc, out, err = inspect(capsys, "--data", data, "--model", "org/model", "--rows", 1)
    assert rc == 0, err
    assert calls == [("org/model", TOKENIZER_PATTERNS)]
    assert not any(p.endswith((".safetensors", ".bin", "*")) for p in TOKENIZER_PATTERNS)
    assert "document 1" in out


def one_line_error(capsys, *args) -> str:
    return cli_error(capsys, "inspect-data", *args)


def test_inspect_data_errors(tiny_ckpt, tmp_path, capsys, monkeypatch):  # noqa: F811
    data = write_jsonl(tmp_path / "d.jsonl", alpaca_rows(2))
    missing = tmp_path / "missing.jsonl"
    assert f"{missing}: data file not found; check the path" in one_line_error(
        capsys, "--data", missing, "--model", tiny_ckpt)
    assert "--rows must be 0 or more, got -1" in one_line_error(
        capsys, "--data", data, "--model", tiny_ckpt, "--rows", -1)
    assert "--max-seq-len must be a positive integer" in one_line_error(
        capsys, "--data", data, "--model", tiny_ckpt, "--max-seq-len", 0)
    assert "no trainable examples" in one_line_error(
        capsys, "--data", write_jsonl(tmp_path / "long.jsonl", [LONG_PROMPT]), "--model",
        tiny_ckpt, "--max-seq-len", 48)
    assert f"{tmp_path / 'nope'}: model path does not exist" in one_line_error(
        capsys, "--data", data, "--model", tmp_path / "nope")

    import huggingface_hub

    def offline(repo_id, allow_patterns=None):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert ("org/model: no local folder of that name, and its tokenizer could not be downloaded "
            "from the hub (OSError); check the path or id, your network, or HF_TOKEN"
            ) in one_line_error(capsys, "--data", data, "--model", "org/model")
