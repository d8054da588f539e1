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
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..data.sources import check_source
from ..errors import LeantuneError
from ..lora import LoRAConfig, apply_lora, save_adapter
from ..model.loader import DTYPES, default_dtype, load_model
from ..utils.io import atomic_write_text
from .checkpoint import (
    CKPT_DIR,
    _rng_state,
    _set_rng_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from .config import TrainConfig
from .merge_at_end import check_merge_at_end, merge_at_end
from .metrics import Progress
from .plot import plot_after_training
from .reporting import check_report_to, open_reporting
from .schedule import lr_factor

RUN_MARKERS = ("adapter_config.json", "adapter_model.safetensors", "metrics.jsonl", CKPT_DIR,
               "model.safetensors.index.json")


@dataclass
class TrainResult:
    steps: int
    train_loss: float | None
    first_eval_loss: float | None
    final_eval_loss: float | None
    output: Path
    tokens_per_s: float


def prepare_output(output: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber a previous run unless --overwrite (wipe it) or --resume (continue)."""
    previous = [m for m in RUN_MARKERS if (output / m).exists()]
    if previous and not (resume or overwrite):
        raise LeantuneError(f"{output}: output folder holds a previous run ({previous[0]}); pass "
                            "--resume to continue it, --overwrite to replace it, or choose "
                            "another --output")
    if previous and overwrite and not resume:
        for m in previous:
            p = output / m
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    output.mkdir(parents=True, exist_ok=True)


class Trainer:
    """Holds the model, data, optimizer and state of one run; `train()` runs it."""

    def __init__(self, cfg: TrainConfig, model=None, tokenizer=None, train_data=None,
                 eval_data=None, log=print):
        self.cfg = cfg.validate()
        self.log = log
        self.output = Path(cfg.output)
        # Cheap checks first, so a typo fails before a large model is loaded and before
        # --overwrite removes a previous run.
        self.device = resolve_device(cfg.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # Triton launches (and bf16 checks) use it
        self.dtype = DTYPES[cfg.dtype] if cfg.dtype else default_dtype(self.device)
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
        prepare_output(self.output, cfg.resume, cfg.overwrite)
        torch.manual_seed(cfg.seed)

        self.model = model if model is not None else load_model(cfg.model, dtype=self.dtype,
                                                                 device=self.device)
        self.tokenizer = (tokenizer if tokenizer is not None or train_data is not None
                          else load_tokenizer(cfg.model))
        self._setup_trainable()
        self._setup_data(train_data, eval_data)
        self._setup_optimizer()
        self.step = 0
        self.tokens_seen = 0
        self.first_eval_loss = None
        if cfg.resume:
            self._resume()

    # --- setup ---------------------------------------------------------------------------------
    def _setup_trainable(self) -> None:
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
        policy = cfg.checkpointing
        from .memory import (describe, gpu_budget_bytes, least_plan_bytes, plan_layers,
                             policy_plans)

        L = m.config.num_hidden_layers
        if cfg.offload_embedding and self.device.type == "cuda" and m.offload_embedding():
            torch.cuda.empty_cache()
            self.log("input embedding: in pinned host memory (--no-offload-embedding keeps it "
                     "on the GPU)")
        m.fused = cfg.fused_layers
        if cfg.compile:
            m.compile_layers()  # (switches the fused layers off)
        # why layers run under autograd instead of the fused layer backward (None: they don't)
        unsupported = ("--no-fused-layers" if not cfg.fused_layers else
                       "--compile" if cfg.compile else m.fused_unsupported())
        if m.fused and self.device.type == "cuda" and unsupported is None:
            m.pack_projections(all_layers=True)  # on CUDA every fused layer runs packed:
            # pack before measuring memory (the LoRA columns add ~1% to the packed weights)
        if policy == "auto" and self.device.type == "cuda":
            # fixed: weights (allocated now) + fp32 grads and two AdamW moments of trainables
            fixed = torch.cuda.memory_allocated(self.device) + sum(
                3 * 4 * p.numel() for p in self.params)
            tokens = cfg.batch_size * cfg.max_seq_len
            budget = gpu_budget_bytes(self.device, cfg.max_memory_gib)
            itemsize = torch.finfo(self.dtype).bits // 8
            plans = plan_layers(m.config, tokens, budget, fixed, itemsize=itemsize,
                                autograd=unsupported is not None)
            policy = f"auto ({describe(plans)})"
            least = fixed + least_plan_bytes(m.config, tokens, itemsize,
                                             autograd=unsupported is not None)
            if least > budget:
                self.log(f"note: this run needs about {least / 2**30:.1f} GiB of GPU memory at "
                         f"least (weights and optimizer state {fixed / 2**30:.1f} GiB), more "
                         f"than the {budget / 2**30:.1f} GiB allowed; it may run out of memory: "
                         f"raise --max-memory-gib, or lower --batch-size or --max-seq-len")
        else:
            if policy == "auto":
                policy = "none"
            if policy == "offload" and self.device.type != "cuda":
                raise LeantuneError("--checkpointing offload needs a CUDA device (it copies "
                                    "activations to pinned host memory); use recompute or none")
            if policy == "offload" and unsupported:
                self.log(f"note: --checkpointing offload needs the fused layer path, which "
                         f"this run can't take ({unsupported}); recomputing instead")
                policy = "recompute"
            plans = policy_plans(policy, L)
            if policy == "none" and self.device.type != "cuda":
                plans = [None] * L  # on the CPU plain autograd is faster (measured: the demo)
        m.set_layer_plans(plans)
        m.pack_projections()
        self.checkpoint_policy = policy
        m.train()
        n_train = sum(p.numel() for p in self.params)
        n_all = sum(p.numel() for p in m.parameters())
        self.log(f"trainable parameters: {n_train:,} of {n_all:,} ({100 * n_train / n_all:.2f}%)"
                 f"  [{'full' if cfg.full else 'LoRA r=%d' % cfg.lora_r}, {self.dtype}, "
                 f"{self.device}, activation checkpointing: {policy}]")

    def _setup_data(self, train_data, eval_data) -> None:
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
        elif eval_data is None and cfg.eval_fraction > 0:
            train_data, eval_data = train_data.split_eval(cfg.eval_fraction, cfg.seed)
        if getattr(train_data, "num_truncated", 0):
            self.log(f"note: {train_data.num_truncated} documents longer than --max-seq-len "
                     f"{cfg.max_seq_len} were truncated")
        vocab = self.model.config.vocab_size
        for what, data in (("training data", train_data), ("eval data", eval_data)):
            if data is not None:
                _check_token_ids(data, vocab, what)
        self.train_data, self.eval_data = train_data, eval_data
        self.loader = PackedLoader(train_data, cfg.batch_size, cfg.max_seq_len, seed=cfg.seed,
                                   shuffle=True)
        self.eval_loader = (PackedLoader(eval_data, cfg.batch_size, cfg.max_seq_len,
                                         seed=cfg.seed, shuffle=False)
                            if eval_data is not None else None)
        per_epoch = max(1, len(self.loader) // cfg.grad_accum)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
        n_docs = getattr(train_data, "num_docs", None) or len(train_data)
        self.log(f"data: {n_docs} documents -> {len(self.loader)} packed batches "
                 f"per epoch; {self.total_steps} optimizer steps"
                 + (f"; eval: {len(eval_data)} documents" if eval_data is not None else ""))

    def _setup_optimizer(self) -> None:
        cfg = self.cfg
        fused = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                           betas=(0.9, 0.999), eps=1e-8, fused=fused or None)
        self.scaler = (torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16
                       else None)

    def _resume(self) -> None:
        ckpt = latest_checkpoint(self.output)
        if ckpt is None:
            raise LeantuneError(f"{self.output}: --resume given but no checkpoint found in "
                                f"{self.output / CKPT_DIR}; start without --resume")
        state = load_checkpoint(ckpt, self.model, self.optimizer)
        self._check_resumed_config(ckpt, state.get("config") or {})
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.first_eval_loss = state.get("first_eval_loss")
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])  # fp16 loss scale: resume exactly
        self.loader.load_state_dict(state["data"])
        self.log(f"resumed from {ckpt} at step {self.step}")

    # Settings that change what the remaining steps compute: resuming with other values would
    # not continue the interrupted run. (Data, batch size, max_seq_len, seed and the LoRA shapes
    # are checked by the loader and the checkpoint loader.)
    RESUME_MUST_MATCH = ("grad_accum", "lr", "weight_decay", "warmup_steps", "schedule",
                         "max_grad_norm", "epochs", "max_steps", "dtype", "train_on_inputs")

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
        the tensors stay on the device (no host sync here)."""
        n_target = max(1, sum(b.num_target_tokens for b in micro_batches))
        loss_total = torch.zeros((), device=self.device, dtype=torch.float32)
        for b in micro_batches:
            b = b.to(self.device)
            loss_sum = self.model.loss_sum(b)
            loss = loss_sum / n_target
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_total += loss_sum.detach()
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_total / n_target, grad_norm, sum(b.num_real_tokens for b in micro_batches)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.eval_loader is None:
            return None
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        n = 0
        for batch in self.eval_loader:
            total += self.model.loss_sum(batch.to(self.device))
            n += batch.num_target_tokens
        self.model.train()
        return (total / max(n, 1)).item()

    # --- the loop ------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        cfg = self.cfg
        if cfg.resume:  # drop records a crash left after the checkpoint: they are redone
            drop_metrics_after(self.output / "metrics.jsonl", self.step)
        metrics = open_reporting(cfg, start_step=self.step)  # metrics.jsonl (+ --report-to)
        progress = Progress(self.total_steps, initial=self.step, enabled=cfg.progress)
        if self.first_eval_loss is None:
            self.first_eval_loss = self.evaluate()
            if self.first_eval_loss is not None:
                metrics.write({"step": self.step, "eval_loss": self.first_eval_loss})
                progress.write(f"eval loss before training: {self.first_eval_loss:.4f}")
        batches = (batch for _, _, batch in self.loader.iter_batches())
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        last_loss, eval_loss = None, self.first_eval_loss
        t_start = time.perf_counter()
        tokens_run, start_step = 0, self.step
        step_start = None
        try:
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                # where this step starts: an interrupt before it ends checkpoints from here
                step_start = (self.step, self.loader.state_dict(), _rng_state())
                lr = self._set_lr(self.step)
                window = [next(batches) for _ in range(cfg.grad_accum)]
                loss, gnorm, ntok = self.train_step(window)
                self.step += 1
                self.tokens_seen += ntok
                tokens_run += ntok
                record = None
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    last_loss = loss.item()  # the one sync per logged step
                    dt = time.perf_counter() - t0
                    elapsed = time.perf_counter() - t_start
                    tok_s = tokens_run / max(elapsed, 1e-9)
                    steps_run = self.step - start_step
                    eta = (self.total_steps - self.step) * elapsed / max(steps_run, 1)
                    record = {"step": self.step, "loss": last_loss, "lr": lr,
                              "grad_norm": float(gnorm), "tokens_per_s": tok_s,
                              "step_time_s": dt, "tokens_seen": self.tokens_seen,
                              "peak_mem_gib": peak_memory_gib(self.device)}
                    progress.update(self.step, last_loss, tok_s, eta_s=eta)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                    eval_loss = self.evaluate()
                    if eval_loss is not None:
                        (record := record or {"step": self.step})["eval_loss"] = eval_loss
                        progress.write(f"step {self.step}: eval loss {eval_loss:.4f}")
                if record:
                    metrics.write(record)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < self.total_steps:
                    self.save_checkpoint()
            eval_loss = self.evaluate() if self.eval_loader is not None else None
            if eval_loss is not None:
                metrics.write({"step": self.step, "eval_loss": eval_loss})
                progress.write(f"step {self.step}: eval loss {eval_loss:.4f}")
        except KeyboardInterrupt:
            progress.close()
            if step_start is not None and step_start[0] == self.step:
                # interrupted mid-step: its batches were drawn and its dropout RNG used, but no
                # update was counted; rewind both so --resume redoes the step exactly
                self.loader.load_state_dict(step_start[1])
                _set_rng_state(step_start[2])
            path = self.save_checkpoint()
            metrics.close()
            err = LeantuneError(f"interrupted at step {self.step}; checkpoint saved to {path}; "
                                "continue with the same command plus --resume")
            err.exit_code = 130  # the shell's code for Ctrl-C
            raise err from None
        progress.close()
        metrics.close()
        self.save_final()
        elapsed = time.perf_counter() - t_start
        plot_after_training(self.output, self.log)
        if cfg.merge_at_end:
            merge_at_end(cfg, self.log)
        return TrainResult(self.step, last_loss, self.first_eval_loss, eval_loss, self.output,
                           tokens_run / max(elapsed, 1e-9))

    def save_checkpoint(self) -> Path:
        state = {"data": self.loader.state_dict(), "tokens_seen": self.tokens_seen,
                 "first_eval_loss": self.first_eval_loss,
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                 "config": {k: v for k, v in asdict(self.cfg).items() if k != "extra"}}
        return save_checkpoint(self.output, self.step, self.model, self.optimizer, state,
                               keep=self.cfg.keep_checkpoints)

    def save_final(self) -> None:
        """LoRA: PEFT adapter files. Full: a HF checkpoint of the trained weights."""
        if self.cfg.full:
            from ..export.full import save_full_model

            save_full_model(self.model, self.output, source=getattr(self.model, "source_path", None))
        else:
            save_adapter(self.model, self.output, base_model_name=self.cfg.model)
        if self.tokenizer is not None and hasattr(self.tokenizer, "save_pretrained"):
            self.tokenizer.save_pretrained(str(self.output))


def drop_metrics_after(path: Path, step: int) -> None:
    """Keep only the records of steps <= `step` in metrics.jsonl (resuming from `step`)."""
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
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise LeantuneError(f"{folder}: cannot load the tokenizer ({type(e).__name__}); the "
                            "checkpoint folder needs tokenizer.json / tokenizer_config.json") from None
    if tok.eos_token_id is None:
        raise LeantuneError(f"{folder}: the tokenizer defines no eos_token; set eos_token in "
                            "tokenizer_config.json")
    return tok
