"""A data line of tens of MB: cut before tokenizing (data/formats.py `_encode` for texts,
`_encode_messages` for conversations), the kept tokens and mask the same as tokenizing it whole,
and the memory bounded."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from leantune.data import SFTDataset, encode_example, files
from leantune.data.formats import CUT_MARGIN_TOKENS, cut_chars, longest_token_chars
from leantune.errors import LeantuneError
from tests.helpers import CORPUS, END_TEMPLATE, make_spm_tokenizer, make_tokenizer

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


# Qwen3-like: an assistant turn after the last user turn is rendered with a marker, so a turn's
# text depends on the turns after it (dropping them instead of emptying them would change it).
LOOK_AHEAD_TEMPLATE = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
    "<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' and loop.index0 > ns.last %}"
    "<|system|>{% endif %}{{ m['content'] }}<|end|>\n{% endfor %}"
)
CHAT_TOKENIZERS = {"byte-bpe": make_tokenizer(), "end": make_tokenizer(END_TEMPLATE),
                   "spm": make_spm_tokenizer(), "look-ahead": make_tokenizer(LOOK_AHEAD_TEMPLATE)}


def _conversations(huge: str) -> dict[str, list[dict]]:
    def turns(*contents):
        roles = ["system"] + ["user", "assistant"] * len(contents)
        return [{"role": r, "content": c} for r, c in zip(roles, ("Be brief.",) + contents)]
    return {
        "huge middle turn": turns("Hi", "Hello there.", huge, "Paris.", "And?", "The dog."),
        "huge first user turn": turns(huge, "Paris is the capital.", "Thanks", "You are welcome."),
        "huge assistant turn": turns("What is it?", huge, "Really?", "Yes."),
        "huge last assistant turn": turns("What is it?", "It is.", "More?", huge),
        "many short turns": turns(*[huge[i:i + 40] for i in range(0, 12_000, 40)]),
    }


@pytest.mark.parametrize("name", CHAT_TOKENIZERS)
@pytest.mark.parametrize("max_seq_len", [16, 100])
@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_cut_conversation_keeps_the_same_tokens_and_mask(name, max_seq_len, train_on_inputs):
    """Contents cut before rendering: the first max_seq_len ids and mask equal those of the
    whole conversation rendered, tokenized and truncated."""
    tok = CHAT_TOKENIZERS[name]
    huge = _text(60_000, 3)
    assert len(huge) > cut_chars(tok, max_seq_len + 1)
    for label, msgs in _conversations(huge).items():
        row = {"messages": msgs}
        ids, mask = encode_example(row, "messages", tok, train_on_inputs=train_on_inputs)
        c_ids, c_mask = encode_example(row, "messages", tok, train_on_inputs=train_on_inputs,
                                       max_tokens=max_seq_len + 1)
        assert len(ids) > len(c_ids) >= max_seq_len, label  # it was cut, and keeps enough
        assert c_ids[:max_seq_len] == ids[:max_seq_len], label
        assert c_mask[:max_seq_len] == mask[:max_seq_len], label


def test_dataset_of_a_huge_conversation_trains_the_same_tokens():
    """A huge assistant turn after a short prompt: the kept labels are those of the whole row,
    and some of them are trained."""
    tok = CHAT_TOKENIZERS["end"]
    rows = [{"messages": _conversations(_text(200_000, 5))["huge assistant turn"]},
            {"messages": [{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hello"}]}]
    ds = SFTDataset(rows, tok, max_seq_len=64)
    ids, mask = encode_example(rows[0], "messages", tok)
    assert ds.docs[0][0] == ids[:64] and ds.truncated == [True, False]
    whole = SFTDataset(rows[:1], tok, max_seq_len=len(ids))  # untruncated labels, then cut
    assert ds.docs[0][1][:63] == whole.docs[0][1][:63]
    assert any(x != -100 for x in ds.docs[0][1])


def test_a_jsonl_line_over_the_limit_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_LINE_CHARS", 100)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "x" * 200}) + "\n")
    with pytest.raises(LeantuneError) as ei:
        files.read_rows(data)
    msg = str(ei.value)
    assert msg.startswith(f"{data}:2: a line of 212 characters") and "\n" not in msg


BIG_ROWS = {
    "text": lambda big: {"text": big},
    "messages": lambda big: {"messages": [{"role": "user", "content": "Say a lot."},
                                          {"role": "assistant", "content": big},
                                          {"role": "user", "content": "Thanks."}]},
}


@pytest.mark.parametrize("kind", BIG_ROWS)
def test_a_30mb_line_needs_little_memory(tmp_path, kind):
    """Peak RSS of building the dataset from a file with one ~30 MB line over the resident size
    before, measured in a fresh process (ru_maxrss is the process's peak, in KiB on Linux)."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux's /proc to read the resident size")
    data = tmp_path / "big.jsonl"
    small = BIG_ROWS[kind]("a small row")
    data.write_text(json.dumps(BIG_ROWS[kind](_text(30_000_000, 1))) + "\n"
                    + json.dumps(small) + "\n")
    # The peak is the kernel's high-water mark (VmHWM), reset to the resident size just before
    # the build (writing 5 to clear_refs), so a transient peak of the imports or of the tokenizer
    # set-up cannot count. Where the reset is refused, a thread samples VmRSS every 2 ms instead.
    script = textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.helpers import make_tokenizer
        from leantune.data import SFTDataset

        def status(key):  # in KiB
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

        tok = make_tokenizer()
        hwm_imports = status("VmHWM")
        before = status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            reset = status("VmHWM") <= before + 1024
        except OSError:
            reset = False
        samples, done = [before], threading.Event()
        if not reset:
            def sample():
                while not done.is_set():
                    samples.append(status("VmRSS"))
                    time.sleep(0.002)
            threading.Thread(target=sample, daemon=True).start()
        ds = SFTDataset({str(data)!r}, tok, max_seq_len=2048)
        done.set()
        peak = status("VmHWM") if reset else max(samples + [status("VmRSS")])
        print(len(ds.docs[0][0]), (peak - before) // 1024, int(reset), hwm_imports // 1024,
              before // 1024)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    n_tokens, grown_mib, reset, hwm_imports, before = map(int, out.stdout.split())
    assert n_tokens == 2048
    how = "high-water mark reset" if reset else "sampled VmRSS"
    assert grown_mib < 600, (f"peak RSS grew by {grown_mib} MiB ({how}; resident before "
                             f"{before} MiB, peak of the set-up {hwm_imports} MiB)")
    print(f"peak RSS grew by {grown_mib} MiB")
