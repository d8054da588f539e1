"""The packed batch: built once per batch on the host, handed to every layer.

A row of `input_ids` holds several documents back to back. Attention never crosses a document
boundary, positions restart at 0 in each document, and `labels` are already shifted: `labels[b, t]`
is the token the model must predict after reading `input_ids[b, t]` (-100 where no loss is taken:
prompt tokens, the last token of a document, padding). Because the labels are pre-shifted per
document, the model never predicts the first token of the next document.

Everything the attention kernels need (cu_seqlens over the flattened B*T tokens, max_seqlen as a
Python int) is computed here once, so the model does no host sync and no per-layer rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

IGNORE_INDEX = -100


@dataclass
class PackedBatch:
    """A packed micro-batch.

    Attributes:
        input_ids: [B, T] int64 token ids.
        labels: [B, T] int64 next-token targets, IGNORE_INDEX where no loss is taken.
        position_ids: [B, T] int64 positions, restarting at 0 for each document.
        cu_seqlens: [N + 1] int32 cumulative segment lengths over the flattened B*T tokens
            (segments are documents, plus one per row for trailing padding if any).
        max_seqlen: longest segment (Python int, known on the host: no sync needed).
        seq_lens: segment lengths as a Python list (host copy of diff(cu_seqlens)), used by the
            CPU attention path so it never reads device memory.
        num_target_tokens: number of labels != IGNORE_INDEX (Python int).
        num_real_tokens: tokens that belong to documents, padding excluded (Python int).
        target_rows: [num_target_tokens] int64 flat indices (over B*T) of the labels !=
            IGNORE_INDEX, found on the host once per batch (None for a batch built on the
            device): the token log-prob head runs on these rows only (model/transformer.py), so
            prompt tokens and padding cost no [rows, vocab] GEMM there. With `target_ids` it
            is the batch's explicit target list, where a row may repeat (below).

    Shared-prompt batches (data/preference.py `pack_preference_batch(shared=True)`: one document
    [prompt | chosen | rejected] per pair, the prompt run once) add, all built on the host:
        target_ids: [N_t] int64, the token each of `target_rows` must predict: the prompt's last
            row predicts the first token of both completions, so it appears twice and `labels`
            (one target a row) cannot say it. None: the targets are `labels` at target_rows.
        target_cu: [D + 1] int64 cumulative targets per document of the target list (targets
            are listed document by document), so per-document sums are segment sums over it.
        kv_index: [Nk] int64 flat indices (over B*T) of the rows each key/value segment reads:
            attention's k/v are gathered as k_flat[kv_index] (model/attention.py); None: every
            segment attends to its own rows (cu_seqlens for queries and keys alike).
        cu_seqlens_k: [segments + 1] int32 cumulative key segment lengths over the Nk gathered
            rows (segment s of the keys goes with query segment s); max_seqlen_k its longest
            (host int); seq_lens_k the host copy of its lengths.

    token_weights: [B, T] fp32, how much each token counts in the MoE load-balancing statistics
        (model/moe.py router_stats): the preference, KTO and GRPO batches' (data/preference.py)
        count padding 0 and a shared prompt twice, so the loss is the two-document layout's and
        transformers' with its attention mask. None (SFT): every token once, padding too.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    seq_lens: list[int] = field(default_factory=list)
    num_target_tokens: int = 0
    num_real_tokens: int = 0
    target_rows: torch.Tensor | None = None
    target_ids: torch.Tensor | None = None
    target_cu: torch.Tensor | None = None
    kv_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int = 0
    seq_lens_k: list[int] = field(default_factory=list)
    token_weights: torch.Tensor | None = None

    def __post_init__(self):
        labels = self.labels
        if self.target_rows is None and labels is not None and labels.device.type == "cpu":
            self.target_rows = (labels.reshape(-1) != IGNORE_INDEX).nonzero()[:, 0]
        # A hand-built batch may omit the host copies: derive them once here (outside the model).
        if not self.seq_lens and self.cu_seqlens is not None and self.cu_seqlens.numel() > 1:
            self.seq_lens = torch.diff(self.cu_seqlens.cpu()).tolist()
            self.max_seqlen = self.max_seqlen or max(self.seq_lens)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def shared_kv(self) -> bool:
        """Whether key/value segments gather rows of other segments (kv_index: shared prompts)."""
        return self.kv_index is not None


    def to(self, device, non_blocking: bool = True) -> "PackedBatch":
        """Move tensors to `device`; pinned host tensors make the copies asynchronous."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                if (non_blocking and torch.device(device).type == "cuda" and v.device.type == "cpu"
                        and not v.is_pinned()):
                    v = v.pin_memory()
                v = v.to(device, non_blocking=non_blocking)
            out[f.name] = v
        return PackedBatch(**out)

    @classmethod
    def from_documents(cls, rows: list[list[tuple[list[int], list[int]]]], pad_id: int = 0,
                       pad_to_multiple: int = 8) -> "PackedBatch":
        """Build a batch from rows of documents.

        Args:
            rows: B rows; each row a list of (token_ids, shifted_labels) documents, where
                `shifted_labels[i]` is the target after token i (IGNORE_INDEX for none).
            pad_id: token used for padding.
            pad_to_multiple: T is the longest row rounded up to this multiple.
        """
        longest = max(sum(len(ids) for ids, _ in row) for row in rows)
        T = -(-longest // pad_to_multiple) * pad_to_multiple
        B = len(rows)
        input_ids = torch.full((B, T), pad_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros((B, T), dtype=torch.long)
        seq_lens: list[int] = []
        real = 0
        for b, row in enumerate(rows):
            t = 0
            for ids, lab in row:
                n = len(ids)
                if n == 0:
                    continue
                input_ids[b, t:t + n] = torch.as_tensor(ids, dtype=torch.long)
                labels[b, t:t + n] = torch.as_tensor(lab, dtype=torch.long)
                position_ids[b, t:t + n] = torch.arange(n)
                seq_lens.append(n)
                t += n
                real += n
            if t < T:  # trailing padding is its own segment, positions 0..pad-1
                position_ids[b, t:] = torch.arange(T - t)
                seq_lens.append(T - t)
        cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.as_tensor(seq_lens, dtype=torch.int32), 0)
        return cls(
            input_ids=input_ids,
            labels=labels,
            position_ids=position_ids,
            cu_seqlens=cu,
            max_seqlen=max(seq_lens),
            seq_lens=seq_lens,
            num_target_tokens=int((labels != IGNORE_INDEX).sum()),
            num_real_tokens=real,
        )


def shift_labels(ids: list[int], loss_mask: list[bool]) -> list[int]:
    """Targets for one document: label[i] = ids[i+1] where token i+1 is trained, else ignored."""
    out = [IGNORE_INDEX] * len(ids)
    for i in range(len(ids) - 1):
        if loss_mask[i + 1]:
            out[i] = ids[i + 1]
    return out
