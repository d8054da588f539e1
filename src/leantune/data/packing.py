"""Packing documents into fixed-capacity rows with first-fit decreasing (FFD).

Packing several short documents into one row of at most ``max_seq_len`` tokens removes almost all
padding; `leantune.batch.PackedBatch` keeps the documents independent (per-document positions,
attention and labels). FFD sorts documents longest first and puts each into the lowest-numbered
row that still has room; it is within 11/9 of the optimal row count and, because the sort is
stable, fully deterministic.

"Lowest-numbered row with room" is answered by a max segment tree over the rows' remaining
capacities, so packing n documents costs O(n log n) rather than O(n * rows).
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_first_fit_decreasing(lengths: Sequence[int], max_seq_len: int) -> list[list[int]]:
    """Pack documents into rows of capacity `max_seq_len` with first-fit decreasing.

    Args:
        lengths: token count of each document (index = document id). Lengths above
            `max_seq_len` are treated as `max_seq_len` (callers truncate such documents first); negative lengths are an error.
        max_seq_len: row capacity in tokens.

    Returns:
        Rows, each a list of document indices (longest first within a row; ties by index). Every
        document appears exactly once; each row's total (clamped) length is <= max_seq_len.
        Row order is the order rows were opened, so the result is deterministic.
    """
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    n = len(lengths)
    if n == 0:
        return []
    sizes = []
    for i, x in enumerate(lengths):
        x = int(x)
        if x < 0:
            raise ValueError(f"document {i} has negative length {x}")
        sizes.append(min(x, max_seq_len))
    order = sorted(range(n), key=lambda i: (-sizes[i], i))

    # Upper bound on rows: first fit leaves at most one row at most half full, so
    # rows <= 2 * total / capacity + 1; never more than n.
    total = sum(sizes)
    max_rows = min(n, 2 * (-(-total // max_seq_len)) + 2)
    leaves = 1
    while leaves < max_rows:
        leaves *= 2
    # tree[leaves + r] = remaining capacity of row r; internal node = max of its children.
    # Unopened rows have full capacity, so "leftmost leaf with room" is exactly first fit:
    # it opens a new row only when no open row fits.
    tree = [max_seq_len] * (2 * leaves)
    rows: list[list[int]] = []
    for i in order:
        size = sizes[i]
        if tree[1] < size:  # cannot happen given the bound above; grow instead of misplacing
            leaves *= 2
            tree = [max_seq_len] * (2 * leaves)
            for r, row in enumerate(rows):
                tree[leaves + r] = max_seq_len - sum(sizes[j] for j in row)
            for node in range(leaves - 1, 0, -1):
                tree[node] = max(tree[2 * node], tree[2 * node + 1])
        node = 1
        while node < leaves:  # descend to the leftmost leaf with capacity >= size
            node *= 2
            if tree[node] < size:
                node += 1
        r = node - leaves
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
        tree[node] -= size
        node //= 2
        while node:
            best = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == best:
                break
            tree[node] = best
            node //= 2
    return rows
