"""Format detection and tokenization with loss masks."""

import json

import pytest

from leantune.data import SFTDataset, detect_format, encode_example, validate_format
from leantune.data.formats import _tokenize_with_spans, assistant_char_spans
from leantune.errors import LeantuneError


def trained_text(tok, ids, mask):
    return tok.decode([i for i, m in zip(ids, mask) if m])


CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital."},
    {"role": "user", "content": "And the dog?"},
    {"role": "assistant", "content": "The lazy dog."},
]


# ---- detection ------------------------------------------------------------------------------

@pytest.mark.parametrize("row,fmt", [
    ({"instruction": "i", "output": "o"}, "alpaca"),
    ({"instruction": "i", "input": "x", "output": "o"}, "alpaca"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "messages"),
    ({"text": "hello"}, "text"),
])
def test_detect(row, fmt):
    assert detect_format([row, row], "d.jsonl") == fmt


def test_detect_unknown_names_keys_and_formats():
    with pytest.raises(LeantuneError) as ei:
        detect_format([{"prompt": "p", "completion": "c"}], "d.jsonl")
    msg = str(ei.value)
    assert msg.startswith("d.jsonl: cannot detect the data format")
    assert "'prompt'" in msg and "'instruction' and 'output'" in msg and "--format" in msg


def test_detect_mixed():
    with pytest.raises(LeantuneError, match="mixed data formats.*row 2 looks like text"):
        detect_format([{"instruction": "i", "output": "o"}, {"text": "t"}], "d.jsonl")


def test_validate_format():
    assert validate_format("Alpaca") == "alpaca"
    assert validate_format("sharegpt") == "messages"
    with pytest.raises(LeantuneError, match="unknown --format 'csv'.*alpaca, messages, text"):
        validate_format("csv")


# ---- alpaca / text --------------------------------------------------------------------------

def test_alpaca_masks_prompt(tokenizer):
    row = {"instruction": "Translate to French", "input": "hello world", "output": "bonjour"}
    ids, mask = encode_example(row, "alpaca", tokenizer)
    assert len(ids) == len(mask)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert ids[-1] == tokenizer.eos_token_id and mask[-1]
    assert trained_text(tokenizer, ids, mask) == "bonjour</s>"
    full = tokenizer.decode(ids)
    assert full == ("<s>### Instruction:\nTranslate to French\n\n### Input:\nhello world\n\n"
                    "### Response:\nbonjour</s>")


def test_alpaca_without_input_omits_section(tokenizer):
    ids, mask = encode_example({"instruction": "Say hi", "input": "", "output": "Hello"},
                               "alpaca", tokenizer)
    assert "### Input" not in tokenizer.decode(ids)
    assert trained_text(tokenizer, ids, mask) == "Hello</s>"


def test_alpaca_train_on_inputs(tokenizer):
    row = {"instruction": "Say hi", "output": "Hello"}
    ids, mask = encode_example(row, "alpaca", tokenizer, train_on_inputs=True)
    assert not mask[0] and all(mask[1:])  # BOS is never a target


def test_text_trains_everything(tokenizer):
    ids, mask = encode_example({"text": "The quick brown fox."}, "text", tokenizer)
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert trained_text(tokenizer, ids, mask) == "The quick brown fox.</s>"
    assert all(mask[1:])


def test_text_already_ending_with_eos_is_not_doubled(tokenizer):
    ids, _ = encode_example({"text": "Hello</s>"}, "text", tokenizer)
    assert ids.count(tokenizer.eos_token_id) == 1


# ---- messages -------------------------------------------------------------------------------

def test_messages_trains_only_assistant_turns(tokenizer):
    ids, mask = encode_example({"messages": CONV}, "messages", tokenizer)
    # The template emits BOS and closes each turn with EOS: neither is doubled.
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.eos_token_id) == len(CONV)
    assert trained_text(tokenizer, ids, mask) == "Paris is the capital.</s>The lazy dog.</s>"
    rendered = tokenizer.apply_chat_template(CONV, tokenize=False)
    assert tokenizer.decode(ids) == rendered


