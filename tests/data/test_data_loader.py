"""SFTDataset and PackedLoader: truncation, batches, determinism and exact resume."""

import random

import pytest
import torch

from leantune.batch import IGNORE_INDEX
from leantune.data import PackedLoader, SFTDataset
from leantune.errors import LeantuneError

WORDS = "the quick brown fox jumps over lazy dog Paris is capital of France hello world".split()


def _rows(n=60, seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if i % 3 == 0:
            rows.append({"instruction": " ".join(rng.choices(WORDS, k=rng.randint(1, 8))),
                         "output": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))})
        else:
            rows.append({"instruction": "Say", "input": " ".join(rng.choices(WORDS, k=3)),
                         "output": " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))})
    return rows


@pytest.fixture(scope="module")
def dataset(tokenizer):
    return SFTDataset(_rows(), tokenizer, max_seq_len=48)


def test_dataset_counts(dataset):
    assert dataset.format == "alpaca"
    assert dataset.num_docs == len(dataset) == 60
    assert all(len(ids) == len(lab) <= 48 for ids, lab in dataset.docs)
    assert dataset.num_target_tokens == sum(
        sum(x != IGNORE_INDEX for x in lab) for _, lab in dataset.docs)
    assert dataset.num_truncated > 0  # long outputs were cut
    assert "truncated to 48 tokens" in dataset.summary()


def test_truncation_and_dropping(tokenizer):
    rows = [{"text": "hello world " * 40}, {"instruction": "the quick brown fox " * 20,
                                             "output": "dog"}]
    ds = SFTDataset(rows[:1], tokenizer, max_seq_len=16)
    assert ds.num_truncated == 1 and len(ds.docs[0][0]) == 16
    assert ds.docs[0][1][-1] == IGNORE_INDEX  # the last kept token predicts nothing
    ok = {"instruction": "a", "output": "b"}
    ds = SFTDataset([rows[1], ok], tokenizer, max_seq_len=16)
    assert ds.num_dropped == 1 and ds.num_docs == 1
    assert ds.dropped == {"empty": 0, "truncated": 1}
    assert ("1 of 2 rows dropped: 1 whose prompt fills --max-seq-len 16 [<rows> (row 1)], "
            "leaving no response token (raise --max-seq-len)") in ds.summary()
    user_only = {"messages": [{"role": "user", "content": "hello"}]}  # nothing to learn
    answered = {"messages": [{"role": "user", "content": "hello"},
                             {"role": "assistant", "content": "world"}]}
    ds = SFTDataset([user_only, answered], tokenizer, max_seq_len=64)
    assert ds.dropped == {"empty": 1, "truncated": 0}
    assert ds.dropped_summary() == ("1 of 2 rows dropped: 1 with no target tokens "
                                    "[<rows> (row 1)] (e.g. a conversation without an "
                                    "assistant turn, or an empty text: fix or remove them)")
    with pytest.raises(LeantuneError, match="no trainable examples.*--max-seq-len 16"):
        SFTDataset([rows[1]], tokenizer, max_seq_len=16)


@pytest.mark.parametrize("bad", [0, -5])
def test_max_seq_len_must_be_positive(tokenizer, bad):
    with pytest.raises(LeantuneError, match=rf"--max-seq-len must be a positive integer.*{bad}"):
        SFTDataset([{"text": "hi"}], tokenizer, max_seq_len=bad)


def test_split_eval(dataset):
    train, ev = dataset.split_eval(0.1, seed=3)
    assert len(ev) == 6 and len(train) == 54
    tr, evs = {id(d) for d in train.docs}, {id(d) for d in ev.docs}
    assert not tr & evs and len(tr | evs) == 60
    again = dataset.split_eval(0.1, seed=3)[1]
    assert again.docs == ev.docs
    with pytest.raises(LeantuneError, match="between 0 and 1"):
        dataset.split_eval(1.5)


def _check_batch(batch, max_seq_len):
    B, T = batch.shape
    assert batch.cu_seqlens.tolist() == [0] + list(torch.tensor(batch.seq_lens).cumsum(0))
    assert batch.cu_seqlens[-1] == B * T
    assert batch.max_seqlen == max(batch.seq_lens)
    pos = batch.position_ids.reshape(-1)
    ids = batch.input_ids.reshape(-1)
    lab = batch.labels.reshape(-1)
    cu = batch.cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        assert s // T == (e - 1) // T  # a segment never spans two rows
        assert torch.equal(pos[s:e], torch.arange(e - s))  # positions restart per document
        assert lab[e - 1] == IGNORE_INDEX  # no label crosses into the next document
        inner = lab[s:e - 1]
        keep = inner != IGNORE_INDEX
        assert torch.equal(inner[keep], ids[s + 1:e][keep])  # label = next token, same doc
    real = (batch.labels != IGNORE_INDEX).sum().item()
    assert batch.num_target_tokens == real


def test_loader_batches_are_consistent(dataset):
    loader = PackedLoader(dataset, batch_size=4, max_seq_len=48, seed=0)
    rows = loader.epoch_rows(0)
    assert sorted(d for r in rows for d in r) == list(range(len(dataset)))
    assert all(sum(dataset.lengths[d] for d in r) <= 48 for r in rows)
    assert len(loader) == -(-len(rows) // 4)
    for i, batch in enumerate(loader):
        _check_batch(batch, 48)
        batch_rows = rows[i * 4:(i + 1) * 4]
        assert batch.shape[0] == len(batch_rows) <= 4
        # one segment per document, plus one trailing-padding segment per row that is not full
        pads = sum(1 for r in batch_rows if sum(dataset.lengths[d] for d in r) < batch.shape[1])
        assert len(batch.seq_lens) == sum(len(r) for r in batch_rows) + pads
    total_targets = sum(b.num_target_tokens for b in loader)
    assert total_targets == dataset.num_target_tokens


def test_loader_shuffles_per_epoch_and_is_seeded(dataset):
    a = PackedLoader(dataset, batch_size=4, seed=7)
    b = PackedLoader(dataset, batch_size=4, seed=7)
    assert a.epoch_rows(0) == b.epoch_rows(0)
    assert a.epoch_rows(1) != a.epoch_rows(0)
    assert len({len(a.epoch_rows(e)) for e in range(3)}) == 1  # rows per epoch are constant


def test_eval_loader_is_ordered_and_repeatable(dataset):
    ev = PackedLoader(dataset, batch_size=3, seed=0, shuffle=False)
    first = [b.input_ids for b in ev]
    second = [b.input_ids for b in ev]
    assert all(torch.equal(x, y) for x, y in zip(first, second)) and len(first) == len(ev)


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_resume_yields_the_same_next_batches(dataset):
    bs = 4
    ref_loader = PackedLoader(dataset, batch_size=bs, seed=11)
    per_epoch = len(ref_loader)
    total = 2 * per_epoch + 3
    reference = _take(ref_loader.iter_batches(), total)
    assert [(e, i) for e, i, _ in reference][:per_epoch + 1] == \
        [(0, i) for i in range(per_epoch)] + [(1, 0)]

    for stop in (1, per_epoch - 1, per_epoch, per_epoch + 2):
        run = PackedLoader(dataset, batch_size=bs, seed=11)
        _take(run.iter_batches(), stop)
        state = run.state_dict()
        resumed = PackedLoader(dataset, batch_size=bs, seed=11)
        resumed.load_state_dict(state)
        rest = _take(resumed.iter_batches(), total - stop)
        for (e1, i1, b1), (e2, i2, b2) in zip(reference[stop:], rest):
            assert (e1, i1) == (e2, i2)
            assert torch.equal(b1.input_ids, b2.input_ids)
            assert torch.equal(b1.labels, b2.labels)
            assert torch.equal(b1.position_ids, b2.position_ids)
            assert torch.equal(b1.cu_seqlens, b2.cu_seqlens)


def test_resume_refuses_changed_settings(dataset):
    state = PackedLoader(dataset, batch_size=4, seed=1).state_dict()
    other = PackedLoader(dataset, batch_size=2, seed=1)
    with pytest.raises(LeantuneError, match="batch_size=4.*batch_size=2"):
        other.load_state_dict(state)


def test_bad_batch_size(dataset):
    with pytest.raises(LeantuneError, match="--batch-size"):
        PackedLoader(dataset, batch_size=0)


def test_messages_file_end_to_end(tmp_path, tokenizer):
    import json
    conv = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."}]
    p = tmp_path / "chat.jsonl"
    p.write_text("\n".join(json.dumps({"messages": conv}) for _ in range(5)))
    ds = SFTDataset(p, tokenizer, max_seq_len=64)
    assert ds.format == "messages" and ds.num_docs == 5
    for _, labels in ds.docs:
        assert tokenizer.decode([x for x in labels if x != IGNORE_INDEX]) == "Paris.</s>"
    loader = PackedLoader(ds, batch_size=2, shuffle=False)
    batch = next(iter(loader))
    _check_batch(batch, 64)
    n_docs = sum(len(r) for r in loader.epoch_rows(0)[:2])
    targets = batch.labels[batch.labels != IGNORE_INDEX].tolist()
    assert tokenizer.decode(targets) == "Paris.</s>" * n_docs
