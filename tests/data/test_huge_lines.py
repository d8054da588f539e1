"""A data line of tens of MB: cut before tokenizing (data/formats.py `_encode`), the kept tokens
the same as tokenizing it whole, and the memory bounded."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from leantune.data import SFTDataset, encode_example
from leantune.data.formats import CUT_MARGIN_TOKENS, longest_token_chars
from tests.helpers import CORPUS, make_spm_tokenizer, make_tokenizer

TOKENIZERS = {"byte-bpe": make_tokenizer(), "spm": make_spm_tokenizer()}
REPO = Path(__file__).resolve().parents[2]


def _text(n_chars: int, seed: int) -> str:
    """Corpus words, digits, punctuation, runs of spaces and newlines, non-ASCII letters, and
    long words without spaces (the hard case for a cut)."""
    rng = random.Random(seed)
    words = " ".join(CORPUS).split() + ["  ", "\n\n", "élan", "日本語", "1234567", "x" * 300]
    out, size = [], 0
    while size < n_chars:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("max_seq_len", [16, 100, 513])
def test_cut_keeps_the_same_tokens(name, max_seq_len):
    tok = TOKENIZERS[name]
    for seed in range(6):
        text = _text(60_000, seed)
        assert len(text) > (max_seq_len + 1 + CUT_MARGIN_TOKENS) * longest_token_chars(tok)
        whole = encode_example({"text": text}, "text", tok)[0][:max_seq_len]
        cut = encode_example({"text": text}, "text", tok, max_tokens=max_seq_len + 1)[0]
        assert cut[:max_seq_len] == whole
        row = {"instruction": text[:30_000], "output": text[30_000:]}
        whole = encode_example(row, "alpaca", tok)
        cut = encode_example(row, "alpaca", tok, max_tokens=max_seq_len + 1)
        assert cut[0][:max_seq_len] == whole[0][:max_seq_len]
        assert cut[1][:max_seq_len] == whole[1][:max_seq_len]


def test_dataset_of_a_huge_row_equals_the_untruncated_encoding():
    tok = TOKENIZERS["byte-bpe"]
    rows = [{"text": _text(200_000, 7)}, {"text": "short one"}]
    ds = SFTDataset(rows, tok, max_seq_len=64)
    ids, _ = encode_example(rows[0], "text", tok)  # whole text, no bound
    assert ds.docs[0][0] == ids[:64] and ds.truncated == [True, False]


def test_a_30mb_line_needs_little_memory(tmp_path):
    """Peak RSS of building the dataset from a file with one ~30 MB line over the resident size
    before, measured in a fresh process (ru_maxrss is the process's peak, in KiB on Linux)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's /proc to read the resident size")
    data = tmp_path / "big.jsonl"
    data.write_text(json.dumps({"text": _text(30_000_000, 1)}) + "\n"
                    + json.dumps({"text": "a small row"}) + "\n")
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.helpers import make_tokenizer
        from leantune.data import SFTDataset
        tok = make_tokenizer()
        with open("/proc/self/status") as f:  # resident now, in KiB (the baseline)
            before = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
        ds = SFTDataset({str(data)!r}, tok, max_seq_len=2048)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(len(ds.docs[0][0]), (after - before) // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    n_tokens, grown_mib = map(int, out.stdout.split())
    assert n_tokens == 2048
    assert grown_mib < 600, f"peak RSS grew by {grown_mib} MiB"
    print(f"peak RSS grew by {grown_mib} MiB")
