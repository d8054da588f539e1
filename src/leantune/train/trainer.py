"""The SFT training loop, written out plainly.

    for each optimizer step:
        take grad_accum packed micro-batches
        n = target tokens in the whole window            (host int: no sync)
        for each micro-batch: (sum of token losses / n).backward()
        clip, AdamW step, lr from the schedule, zero grads
        log loss / lr / grad norm / tokens/s / peak memory; eval and checkpoint when due

Dividing by the target tokens of the whole accumulation window makes 4 micro-batches with
accumulation 4 give exactly the gradient of one batch of 4 (tested), unlike averaging per-micro-
batch means.

Set-up checks everything it can before it touches the output folder or reads the weights: flags,
the output path, the tokenizer, the data (read, encoded, checked against the vocabulary), the
model's config and safetensors headers; then the weights load. The last step is always
checkpointed, so a finished run can be resumed (nothing to do) or extended (a larger
--max-steps / --epochs). Ctrl-C and SIGTERM checkpoint and stop; a NaN / inf loss stops the run
without writing its result.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from ..data.sources import check_source
from ..dist.data import RankLoader, window_tokens
from ..dist.parallel import Parallel
from ..dist.tensors import full_tensor
from ..errors import LeantuneError
from ..lora import LoRAConfig, apply_lora, save_adapter
from ..model.config import ModelConfig
from ..model.loader import DTYPES, build_empty, default_dtype, load_model, resolve_checkpoint
from ..utils import signals
from ..utils.io import (atomic_write_json, atomic_write_text, refuse_link_at,
                        save_pretrained_safely)
from ..utils.paths import check_output_folder
from .checkpoint import (
    _rng_state,
    _set_rng_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .config import TrainConfig
from .health import NonFiniteWatch
from .merge_at_end import check_merge_at_end, merge_at_end
from .metrics import NoMetrics, Progress
from .output import FULL_INDEX, RUN_CONFIG, RunFolder
from .plot import plot_after_training
from .preflight import check_weights, locate_model
from .reporting import check_report_to, open_reporting
from .samples import SAMPLES, SampleWriter
from .schedule import lr_factor


@dataclass
class TrainResult:
    steps: int
    train_loss: float | None
    first_eval_loss: float | None
    final_eval_loss: float | None
    output: Path
    tokens_per_s: float
    steps_run: int = 0  # steps this call ran (0: the run had already finished)
    skipped_steps: int = 0  # fp16: updates the loss scaler skipped (gradient overflow)


class Trainer:
    """Holds the model, data, optimizer and state of one run; `train()` runs it.

    `model`, `tokenizer`, `train_data` and `eval_data` may be given ready-made (tests,
    benchmarks); what is not given is built from `cfg`."""

    def __init__(self, cfg: TrainConfig, model=None, tokenizer=None, train_data=None,
                 eval_data=None, log=print):
        self.cfg = cfg.validate()
        # under torchrun: the process group, this process's device; rank 0 alone logs and writes
        self.parallel = Parallel.start(resolve_device(cfg.device))
        self.log = log if self.parallel.writer else _quiet
        self.output = Path(cfg.output)
        self.device = self.parallel.device
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches (and bf16 checks) use it
        self.dtype = DTYPES[cfg.dtype] if cfg.dtype else default_dtype(self.device)
        with self.parallel.agreeing():  # an error in any process: every process stops with it
            model_dir, weights = self._check(model, tokenizer, train_data, eval_data)
        model_config = model.config if model is not None else ModelConfig.from_file(
            model_dir / "config.json")
        self.parallel.choose(cfg, model_config, self.dtype, self.log)
        if model is None:
            four_bit = cfg.load_in_4bit or self.prequantized
            if self.parallel.sharded and four_bit:
                raise LeantuneError("a 4-bit base (QLoRA) with FSDP2 is not supported yet; use "
                                    "--parallel ddp")
            if self.parallel.sharded:  # built on the meta device; each process loads its rows
                model = build_empty(model_config, self.dtype, torch.device("meta"))
                model.source_path = weights
            else:
                self.log(f"model: loading {cfg.model}" + (
                    " (4-bit NF4: quantising the decoder's linear weights as they load)"
                    if cfg.load_in_4bit and not self.prequantized else ""))
                model = load_model(weights, dtype=self.dtype, device=self.device,
                                   load_in_4bit=cfg.load_in_4bit)
                weights = None
        torch.manual_seed(cfg.seed)
        self.model = model
        self._setup_router_aux_loss()
        self._setup_trainable()
        self.forward_model = self.parallel.wrap(model, weights, seed=cfg.seed)
        self.params = [p for p in model.parameters() if p.requires_grad]  # (FSDP2: its shards)
        self._setup_optimizer()
        self.watch = NonFiniteWatch(self.device, loss_scaling=self.scaler is not None)
        self.step = 0
        self.router_aux_loss = None  # the last step's (--router-aux-loss-coef), on the device
        self.tokens_seen = 0
        self.first_eval_loss = None
        self.saved_step = None  # the step of the last checkpoint this run wrote or resumed
        if cfg.resume:
            self._resume()
        if self.parallel.rank:  # dropout masks: a stream of its own in each process
            torch.manual_seed(cfg.seed + 7919 * self.parallel.rank + self.step)

    def _check(self, model, tokenizer, train_data, eval_data) -> tuple[Path | None, Path | None]:
        """Everything that can be checked before the weights load: flags, the output folder,
        the tokenizer, the data, the checkpoint's config and safetensors headers. Returns the
        model's folder (config and tokenizer; None where not needed) and its weights' folder
        (None where `model` is given)."""
        cfg = self.cfg
        if cfg.full and self.dtype == torch.float16:
            raise LeantuneError("--full with float16 weights is not supported (no fp32 master "
                                "weights for loss scaling); use --dtype float32, or bfloat16 on "
                                "a GPU that has it")
        if not cfg.full:
            LoRAConfig(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                       targets=cfg.lora_targets)
        for flag, path in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
            if path and train_data is None:
                check_source(path, flag)
        check_report_to(cfg.report_to)
        check_merge_at_end(cfg)
        model_dir = None
        if model is None or (tokenizer is None and train_data is None):
            if not cfg.model:
                raise LeantuneError("no model given: set --model (a checkpoint folder or a hub "
                                    "id)")
            model_dir = locate_model(cfg.model)  # config and tokenizer; weights later
        check_output_folder(self.output, {"model": model_dir})
        self.run_folder = RunFolder(self.output, self.log)
        if self.parallel.writer:  # (the other processes learn of an error through `agreeing`)
            self.run_folder.settle_leftover()
            self.run_folder.check(cfg.resume, cfg.overwrite)

        self.tokenizer = (tokenizer if tokenizer is not None or train_data is not None
                          else load_tokenizer(model_dir))
        self.samples = (SampleWriter(cfg.sample_prompts, self.tokenizer, self.output,
                                     cfg.sample_max_new_tokens) if cfg.sample_prompts else None)
        vocab = (model.config if model is not None
                 else ModelConfig.from_file(model_dir / "config.json")).vocab_size
        self._setup_data(train_data, eval_data, vocab)
        weights, self.prequantized = None, False
        if model is None:
            weights = resolve_checkpoint(cfg.model)  # a hub model's weights download here
            self.prequantized = check_weights(weights)
            if self.prequantized and cfg.full:
                raise LeantuneError(f"{weights}: a 4-bit (bnb-4bit) checkpoint is a frozen base "
                                    "for LoRA; --full needs its 16-bit weights")
        return model_dir, weights

    # --- setup ---------------------------------------------------------------------------------
    def _setup_trainable(self) -> None:
        """Trainable parameters (LoRA adapters, or everything with --full), then how the layers
        run: the engine's executors with a plan per layer for the memory budget."""
        from .. import kernels
        from ..engine import Engine, compile_layers, has_expert_lora, lora_ranks
        from ..engine.planner import (BudgetTooSmall, Workload, describe, gpu_budget_bytes,
                                      plan_memory, policy_plans)

        cfg, m = self.cfg, self.model
        if cfg.full:
            for p in m.parameters():
                p.requires_grad_(True)
        else:
            lcfg = LoRAConfig(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                              targets=cfg.lora_targets, use_rslora=cfg.use_rslora)
            # fp32 adapter masters under a half-precision base
            apply_lora(m, lcfg, seed=cfg.seed, dtype=torch.float32)
        self.params = [p for p in m.parameters() if p.requires_grad]
        options, overridden = cfg.engine_options().with_env_overrides()
        options = self.parallel.engine_options(options)  # FSDP2: no packed projections
        if overridden:
            self.log(f"engine options from the environment: "
                     f"{', '.join(f'{k}={getattr(options, k)}' for k in overridden)}")
        self.engine_options = options
        kernels.set_backend(options.kernels)
        self.engine = Engine(options)
        cuda = self.device.type == "cuda"
        if (cfg.offload_embedding and cuda and not self.parallel.sharded  # (FSDP2 shards it)
                and m.offload_embedding()):
            torch.cuda.empty_cache()
            self.log("input embedding: in pinned host memory (--no-offload-embedding keeps it "
                     "on the GPU)")
        # why the layers run under autograd instead of the fused layer backward (None: they don't)
        autograd_why = ("--compile" if cfg.compile else
                        "--no-fused-layers" if not options.fused_layers else
                        self.engine.fused_unsupported(m))
        if autograd_why is not None and not (cfg.compile or not options.fused_layers):
            self.log(f"note: the layers run under autograd, not leantune's fused layers "
                     f"({autograd_why}): slower and more activation memory (Llama-3.1-8B on an "
                     f"H200: 11.5k tok/s at 19.0 GiB instead of 14.2k at 16.7 GiB); "
                     + _fused_path_hint(autograd_why))
        if cuda and autograd_why is None:
            self.engine.pack(m)  # the LoRA columns add ~1% to the packed weights: pack before
            # memory is measured
        L = m.config.num_hidden_layers
        itemsize = torch.finfo(self.dtype).bits // 8
        work = Workload(m.config, cfg.batch_size * cfg.max_seq_len, itemsize,
                        lora_ranks=lora_ranks(m.layers[0]), autograd=autograd_why is not None,
                        options=options, expert_lora=has_expert_lora(m))
        policy = cfg.activations
        if policy == "auto" and cuda:
            fixed = self._fixed_bytes()
            budget = gpu_budget_bytes(self.device, cfg.max_memory_gib)
            try:
                mem = plan_memory(work, budget, fixed, host_bytes=self.parallel.host_bytes())
            except BudgetTooSmall as e:
                raise LeantuneError(budget_message(cfg, budget, e)) from None
            plans = mem.layers
            m.loss_chunk_bytes = mem.loss_chunk_bytes
            policy = f"auto ({describe(plans)})"
        else:
            if policy == "auto":
                policy = "keep"
            if policy == "offload" and not cuda:
                raise LeantuneError("--activations offload needs a CUDA device (it copies "
                                    "activations to pinned host memory); use recompute or keep")
            if policy == "offload" and autograd_why:
                self.log(f"note: --activations offload needs the fused layer path, which "
                         f"this run can't take ({autograd_why}); recomputing instead")
                policy = "recompute"
            plans = policy_plans(policy, L)
            if policy == "keep" and not cuda:
                plans = [None] * L  # on the CPU plain autograd is faster (measured: the demo)
        if cfg.compile:
            compile_layers(m)  # compiled layers run plainly, keeping every activation
        else:
            self.engine.attach(m, plans)
        self.activation_policy = policy
        m.train()
        n_train = sum(p.numel() for p in self.params)
        n_all = sum(p.numel() for p in m.parameters())
        self.log(f"trainable parameters: {n_train:,} of {n_all:,} ({100 * n_train / n_all:.2f}%)"
                 f"  [{'full' if cfg.full else 'LoRA r=%d' % cfg.lora_r}, {self.dtype}, "
                 f"{self.device}, activations: {policy}]")

    def _setup_router_aux_loss(self) -> None:
        """--router-aux-loss-coef > 0: the model also returns the router's load-balancing loss,
        which train_step adds (as transformers does with output_router_logits)."""
        if self.cfg.router_aux_loss_coef <= 0:
            return
        if self.model.config.moe is None:
            raise LeantuneError(f"--router-aux-loss-coef: {self.cfg.model or 'the model'} is "
                                f"not a mixture-of-experts model ({self.model.config.model_type})"
                                "; leave the flag out")
        self.model.router_aux_loss = True

    def _fixed_bytes(self) -> float:
        """GPU bytes of weights and optimizer state, beside which activations are planned: the
        weights (allocated now) and the trainables' fp32 gradient and two AdamW moments; under
        FSDP2 this process's share, from the parameters' shapes (dist/fsdp.fixed_bytes)."""
        if self.parallel.sharded:
            return self.parallel.fixed_bytes(self.model)
        # DDP's reducer holds two more fp32 copies' worth of the gradients (its buckets and the
        # gradients on their way in): measured on an H200, Llama-3.1-8B LoRA under torchrun,
        # world size 1, +0.31 GiB at the peak for 42M trainable parameters (world size 1 now
        # runs unwrapped: dist/parallel.py)
        per_param = 3 * 4 + (2 * 4 if self.parallel.kind == "ddp" else 0)
        return torch.cuda.memory_allocated(self.device) + sum(per_param * p.numel()
                                                              for p in self.params)

    def _setup_data(self, train_data, eval_data, vocab: int) -> None:
        from ..data import PackedLoader, SFTDataset

        cfg = self.cfg
        if train_data is None:
            train_data = SFTDataset(cfg.data, self.tokenizer, cfg.max_seq_len, format=cfg.format,
                                    train_on_inputs=cfg.train_on_inputs, split=cfg.data_split,
                                    subset=cfg.data_subset)
        if eval_data is None and cfg.eval_data:
            eval_data = SFTDataset(cfg.eval_data, self.tokenizer, cfg.max_seq_len,
                                   format=cfg.format, train_on_inputs=cfg.train_on_inputs,
                                   split=cfg.eval_split, subset=cfg.data_subset,
                                   split_flag="--eval-split")
        for what, data in (("training data", train_data), ("eval data", eval_data)):
            if data is not None:
                _check_token_ids(data, vocab, what)
                if getattr(data, "num_dropped", 0):
                    self.log(f"note: {what}: {data.dropped_summary()}")
        if eval_data is None and cfg.eval_fraction > 0:
            train_data, eval_data = train_data.split_eval(cfg.eval_fraction, cfg.seed)
        if getattr(train_data, "num_truncated", 0):
            self.log(f"note: {train_data.num_truncated} documents longer than --max-seq-len "
                     f"{cfg.max_seq_len} were truncated")
        self.train_data, self.eval_data = train_data, eval_data
        par = self.parallel
        # under torchrun: global batches of batch_size rows per process, this process's rows
        loader = (partial(RankLoader, rank=par.rank, world_size=par.world_size) if par.launched
                  else PackedLoader)
        self.loader = loader(train_data, cfg.batch_size, cfg.max_seq_len, seed=cfg.seed,
                             shuffle=True)
        self.eval_loader = (loader(eval_data, cfg.batch_size, cfg.max_seq_len, seed=cfg.seed,
                                   shuffle=False)
                            if eval_data is not None else None)
        per_epoch = max(1, len(self.loader) // cfg.grad_accum)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
        n_docs = getattr(train_data, "num_docs", None) or len(train_data)
        self.log(f"data: {n_docs} documents -> {len(self.loader)} packed batches "
                 f"per epoch; {self.total_steps} optimizer steps"
                 + (f"; eval: {len(eval_data)} documents" if eval_data is not None else ""))
        if par.launched:
            self.log(par.describe_batch(cfg))

    def _setup_optimizer(self) -> None:
        cfg = self.cfg
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.999), eps=1e-8, fused=fused or None)
        self.scaler = (torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16
                       else None)

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.output)  # there is one: RunFolder.check
        state = load_checkpoint(ckpt, self.model, self.optimizer)
        self._check_resumed_config(ckpt, state.get("config") or {})
        self.step = self.saved_step = int(state["step"])
        if self.step > self.total_steps:
            raise LeantuneError(f"{ckpt}: the run is at step {self.step}, past the "
                                f"{self.total_steps} steps this command asks for; give "
                                f"--max-steps {self.step} or more (or the --epochs it ran with)")
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.first_eval_loss = state.get("first_eval_loss")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])  # fp16 loss scale: resume exactly
        self.loader.load_state_dict(state["data"])
        self.log(f"resumed from {ckpt} at step {self.step}")
        before = state.get("total_steps", self.total_steps)
        if before != self.total_steps and self.step < self.total_steps:
            cfg = self.cfg
            old, new = (cfg.lr * lr_factor(self.step, cfg.warmup_steps, n, cfg.schedule)
                        for n in (before, self.total_steps))
            self.log(f"the run now has {self.total_steps} optimizer steps (it was started with "
                     f"{before}): the {cfg.schedule} schedule runs over {self.total_steps} steps, "
                     f"so step {self.step + 1} gets learning rate {new:.3g} (was {old:.3g})")

    # Settings that change what the remaining steps compute: resuming with other values would
    # not continue the interrupted run. (Data, batch size, max_seq_len, seed and the LoRA shapes
    # are checked by the loader and the checkpoint loader; the length, --max-steps / --epochs,
    # may change: that extends or shortens the run.)
    RESUME_MUST_MATCH = ("grad_accum", "lr", "weight_decay", "warmup_steps", "schedule",
                         "max_grad_norm", "dtype", "train_on_inputs", "router_aux_loss_coef",
                         "load_in_4bit")

    def _check_resumed_config(self, ckpt: Path, saved: dict) -> None:
        for key in self.RESUME_MUST_MATCH:
            if key in saved and saved[key] != getattr(self.cfg, key):
                flag = "--" + key.replace("_", "-")
                raise LeantuneError(
                    f"{ckpt}: the run was started with {flag} {saved[key]}, this command has "
                    f"{getattr(self.cfg, key)}; resume with the same value (or start a new run "
                    f"in another --output)")

    # --- one step ------------------------------------------------------------------------------
    def _set_lr(self, step: int) -> float:
        lr = self.cfg.lr * lr_factor(step, self.cfg.warmup_steps, self.total_steps,
                                     self.cfg.schedule)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Forward/backward over the window, clip, step. Returns (loss sum, grad norm, tokens);
        the tensors stay on the device (no host sync here). Under torchrun the loss and the
        tokens are the global window's (dist/data.py), and gradients are reduced over the
        processes after the window's last micro-batch (dist/parallel.py). With
        --router-aux-loss-coef the router's load-balancing loss (its mean over the window:
        `router_aux_loss`) is added, times the coefficient; the loss returned is the next-token
        loss alone."""
        n_target, n_real = window_tokens(micro_batches)
        n_target = max(1, n_target)
        scale = self.parallel.grad_scale
        loss_total = torch.zeros((), device=self.device, dtype=torch.float32)
        coef, aux_total = self.cfg.router_aux_loss_coef, None
        for i, b in enumerate(micro_batches):
            b = b.to(self.device)
            with self.parallel.micro_batch(self.model, last=i == len(micro_batches) - 1):
                out = self.forward_model(batch=b, loss_only=True)
                loss = out.loss_sum / n_target
                if out.aux_loss is not None:
                    aux = out.aux_loss / len(micro_batches)
                    loss = loss + coef * aux
                    aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
                if scale != 1:  # DDP and FSDP2 average over processes: the sum is wanted
                    loss = loss * scale
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_total += out.loss_sum.detach()
        self.parallel.sum_(loss_total)
        self.router_aux_loss = aux_total
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_total / n_target, grad_norm, n_real

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.eval_loader is None:
            return None
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        n = 0
        for batch in self.eval_loader:
            total += self.model(batch=batch.to(self.device), loss_only=True).loss_sum
            n += window_tokens([batch])[0]  # (under torchrun: the global batch's)
        self.model.train()
        return (self.parallel.sum_(total) / max(n, 1)).item()

    def write_samples(self, progress) -> None:
        """--sample-prompts: complete them with the model as it is now (samples.py)."""
        if self.samples is not None:
            first = self.samples.write(self.model, self.step)
            progress.write(f"step {self.step}: sample: {' '.join(first.split())[:100]!r}")

    # --- the loop ------------------------------------------------------------------------------
    def run_settings(self) -> dict:
        """The settings this run trains with: its config and the engine options in effect
        (written to run_config.json and into every checkpoint)."""
        return {"config": asdict(self.cfg), "engine_options": self.engine_options.to_dict(),
                "activations": self.activation_policy}

    def train(self) -> TrainResult:
        """Run to `total_steps`. With --overwrite the previous run is set aside first, deleted
        at this run's first checkpoint, and put back if the run stops before it."""
        if self.step >= self.total_steps:
            return self._already_finished()
        with signals.as_interrupts():
            if self.parallel.writer:
                self.run_folder.begin(overwrite=self.cfg.overwrite)
            try:
                return self._train()
            except BaseException:
                self.run_folder.restore()
                raise

    def _train(self) -> TrainResult:
        cfg = self.cfg
        writer = self.parallel.writer  # (under torchrun rank 0 alone writes and reports)
        if writer:
            atomic_write_json(self.output / RUN_CONFIG, self.run_settings())
        if cfg.resume and writer:  # drop records a crash left after the checkpoint: redone
            drop_metrics_after(self.output / "metrics.jsonl", self.step)
            drop_metrics_after(self.output / SAMPLES, self.step)
        # metrics.jsonl (+ --report-to)
        metrics = open_reporting(cfg, start_step=self.step) if writer else NoMetrics()
        progress = Progress(self.total_steps, initial=self.step, bar=cfg.progress,
                            quiet=not writer)
        last_loss, eval_loss = None, self.first_eval_loss
        t_start = time.perf_counter()
        tokens_run, start_step = 0, self.step
        self.watch.good_until = self.step
        step_start = None
        try:
            if self.first_eval_loss is None:
                self.first_eval_loss = self.evaluate()
                if self.first_eval_loss is not None:
                    metrics.write({"step": self.step, "eval_loss": self.first_eval_loss})
                    progress.write(f"eval loss before training: {self.first_eval_loss:.4f}")
            if self.step == 0:
                self.write_samples(progress)
            batches = (batch for _, _, batch in self.loader.iter_batches())
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                # where this step starts: an interrupt before it ends checkpoints from here
                step_start = (self.step, self.loader.state_dict(), _rng_state())
                lr = self._set_lr(self.step)
                window = [next(batches) for _ in range(cfg.grad_accum)]
                loss, gnorm, ntok = self.train_step(window)
                self.watch.observe(loss, gnorm)
                self.step += 1
                self.tokens_seen += ntok
                tokens_run += ntok
                record = None
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    # the one sync per logged step
                    aux = [] if self.router_aux_loss is None else [self.router_aux_loss]
                    (last_loss, grad_norm, *aux), bad, skipped = self.watch.read(
                        self.step, loss, gnorm, *aux)  # (the aux loss in the same copy)
                    dt = time.perf_counter() - t0
                    elapsed = time.perf_counter() - t_start
                    tok_s = tokens_run / max(elapsed, 1e-9)
                    steps_run = self.step - start_step
                    eta = (self.total_steps - self.step) * elapsed / max(steps_run, 1)
                    record = {"step": self.step, "loss": last_loss, "lr": lr,
                              "grad_norm": grad_norm, "tokens_per_s": tok_s,
                              "step_time_s": dt, "tokens_seen": self.tokens_seen,
                              "peak_mem_gib": peak_memory_gib(self.device)}
                    if self.scaler is not None:
                        record["skipped_steps"] = skipped
                    if aux:
                        record["router_aux_loss"] = aux[0]
                    if bad:
                        metrics.write(record)
                        raise self._diverged(last_loss, grad_norm)
                    progress.update(self.step, last_loss, tok_s, eta_s=eta)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                    eval_loss = self.evaluate()
                    if eval_loss is not None:
                        (record := record or {"step": self.step})["eval_loss"] = eval_loss
                        progress.write(f"step {self.step}: eval loss {eval_loss:.4f}")
                    self.write_samples(progress)
                if record:
                    metrics.write(record)
                if (cfg.save_every and self.step % cfg.save_every == 0) \
                        or self.step == self.total_steps:
                    self.save_checkpoint()
            eval_loss = self.evaluate() if self.eval_loader is not None else None
            if eval_loss is not None:
                metrics.write({"step": self.step, "eval_loss": eval_loss})
                progress.write(f"step {self.step}: eval loss {eval_loss:.4f}")
            self.write_samples(progress)
            skipped = self.watch.read(self.step)[2]
            if skipped:
                progress.write(f"note: the fp16 loss scaler skipped {skipped} of "
                               f"{self.step - start_step} updates (gradient overflow: it skips "
                               "the update and lowers the scale, by design)")
        except KeyboardInterrupt as interrupt:
            try:
                progress.close()
                err = self._stopped(interrupt, start_step, step_start)
            except KeyboardInterrupt:  # again, while checkpointing: stop now
                err = self._stopped_again(interrupt)
            raise err from None
        finally:
            progress.close()
            metrics.close()
        self.save_final()
        elapsed = time.perf_counter() - t_start
        if writer:
            plot_after_training(self.output, self.log)
            if cfg.merge_at_end:
                merge_at_end(cfg, self.log)
        return TrainResult(self.step, last_loss, self.first_eval_loss, eval_loss, self.output,
                           tokens_run / max(elapsed, 1e-9), steps_run=self.step - start_step,
                           skipped_steps=skipped)

    def _stopped(self, interrupt: KeyboardInterrupt, start_step: int, step_start) -> LeantuneError:
        """The one line for a Ctrl-C / SIGTERM: checkpoint what was trained, say how to go on."""
        what = signals.describe(interrupt)
        # no step finished: nothing worth a checkpoint; under torchrun the other processes may
        # be anywhere in a step (in a collective, or stopped): none is written from here
        if self.step == start_step or self.parallel.launched:
            if self.run_folder.pending:
                note = f"the previous run in {self.output} is put back as it was"
            elif self.saved_step is not None:
                note = (f"its checkpoint at step {self.saved_step} is unchanged; continue with "
                        "the same command plus --resume")
            else:
                note = "nothing was saved; run the command again to start over"
            when = ("before the first step finished" if self.step == start_step else
                    f"at step {self.step} (under torchrun a stop writes no checkpoint; "
                    "--save-every sets how often one is written)")
            err = LeantuneError(f"{what} {when}; {note}")
        else:
            if step_start is not None and step_start[0] == self.step:
                # interrupted mid-step: its batches were drawn and its dropout RNG used, but no
                # update was counted; rewind both so --resume redoes the step exactly
                self.loader.load_state_dict(step_start[1])
                _set_rng_state(step_start[2])
            path = self.save_checkpoint()
            err = LeantuneError(f"{what} at step {self.step}; checkpoint saved to {path}; "
                                "continue with the same command plus --resume")
        err.exit_code = signals.exit_code(interrupt)
        return err

    def _stopped_again(self, interrupt: KeyboardInterrupt) -> LeantuneError:
        """The one line for a second Ctrl-C / SIGTERM while the first one's checkpoint was
        being written: that checkpoint is not there (a half-written one is never used)."""
        last = latest_checkpoint(self.output)
        note = (f"the previous run in {self.output} is put back as it was"
                if self.run_folder.pending else
                "there is no earlier one; run the command again to start over" if last is None
                else f"--resume continues from {last}")
        err = LeantuneError(f"{signals.describe(interrupt)} again while saving the checkpoint of "
                            f"step {self.step}, so it was not saved; {note}")
        err.exit_code = signals.exit_code(interrupt)
        return err

    def _diverged(self, loss: float | None = None, grad_norm: float | None = None
                  ) -> LeantuneError:
        """The one line for a NaN / inf: what to try; nothing of the diverged weights is kept.
        `loss` and `grad_norm`: this step's, when it is the step that was read."""
        if loss is not None and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = f"the loss is {loss} and the gradient norm {grad_norm}"
        else:
            what = "the loss or the gradient norm became NaN or infinite"
        first = self.watch.good_until + 1
        steps = f"step {self.step}" if first >= self.step else f"steps {first}-{self.step}"
        ckpt = None if self.run_folder.pending else latest_checkpoint(self.output)
        kept = (f"the last good checkpoint {ckpt} is kept" if ckpt is not None
                else "no checkpoint was written")
        clip = (f"a lower --max-grad-norm (now {self.cfg.max_grad_norm})"
                if self.cfg.max_grad_norm > 0 else "gradient clipping, --max-grad-norm 1.0")
        result = "model" if self.cfg.full else "adapter"
        return LeantuneError(f"{steps}: {what}: training diverged and stopped, and no final "
                             f"{result} was written ({kept}); try a lower --lr (now "
                             f"{self.cfg.lr:g}) or {clip}, in a new run (--overwrite)")

    def _already_finished(self) -> TrainResult:
        """`--resume` of a run that reached its last step: nothing to train. The final adapter
        (or model) is written from the checkpoint if it is missing or older."""
        self.log(f"{self.output}: the run already finished at step {self.step}; nothing to do "
                 "(to train on, --resume with a larger --max-steps or --epochs)")
        final = self.output / (FULL_INDEX if self.cfg.full else "adapter_model.safetensors")
        ckpt = latest_checkpoint(self.output)
        if not final.exists() or final.stat().st_mtime < ckpt.stat().st_mtime:
            self.save_final()
            self.log(f"wrote the final {'model' if self.cfg.full else 'adapter'} from {ckpt}")
        return TrainResult(self.step, None, self.first_eval_loss, None, self.output, 0.0)

    def save_checkpoint(self) -> Path:
        """Checkpoint this step (once), and settle --overwrite: the previous run is deleted."""
        if self.watch.read(self.step)[1]:
            raise self._diverged()
        if self.saved_step == self.step:
            return latest_checkpoint(self.output)
        state = {"data": self.loader.state_dict(), "tokens_seen": self.tokens_seen,
                 "first_eval_loss": self.first_eval_loss, "total_steps": self.total_steps,
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                 **self.run_settings()}
        path = save_checkpoint(self.output, self.step, self.model, self.optimizer, state,
                               keep=self.cfg.keep_checkpoints, write=self.parallel.writer)
        self.saved_step = self.step
        self.run_folder.commit()
        return path

    def save_final(self) -> None:
        """LoRA: PEFT adapter files. Full: a HF checkpoint of the trained weights. (Under
        torchrun every process takes part, FSDP2 gathering the weights; rank 0 writes.)"""
        write = self.parallel.writer
        if self.cfg.full:
            from ..export.full import save_full_model

            save_full_model(self.model, self.output,
                            source=getattr(self.model, "source_path", None), write=write)
        else:
            save_adapter(self.model, self.output, base_model_name=self.cfg.model, write=write)
        if write and self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            save_pretrained_safely(self.tokenizer, self.output)  # (renamed in: no link followed)


