"""The data of one process: its whole packed rows of each global batch.

Every process builds the same packed rows per epoch (same data, seed and packing: PackedLoader),
so no data moves between processes. With B = --batch-size and N processes, a global batch is N*B
consecutive rows of the epoch, the batch a one-process run with --batch-size N*B takes, and rank
r takes rows [r*B, (r+1)*B) of it:

    the epoch's rows:  | batch 0: r0 r0 r1 r1 | batch 1: r0 r0 r1 r1 | batch 2 (short): r0 r0 r1 |

So N processes with --batch-size B train on what one process with --batch-size N*B trains on,
step for step, in the same order for any N. The loader's position (epoch, global batch) and its
fingerprint (with the global batch size) are the one-process loader's: a checkpoint resumes on
any number of processes that keeps the global batch.

The loss of a window is normalised by the target tokens of the whole global window. Each process
counts them from the shared row plan (`RankBatch.global_target_tokens`), which gives the number
an all-reduce of the per-process counts would, with no collective and no host sync.

A process whose share of the last, short batch is empty gets one row of padding without targets:
it still runs forward and backward (DDP and FSDP2 need every process in every collective), and
adds nothing to the loss or the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..batch import IGNORE_INDEX, PackedBatch
from ..data.dataset import PackedLoader


@dataclass
class RankBatch(PackedBatch):
    """This process's rows of a global micro-batch, with the target and real (non-padding)
    tokens of the whole global micro-batch."""

    global_target_tokens: int = 0
    global_real_tokens: int = 0

    def to(self, device, non_blocking: bool = True) -> PackedBatch:
        """This process's rows on `device`, as a plain PackedBatch (the global counts are host
        numbers, read before the move)."""
        local = PackedBatch(**{f.name: getattr(self, f.name) for f in fields(PackedBatch)})
        return local.to(device, non_blocking)


def window_tokens(batches) -> tuple[int, int]:
    """(target tokens, real tokens) of the window `batches` belong to: the global window's for
    RankBatches, the batches' own otherwise (one process)."""
    targets = reals = 0
    for b in batches:
        whole = isinstance(b, RankBatch)
        targets += b.global_target_tokens if whole else b.num_target_tokens
        reals += b.global_real_tokens if whole else b.num_real_tokens
    return targets, reals


class RankLoader(PackedLoader):
    """PackedLoader over global batches of `batch_size * world_size` rows, of which `get_batch`
    (and so iteration) gives rank `rank`'s `batch_size` rows as a RankBatch (module
    docstring)."""

    def __init__(self, dataset, batch_size: int, max_seq_len: int | None = None, seed: int = 0,
                 shuffle: bool = True, *, rank: int, world_size: int, **kw):
        super().__init__(dataset, batch_size * world_size, max_seq_len, seed, shuffle, **kw)
        self.rank, self.world_size, self.rank_batch_size = rank, world_size, batch_size
        self._targets = [sum(1 for x in labels if x != IGNORE_INDEX) for _, labels in self.docs]

    def get_batch(self, epoch: int, index: int) -> RankBatch:
        """This rank's rows of global batch `index` of `epoch`."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches")
        rows = self.epoch_rows(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        B = self.rank_batch_size
        mine = [[self.docs[d] for d in row] for row in rows[self.rank * B:(self.rank + 1) * B]]
        batch = RankBatch.from_documents(mine or [[([self.pad_id], [IGNORE_INDEX])]],
                                         pad_id=self.pad_id, pad_to_multiple=self.pad_to_multiple)
        batch.global_target_tokens = sum(self._targets[d] for row in rows for d in row)
        batch.global_real_tokens = sum(self.lengths[d] for row in rows for d in row)
        return batch
