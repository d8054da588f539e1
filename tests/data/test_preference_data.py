"""Preference data (data/preference.py): row forms, truncation, errors, packing."""

import json

import pytest
import torch

from leantune import assets
from leantune.batch import IGNORE_INDEX
from leantune.data.preference import (
    PreferenceDataset,
    pack_kto_batch,
    pack_preference_batch,
    split_shared_prefix,
    truncate,
)
from leantune.errors import LeantuneError
from leantune.train.losses import sum_by_document


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


CONV = {"prompt": [user("Capital of France?")], "chosen": [bot("Paris.")],
        "rejected": [bot("Rome.")]}


def decoded(tok, pair):
    return tok.decode(pair.prompt), tok.decode(pair.chosen), tok.decode(pair.rejected)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- forms ----------------------------------------------------------------------------------

def test_string_pairs_end_with_eos_and_join_to_the_whole(tokenizer):
    ds = PreferenceDataset([{"prompt": "The capital of France is", "chosen": " Paris.",
                             "rejected": " Rome."}], tokenizer, 64)
    assert (ds.kind, ds.form) == ("pairs", "strings")
    pair = ds[0]
    assert pair.prompt[0] == tokenizer.bos_token_id
    assert pair.chosen[-1] == pair.rejected[-1] == tokenizer.eos_token_id
    whole = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    assert pair.prompt[1:] + pair.chosen[:-1] == whole


def test_conversational_prompt_uses_the_generation_prompt(tokenizer):
    ds = PreferenceDataset([CONV], tokenizer, 64)
    assert ds.form == "conversational"
    prompt, chosen, rejected = decoded(tokenizer, ds[0])
    assert prompt.endswith("<|assistant|>\n") and "Capital of France?" in prompt
    assert (chosen, rejected) == ("Paris.</s>", "Rome.</s>")
    # prompt + chosen is the rendered whole conversation (its layout "\n" after EOS dropped)
    whole = tokenizer.apply_chat_template(CONV["prompt"] + CONV["chosen"], tokenize=False)
    assert tokenizer.decode(ds[0].prompt + ds[0].chosen) == whole.rstrip("\n")


def test_whole_conversations_split_at_the_shared_prefix(tokenizer):
    chosen = [user("Hi"), bot("Hello."), user("Capital of France?"), bot("Paris.")]
    rejected = chosen[:3] + [bot("Rome.")]
    assert split_shared_prefix(chosen, rejected) == (chosen[:3], chosen[3:], rejected[3:])
    implicit = PreferenceDataset([{"chosen": chosen, "rejected": rejected}], tokenizer, 64)[0]
    explicit = PreferenceDataset([{"prompt": chosen[:3], "chosen": chosen[3:],
                                   "rejected": rejected[3:]}], tokenizer, 64)[0]
    assert decoded(tokenizer, implicit) == decoded(tokenizer, explicit)
    assert "Hello." in tokenizer.decode(implicit.prompt)


@pytest.mark.parametrize("label,expected", [(True, True), (False, False), ("false", False)])
def test_kto_rows(tokenizer, label, expected):
    ds = PreferenceDataset([{"prompt": [user("Capital of Peru?")], "completion": [bot("Lima.")],
                             "label": label}], tokenizer, 64)
    assert (ds.kind, ds.form) == ("kto", "conversational")
    assert ds[0].label is expected
    assert tokenizer.decode(ds[0].completion) == "Lima.</s>"


# ---- errors name the file and line ----------------------------------------------------------

@pytest.mark.parametrize("bad,message", [
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, ":3: the chosen and rejected "
                                                            "completions are identical"),
    ({"prompt": "p", "chosen": "c"}, ":3: missing field 'rejected'"),
    ({"prompt": "p", "chosen": "c", "rejected": None}, ":3: field 'rejected' is null"),
    ({"prompt": "p", "chosen": [bot("a")], "rejected": "b"}, ":3: field 'chosen' must be a string"),
])
def test_bad_rows_name_file_and_line(tokenizer, tmp_path, bad, message):
    good = {"prompt": "p", "chosen": "yes", "rejected": "no"}
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(LeantuneError) as ei:
        PreferenceDataset(path, tokenizer, 64)
    assert f"{path}{message}" in str(ei.value)


def test_conversational_errors(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [
        CONV, {"chosen": [user("a"), bot("b")], "rejected": [user("x"), bot("y")]}])
    with pytest.raises(LeantuneError, match=r"c.jsonl:2: missing field 'prompt', and 'chosen'"):
        PreferenceDataset(path, tokenizer, 64)
    write_jsonl(path, [CONV, {"prompt": "p", "completion": "c", "label": True}])
    with pytest.raises(LeantuneError, match=r"c.jsonl:2: a kto row in a file of pairs rows"):
        PreferenceDataset(path, tokenizer, 64)
    write_jsonl(path, [{"prompt": "p", "completion": "c", "label": "maybe"}])
    with pytest.raises(LeantuneError, match=r"c.jsonl:1: field 'label' must be true or false"):
        PreferenceDataset(path, tokenizer, 64)
    with pytest.raises(LeantuneError, match="--max-prompt-len 64 must be below --max-seq-len"):
        PreferenceDataset([CONV], tokenizer, 64, max_prompt_len=64)


