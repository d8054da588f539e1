"""The data of one process under torchrun: whole packed rows of each global batch, the global
window's token counts, and a loader position that any number of processes resumes."""

from __future__ import annotations

import random

import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune.batch import IGNORE_INDEX
from leantune.data import PackedLoader
from leantune.dist.data import RankBatch, RankLoader, window_tokens
from leantune.errors import LeantuneError


def documents(n: int = 41, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Documents of 3..40 tokens whose first third predicts nothing (a prompt)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        ids = [rng.randrange(1, 50) for _ in range(rng.randint(3, 40))]
        labels = [IGNORE_INDEX if i < len(ids) // 3 else t for i, t in enumerate(ids[1:] + [0])]
        labels[-1] = IGNORE_INDEX
        docs.append((ids, labels))
    return docs


def rows_of(batch) -> list[tuple[list[int], list[int]]]:
    """Each row's (tokens, labels) without its trailing padding (token 0: documents() never
    uses it)."""
    out = []
    for ids, labels in zip(batch.input_ids.tolist(), batch.labels.tolist()):
        n = len(ids)
        while n and ids[n - 1] == 0:
            n -= 1
        out.append((ids[:n], labels[:n]))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_take_whole_rows_of_the_one_process_batch(world):
    docs = documents()
    B = 2
    one = PackedLoader(docs, B * world, 64, seed=5)
    ranks = [RankLoader(docs, B, 64, seed=5, rank=r, world_size=world) for r in range(world)]
    assert all(len(r) == len(one) for r in ranks)
    empty_seen = False
    for epoch in (0, 1):
        for i in range(len(one)):
            whole = one.get_batch(epoch, i)
            parts = [r.get_batch(epoch, i) for r in ranks]
            # rank by rank, the rows are the one-process batch's, in its order
            got = [row for p in parts if p.num_target_tokens for row in rows_of(p)]
            assert got == rows_of(whole)
            for p in parts:
                assert isinstance(p, RankBatch) and p.input_ids.shape[0] <= B
                assert (p.global_target_tokens, p.global_real_tokens) == (
                    whole.num_target_tokens, whole.num_real_tokens)
                if p.num_target_tokens == 0:  # a rank past the end of a short batch
                    empty_seen = True
                    assert p.input_ids.shape[0] == 1 and (p.labels == IGNORE_INDEX).all()
    assert empty_seen, "the data must leave some rank without rows in an epoch's last batch"


def test_window_tokens_are_the_global_windows():
    docs = documents()
    one = PackedLoader(docs, 4, 64, seed=5)
    mine = RankLoader(docs, 2, 64, seed=5, rank=1, world_size=2)
    window = [mine.get_batch(0, i) for i in (0, 1)]
    whole = [one.get_batch(0, i) for i in (0, 1)]
    assert window_tokens(window) == window_tokens(whole) == (
        sum(b.num_target_tokens for b in whole), sum(b.num_real_tokens for b in whole))
    assert window_tokens(window)[0] > sum(b.num_target_tokens for b in window)
    # moved to a device, a RankBatch is a plain PackedBatch of this rank's rows
    moved = window[0].to("cpu")
    assert type(moved).__name__ == "PackedBatch"
    assert moved.input_ids.equal(window[0].input_ids)


def test_position_is_in_global_batches():
    """A checkpoint's loader state moves between one process with --batch-size 4 and two with
    --batch-size 2 (the same global batch), but not to another global batch."""
    docs = documents()
    one = PackedLoader(docs, 4, 64, seed=5)
    two = RankLoader(docs, 2, 64, seed=5, rank=0, world_size=2)
    it = two.iter_batches()
    for _ in range(3):
        next(it)
    one.load_state_dict(two.state_dict())
    assert (one.epoch, one.batch_index) == (two.epoch, two.batch_index) == (0, 3)
    again = RankLoader(docs, 2, 64, seed=5, rank=1, world_size=2)
    again.load_state_dict(one.state_dict())
    assert again.get_batch(0, 3).global_target_tokens == one.get_batch(0, 3).num_target_tokens
    with pytest.raises(LeantuneError, match="batch_size=8 but this run has batch_size=4"):
        PackedLoader(docs, 4, 64, seed=5).load_state_dict(
            RankLoader(docs, 2, 64, seed=5, rank=0, world_size=4).state_dict())