def test_messages_template_without_bos_or_eos(end_tokenizer):
    tok = end_tokenizer
    ids, mask = encode_example({"messages": CONV}, "messages", tok)
    assert ids[0] == tok.bos_token_id and not mask[0]
    assert ids[-1] == tok.eos_token_id and mask[-1]
    assert trained_text(tok, ids, mask) == "Paris is the capital.<|end|>The lazy dog.<|end|></s>"
    # EOS follows the closing marker directly (layout newline after it dropped).
    assert tok.decode(ids[-2:]) == "<|end|></s>"


def test_messages_train_on_inputs(tokenizer):
    ids, mask = encode_example({"messages": CONV}, "messages", tokenizer, train_on_inputs=True)
    assert all(mask[1:])


def test_sharegpt_conversations(tokenizer):
    row = {"conversations": [{"from": "human", "value": "Hello there"},
                             {"from": "gpt", "value": "I am fine."}]}
    ids, mask = encode_example(row, "messages", tokenizer)
    assert trained_text(tokenizer, ids, mask) == "I am fine.</s>"


def test_conversation_ending_with_user_has_no_trained_eos(end_tokenizer):
    row = {"messages": CONV[:2]}
    ids, mask = encode_example(row, "messages", end_tokenizer)
    assert not any(mask)


def test_piecewise_tokenization_matches_offsets(tokenizer):
    text, spans = assistant_char_spans(tokenizer, CONV)
    assert [text[s:e] for s, e in spans] == ["Paris is the capital.</s>", "The lazy dog.</s>"]
    a = _tokenize_with_spans(tokenizer, text, spans, use_offsets=True)
    b = _tokenize_with_spans(tokenizer, text, spans, use_offsets=False)
    assert trained_text(tokenizer, *a) == trained_text(tokenizer, *b)


def test_no_chat_template(plain_tokenizer):
    with pytest.raises(LeantuneError, match="d.jsonl:3: the tokenizer has no chat template"):
        encode_example({"messages": CONV}, "messages", plain_tokenizer, source="d.jsonl", line=3)


# ---- missing fields, reported with file and line ----------------------------------------------

def _jsonl(tmp_path, rows, name="data.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


@pytest.mark.parametrize("rows,fmt,pattern", [
    ([{"instruction": "a", "output": "b"}, {"instruction": "a", "input": "x"}], None,
     r"data\.jsonl:2: missing field 'output'; the alpaca format needs 'instruction' and "
     r"'output' \(optional 'input'\)"),
    ([{"text": "a"}, {"txt": "b"}], None,
     r"data\.jsonl:2: missing field 'text'; the text format needs a 'text' string"),
    ([{"instruction": "a", "output": "b"}, {"instruction": "a", "output": None}], None,
     r"data\.jsonl:2: field 'output' is null; the alpaca format needs 'instruction' and "),
    ([{"messages": [{"role": "user", "content": "x"}]}, {"messages": [{"role": "user"}]}], None,
     r"data\.jsonl:2: messages\[0\] is missing field 'content'; the messages format needs a "
     r"'messages'"),
    ([{"text": "a"}], "alpaca", r"data\.jsonl:1: missing field 'instruction'"),
])
def test_missing_field_errors(tmp_path, tokenizer, rows, fmt, pattern):
    p = _jsonl(tmp_path, rows)
    with pytest.raises(LeantuneError, match=pattern) as ei:
        SFTDataset(p, tokenizer, max_seq_len=64, format=fmt)
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)


def test_wrong_field_type(tokenizer):
    with pytest.raises(LeantuneError, match=r"d\.json \(row 4\): field 'output' must be a string"):
        encode_example({"instruction": "a", "output": ["x"]}, "alpaca", tokenizer,
                       source="d.json", line="row 4")