def _quiet(*_args, **_kw) -> None:
    """The log of a process that prints nothing (under torchrun, all but rank 0)."""


def budget_message(cfg: TrainConfig, budget: float, e) -> str:
    """One line for a memory budget no plan fits (planner.BudgetTooSmall `e`)."""
    what = (f"--max-memory-gib {cfg.max_memory_gib:g}" if cfg.max_memory_gib
            else f"this GPU's {budget / 2**30:.1f} GiB")
    return (f"{what} is too little for this run: it needs at least {e.least_bytes / 2**30:.2f} "
            f"GiB (weights and optimizer state {e.fixed_bytes / 2**30:.2f} GiB, "
            f"{cfg.batch_size} x {cfg.max_seq_len} tokens a micro-batch); raise "
            "--max-memory-gib, or lower --batch-size or --max-seq-len")


def drop_metrics_after(path: Path, step: int) -> None:
    """Keep only the records of steps <= `step` in metrics.jsonl (resuming from `step`)."""
    refuse_link_at(path, "metrics log")  # (its target's lines would be copied in)
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except (ValueError, AttributeError):
            continue  # a line cut short by the crash
        keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(keep))


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)


def resolve_device(name: str | None) -> torch.device:
    """--device as a torch.device this machine has; default cuda when available, else cpu."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise LeantuneError(f"--device {name!r} is not a device; use cuda, cuda:N or cpu") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LeantuneError(f"--device {name}: torch sees no CUDA GPU here (see `leantune "
                                "doctor`); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise LeantuneError(f"--device {name}: torch sees only {torch.cuda.device_count()} "
                                "CUDA GPU(s), numbered from 0")
    return device


def _check_token_ids(data, vocab: int, what: str) -> None:
    """Every token id must index the model's embedding (an id past it would read outside the
    table): one line naming the document otherwise."""
    for i in range(len(data)):
        ids = data[i][0]
        if not len(ids):
            continue
        hi, lo = max(ids), min(ids)
        if hi >= vocab or lo < 0:
            bad = hi if hi >= vocab else lo
            raise LeantuneError(
                f"{what}: document {i} holds token id {bad}, outside the model's vocabulary "
                f"(0..{vocab - 1}); the tokenizer does not match the model (check --model), or "
                f"the ids were made for another vocabulary")


def load_tokenizer(model: str | None):
    from transformers import AutoTokenizer

    from ..model.loader import resolve_checkpoint

    folder = resolve_checkpoint(model)
    try:
        # never the checkpoint's own Python code (auto_map): a downloaded folder runs nothing
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except Exception as e:
        from ..model.loader import custom_code_error

        code = custom_code_error(folder) if "trust_remote_code" in str(e) else None
        raise code or LeantuneError(f"{folder}: cannot load the tokenizer ({type(e).__name__}); "
                                    "the checkpoint folder needs tokenizer.json / "
                                    "tokenizer_config.json") from None
    if tok.eos_token_id is None:
        raise LeantuneError(f"{folder}: the tokenizer defines no eos_token; set eos_token in "
                            "tokenizer_config.json")
    return tok


def _fused_path_hint(why: str) -> str:
    """What to do about `why` (fused_unsupported's reason) to take the fused layers."""
    if "dropout" in why:
        return "use --lora-dropout 0 for the fused path"
    if "load-balancing" in why:
        return "--router-aux-loss-coef 0 takes the fused path"
    if "jitter" in why:
        return "the fused layer does not cover this model yet"
    return "LoRA on a frozen base takes the fused path"
