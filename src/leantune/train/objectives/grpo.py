"""GRPO: online RL with leantune's own generation inside the training loop (`--objective grpo`).

One optimizer step (the step runner, train/runner.py, asks `next_window` for its micro-batches):

    every num_iterations steps, for each of the grad_accum micro-batches of the window:
        batch_size prompts (PromptLoader) -> G = num_generations completions each, sampled by
        generate.decode with the adapter live (static KV cache sized once for the longest
        prompt + max_completion_tokens; on CUDA the decode step's CUDA graph is captured once
        and replayed for the whole run; one prefill per distinct prompt, copied to its G rows;
        the LoRA projections over the engine's packed weights, generate/projections.py:
        `decode_share_prompts` / `decode_projections` switch them), temperature / top_p,
        stopping at EOS / end of turn
    -> rewards (train/rewards.py, each function once over the window's completions)
    -> group-normalised advantages over the window (losses/grpo.py: --scale-rewards)
    -> the B x G (prompt, completion) sequences packed as documents of packed rows (no
       cross-document attention), the completion tokens the targets (EOS included)
    -> old log-probs (num_iterations > 1) and reference log-probs (beta > 0: the base with the
       adapter switched off), each once, with no graph
    then each step: per micro-batch the policy's per-token log-probs through the fused
    token_logprobs head (logits / temperature, as TRL), gathered into [N, C], the clipped loss
    (--loss-type) summed as the runner's exact accumulation wants it.

Sampling RNG: each micro-batch's completions are drawn with a generator seeded from (--seed,
the generation's step, the micro-batch), so the step a checkpoint holds fixes every later
draw: a resumed run samples exactly what the uninterrupted run sampled (tested). With
num_iterations > 1 the window's rollouts are also kept in OUTPUT/grpo_rollouts.safetensors, so a
run resumed between two updates of one generation batch trains on the same rollouts.

Metrics (per step, to the progress line and metrics.jsonl): reward (the weighted total) and
reward_std, reward/<function> and reward/<function>_std, completion_len and truncated (share),
zero_std_groups (groups whose rewards were all equal: no gradient), clip fraction (clip,
clip_low, clip_high), kl (beta > 0), gen_tokens_per_s and generation_s (the runner adds
train_tokens_per_s). `--log-completions-every N`: the first prompt's completions with their
rewards go to OUTPUT/samples.jsonl every N steps.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from ...batch import PackedBatch
from ...errors import LeantuneError
from ...generate.cache import FitHint
from ..losses import grpo as L
from .base import MicroLoss, Objective

ROLLOUTS_FILE = "grpo_rollouts.safetensors"
SUM_METRICS = ("clip", "clip_low", "clip_high", "kl", "tokens")
# a rollouts' KV cache too large for free memory names these flags (generate/cache.py); its rows
# are --batch-size x --num-generations, its slots the longest prompt + --max-completion-tokens
ROLLOUT_FIT = FitHint("completion", "give fewer prompts a micro-batch (--batch-size; a larger "
                      "--grad-accum keeps the prompts a step) or fewer completions per prompt "
                      "(--num-generations), shorter prompts (--max-prompt-len) or fewer "
                      "--max-completion-tokens")


@dataclass
class RolloutBatch:
    """One micro-batch of rollouts, ready to train on.

    batch: the PackedBatch of the N = B x G (prompt, completion) documents (labels: the
        completion tokens).
    index: [N, C] int64, the flat position in batch's [B_rows * T] token log-probs of each
        completion token (0 where masked); mask: [N, C] fp32, 1 on trained tokens.
    advantages: [N] fp32; old_logps / ref_logps: [N, C] fp32 or None.
    num_sequences, num_tokens (trained, after masking): host ints.
    """

    batch: PackedBatch
    index: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    num_sequences: int = 0
    num_tokens: int = 0

    def to(self, device, non_blocking: bool = True) -> "RolloutBatch":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device, non_blocking=non_blocking)
                                for k, v in values.items()
                                if isinstance(v, (torch.Tensor, PackedBatch))})


def pack_rollouts(prompts: list[list[int]], completions: list[list[int]], keep: list[bool],
                  advantages: torch.Tensor, max_seq_len: int, pad_id: int = 0) -> RolloutBatch:
    """The (prompt, completion) sequences as documents of packed rows (first-fit decreasing)
    and the [N, C] gather index of their completion tokens' log-probs; `keep[i]` False masks
    sequence i out of the loss (a truncated completion with --mask-truncated-completions)."""
    from ...batch import IGNORE_INDEX
    from ...data.preference import _pack_documents

    docs = list(zip(prompts, completions))
    batch, doc_index, counts = _pack_documents(docs, max_seq_len, pad_id, 8)
    N, C = len(docs), max(1, max(len(c) for c in completions))
    trained = (batch.labels != IGNORE_INDEX).flatten()
    pos = trained.nonzero().squeeze(1)
    doc = doc_index.flatten()[pos]
    pos = pos[torch.sort(doc, stable=True).indices]  # document order, then token order
    valid = torch.arange(C)[None, :] < counts[:, None]  # [N, C]
    index = torch.zeros(N, C, dtype=torch.long)
    index[valid] = pos
    mask = valid.float() * torch.tensor(keep, dtype=torch.float32)[:, None]
    return RolloutBatch(batch, index, mask, advantages.float(), num_sequences=N,
                        num_tokens=int(mask.sum()))


def completion_logps(model, batch: PackedBatch, index: torch.Tensor, mask: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """[N, C] fp32 log-probs of the completion tokens under `model` (0 where masked), through
    the fused token_logprobs head with logits / temperature. At temperature 1 through the
    model's own forward (`token_logps`), so wrappers see the whole forward."""
    from ... import kernels

    if temperature == 1.0:
        flat = model(batch=batch, token_logps=True).token_logps
    else:
        inner = getattr(model, "module", model)
        h = inner.hidden_states(batch.input_ids, batch.position_ids, batch)
        flat = kernels.token_logprobs(h.flatten(0, 1), inner.output_weight(),
                                      batch.labels.flatten(), temperature=temperature,
                                      chunk_bytes=inner.loss_chunk_bytes)
    return torch.where(mask > 0, flat[index], torch.zeros((), device=flat.device))


