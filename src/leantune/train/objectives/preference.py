"""Preference objectives: DPO (sigmoid / IPO / hinge), ORPO, SimPO and KTO on the fused path.

A micro-batch is a `PreferenceBatch` (data/preference.py): P pairs packed as 2P documents of the
packed rows (chosen 2i, rejected 2i + 1), or R KTO rows as 2R documents (row 2i, its KL sequence
2i + 1: the row's prompt with another row's completion). One forward of the policy in
`token_logps` mode gives the per-token log-probs of the completion targets, [B*T]; their sums per
document come from the packed rows' cu_seqlens (`kernels.segment_sum`, no host sync), and the
losses of train/losses/preference.py turn them into the loss.

Shared prompts (the pair objectives, on by default; ``shared_prompt: false``, --no-shared-prompt
or LEANTUNE_SHARED_PROMPT=0 switch it off): a pair is packed as one document [prompt | chosen |
rejected] whose rejected tokens attend to the prompt, never to chosen, so the prompt runs once in
the policy and the reference pass (at 512 + 512 + 512 tokens, 3/4 of the tokens). The forward
then gives one log-prob per entry of the batch's target list, summed per document over its
target_cu: the same sums. Models with attention soft-capping or sinks pack unshared (one log
line). KTO stays unshared (its rows are not pairs).

The reference model (DPO, KTO) is the base with the adapter switched off
(`lora.adapters_disabled`): the same weights, run under torch.no_grad, so no second copy, no
gradients and nothing kept for backward; without a graph the layers run their plain forward on
the fast kernels (flash varlen attention, Triton norms / RoPE / GLU, the chunked log-prob head).
With `precompute_reference`, `prepare` computes every training pair's reference log-probs once
before training and saves them in the run folder (reference_logps.safetensors, with a
fingerprint of the data and the model); each step then reads them instead of running the
reference pass, and a resume whose data or model changed is refused in one line.

Reduction, as the step runner wants it (objectives/base.py): loss_sum is the sum over the
micro-batch's pairs (rows) of the per-pair loss, the normaliser is the pairs of the window, so a
window of one micro-batch gives exactly TRL's mean loss. The token-mean NLL terms (ORPO) are
taken per micro-batch and weighted by its pairs. Metrics are sums over pairs:
rewards_chosen, rewards_rejected, reward_margin, reward_accuracy (KTO: the rewards of the
desirable / undesirable rows, summed over rows, and the KL estimate weighted by rows).

Settings come from ``cfg.objective``: name, beta (None: the objective's default), loss_type,
label_smoothing, simpo_gamma, desirable_weight, undesirable_weight, precompute_reference,
max_prompt_len.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from ...errors import LeantuneError
from ...kernels import segment_sum
from ..losses import preference as L
from ...data.dataset import check_fingerprint
from ...data.files import format_location
from .base import MicroLoss, Objective

REFERENCE_FILE = "reference_logps.safetensors"
PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


# --------------------------------------------------------------------------------------------
# Batches and the loader
# --------------------------------------------------------------------------------------------

def _batch_classes():
    from ...data.preference import PreferenceBatch

    @dataclass
    class IndexedPreferenceBatch(PreferenceBatch):
        """A PreferenceBatch that also knows which dataset items it holds.

        items: [U] int64, the dataset index of each pair / row (reference look-ups).
        split: "train" or "eval" (the precomputed reference covers the training items only).
        """

        items: torch.Tensor | None = None
        split: str = "train"

        @property
        def num_real_tokens(self) -> int:
            return self.batch.num_real_tokens

        def to(self, device, non_blocking: bool = True) -> "IndexedPreferenceBatch":
            out = {}
            for f in fields(self):
                v = getattr(self, f.name)
                if hasattr(v, "to") and not isinstance(v, str):
                    v = v.to(device, non_blocking=non_blocking)
                out[f.name] = v
            return IndexedPreferenceBatch(**out)

    return IndexedPreferenceBatch


class PreferenceLoader:
    """Shuffled, resumable micro-batches of `batch_size` pairs (or KTO rows) over a
    `PreferenceDataset`. Per epoch e the items are shuffled with ``random.Random(seed + e)``;
    batch i holds items ``[i * batch_size, (i + 1) * batch_size)`` of that order, packed by
    `pack_preference_batch` / `pack_kto_batch` (both sequences of a pair in the same batch).
    Same position protocol as `data.PackedLoader`: iter_batches, plain iteration (one epoch),
    state_dict / load_state_dict (refused when the data or batching changed)."""

    def __init__(self, dataset, batch_size: int, max_seq_len: int, seed: int = 0,
                 shuffle: bool = True, pad_id: int = 0, split: str = "train",
                 shared_prompt: bool = False):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise LeantuneError(f"--batch-size must be a positive integer, got {batch_size!r}")
        if len(dataset) == 0:
            raise LeantuneError("no preference rows to load; the dataset is empty")
        self.dataset, self.batch_size, self.max_seq_len = dataset, batch_size, max_seq_len
        self.seed, self.shuffle, self.pad_id, self.split = int(seed), bool(shuffle), pad_id, split
        self.kind = getattr(dataset, "kind", "pairs")
        # pairs as shared-prompt documents (data/preference.py _pack_shared); KTO never
        self.shared_prompt = bool(shared_prompt) and self.kind == "pairs"
        self.epoch = self.batch_index = 0
        self._cls = _batch_classes()
        self._digest: str | None = None

    def __len__(self) -> int:
        return -(-len(self.dataset) // self.batch_size)

    def order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def get_batch(self, epoch: int, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range for {len(self)} batches")
        idx = self.order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        return self.pack(idx)

    def pack(self, idx: list[int]):
        """The batch of dataset items `idx` (in that order)."""
        from ...data.preference import pack_kto_batch, pack_preference_batch

        items = [self.dataset[i] for i in idx]
        if self.kind == "kto":
            b = pack_kto_batch(items, self.max_seq_len, pad_id=self.pad_id)
        else:
            b = pack_preference_batch(items, self.max_seq_len, pad_id=self.pad_id,
                                      shared=self.shared_prompt)
        return self._cls(**{f.name: getattr(b, f.name) for f in fields(b)},
                         items=torch.tensor(idx, dtype=torch.long), split=self.split)

    def iter_batches(self):
        while True:
            epoch, index = self.epoch, self.batch_index
            if index >= len(self):
                self.epoch, self.batch_index = epoch + 1, 0
                continue
            batch = self.get_batch(epoch, index)
            if index + 1 >= len(self):
                self.epoch, self.batch_index = epoch + 1, 0
            else:
                self.batch_index = index + 1
            yield epoch, index, batch

    def __iter__(self):
        for i in range(len(self)):
            yield self.get_batch(self.epoch, i)

    def _fingerprint(self) -> dict:
        if self._digest is None:  # the rows' content (utils/digest.py): edited data is refused
            from ...utils.digest import content_digest

            self._digest = content_digest(self.dataset[i] for i in range(len(self.dataset)))
        return {"seed": self.seed, "batch_size": self.batch_size, "max_seq_len": self.max_seq_len,
                "shuffle": self.shuffle, "num_items": len(self.dataset),
                "data_digest": self._digest}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch_index": self.batch_index, **self._fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        check_fingerprint(self._fingerprint(), state, "--batch-size, --max-seq-len and --seed")
        epoch, index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= index <= len(self):
            raise LeantuneError(f"cannot resume the data loader: position epoch={epoch}, "
                                f"batch={index} is out of range ({len(self)} batches per epoch)")
        self.epoch, self.batch_index = epoch, index


# --------------------------------------------------------------------------------------------
# Log-probs per document
# --------------------------------------------------------------------------------------------

def document_logps(token_logps: torch.Tensor, batch) -> torch.Tensor:
    """token_logps [B*T] (0 off the targets) -> [D] summed log-probs of each document, in
    document order. Each document is one segment of the packed rows' cu_seqlens (padding is
    segments of its own): segment sums on the device, then each segment's sum goes to the
    document at its first token (padding segments to a slot that is dropped). No host sync,
    deterministic (no atomics)."""
    cu = batch.batch.cu_seqlens.to(token_logps.device, torch.long)
    seg = segment_sum(token_logps, cu)  # [S]
    D = batch.doc_unit.numel()
    first = batch.doc_index.reshape(-1).to(token_logps.device)[cu[:-1]]  # [S], -1: padding
    slot = torch.where(first >= 0, first, torch.full_like(first, D))
    out = torch.zeros(D + 1, dtype=seg.dtype, device=seg.device)
    return out.index_put((slot,), seg)[:D]


def output_logps(out, batch) -> torch.Tensor:
    """[D] summed log-probs of each document from a token_logps forward's output: over the
    target list's documents (target_cu: shared prompts) where the output has one log-prob per
    target, else `document_logps` of the per-token ones."""
    if out.target_logps is not None:
        return segment_sum(out.target_logps, batch.batch.target_cu)
    return document_logps(out.token_logps, batch)


def policy_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([D] summed completion log-probs of the policy, MoE aux loss or None)."""
    out = model(batch=batch.batch, token_logps=True)
    return output_logps(out, batch), out.aux_loss


