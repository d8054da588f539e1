"""Supervised fine-tuning: the summed next-token cross-entropy over the target tokens of packed
rows, divided by the target tokens of the whole accumulation window (exact accumulation)."""

from __future__ import annotations

from ...errors import LeantuneError
from .base import MicroLoss, Objective


def _preference_hint(e: LeantuneError) -> LeantuneError:
    """An undetectable format whose first row is a preference pair or KTO row: `e` plus which
    objective reads it (sft reads instruction / chat / text rows)."""
    msg = str(e)
    if "cannot detect the data format" not in msg:
        return e
    if "'chosen'" in msg or "'rejected'" in msg:
        return LeantuneError(f"{msg.split('; expected')[0]}: these are preference pairs, which "
                             "--objective sft does not read; use --objective dpo, orpo or simpo")
    if "'completion'" in msg and "'label'" in msg:
        return LeantuneError(f"{msg.split('; expected')[0]}: these are KTO rows, which "
                             "--objective sft does not read; use --objective kto")
    return e


class SFTObjective(Objective):
    name = "sft"

    def build_data(self, tokenizer, train_data, eval_data):
        from ...data import SFTDataset

        cfg = self.cfg
        try:
            if train_data is None:
                train_data = SFTDataset(cfg.data, tokenizer, cfg.max_seq_len, format=cfg.format,
                                        train_on_inputs=cfg.train_on_inputs, split=cfg.data_split,
                                        subset=cfg.data_subset)
            if eval_data is None and cfg.eval_data:
                eval_data = SFTDataset(cfg.eval_data, tokenizer, cfg.max_seq_len,
                                       format=cfg.format, train_on_inputs=cfg.train_on_inputs,
                                       split=cfg.eval_split, subset=cfg.data_subset,
                                       split_flag="--eval-split")
        except LeantuneError as e:
            raise _preference_hint(e) from None
        return train_data, eval_data

    def make_loader(self, data, loader_cls, shuffle: bool):
        cfg = self.cfg
        return loader_cls(data, cfg.batch_size, cfg.max_seq_len, seed=cfg.seed, shuffle=shuffle)

    def check_token_ids(self, data, vocab: int, what: str) -> None:
        from ...data.files import format_location
        from ...errors import LeantuneError

        locations = getattr(data, "locations", None)
        for i in range(len(data)):
            ids = data[i][0]
            if not len(ids):
                continue
            hi, lo = max(ids), min(ids)
            if hi >= vocab or lo < 0:
                bad = hi if hi >= vocab else lo
                where = (format_location(data.source, locations[i])  # its file and line
                         if locations is not None and i < len(locations) else f"document {i}")
                raise LeantuneError(
                    f"{what}: {where} holds token id {bad}, outside the model's vocabulary "
                    f"(0..{vocab - 1}); the tokenizer does not match the model (check --model), "
                    f"or the ids were made for another vocabulary")

    def normaliser(self, micro_batches) -> int:
        from ...dist.data import window_tokens

        return window_tokens(micro_batches)[0]

    def loss(self, model, batch) -> MicroLoss:
        out = model(batch=batch, loss_only=True)
        return MicroLoss(out.loss_sum, out.aux_loss)