# ---- truncation -----------------------------------------------------------------------------

def test_truncate_cuts_prompt_left_then_completions_right():
    prompt = [1] + list(range(10, 30))  # BOS + 20 tokens
    chosen, rejected = list(range(100, 112)), list(range(200, 203))
    p, (c, r), p_cut, c_cut = truncate(prompt, [chosen, rejected], 24, 8, bos=1)
    assert p == [1] + list(range(23, 30)) and p_cut  # BOS kept, the prompt's end kept
    assert c == chosen[:16] == chosen and r == rejected and not c_cut
    p, (c, r), p_cut, c_cut = truncate(prompt, [chosen, rejected], 16, None, bos=1)
    assert len(p) == 8 and p[0] == 1 and p[-1] == 29  # cut to max_seq_len // 2 at the most
    assert c == chosen[:8] and r == rejected and p_cut and c_cut


def test_dataset_counts_truncation(tokenizer):
    rows = [{"prompt": "word " * 40, "chosen": "yes " * 30, "rejected": "no"},
            {"prompt": "short", "chosen": "a", "rejected": "b"}]
    ds = PreferenceDataset(rows, tokenizer, 48, max_prompt_len=20)
    assert ds.num_prompt_truncated == 1 and ds.num_completion_truncated == 1
    for pair in ds:
        assert len(pair.prompt) <= 20
        assert len(pair.prompt) + max(len(pair.chosen), len(pair.rejected)) <= 48
    assert "1 prompts cut from the left" in ds.summary()


# ---- packing --------------------------------------------------------------------------------

def _pairs(tokenizer, n=5):
    rows = [{"prompt": [user(f"Question {i}: " + "why " * i)], "chosen": [bot("good " * (i + 1))],
             "rejected": [bot("bad")]} for i in range(n)]
    return PreferenceDataset(rows, tokenizer, 64).items


def test_pack_keeps_pairs_together_and_labels_only_completions(tokenizer):
    pairs = _pairs(tokenizer)
    pb = pack_preference_batch(pairs, 64, pad_id=tokenizer.pad_token_id)
    b = pb.batch
    assert pb.num_units == 5 and len(pb.doc_unit) == 10
    assert b.input_ids.shape[0] > 1  # several rows: the pairs' documents span rows
    assert set(pb.doc_index.unique().tolist()) - {-1} == set(range(10))
    for d in range(10):
        pair = pairs[int(pb.doc_unit[d])]
        completion = pair.chosen if pb.doc_role[d] == 0 else pair.rejected
        where = pb.doc_index == d
        assert b.input_ids[where].tolist() == pair.prompt + completion
        # the targets of this document are exactly its completion tokens
        targets = b.labels[where]
        assert targets[targets != IGNORE_INDEX].tolist() == completion
        assert int(pb.completion_tokens[d]) == len(completion)
    assert pb.first_doc.tolist() == [0, 2, 4, 6, 8] and pb.second_doc.tolist() == [1, 3, 5, 7, 9]
    assert b.num_target_tokens == int(pb.completion_tokens.sum())


def test_packed_logps_give_per_pair_sums(tokenizer):
    """doc_index + the labels mask select each document's completion log-probs."""
    pb = pack_preference_batch(_pairs(tokenizer, 3), 64)
    token_logps = -torch.rand(pb.batch.input_ids.shape)
    sums, counts = sum_by_document(token_logps.flatten(), pb.doc_index.flatten(), 6,
                                   pb.batch.labels.flatten() != IGNORE_INDEX)
    assert counts.tolist() == pb.completion_tokens.tolist()
    for d in range(6):
        mask = (pb.doc_index == d) & (pb.batch.labels != IGNORE_INDEX)
        assert sums[d].item() == pytest.approx(token_logps[mask].sum().item())


def test_pack_kto_adds_rotated_kl_documents(tokenizer):
    rows = PreferenceDataset([{"prompt": f"q{i}", "completion": f"answer {i}", "label": i % 2 == 0}
                              for i in range(3)], tokenizer, 32).items
    pb = pack_kto_batch(rows, 32)
    assert pb.label.tolist() == [True, False, True]
    for i in range(3):
        kl = pb.batch.input_ids[pb.doc_index == int(pb.second_doc[i])].tolist()
        assert kl == rows[i].prompt + rows[i - 1].completion


# ---- the demo asset -------------------------------------------------------------------------

def test_demo_preference_file_reads_with_the_demo_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets.path("tiny-llama"))
    ds = PreferenceDataset(assets.path("data/demo_preference.jsonl"), tok, 128)
    assert (ds.kind, ds.form) == ("pairs", "conversational") and len(ds) >= 40
    assert ds.num_prompt_truncated == ds.num_completion_truncated == 0
    prompt, chosen, rejected = (tok.decode(x) for x in (ds[0].prompt, ds[0].chosen,
                                                        ds[0].rejected))
    assert "capital" in prompt and chosen != rejected