@torch.no_grad()
def reference_logps(model, batch) -> torch.Tensor:
    """[D] summed completion log-probs of the reference: the base with every adapter off, no
    graph (so the plain layer path on the fast kernels)."""
    from ...lora import adapters_disabled

    with adapters_disabled(model):
        out = model(batch=batch.batch, token_logps=True)
    return output_logps(out, batch)


def _has_lora(model) -> bool:
    return any(getattr(m, "has_lora", False) for m in model.modules())


SHARED_PROMPT_ENV = "LEANTUNE_SHARED_PROMPT"


def shared_prompt_unsupported(model) -> str | None:
    """Why `model`'s attention can't run shared-prompt batches (None: it can): soft-capped
    scores (Gemma 2) and attention sinks (gpt-oss) have kernels over plain documents only."""
    inner = getattr(model, "module", model)
    for layer in getattr(inner, "layers", ()):
        attn = getattr(layer, "self_attn", None)
        if getattr(attn, "softcap", None):
            return "attention soft-capping"
        if getattr(attn, "sinks", None) is not None:
            return "attention sinks"
    return None


# --------------------------------------------------------------------------------------------
# The objectives
# --------------------------------------------------------------------------------------------

class PreferenceObjective(Objective):
    """Shared by the pair objectives and KTO: data, loader, reference, normaliser, metrics.
    Subclasses implement `preference_loss(policy [D], reference [D] or None, batch)`."""

    unit = "pairs"
    sequences_per_unit = 2  # a pair's chosen and rejected; a KTO row and its KL sequence
    kind = "pairs"  # the rows it reads: "pairs" or "kto"
    metric_names = PAIR_METRICS
    needs_reference = True
    default_beta = L.DPO_BETA

    def __init__(self, cfg, log=print):
        super().__init__(cfg, log)
        s = getattr(cfg, "objective", None)
        self.settings = s
        beta = getattr(s, "beta", None)
        self.beta = L._check_beta(self.default_beta if beta is None else beta)
        self.precompute = bool(getattr(s, "precompute_reference", False))
        self.max_prompt_len = getattr(s, "max_prompt_len", None)
        # pairs packed with the prompt once (module docstring); prepare() checks the model
        self.shared_prompt = (self.kind == "pairs"
                              and getattr(s, "shared_prompt", True) is not False
                              and os.environ.get(SHARED_PROMPT_ENV, "1") != "0")
        if self.precompute and not self.needs_reference:
            raise LeantuneError(f"--precompute-reference: --objective {self.name} uses no "
                                "reference model; leave the flag out")
        self.reference_table: torch.Tensor | None = None  # [items, 2] fp32 (precompute)
        self.eval_reference_table: torch.Tensor | None = None  # the same for the eval items
        self.eval_loader = None  # make_loader(shuffle=False) sets it
        self.reference_model = None  # full fine-tuning: the frozen copy (attach_reference)
        self._checked_reference = False

    # --- the reference model ---------------------------------------------------------------
    def wants_frozen_copy(self, full: bool) -> bool:
        """Whether this run needs a frozen copy of the model as its reference: full
        fine-tuning (no adapter to switch off) of an objective with a reference, unless the
        reference log-probs are precomputed."""
        return full and self.needs_reference and not self.precompute

    def attach_reference(self, model, full: bool) -> int:
        """Full fine-tuning (wants_frozen_copy): keep a frozen copy of `model` as it is now
        (its loaded weights; with --adapter, base + SFT) as the reference: no gradients, eval
        mode, run under no_grad. Call before the trainer attaches its executors and before a
        resume loads trained weights. Returns the copy's bytes (0: no copy)."""
        if not self.wants_frozen_copy(full):
            return 0
        import copy

        if any(p.device.type == "meta" for p in model.parameters()):  # FSDP2 loads shards later
            raise LeantuneError(f"--full --objective {self.name} under FSDP2: the frozen "
                                "reference copy is not sharded yet; train a LoRA adapter, add "
                                "--precompute-reference, or use --parallel ddp")
        ref = copy.deepcopy(model)
        for p in ref.parameters():
            p.requires_grad_(False)
        self.reference_model = ref.eval()
        return sum(t.numel() * t.element_size()
                   for t in [*ref.parameters(), *ref.buffers()])

    # --- data ------------------------------------------------------------------------------
    def _dataset(self, tokenizer, data, split, flag):
        from ...data.preference import PreferenceDataset

        cfg = self.cfg
        try:
            ds = PreferenceDataset(data, tokenizer, cfg.max_seq_len,
                                   max_prompt_len=self.max_prompt_len, split=split,
                                   subset=getattr(cfg, "data_subset", None), split_flag=flag)
        except LeantuneError as e:
            if "not a preference row" in str(e):  # SFT rows, most likely: say which objective
                raise LeantuneError(f"{e}; --objective {self.name} reads preference rows: for "
                                    "SFT rows use --objective sft (the default)") from None
            raise
        self.check_kind(ds)
        if ds.num_prompt_truncated or ds.num_completion_truncated:
            self.log(f"note: {ds.summary()}")  # both counts
        return ds

    def check_kind(self, ds) -> None:
        """The data's rows must be the kind this objective reads (one line otherwise)."""
        kind = getattr(ds, "kind", None)
        if kind is not None and kind != self.kind:
            want = ("pairs ('prompt', 'chosen', 'rejected')" if self.kind == "pairs"
                    else "KTO rows ('prompt', 'completion', 'label')")
            fix = "--objective kto" if kind == "kto" else "--objective dpo, orpo or simpo"
            have = "preference pairs" if kind == "pairs" else "KTO rows"
            raise LeantuneError(f"{getattr(ds, 'source', 'the data')}: --objective {self.name} "
                                f"reads {want}, but the file holds {have}; use {fix}")

    def build_data(self, tokenizer, train_data, eval_data):
        cfg = self.cfg
        if train_data is None:
            train_data = self._dataset(tokenizer, cfg.data, getattr(cfg, "data_split", "train"),
                                       "--data-split")
        else:
            self.check_kind(train_data)
        if eval_data is None and getattr(cfg, "eval_data", None):
            eval_data = self._dataset(tokenizer, cfg.eval_data, getattr(cfg, "eval_split", "test"),
                                      "--eval-split")
        elif eval_data is not None:
            self.check_kind(eval_data)
        return train_data, eval_data

    def make_loader(self, data, loader_cls, shuffle: bool):
        """A `PreferenceLoader` (`loader_cls`, the SFT row loader, does not apply: batches hold
        pairs, not rows). shuffle=False is the eval loader."""
        cfg = self.cfg
        loader = PreferenceLoader(data, cfg.batch_size, cfg.max_seq_len, seed=cfg.seed,
                                  shuffle=shuffle, pad_id=getattr(data, "pad_id", 0),
                                  split="train" if shuffle else "eval",
                                  shared_prompt=self.shared_prompt)
        if not shuffle:
            self.eval_loader = loader  # (prepare: its reference log-probs too)
        return loader

    def check_token_ids(self, data, vocab: int, what: str) -> None:
        for i, item in enumerate(data.items):
            seqs = [item.prompt] + ([item.chosen, item.rejected] if self.kind == "pairs"
                                    else [item.completion])
            for ids in seqs:
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    loc = getattr(item, "location", None)
                    where = (format_location(getattr(data, "source", "data"), loc)
                             if loc is not None else f"item {i}")
                    raise LeantuneError(
                        f"{what}: {where} holds token id {bad[0]}, outside the model's vocabulary "
                        f"(0..{vocab - 1}); the tokenizer does not match the model (check "
                        "--model)")

    # --- the loss --------------------------------------------------------------------------
    def normaliser(self, micro_batches) -> int:
        return sum(getattr(b, "global_units", b.num_units) for b in micro_batches)

    def tokens(self, micro_batches) -> int:
        """Tokens of both sequences of each pair (a shared prompt counted twice, so tokens/s
        means the same with the switch on or off)."""
        return sum(getattr(b, "sequence_tokens", 0) or b.batch.num_real_tokens
                   for b in micro_batches)

    def check_shared_prompt(self, model, loaders) -> None:
        """Pack unshared (one log line) where the model's attention can't take shared prompts."""
        why = shared_prompt_unsupported(model) if self.shared_prompt else None
        if why is None:
            return
        self.shared_prompt = False
        for loader in loaders:
            if loader is not None:
                loader.shared_prompt = False
        self.log(f"note: pairs packed with the prompt twice ({why} runs on plain documents "
                 "only): slower than the shared-prompt layout")

    def reference(self, model, batch) -> torch.Tensor | None:
        """[D] reference log-probs of the batch's documents: from the precomputed table for
        training batches, else a no-grad pass with the adapters off."""
        if not self.needs_reference:
            return None
        table = (self.eval_reference_table if getattr(batch, "split", "train") == "eval"
                 else self.reference_table)
        if table is not None and getattr(batch, "items", None) is not None:
            table = table.to(batch.doc_unit.device)
            return table[batch.items].reshape(-1)  # [U, 2] -> documents 2i, 2i + 1
        if self.reference_model is not None:
            return reference_logps(self.reference_model, batch)
        if not self._checked_reference:
            if not _has_lora(model):
                raise LeantuneError(
                    f"--objective {self.name} needs a frozen reference model; with full "
                    "fine-tuning there is no adapter to switch off: train a LoRA adapter, or "
                    "use --precompute-reference")
            self._checked_reference = True
        return reference_logps(model, batch)

    def loss(self, model, batch) -> MicroLoss:
        ref = self.reference(model, batch)  # first: no graph, nothing kept
        policy, aux = policy_logps(model, batch)
        out = self.preference_loss(policy, ref, batch)
        return MicroLoss(out[0], aux, out[1])

    def preference_loss(self, policy, ref, batch):
        """-> (loss sum over units, metrics sums)."""
        raise NotImplementedError

    @staticmethod
    def _pair_sums(pl: L.PreferenceLoss, units: int) -> tuple[torch.Tensor, dict]:
        """Sum over pairs of the per-pair loss (+ the micro-batch's token-mean NLL once per
        pair, so loss_sum / pairs is the micro-batch's mean loss) and of the pair metrics."""
        loss = pl.losses.float().sum()
        if pl.nll_sum is not None:
            loss = loss + units * pl.nll_sum / pl.nll_tokens.clamp(min=1)
        return loss, {k: pl.metrics[k].float().sum() for k in PAIR_METRICS}

    # --- precomputed reference -------------------------------------------------------------
    def prepare(self, model, train_loader, parallel) -> None:
        """With precompute_reference: the reference log-probs of every training (and eval)
        item, read from the run folder's reference_logps.safetensors when its fingerprint
        matches this data and model, else computed now (no grad, adapters off) and saved there
        (rank 0, atomically). A file with another fingerprint is refused in one line. (A resume
        reads the file: the adapter-off model is the same, but with --full the weights have
        trained, so the file is what keeps the reference fixed.)"""
        self.check_shared_prompt(model, (train_loader, self.eval_loader))
        if not (self.precompute and self.needs_reference):
            return
        device = getattr(parallel, "device", None) or next(model.parameters()).device
        path = Path(self.cfg.output) / REFERENCE_FILE
        loaders = {"train": train_loader, "eval": self.eval_loader}
        loaders = {k: v for k, v in loaders.items() if v is not None}
        fp = self.fingerprint(model, train_loader.dataset,
                              getattr(self.eval_loader, "dataset", None))
        if path.exists():
            tables, saved = load_reference(path)
            if saved != fp or set(tables) != set(loaders) or any(
                    tables[k].shape[0] != len(v.dataset) for k, v in loaders.items()):
                raise LeantuneError(
                    f"{path}: these reference log-probs were computed for other data or another "
                    "model than this run's; resume with the same --data, --eval-data, --model, "
                    "--adapter and --max-seq-len, or delete the file to compute them again")
            self.log(f"reference log-probs: read {tables['train'].shape[0]} from {path}")
        else:
            if getattr(self.cfg, "full", False) and getattr(self.cfg, "resume", False):
                raise LeantuneError(f"{path}: missing; a resumed --full run cannot compute its "
                                    "reference log-probs again (its weights have trained); "
                                    "start the run again with --overwrite")
            tables = {k: self.compute_reference_table(model, v, device)
                      for k, v in loaders.items()}
            if getattr(parallel, "writer", True):
                save_reference(path, tables, fp, root=self.cfg.output)
            self.log(f"reference log-probs: computed {tables['train'].shape[0]} into {path}")
        self.reference_table = tables["train"].to(device)
        if "eval" in tables:
            self.eval_reference_table = tables["eval"].to(device)

    def compute_reference_table(self, model, loader, device) -> torch.Tensor:
        """[items, 2] fp32: per item, the reference log-probs of its two documents."""
        n = len(loader.dataset)
        table = torch.zeros(n, 2, dtype=torch.float32)
        for start in range(0, n, loader.batch_size):
            batch = loader.pack(list(range(start, min(n, start + loader.batch_size))))
            batch = batch.to(device)
            table[start:start + batch.num_units] = reference_logps(model, batch).view(-1, 2).cpu()
        return table

    def fingerprint(self, model, dataset, eval_dataset=None) -> str:
        """sha256 over what the reference log-probs depend on: the tokenised items (training,
        then eval), the model's name, config and weights (its checkpoint's fingerprint, or a
        probe of a model built in memory), --adapter, and the objective's kind."""
        h = hashlib.sha256()
        items = list(dataset.items) + ([None] + list(eval_dataset.items)
                                       if eval_dataset is not None else [])
        for item in items:
            if item is None:
                h.update(b"|eval|")
                continue
            seqs = ([item.prompt, item.chosen, item.rejected] if self.kind == "pairs"
                    else [item.prompt, item.completion])
            h.update(json.dumps(seqs).encode())
        inner = getattr(model, "module", model)
        h.update(repr(getattr(inner, "config", "")).encode())
        h.update(str(getattr(self.cfg, "model", "")).encode())
        adapter = getattr(self.cfg, "adapter", None)
        if adapter:  # --adapter: the SFT adapter folded into the base (its weights file's stamp)
            from ...export.merge import adapter_source

            weights = adapter_source(Path(adapter), log=lambda _: None)[1]
            st = weights.stat()
            h.update(f"{Path(adapter).resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
        from ...lora.base_check import model_fingerprint

        base = model_fingerprint(inner)  # the checkpoint's files: the same on resume (--full too)
        if base is not None:
            h.update(base.encode())
        else:  # a model built in memory: a probe of its (non-adapter) weights
            with torch.no_grad():
                probe = [p.detach().reshape(-1)[:: max(1, p.numel() // 997)][:1000].double().sum()
                         for n_, p in inner.named_parameters() if "lora_" not in n_]
            h.update(repr([round(float(x), 6) for x in probe]).encode())
        h.update(self.kind.encode())
        return h.hexdigest()


TABLE_NAMES = {"train": "reference_logps", "eval": "eval_reference_logps"}


def save_reference(path: Path, tables, fingerprint: str, root=None) -> None:
    """Write {"train": [items, 2], "eval": [eval items, 2]} (or one tensor: the training
    table) as safetensors, atomically, with the fingerprint in its metadata."""
    from safetensors.torch import save

    from ...utils.io import atomic_write_bytes

    if isinstance(tables, torch.Tensor):
        tables = {"train": tables}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, save({TABLE_NAMES[k]: t.contiguous().cpu() for k, t in tables.items()},
                                  metadata={"fingerprint": fingerprint}), root=root)


def load_reference(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """({"train": ..., maybe "eval": ...}, fingerprint) of a file save_reference wrote."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            return ({k: f.get_tensor(n) for k, n in TABLE_NAMES.items() if n in f.keys()},
                    meta.get("fingerprint", ""))
    except Exception as e:  # a cut or foreign file
        raise LeantuneError(f"{path}: unreadable reference log-probs ({e}); delete it to "
                            "compute them again") from None


class DPOObjective(PreferenceObjective):
    """DPO against the adapter-off reference; loss_type sigmoid (with label_smoothing), ipo,
    hinge."""

    name = "dpo"

    def __init__(self, cfg, log=print):
        super().__init__(cfg, log)
        self.loss_type = getattr(self.settings, "loss_type", None) or "sigmoid"
        self.label_smoothing = float(getattr(self.settings, "label_smoothing", 0.0) or 0.0)
        if self.loss_type not in L.DPO_LOSS_TYPES:
            raise LeantuneError(f"--loss-type {self.loss_type!r} is not one of "
                                f"{', '.join(L.DPO_LOSS_TYPES)}")
        L._check_smoothing(self.label_smoothing)

    def preference_loss(self, policy, ref, batch):
        tok = batch.completion_tokens
        pl = L.dpo_loss(policy[batch.first_doc], policy[batch.second_doc], ref[batch.first_doc],
                        ref[batch.second_doc], beta=self.beta, loss_type=self.loss_type,
                        label_smoothing=self.label_smoothing, chosen_tokens=tok[batch.first_doc],
                        rejected_tokens=tok[batch.second_doc])
        return self._pair_sums(pl, batch.num_units)


class ORPOObjective(PreferenceObjective):
    """ORPO: the chosen completions' token-mean NLL plus beta times the odds-ratio term."""

    name = "orpo"
    needs_reference = False
    default_beta = L.ORPO_BETA

    def preference_loss(self, policy, ref, batch):
        tok = batch.completion_tokens
        pl = L.orpo_loss(policy[batch.first_doc], policy[batch.second_doc], tok[batch.first_doc],
                         tok[batch.second_doc], beta=self.beta)
        return self._pair_sums(pl, batch.num_units)


class SimPOObjective(PreferenceObjective):
    """SimPO: a margin (simpo_gamma) loss on length-averaged log-probs, no reference."""

    name = "simpo"
    needs_reference = False
    default_beta = L.SIMPO_BETA

    def __init__(self, cfg, log=print):
        super().__init__(cfg, log)
        gamma = getattr(self.settings, "simpo_gamma", None)
        self.gamma = L.SIMPO_GAMMA if gamma is None else gamma
        self.label_smoothing = float(getattr(self.settings, "label_smoothing", 0.0) or 0.0)
        L._check_smoothing(self.label_smoothing)

    def preference_loss(self, policy, ref, batch):
        tok = batch.completion_tokens
        pl = L.simpo_loss(policy[batch.first_doc], policy[batch.second_doc], tok[batch.first_doc],
                          tok[batch.second_doc], beta=self.beta, gamma=self.gamma,
                          label_smoothing=self.label_smoothing)
        return self._pair_sums(pl, batch.num_units)


class KTOObjective(PreferenceObjective):
    """KTO on unpaired rows: each row's log-ratio against the batch's KL estimate from its
    mismatched (prompt, other completion) sequences, with desirable / undesirable weights."""

    name = "kto"
    kind = "kto"
    unit = "rows"
    metric_names = ("rewards_chosen", "rewards_rejected", "kl")
    default_beta = L.KTO_BETA

    def __init__(self, cfg, log=print):
        super().__init__(cfg, log)
        if self.precompute:
            raise LeantuneError("--precompute-reference does not apply to --objective kto: its "
                                "KL sequences pair each row with another row of its batch, which "
                                "changes every epoch; leave the flag out")
        s = self.settings
        self.desirable_weight = float(getattr(s, "desirable_weight", None) or 1.0)
        self.undesirable_weight = float(getattr(s, "undesirable_weight", None) or 1.0)
        for flag, w in (("--desirable-weight", self.desirable_weight),
                        ("--undesirable-weight", self.undesirable_weight)):
            if not w > 0:
                raise LeantuneError(f"{flag} must be a positive number, got {w}")

    def preference_loss(self, policy, ref, batch):
        rows, kl_docs = batch.first_doc, batch.second_doc
        kl = L.kto_kl(policy[kl_docs], ref[kl_docs])
        pl = L.kto_loss(policy[rows], ref[rows], batch.label, kl=kl, beta=self.beta,
                        desirable_weight=self.desirable_weight,
                        undesirable_weight=self.undesirable_weight)
        r, d = pl.metrics["rewards"], pl.metrics["desirable"]
        metrics = {"rewards_chosen": (r * d).sum(), "rewards_rejected": (r * (1 - d)).sum(),
                   "kl": kl * batch.num_units}
        return pl.losses.float().sum(), metrics


PREFERENCE_OBJECTIVES = {"dpo": DPOObjective, "orpo": ORPOObjective, "simpo": SimPOObjective,
                         "kto": KTOObjective}

__all__ = ["DPOObjective", "KTOObjective", "ORPOObjective", "PREFERENCE_OBJECTIVES",
           "PreferenceLoader", "PreferenceObjective", "SimPOObjective", "document_logps",
           "load_reference", "output_logps", "policy_logps", "reference_logps", "save_reference",
           "shared_prompt_unsupported"]
