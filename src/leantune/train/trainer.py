"""The set-up of a training run: model, adapter, engine plan, data, optimizer, resume.

Trainer builds a run from its TrainConfig and hands it to the step runner it derives from
(train/runner.py: the loop, the same for every objective); what the run optimises is its
objective (train/objectives: SFT by default), which also reads and batches its rows.

Set-up checks everything it can before it touches the output folder or reads the weights: flags,
the output path, the tokenizer, the data (read, encoded, checked against the vocabulary), the
model's config and safetensors headers; then the weights load. Here too is what a run keeps:
its settings (run_config.json), checkpoints (written when the runner says) and the final
adapter or model.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from ..data.sources import check_source
from ..dist.data import RankLoader
from ..dist.parallel import Parallel
from ..errors import LeantuneError
from ..generate.prompts import TRAINED_AS, read_prompt_file
from ..lora import apply_lora, save_adapter
from ..lora.base_check import base_name_to_record, model_fingerprint
from ..lora.params import count_parameters
from ..utils.words import count
from ..model.config import ModelConfig
from ..model.loader import DTYPES, build_empty, default_dtype, load_model, resolve_checkpoint
from ..kernels.fp8 import emulating as fp8_emulating
from ..lora.base_weight import check_precision, quantize_fp8_
from ..utils.io import save_pretrained_safely
from ..utils.paths import check_output_folder
from .checkpoint import (check_resumed_config, latest_checkpoint, load_checkpoint, read_state,
                         save_checkpoint)
from .config import TrainConfig
from .health import NonFiniteWatch
from .merge_at_end import check_merge_at_end
from .objectives import objective_for
from .output import RunFolder, final_save
from .preflight import check_kernels, check_settings, check_weights, locate_model
from .reporting import check_report_to
from .runner import StepRunner, TrainResult, drop_metrics_after, peak_memory_gib  # noqa: F401
from .samples import SampleWriter
from .schedule import lr_factor


class Trainer(StepRunner):
    """Holds the model, data, optimizer and state of one run; `train()` (StepRunner) runs it.

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
        check_precision(cfg.precision, self.device, self.prequantized, self.parallel.sharded,
                        resuming=bool(cfg.resume))
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
                    if cfg.load_in_4bit and not self.prequantized else "") + (
                    " (FP8: quantising the decoder's linear weights to e4m3 as they load"
                    + ("; its GEMMs emulated in PyTorch, LEANTUNE_FP8_EMULATE: slow)"
                       if fp8_emulating() else ")")
                    if cfg.precision == "fp8" else ""))
                model = load_model(weights, dtype=self.dtype, device=self.device,
                                   load_in_4bit=cfg.load_in_4bit, precision=cfg.precision)
                weights = None
        elif cfg.precision == "fp8":
            quantize_fp8_(model)  # (a model passed in: its 16-bit projections, one at a time)
        torch.manual_seed(cfg.seed)
        self.model = model
        self._setup_router_aux_loss()
        self.folded = None  # --adapter: the SFT adapter folded into the base (lora/fold.py)
        if cfg.adapter:
            from ..lora.fold import fold_adapter

            self.folded = fold_adapter(model, cfg.adapter, self.log)
        # full fine-tuning with a reference: its frozen copy, before any weight trains
        self.reference_bytes = getattr(self.objective, "attach_reference", lambda *_: 0)(
            model, cfg.full)
        self._setup_trainable()
        self.forward_model = self.parallel.wrap(model, weights, seed=cfg.seed)
        self.params = [p for p in model.parameters() if p.requires_grad]  # (FSDP2: its shards)
        self._setup_optimizer()
        self.watch = NonFiniteWatch(self.device, loss_scaling=self.scaler is not None)
        self.step = 0
        self.router_aux_loss = None  # the last step's (--router-aux-loss-coef), on the device
        self.step_metrics = {}  # the last step's objective metrics (name -> device scalar)
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
            cfg.lora.build()  # (checked: a bad value is one line, before anything is read)
        for flag, path in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
            if path and train_data is None:
                check_source(path, flag)
        check_report_to(cfg.report_to)
        check_merge_at_end(cfg)
        # (the device now; the checkpoint later)
        check_precision(cfg.precision, self.device, resuming=bool(cfg.resume))
        model_dir = None
        if model is None or (tokenizer is None and train_data is None):
            if not cfg.model:
                raise LeantuneError("no model given: set --model (a checkpoint folder or a hub "
                                    "id)")
            model_dir = locate_model(cfg.model)  # config and tokenizer; weights later
        check_settings(cfg, model.config if model is not None else
                       ModelConfig.from_file(model_dir / "config.json"), self.device)
        check_output_folder(self.output, {"model": model_dir})
        self.run_folder = RunFolder(self.output, self.log)
        if self.parallel.writer:  # (the other processes learn of an error through `agreeing`)
            self.run_folder.settle_leftover()
            self.run_folder.check(cfg.resume, cfg.overwrite, cfg)  # (+ resume settings)

        self.tokenizer = (tokenizer if tokenizer is not None or train_data is not None
                          else load_tokenizer(model_dir))
        self.objective = objective_for(cfg, self.log)
        model_config = (model.config if model is not None
                        else ModelConfig.from_file(model_dir / "config.json"))
        # a bad --sample-prompts file is refused before the data is tokenized; its prompts are
        # tokenized after ({"prompt": text} rows are asked in the layout trained on)
        sample_rows = read_prompt_file(cfg.sample_prompts) if cfg.sample_prompts else None
        vocab = model_config.vocab_size
        self._setup_data(train_data, eval_data, vocab)
        self.samples = (SampleWriter(cfg.sample_prompts, self.tokenizer, self.output,
                                     cfg.sample_max_new_tokens, model_config, self.log,
                                     TRAINED_AS.get(getattr(self.train_data, "format", None)),
                                     rows=sample_rows)
                        if cfg.sample_prompts else None)
        weights, self.prequantized = None, False
        if model is None:
            weights = resolve_checkpoint(cfg.model)  # a hub model's weights download here
            self.prequantized = check_weights(weights)
            if self.prequantized and cfg.full:
                raise LeantuneError(f"{weights}: a 4-bit (bnb-4bit) checkpoint is a frozen base "
                                    "for LoRA; --full needs its 16-bit weights")
        if weights is not None and cfg.resume and not cfg.full:
            self._check_resumed_base(weights)
        if cfg.adapter:  # lora/fold.py: checked (and its base) before the weights load
            from ..lora.base_check import check_base
            from ..lora.fold import check_foldable

            if self.parallel.sharded:
                raise LeantuneError("--adapter with FSDP2 is not supported yet; use --parallel "
                                    "ddp")
            _, adapter_weights = check_foldable(cfg.adapter, cfg.load_in_4bit or self.prequantized)
            if weights is not None:
                check_base(adapter_weights, cfg.model, weights, log=self.log)
        return model_dir, weights

    def _check_resumed_base(self, weights: Path) -> None:
        """--resume of a LoRA run on other base weights than its checkpoints were trained on
        (state.json's base_fingerprint: lora/base_check.py) would mix two bases in one adapter:
        refused in one line before the weights load."""
        from ..lora.base_check import fingerprint, recorded_base

        ckpt = latest_checkpoint(self.output)
        if ckpt is None:
            return
        name, was = recorded_base(ckpt / "trainable.safetensors")
        if was is None:  # (a checkpoint written before fingerprints: nothing to compare)
            return
        now = fingerprint(weights)
        if now != was:
            raise LeantuneError(
                f"{ckpt}: the run was trained on {name or 'another base'} (weights fingerprint "
                f"{was}), but --model {self.cfg.model} has other weights ({now}); resume with "
                "the base it was trained on (or start a new run in another --output)")

    # --- setup ---------------------------------------------------------------------------------
    def _setup_trainable(self) -> None:
        """Trainable parameters (LoRA adapters, or everything with --full), then how the layers
        run: the engine's executors with a plan per layer for the memory budget."""
        from .. import kernels
        from ..engine import Engine, compile_layers, has_expert_lora, lora_ranks
        from ..engine.planner import (BudgetTooSmall, Workload, describe, gpu_budget_bytes,
                                      plan_streaming, policy_plans)

        cfg, m = self.cfg, self.model
        if cfg.full:
            for p in m.parameters():
                p.requires_grad_(True)
        else:
            # fp32 adapter masters under a half-precision base
            apply_lora(m, cfg.lora.build(), seed=cfg.seed, dtype=torch.float32)
        self.params = [p for p in m.parameters() if p.requires_grad]
        options, overridden = cfg.engine_options().with_env_overrides()
        options = self.parallel.engine_options(options)  # FSDP2: no packed projections
        if overridden:
            self.log(f"engine options from the environment: "
                     f"{', '.join(f'{k}={getattr(options, k)}' for k in overridden)}")
        self.engine_options = options
        if not options.stream_weights and (options.stream_max_layers or options.stream_fill_ahead):
            self.log("note: --stream-max-layers and --stream-fill-ahead apply with "
                     "--stream-weights only; ignored here")
        cuda = self.device.type == "cuda"
        check_kernels(options.kernels, self.device, "LEANTUNE_KERNELS")  # (an env override)
        if options.attention == "flash" and not cuda:
            self.log(f"note: --attention flash is for CUDA; on the {self.device.type.upper()} "
                     "the layers' attention runs through PyTorch ops")
        kernels.set_backend(options.kernels)
        self.engine = Engine(options)
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
            # (on the CPU every run's layers run under autograd: said as what a GPU would do)
            where = ("the layers run" if cuda else
                     "on a GPU the layers would run (on the CPU every run's do)")
            self.log(f"note: {where} under autograd, not leantune's fused layers "
                     f"({autograd_why}): slower and more activation memory (Llama-3.1-8B on an "
                     f"H200: 11.5k tok/s at 19.0 GiB instead of 14.2k at 16.7 GiB); "
                     + _fused_path_hint(autograd_why))
        if cuda and autograd_why is None:
            self.engine.pack(m)  # the LoRA columns add ~1% to the packed weights: pack before
            # memory is measured
        L = m.config.num_hidden_layers
        itemsize = torch.finfo(self.dtype).bits // 8
        seqs = getattr(self.objective, "sequences_per_unit", 1)  # a pair: 2 sequences
        work = Workload(m.config, seqs * cfg.batch_size * cfg.max_seq_len, itemsize,
                        lora_ranks=lora_ranks(m.layers[0]), autograd=autograd_why is not None,
                        options=options, expert_lora=has_expert_lora(m),
                        reference_pass=getattr(self.objective, "needs_reference", False),
                        reference_bytes=self.reference_bytes,
                        generation=getattr(self.objective, "generation_shape", None),
                        shared_prompt=getattr(self.objective, "shared_prompt", False),
                        fp8=cfg.precision == "fp8")
        policy = cfg.activations
        streamed: list[int] = []  # layers whose base weights stream from the host
        if policy == "auto" and cuda:
            fixed = self._fixed_bytes()
            budget = gpu_budget_bytes(self.device, cfg.max_memory_gib)
            candidates, layer_bytes = self._streamable(options, autograd_why)
            try:  # (no candidates: plan_memory's plan, nothing streamed)
                mem, streamed = plan_streaming(work, budget, fixed, layer_bytes, candidates,
                                               host_bytes=self.parallel.host_bytes())
            except BudgetTooSmall as e:
                raise LeantuneError(budget_message(cfg, budget, e)) from None
            plans = mem.layers
            m.loss_chunk_bytes = mem.loss_chunk_bytes
            policy = f"auto ({describe(plans)})"
            if streamed:
                policy += (f"; base weights of {len(streamed)} layers streamed from pinned host "
                           f"memory ({len(streamed) * layer_bytes / 2**30:.2f} GiB)")
        else:
            if options.stream_weights:
                self.log("note: --stream-weights is for --activations auto on a CUDA device (the "
                         "planner decides which layers' weights stream); ignored here")
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
            if streamed:
                self.engine.stream_weights(m, streamed)
                torch.cuda.empty_cache()  # (the streamed layers' GPU buffers went back)
        self.activation_policy = policy
        m.train()
        n_train, n_all = count_parameters(m, self.params)  # (4-bit weights: their real count)
        self.log(f"trainable parameters: {n_train:,} of {n_all:,} ({100 * n_train / n_all:.2f}%)"
                 f"  [{'full' if cfg.full else 'LoRA r=%d' % cfg.lora.r}, {self.dtype}, "
                 f"{self.device}, activations: {policy}]")

    def _streamable(self, options, autograd_why) -> tuple[list[int], int]:
        """The layers whose base weights the planner may stream (engine/weight_stream.py), and
        the bytes each gives up: with EngineOptions.stream_weights, in one process (DDP and
        FSDP2 hold every parameter on the GPU), on the fused path, 16-bit packed dense layers
        only; ([], 0) otherwise."""
        if (not options.stream_weights or autograd_why is not None or self.cfg.full
                or self.parallel.kind is not None):
            return [], 0
        ok = self.engine.streamable(self.model)
        return ok, self.engine.layer_weight_bytes(self.model) if ok else 0

    def _setup_router_aux_loss(self) -> None:
        """--router-aux-loss-coef > 0: the model also returns the router's load-balancing loss,
        which train_step adds (as transformers does with output_router_logits)."""
        if self.cfg.router_aux_loss_coef <= 0:
            return
        # (a dense model was refused before loading: preflight.check_settings)
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
        """The objective's datasets (given ones pass through) and resumable loaders over them,
        and the run's length in optimizer steps."""
        from ..data import PackedLoader

        cfg, objective = self.cfg, self.objective
        train_data, eval_data = objective.build_data(self.tokenizer, train_data, eval_data)
        for what, data in (("training data", train_data), ("eval data", eval_data)):
            if data is not None:
                objective.check_token_ids(data, vocab, what)
                if getattr(data, "num_dropped", 0):
                    self.log(f"note: {what}: {data.dropped_summary()}")
        if eval_data is None and cfg.eval_fraction > 0:
            train_data, eval_data = train_data.split_eval(cfg.eval_fraction, cfg.seed)
        if getattr(train_data, "num_truncated", 0):
            n = train_data.num_truncated
            self.log(f"note: {count(n, 'document')} longer than --max-seq-len "
                     f"{cfg.max_seq_len} {'was' if n == 1 else 'were'} truncated")
        self.train_data, self.eval_data = train_data, eval_data
        par = self.parallel
        # under torchrun: global batches of batch_size rows per process, this process's rows
        loader = (partial(RankLoader, rank=par.rank, world_size=par.world_size) if par.launched
                  else PackedLoader)
        self.loader = objective.make_loader(train_data, loader, shuffle=True)
        self.eval_loader = (objective.make_loader(eval_data, loader, shuffle=False)
                            if eval_data is not None else None)
        ckpt = latest_checkpoint(self.output) if cfg.resume else None
        if ckpt is not None:  # the data against the checkpoint's before the weights load (the
            # position is set again with the rest of the state: _resume)
            self.loader.load_state_dict(read_state(ckpt, required=("step", "data"))["data"])
        else:  # (the data's digest made now, not inside the first timed step)
            self.loader.state_dict()
        per_epoch = max(1, len(self.loader) // cfg.grad_accum)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
        n_docs = getattr(train_data, "num_docs", None) or len(train_data)
        batches = count(len(self.loader), "packed batch", "packed batches")
        noun = "document" if objective.unit == "tokens" else objective.unit[:-1]  # pair, row
        self.log(f"data: {count(n_docs, noun)} -> {batches} per epoch; "
                 f"{count(self.total_steps, 'optimizer step')}"
                 + (f"; eval: {count(len(eval_data), noun)}" if eval_data is not None
                    else ""))
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
        # (again under torchrun, where only rank 0 checked before loading: RunFolder.check)
        check_resumed_config(ckpt, state.get("config") or {}, self.cfg)
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
            digits = next((d for d in (3, 6) if f"{new:.{d}g}" != f"{old:.{d}g}"), None)
            change = (f"gets learning rate {new:.{digits}g} (was {old:.{digits}g})" if digits
                      else f"keeps learning rate {new:.3g}")
            self.log(f"the run now has {self.total_steps} optimizer steps (it was started with "
                     f"{before}): the {cfg.schedule} schedule runs over {self.total_steps} steps, "
                     f"so step {self.step + 1} {change}")

    # --- what a run keeps ------------------------------------------------------------------------
    def run_settings(self) -> dict:
        """The settings this run trains with: its config and the engine options in effect
        (written to run_config.json and into every checkpoint)."""
        config = asdict(self.cfg)  # a local base as its absolute path: found from any folder
        config["model"] = base_name_to_record(self.cfg.model)
        return {"config": config, "engine_options": self.engine_options.to_dict(),
                "activations": self.activation_policy,
                # the detected data format: generate/chat ask in the layout trained on
                "data_format": getattr(getattr(self, "train_data", None), "format", None),
                # --precision fp8 through the PyTorch emulation (LEANTUNE_FP8_EMULATE)
                "fp8_emulated": self.cfg.precision == "fp8" and fp8_emulating(),
                "base_fingerprint": model_fingerprint(self.model)}  # lora/base_check.py

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
        with final_save(self.output, self.step, write):  # (a kill inside: --resume redoes it)
            if self.cfg.full:
                from ..export.full import save_full_model

                save_full_model(self.model, self.output,
                                source=getattr(self.model, "source_path", None), write=write)
            elif self.folded is not None:  # --adapter: the SFT adapter and the new one, stacked
                from ..lora.fold import save_stacked_adapter

                save_stacked_adapter(self.model, self.folded, self.output,
                                     base_model_name=base_name_to_record(self.cfg.model),
                                     write=write)
            else:
                save_adapter(self.model, self.output,
                             base_model_name=base_name_to_record(self.cfg.model), write=write)
            if write and self.tokenizer is not None and hasattr(self.tokenizer,
                                                                "save_pretrained"):
                save_pretrained_safely(self.tokenizer, self.output)  # (renamed in: no link)


def _quiet(*_args, **_kw) -> None:
    """The log of a process that prints nothing (under torchrun, all but rank 0)."""


def budget_message(cfg: TrainConfig, budget: float, e) -> str:
    """One line for a memory budget no plan fits (planner.BudgetTooSmall `e`)."""
    what = (f"--max-memory-gib {cfg.max_memory_gib:g}" if cfg.max_memory_gib
            else f"this GPU's {budget / 2**30:.1f} GiB")
    ref = getattr(e, "reference_bytes", 0)
    if ref:  # full fine-tuning's frozen reference copy
        return (f"{what} is too little for this run: it needs at least "
                f"{e.least_bytes / 2**30:.2f} GiB (weights and optimizer state "
                f"{e.fixed_bytes / 2**30:.2f} GiB, of which the frozen reference copy --objective "
                f"{cfg.objective.name} needs with --full {ref / 2**30:.2f} GiB); train a LoRA "
                "adapter instead of --full (its reference is the base, no copy), or add "
                "--precompute-reference (the reference log-probs computed once, no copy)")
    return (f"{what} is too little for this run: it needs at least {e.least_bytes / 2**30:.2f} "
            f"GiB (weights and optimizer state {e.fixed_bytes / 2**30:.2f} GiB, "
            f"{cfg.batch_size} x {cfg.max_seq_len} tokens a micro-batch); raise "
            "--max-memory-gib, or lower --batch-size or --max-seq-len")


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


# a tokenizer's vocabulary lives in one of these (transformers builds an empty tokenizer from
# config.json alone for some model types: Gemma's had 5 tokens, and trained on <unk>s)
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt",
               "sentencepiece.bpe.model")


def load_tokenizer(model: str | None):
    from transformers import AutoTokenizer

    from ..model.loader import resolve_checkpoint
    from ..utils.quiet import transformers_quiet

    folder = resolve_checkpoint(model)
    if not any((folder / f).is_file() for f in VOCAB_FILES) and not any(
            folder.glob("*.tiktoken")):
        raise LeantuneError(f"{folder}: no tokenizer files (tokenizer.json, tokenizer.model or "
                            "vocab.json); copy the tokenizer of the checkpoint this model came "
                            "from into the folder")
    try:
        # never the checkpoint's own Python code (auto_map): a downloaded folder runs nothing
        with transformers_quiet():  # (its notes on config.json: leantune reads that itself)
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
