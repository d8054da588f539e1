"""First-fit decreasing packing."""

import random
import time

import pytest

from leantune.data import pack_first_fit_decreasing


def test_ffd_known_example():
    # sorted: 5(0) 4(1) 3(2) 3(3) 2(4) 1(5); first fit into capacity 8
    assert pack_first_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]


def _naive_ffd(lengths, cap):
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows, room = [], []
    for i in order:
        for r in range(len(rows)):
            if room[r] >= lengths[i]:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(cap - lengths[i])
    return rows


def test_ffd_matches_reference_and_capacity():
    rng = random.Random(0)
    for _ in range(200):
        cap = rng.randint(1, 40)
        lengths = [rng.randint(0, cap) for _ in range(rng.randint(0, 50))]
        rows = pack_first_fit_decreasing(lengths, cap)
        assert rows == _naive_ffd(lengths, cap)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in r) <= cap for r in rows)
        assert pack_first_fit_decreasing(lengths, cap) == rows  # deterministic


def test_ffd_large_is_fast():
    rng = random.Random(1)
    lengths = [rng.randint(1, 600) for _ in range(100_000)]
    t = time.perf_counter()
    rows = pack_first_fit_decreasing(lengths, 2048)
    assert time.perf_counter() - t < 5.0
    assert all(sum(lengths[i] for i in r) <= 2048 for r in rows)
    assert len(rows) <= -(-sum(lengths) // 2048) * 1.05 + 1


def test_oversized_lengths_are_clamped():
    assert pack_first_fit_decreasing([10, 3, 2], 4) == [[0], [1], [2]]


def test_bad_capacity():
    with pytest.raises(ValueError):
        pack_first_fit_decreasing([1], 0)