class GRPOObjective(Objective):
    """--objective grpo (module docstring)."""

    name = "grpo"
    unit = "prompts"
    metric_names = SUM_METRICS
    checks_stall = False  # a step of flat groups has loss 0 and gradient 0 by design

    @property
    def sequences_per_unit(self) -> int:
        """Sequences per prompt in a micro-batch (the trainer's planner counts batch_size x G
        rows of up to --max-seq-len tokens: a bound, exact when --max-seq-len is prompt +
        completion)."""
        return self.G

    @property
    def needs_reference(self) -> bool:
        """Whether a no-grad pass over the rollouts runs besides training (the planner's
        reference_pass): reference log-probs (beta > 0) or old log-probs (num_iterations > 1)."""
        return self.beta > 0 or self.s.num_iterations > 1

    @property
    def generation_shape(self) -> tuple[int, int, int] | None:
        """(rows, KV slots, prompt tokens) of the rollouts' decode, for the planner
        (engine/planner.Workload.generation); None before the data is read."""
        ds = getattr(self, "dataset", None)
        if ds is None:
            return None
        rows = self.cfg.batch_size * self.G
        return rows, ds.longest + self.s.max_completion_tokens, ds.longest

    def __init__(self, cfg, log=print):
        super().__init__(cfg, log)
        from ..rewards import load_rewards

        s = cfg.objective
        self.s = s
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise LeantuneError("--objective grpo runs in one process for now; start it "
                                "without torchrun")
        if getattr(cfg, "full", False) and (s.beta or 0) > 0:
            raise LeantuneError("--objective grpo --beta > 0 with --full: the reference is the "
                                "base with the adapter switched off, and full fine-tuning has "
                                "no adapter; train a LoRA adapter, or --beta 0")
        if s.num_iterations > 1 and not cfg.max_steps:
            raise LeantuneError(f"--num-iterations {s.num_iterations}: give --max-steps (each "
                                "generation batch trains several steps, so --epochs does not "
                                "count them)")
        if s.temperature != 1.0 and getattr(cfg, "router_aux_loss_coef", 0) > 0:
            raise LeantuneError("--router-aux-loss-coef with --objective grpo needs "
                                "--temperature 1")
        self.loss_type = s.loss_type or "dapo"
        self.beta = float(s.beta or 0.0)
        self.G = s.num_generations
        self.rewards = load_rewards(s.reward, s.reward_weights, s.max_completion_tokens)
        self.window_cache: list[RolloutBatch] | None = None
        self.cache_step = None  # the step whose generation made window_cache
        self.rollout_metrics: dict[str, float] = {}
        self.tokenizer = None
        self.eos_ids = None
        # how the rollouts' decode step runs the LoRA projections (generate/projections.py)
        self.decode_projections = "packed"
        self.decode_share_prompts = True  # one prefill per distinct prompt (decode's switch)

    # --- data ------------------------------------------------------------------------------
    def build_data(self, tokenizer, train_data, eval_data):
        from ...data.prompts_data import PromptDataset
        from ..rewards import check_fields

        cfg, s = self.cfg, self.s
        self.tokenizer = tokenizer
        keep = s.max_prompt_len or cfg.max_seq_len - s.max_completion_tokens
        if train_data is None:
            try:
                train_data = PromptDataset(cfg.data, tokenizer, keep, split=cfg.data_split,
                                           subset=cfg.data_subset)
            except LeantuneError as e:
                if "missing field 'prompt'" in str(e) and any(
                        k in str(e) for k in ("'chosen'", "'messages'", "'instruction'")):
                    raise LeantuneError(f"{e} (these look like SFT or preference rows: "
                                        "--objective sft or dpo reads them)") from None
                raise
        if train_data.num_prompt_truncated:
            self.log(f"note: {train_data.num_prompt_truncated} prompts cut from the left to "
                     f"{keep} tokens (--max-seq-len {cfg.max_seq_len} minus "
                     f"--max-completion-tokens {s.max_completion_tokens})")
        check_fields(self.rewards, set(train_data.fields), train_data.source)
        self.dataset = train_data
        return train_data, None

    def make_loader(self, data, loader_cls, shuffle: bool):
        from ...data.prompts_data import prompt_loader_class

        cfg = self.cfg
        return prompt_loader_class()(data, cfg.batch_size, cfg.max_seq_len, seed=cfg.seed,
                                     shuffle=shuffle, split="train")

    def check_token_ids(self, data, vocab: int, what: str) -> None:
        for i, item in enumerate(data.items):
            bad = [t for t in item.ids if not 0 <= t < vocab]
            if bad:
                raise LeantuneError(f"{what}: {data.where(i)} holds token id {bad[0]}, outside "
                                    f"the model's vocabulary (0..{vocab - 1}); the tokenizer "
                                    "does not match the model (check --model)")

    # --- rollouts ----------------------------------------------------------------------------
    def next_window(self, runner, batches) -> list[RolloutBatch]:
        """The window of the runner's next step (module docstring): new rollouts every
        num_iterations steps, else the kept ones."""
        step, ni = runner.step, self.s.num_iterations
        gen_step = step - step % ni
        if self.window_cache is not None and self.cache_step == gen_step:
            self.rollout_metrics = {**self.rollout_metrics, "generation_s": 0.0,
                                    "gen_tokens_per_s": 0.0}
            return self.window_cache
        if step % ni and self._load_rollouts(runner, gen_step):
            return self.window_cache
        prompts = [next(batches) for _ in range(self.cfg.grad_accum)]
        self.window_cache = self.generate_window(runner.model, prompts, gen_step, runner)
        self.cache_step = gen_step
        if ni > 1 and runner.parallel.writer:
            self._save_rollouts(runner, gen_step)
        return self.window_cache

    @torch.no_grad()
    def generate_window(self, model, prompt_batches, gen_step: int, runner=None
                        ) -> list[RolloutBatch]:
        """Sample, score and pack the window's rollouts (module docstring)."""
        from ...generate.cache import fit_hint
        from ...generate.decode import LENGTH, decode
        from ...generate.sampling import Sampling
        from ...generate.text import default_eos_ids
        from .. import rewards as R

        cfg, s, G = self.cfg, self.s, self.G
        tok = self.tokenizer
        if self.eos_ids is None:
            self.eos_ids = default_eos_ids(model, tok)
        device = model.output_weight().device
        longest = self.dataset.longest if hasattr(self, "dataset") else None
        t0 = time.perf_counter()
        seqs = []  # per micro-batch: (prompt ids, completions (Decoded), items)
        for i, pb in enumerate(prompt_batches):
            ids = [item.ids for item in pb.items for _ in range(G)]
            seed = (cfg.seed * 1_000_003 + gen_step * 1009 + i) % (2**63)
            with fit_hint(ROLLOUT_FIT):  # (a cache too large: GRPO's flags)
                done = decode(model, ids, s.max_completion_tokens,
                              Sampling(temperature=s.temperature, top_p=s.top_p, seed=seed),
                              self.eos_ids, cuda_graphs=True,
                              min_slots=(longest or 0) + s.max_completion_tokens,
                              projections=self.decode_projections,
                              share_prompts=self.decode_share_prompts)
            seqs.append((ids, done, pb))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        gen_s = time.perf_counter() - t0
        # rewards, once per function over the window's completions
        prompts, completions, comp_ids, rows, field_lists = [], [], [], [], {}
        names = self.dataset.fields if hasattr(self, "dataset") else []
        for _, done, pb in seqs:
            for j, item in enumerate(pb.items):
                for d in done[j * G:(j + 1) * G]:
                    kept = d.token_ids[:-1] if d.stopped == "eos" else d.token_ids
                    text = tok.decode(kept, skip_special_tokens=True) if tok is not None else ""
                    prompts.append(item.prompt)
                    completions.append(text if isinstance(item.prompt, str) else
                                       [{"role": "assistant", "content": text}])
                    comp_ids.append(list(d.token_ids))
                    rows.append(self.dataset.where(pb.indices[j]) if hasattr(self, "dataset")
                                else str(pb.indices[j]))
                    for k in names:
                        field_lists.setdefault(k, []).append(item.fields.get(k))
        step_no = gen_step + 1
        table = R.score(self.rewards, prompts, completions, comp_ids, field_lists, step_no,
                        rows, max_steps=getattr(runner, "total_steps", None))
        total = torch.tensor(R.totals(table, self.rewards), dtype=torch.float32)
        adv = L.group_advantages(total, G, s.scale_rewards)
        truncated = [d.stopped == LENGTH for _, done, _ in seqs for d in done]
        window, start = [], 0
        for ids, done, _ in seqs:
            n = len(done)
            keep = [not (s.mask_truncated_completions and t) for t in truncated[start:start + n]]
            rb = pack_rollouts(ids, [list(d.token_ids) for d in done], keep,
                               adv.advantages[start:start + n], cfg.max_seq_len,
                               pad_id=getattr(tok, "pad_token_id", None) or 0)
            window.append(rb)
            start += n
        self._extra_logps(model, window, device)
        self._rollout_metrics(table, total, comp_ids, truncated, adv, gen_s)
        self._log_completions(runner, gen_step, prompts, completions, table, total)
        self._note_flat_rewards(step_no, total, adv, len(total) // G)
        return window

    def _note_flat_rewards(self, step: int, total: torch.Tensor, adv, groups: int) -> None:
        """One line, once a run, the first time every group's rewards are equal: such a step
        trains nothing (no advantage), which the loss of 0 alone does not explain."""
        if adv.zero_std_groups < groups or getattr(self, "_flat_noted", False):
            return
        self._flat_noted = True
        values = sorted({round(float(v), 4) for v in total if not math.isnan(float(v))})
        shown = ", ".join(f"{v:g}" for v in values[:3]) + (", ..." if len(values) > 3 else "")
        self.log(f"note: step {step}: within every group the completions got the same reward "
                 f"({shown or 'none scored'}), so this step trains nothing; the rewards must "
                 "tell a prompt's completions apart (--log-completions-every 1 writes them to "
                 "samples.jsonl), or a higher --temperature / more --num-generations vary them")

    def _extra_logps(self, model, window, device) -> None:
        """Old log-probs (num_iterations > 1) and reference log-probs (beta > 0), no graph."""
        if self.s.num_iterations == 1 and self.beta == 0:
            return
        from ...lora import adapters_disabled

        t = self.s.temperature
        for rb in window:
            d = rb.to(device)
            if self.s.num_iterations > 1:
                rb.old_logps = completion_logps(model, d.batch, d.index, d.mask, t).cpu()
            if self.beta > 0:
                with adapters_disabled(model):
                    rb.ref_logps = completion_logps(model, d.batch, d.index, d.mask, t).cpu()

    def _rollout_metrics(self, table, total, comp_ids, truncated, adv, gen_s) -> None:
        def mean_std(xs):
            xs = [x for x in xs if not math.isnan(x)]
            if not xs:
                return math.nan, math.nan
            return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)

        m = {}
        m["reward"], m["reward_std"] = mean_std(total.tolist())
        for j, r in enumerate(self.rewards):
            m[f"reward/{r.name}"], m[f"reward/{r.name}_std"] = mean_std([row[j] for row in table])
        lengths = [len(c) for c in comp_ids]
        m["completion_len"] = statistics.fmean(lengths)
        m["truncated"] = sum(truncated) / len(truncated)
        m["zero_std_groups"] = float(adv.zero_std_groups)
        m["generation_s"] = gen_s
        m["gen_tokens_per_s"] = sum(lengths) / max(gen_s, 1e-9)
        self.rollout_metrics = m

    def _log_completions(self, runner, gen_step, prompts, completions, table, total) -> None:
        every = self.s.log_completions_every
        if not every or runner is None or (gen_step + 1) % every or not runner.parallel.writer:
            return
        from ...utils.io import open_append
        from ..samples import SAMPLES

        with open_append(Path(runner.output) / SAMPLES) as f:
            for i in range(self.G):
                c = completions[i]
                row = {"step": gen_step + 1, "prompt": prompts[i],
                       "completion": c if isinstance(c, str) else c[0]["content"],
                       "reward": total[i].item(),
                       **{f"reward/{r.name}": table[i][j] for j, r in enumerate(self.rewards)}}
                f.write(json.dumps(row) + "\n")

    # --- rollouts kept on disk (num_iterations > 1) --------------------------------------------
    def _save_rollouts(self, runner, gen_step: int) -> None:
        from safetensors.torch import save

        from ...utils.io import atomic_write_bytes

        tensors = {}
        for i, rb in enumerate(self.window_cache):
            b = rb.batch
            for f in fields(b):  # every tensor the batch holds (token_weights included)
                v = getattr(b, f.name)
                if isinstance(v, torch.Tensor):
                    tensors[f"{i}.{f.name}"] = v.contiguous()
            for name in ("index", "mask", "advantages", "old_logps", "ref_logps"):
                v = getattr(rb, name)
                if v is not None:
                    tensors[f"{i}.{name}"] = v.contiguous()
        meta = {"step": str(gen_step), "metrics": json.dumps(self.rollout_metrics),
                "batches": json.dumps([{f.name: getattr(rb.batch, f.name) for f in
                                        fields(rb.batch) if not isinstance(
                                            getattr(rb.batch, f.name), torch.Tensor)}
                                       for rb in self.window_cache])}
        path = Path(runner.output) / ROLLOUTS_FILE
        atomic_write_bytes(path, save(tensors, metadata=meta), root=runner.output)

    def _load_rollouts(self, runner, gen_step: int) -> bool:
        """The kept rollouts of generation step `gen_step` (a resume between two of its
        updates); one line when the file is missing or of another step."""
        from safetensors import safe_open

        path = Path(runner.output) / ROLLOUTS_FILE
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("step") != str(gen_step):
                    raise ValueError(f"it holds step {meta.get('step')}'s")
                t = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise LeantuneError(
                f"{path}: cannot resume at step {runner.step}, inside the generation batch of "
                f"step {gen_step + 1} (--num-iterations {self.s.num_iterations}): its rollouts "
                f"are not there ({e}); resume from a checkpoint at a multiple of "
                "--num-iterations, or start again with --overwrite") from None
        window = []
        names = {f.name for f in fields(PackedBatch)}
        for i, extra in enumerate(json.loads(meta["batches"])):
            # (the tensors saved; `extra` holds the other fields, the unset tensors' None too)
            b = PackedBatch(**{n: t[f"{i}.{n}"] for n in names if f"{i}.{n}" in t}, **extra)
            rb = RolloutBatch(b, t[f"{i}.index"], t[f"{i}.mask"], t[f"{i}.advantages"],
                              t.get(f"{i}.old_logps"), t.get(f"{i}.ref_logps"),
                              num_sequences=t[f"{i}.index"].shape[0],
                              num_tokens=int(t[f"{i}.mask"].sum()))
            window.append(rb)
        self.window_cache, self.cache_step = window, gen_step
        self.rollout_metrics = json.loads(meta["metrics"])
        return True

    # --- the loss --------------------------------------------------------------------------
    def normaliser(self, micro_batches) -> int:
        return L.normaliser(self.loss_type, sum(b.num_sequences for b in micro_batches),
                            sum(b.num_tokens for b in micro_batches), len(micro_batches))

    def tokens(self, micro_batches) -> int:
        return sum(b.batch.num_real_tokens for b in micro_batches)

    def loss(self, model, batch: RolloutBatch) -> MicroLoss:
        s = self.s
        logps = completion_logps(model, batch.batch, batch.index, batch.mask, s.temperature)
        tl = L.token_loss(logps, batch.old_logps, batch.advantages, batch.mask,
                          loss_type=self.loss_type, epsilon_low=s.epsilon,
                          epsilon_high=s.epsilon_high, beta=self.beta, ref_logps=batch.ref_logps)
        loss_sum = L.reduce(tl.per_token, batch.mask, self.loss_type, s.max_completion_tokens)
        return MicroLoss(loss_sum.float(), None, L.masked_sums(tl, batch.mask))

    def finish_metrics(self, sums: dict, n: int) -> dict:
        """The window's metric sums -> the logged device values: clip fractions and the mean
        KL over the trained tokens."""
        tokens = sums["tokens"].clamp(min=1.0)
        out = {k: sums[k] / tokens for k in ("clip", "clip_low", "clip_high")}
        if self.beta > 0:
            out["kl"] = sums["kl"] / tokens
        return out

    def host_metrics(self) -> dict[str, float]:
        """The last generation's metrics (module docstring), for the step's record."""
        return dict(self.rollout_metrics)

    def progress_metrics(self, record: dict) -> dict[str, float]:
        """What the progress line shows beside the loss."""
        keys = ["reward", "reward_std", "completion_len", "clip"] + (["kl"] if self.beta else [])
        return {k: record[k] for k in keys if k in record}

    def evaluate(self, model, loader, parallel) -> dict[str, float]:
        return {}
