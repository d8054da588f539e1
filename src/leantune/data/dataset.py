"""The tokenized SFT dataset and the packed, resumable batch loader.

`SFTDataset` reads a data file (or rows), detects or validates the format, tokenizes every row
once, truncates to ``max_seq_len`` and stores each document as ``(ids, labels)`` with the labels
already shifted (`leantune.batch.shift_labels`): ``labels[i]`` is the target after token i.

`PackedLoader` turns the documents into `PackedBatch` es: every epoch it shuffles the documents
with a seeded generator, packs them into rows of at most ``max_seq_len`` tokens with first-fit
decreasing, shuffles the rows, and groups ``batch_size`` rows into a batch. Its position
(epoch, batch index) is checkpointable so a resumed run continues with exactly the next batch.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Sequence

from leantune.batch import IGNORE_INDEX, PackedBatch, shift_labels
from leantune.data.files import Location, format_location
from leantune.data.formats import detect_format, encode_example, validate_format
from leantune.data.packing import pack_first_fit_decreasing
from leantune.data.sources import load_rows
from leantune.errors import LeantuneError

# a loader fingerprint's keys that describe the data itself (the rest: batching settings)
DATA_KEYS = ("num_docs", "num_tokens", "num_items", "data_digest")


def check_fingerprint(mine: dict, state: dict, settings: str) -> None:
    """Refuse a resume whose loader fingerprint `mine` differs from the checkpoint's `state`
    (a key the checkpoint lacks, from an older leantune, is not compared): the data itself
    (DATA_KEYS), or the batching `settings` the message names."""
    for key, value in mine.items():
        if key in state and state[key] != value:
            if key in DATA_KEYS:
                raise LeantuneError(
                    f"cannot resume: the tokenized training data (its rows, or the tokenizer or "
                    f"chat template) changed since the checkpoint ({key} {state[key]!r}, now "
                    f"{value!r}); resume with the same data, or start a new run in another "
                    "--output")
            raise LeantuneError(
                f"cannot resume the data loader: the checkpoint has {key}={state[key]!r} but this "
                f"run has {key}={value!r}; resume with the same data, {settings}")

Document = tuple[list[int], list[int]]  # (token ids [L], shifted labels [L])


def _check_max_seq_len(max_seq_len) -> int:
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len <= 0:
        raise LeantuneError(
            f"--max-seq-len must be a positive integer (tokens per packed row), "
            f"got {max_seq_len!r}")
    return max_seq_len


def _default_pad_id(tokenizer) -> int:
    for attr in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, attr, None)
        if v is not None:
            return int(v)
    return 0


class SFTDataset:
    """Tokenized supervised fine-tuning documents.

    Args:
        data: a .jsonl / .json / .csv / .parquet file, a dataset folder or a hub dataset id
            (`leantune.data.sources`), or a list of row dicts.
        tokenizer: Hugging Face tokenizer (needs a chat template for the messages format).
        max_seq_len: longest document in tokens; longer ones are truncated (head kept).
        format: "alpaca", "messages" or "text"; None detects it from the first rows.
        train_on_inputs: train on prompt/user tokens too, not only on responses.
        split, subset: what to load from a dataset folder or hub dataset; `split_flag` is the
            flag named when the split does not exist.

    Attributes:
        docs: list of (ids, labels), each a list[int] of length L <= max_seq_len.
        locations: where each kept document's row came from (`leantune.data.files.Location`).
        format: the format used.
        num_rows: rows read. num_docs: documents kept.
        num_truncated: documents cut to max_seq_len.
        dropped: rows dropped because no target token remained, by reason: "empty" (the row
            has none: no assistant turn, an empty text) or "truncated" (the prompt fills
            max_seq_len); num_dropped is their sum.
        num_tokens / num_target_tokens: totals over kept documents.
        pad_id: padding token for batches (pad, else eos, else 0).
    """

    def __init__(self, data: str | os.PathLike | Sequence[dict], tokenizer, max_seq_len: int,
                 *, format: str | None = None, train_on_inputs: bool = False,
                 split: str = "train", subset: str | None = None,
                 split_flag: str = "--data-split"):
        self.max_seq_len = _check_max_seq_len(max_seq_len)
        self.tokenizer = tokenizer
        self.train_on_inputs = bool(train_on_inputs)
        located: list[tuple[Location, dict]]
        if isinstance(data, (str, os.PathLike)):
            self.source, located = load_rows(data, split, subset, split_flag=split_flag)
        else:
            self.source = "<rows>"
            located = [(f"row {i}", row) for i, row in enumerate(data, start=1)]
            if not located:
                raise LeantuneError("no training rows given; add at least one example")
        rows = [r for _, r in located]
        self.format = validate_format(format) if format else detect_format(rows, self.source)
        self.pad_id = _default_pad_id(tokenizer)

        self.docs: list[Document] = []
        self.locations: list[Location] = []
        self._truncated: list[bool] = []
        self.num_rows = len(rows)
        self.dropped = {"empty": 0, "truncated": 0}
        self.dropped_at: dict[str, list[Location]] = {"empty": [], "truncated": []}  # first 3
        for loc, row in located:
            ids, mask = encode_example(row, self.format, tokenizer,
                                       train_on_inputs=self.train_on_inputs,
                                       source=self.source, line=loc,
                                       max_tokens=self.max_seq_len + 1)
            has_target = any(mask[1:])  # token i + 1 is the target of token i
            cut = len(ids) > self.max_seq_len
            if cut:
                ids, mask = ids[:self.max_seq_len], mask[:self.max_seq_len]
            labels = shift_labels(ids, mask)
            if all(x == IGNORE_INDEX for x in labels):
                reason = "truncated" if has_target else "empty"
                self.dropped[reason] += 1
                if len(self.dropped_at[reason]) < 3:
                    self.dropped_at[reason].append(loc)
                continue
            self.docs.append((ids, labels))
            self.locations.append(loc)
            self._truncated.append(cut)
        if not self.docs:
            raise LeantuneError(
                f"{self.source}: no trainable examples: all {self.num_rows} rows have no target "
                f"tokens after truncation to --max-seq-len {self.max_seq_len} (empty responses, "
                "or prompts longer than --max-seq-len)")

    # -- construction of subsets ---------------------------------------------------------------
    @classmethod
    def _subset(cls, parent: "SFTDataset", indices: Sequence[int]) -> "SFTDataset":
        obj = cls.__new__(cls)
        obj.__dict__.update({k: v for k, v in parent.__dict__.items()
                             if k not in ("docs", "locations", "_truncated")})
        obj.docs = [parent.docs[i] for i in indices]
        obj.locations = [parent.locations[i] for i in indices]
        obj._truncated = [parent._truncated[i] for i in indices]
        obj.num_rows = len(indices)
        obj.dropped = {"empty": 0, "truncated": 0}
        obj.dropped_at = {"empty": [], "truncated": []}
        return obj

    def split_eval(self, fraction: float, seed: int = 0) -> tuple["SFTDataset", "SFTDataset"]:
        """Carve a random held-out set: returns (train, eval), each keeping the original order.

        ``round(fraction * num_docs)`` documents (at least 1, and leaving at least 1 for
        training) go to eval; the choice depends only on `seed` and the documents.
        """
        if not (0.0 < float(fraction) < 1.0):
            raise LeantuneError(
                f"eval split fraction must be between 0 and 1 (exclusive), got {fraction!r}")
        n = len(self.docs)
        if n < 2:
            raise LeantuneError(
                f"{self.source}: cannot split {n} example into train and eval sets; add data or "
                "disable the eval split")
        k = min(n - 1, max(1, round(float(fraction) * n)))
        perm = list(range(n))
        random.Random(seed).shuffle(perm)
        eval_idx = sorted(perm[:k])
        train_idx = sorted(perm[k:])
        return SFTDataset._subset(self, train_idx), SFTDataset._subset(self, eval_idx)

    # -- accessors -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> Document:
        return self.docs[i]

    @property
    def num_docs(self) -> int:
        return len(self.docs)

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def dropped_summary(self) -> str:
        """The dropped rows, counted by reason, with what to do about them and where the first
        ones are (file:line)."""
        def where(reason):
            at = [format_location(self.source, loc) for loc in self.dropped_at[reason]]
            more = ", ..." if self.dropped[reason] > len(at) else ""
            return f" [{', '.join(at)}{more}]" if at else ""

        why = []
        if self.dropped["empty"]:
            why.append(f"{self.dropped['empty']} with no target tokens{where('empty')} (e.g. a "
                       "conversation without an assistant turn, or an empty text: fix or remove "
                       "them)")
        if self.dropped["truncated"]:
            why.append(f"{self.dropped['truncated']} whose prompt fills --max-seq-len "
                       f"{self.max_seq_len}{where('truncated')}, leaving no response token "
                       "(raise --max-seq-len)")
        return f"{self.num_dropped} of {self.num_rows} rows dropped: " + ", ".join(why)

    @property
    def num_truncated(self) -> int:
        return sum(self._truncated)

    @property
    def truncated(self) -> list[bool]:
        """Whether each kept document was cut to max_seq_len."""
        return self._truncated

    @property
    def lengths(self) -> list[int]:
        return [len(ids) for ids, _ in self.docs]

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.docs)

    @property
    def num_target_tokens(self) -> int:
        return sum(sum(1 for x in lab if x != IGNORE_INDEX) for _, lab in self.docs)

    def summary(self) -> str:
        """One line for logs: counts, format, truncation and dropped rows."""
        s = (f"{self.source}: {self.num_docs} examples ({self.format}), {self.num_tokens} tokens, "
             f"{self.num_target_tokens} trained")
        if self.num_truncated:
            s += f", {self.num_truncated} truncated to {self.max_seq_len} tokens"
        if self.num_dropped:
            s += f"; {self.dropped_summary()}"
        return s


class PackedLoader:
    """Packed, shuffled, resumable batches over an `SFTDataset` (or a list of documents).

    Per epoch e: the documents are shuffled with ``random.Random(seed + e)``, packed into rows of
    at most `max_seq_len` tokens with first-fit decreasing, and the rows are shuffled with the same
    generator (FFD orders by length, so the row shuffle is what mixes long and short rows across
    batches). Batch i is rows ``[i * batch_size, (i + 1) * batch_size)`` turned into a
    `PackedBatch` of shape [B <= batch_size, T] on the host. With ``shuffle=False`` (eval) the
    documents and rows keep their order and every epoch is identical.

    The number of rows is the same every epoch (FFD depends only on the sorted lengths), so
    ``len(loader)`` is the constant number of batches per epoch. The last batch of an epoch may
    have fewer rows unless ``drop_last``.

    Position: ``(epoch, batch_index)`` of the next batch; `state_dict` / `load_state_dict` save
    and restore it. `iter_batches` yields from that position on, forever; plain iteration
    (``for batch in loader``) yields one full epoch (the current one) and leaves the position
    alone, which is what an eval loop wants.
    """

    def __init__(self, dataset: SFTDataset | Sequence[Document], batch_size: int,
                 max_seq_len: int | None = None, seed: int = 0, shuffle: bool = True,
                 pad_id: int | None = None, *, pad_to_multiple: int = 8, drop_last: bool = False):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise LeantuneError(f"--batch-size must be a positive integer, got {batch_size!r}")
        self.docs: list[Document] = list(dataset.docs if isinstance(dataset, SFTDataset)
                                         else dataset)
        if not self.docs:
            raise LeantuneError("no documents to load; the dataset is empty")
        if max_seq_len is None:
            max_seq_len = getattr(dataset, "max_seq_len", None) or max(len(d[0]) for d in self.docs)
        self.max_seq_len = _check_max_seq_len(max_seq_len)
        self.lengths = [len(ids) for ids, _ in self.docs]
        self._num_tokens = sum(self.lengths)  # for the fingerprint, taken every training step
        self._digest: str | None = None  # data_digest, made once (the trainer: at set-up)
        longest = max(self.lengths)
        if longest > self.max_seq_len:
            raise ValueError(f"a document has {longest} tokens, more than max_seq_len "
                             f"{self.max_seq_len}; build the dataset with the same max_seq_len")
        if pad_id is None:
            pad_id = getattr(dataset, "pad_id", 0)
        self.pad_id = int(pad_id)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.pad_to_multiple = pad_to_multiple
        self.drop_last = drop_last
        self.epoch = 0
        self.batch_index = 0
        self._plan_cache: tuple[int, list[list[int]]] | None = None
        self._num_rows = len(self.epoch_rows(0))  # the same for every epoch, see class docstring
        if len(self) == 0:
            raise LeantuneError(
                f"--batch-size {batch_size} is larger than the {self.num_rows} packed rows and "
                "drop_last is set: no batch can be formed; lower the batch size or add data")

    # -- the per-epoch plan --------------------------------------------------------------------
    def epoch_rows(self, epoch: int) -> list[list[int]]:
        """The packed rows (lists of document indices) of `epoch`, in batch order."""
        key = epoch if self.shuffle else 0
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        if not self.shuffle:
            rows = pack_first_fit_decreasing(self.lengths, self.max_seq_len)
        else:
            rng = random.Random(self.seed + epoch)
            order = list(range(len(self.docs)))
            rng.shuffle(order)
            bins = pack_first_fit_decreasing([self.lengths[i] for i in order], self.max_seq_len)
            rows = [[order[j] for j in b] for b in bins]
            rng.shuffle(rows)
        self._plan_cache = (key, rows)
        return rows

    @property
    def num_rows(self) -> int:
        """Packed rows per epoch (constant across epochs)."""
        return self._num_rows

    @property
    def packing_efficiency(self) -> float:
        """Fraction of the rows' token capacity (rows * max_seq_len) holding real tokens."""
        return sum(self.lengths) / (self.num_rows * self.max_seq_len)

    def __len__(self) -> int:
        """Batches per epoch."""
        rows = self.num_rows
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)


    def get_batch(self, epoch: int, index: int) -> PackedBatch:
        """Build batch `index` of `epoch` (random access; does not move the position)."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches")
        rows = self.epoch_rows(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        return PackedBatch.from_documents([[self.docs[d] for d in row] for row in rows],
                                          pad_id=self.pad_id,
                                          pad_to_multiple=self.pad_to_multiple)

    # -- iteration -----------------------------------------------------------------------------
    def iter_batches(self) -> Iterator[tuple[int, int, PackedBatch]]:
        """Yield ``(epoch, index, batch)`` from the current position on, across epochs, forever.

        The position advances *before* each yield, so `state_dict` taken after receiving a batch
        points at the following one.
        """
        while True:
            epoch, index = self.epoch, self.batch_index
            n = len(self)
            if index >= n:
                self.epoch, self.batch_index = epoch + 1, 0
                continue
            batch = self.get_batch(epoch, index)
            if index + 1 >= n:
                self.epoch, self.batch_index = epoch + 1, 0
            else:
                self.batch_index = index + 1
            yield epoch, index, batch

    def __iter__(self) -> Iterator[PackedBatch]:
        """One full epoch (the current one) from its first batch; the position is unchanged."""
        epoch = self.epoch
        for i in range(len(self)):
            yield self.get_batch(epoch, i)

    # -- checkpointing -------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        return {"seed": self.seed, "batch_size": self.batch_size, "max_seq_len": self.max_seq_len,
                "shuffle": self.shuffle, "num_docs": len(self.docs),
                "num_tokens": self._num_tokens, "data_digest": self.data_digest}

    @property
    def data_digest(self) -> str:
        """The documents' content (utils/digest.py), once: a resume on edited data is refused."""
        if self._digest is None:
            from ..utils.digest import content_digest

            self._digest = content_digest(self.docs)
        return self._digest

    def state_dict(self) -> dict:
        """Position of the next batch plus a fingerprint of what determines the batches."""
        return {"epoch": self.epoch, "batch_index": self.batch_index, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; refuse if the data or batching settings changed since."""
        check_fingerprint(self._fingerprint(), state, "--batch-size (under torchrun: the same "
                          "--batch-size times processes), --max-seq-len and --seed")
        epoch, index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= index <= len(self):
            raise LeantuneError(
                f"cannot resume the data loader: position epoch={epoch}, batch={index} is out of "
                f"range ({len(self)} batches per epoch)")
        self.epoch, self.batch_index = epoch, index
