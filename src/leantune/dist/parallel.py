"""How a training run spreads over processes: one process (the plain path, no process group),
or, under torchrun, DDP or FSDP2 (`--parallel ddp|fsdp|auto`).

Under torchrun with one process (world size 1) the model runs unwrapped, whatever --parallel
says: there is nothing to all-reduce and nothing to shard over, and DDP's gradient copies would
take memory the activation plan could use (measured: 1.9% slower at Llama-3.1-8B on an H200).
Everything else stays as under torchrun (rank 0 writes, the data split, the loss normalised by
the global token count). LEANTUNE_WRAP_AT_WORLD_SIZE_1=1 wraps it anyway (bench/dist_speed.py
times both).

auto picks DDP where the model, its trainable state (LoRA, or everything with --full) and the
leanest activation plan fit one GPU at the memory budget (--max-memory-gib, default the GPU),
FSDP2 otherwise; on the CPU, which has no budget, DDP. Each process plans its activations
against its own GPU and its share of the host's memory (host memory / processes on the host).

Gradients: each process's loss is its rows' summed token loss over the target tokens of the
whole global window, so the gradients summed over processes are the global window's. DDP and
FSDP2 average over processes, so the loss is scaled by the number of processes (`grad_scale`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from ..errors import LeantuneError
from . import setup

NAMES = {"ddp": "DDP", "fsdp": "FSDP2"}
WRAP_AT_WORLD_SIZE_1 = "LEANTUNE_WRAP_AT_WORLD_SIZE_1"  # (benchmarks: module docstring)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def one_gpu_bytes(cfg, model_config, dtype: torch.dtype,
                  host_bytes: float | None) -> tuple[int, int]:
    """(GPU bytes a run needs on one GPU: weights, the trainables' fp32 gradient and two AdamW
    moments, the leanest activation plan; of which the weights), from shapes alone (the model
    is built on the meta device)."""
    from ..engine import Engine, has_expert_lora, lora_ranks
    from ..engine.planner import Workload, least_plan_bytes
    from ..lora import apply_lora
    from ..model.loader import build_empty

    m = build_empty(model_config, dtype, torch.device("meta"))
    if cfg.full:
        m.requires_grad_(True)
    else:
        apply_lora(m, cfg.lora.build(), dtype=torch.float32)
    options = cfg.engine_options()
    autograd = cfg.compile or Engine(options).fused_unsupported(m) is not None
    work = Workload(model_config, cfg.batch_size * cfg.max_seq_len,
                    torch.finfo(dtype).bits // 8, lora_ranks=lora_ranks(m.layers[0]),
                    autograd=autograd, options=options, expert_lora=has_expert_lora(m),
                    fp8=cfg.precision == "fp8")
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    state = sum(12 * p.numel() for p in m.parameters() if p.requires_grad)
    return weights + state + least_plan_bytes(work, host_bytes), weights


class Parallel:
    """The trainer's view of the processes. Without a launcher (`start`) every method is a no-op
    and nothing distributed is imported; under torchrun the process group is up, this process
    has its device (the GPU of its LOCAL_RANK, or the CPU), `choose` picks DDP or FSDP2 (neither
    at world size 1), `wrap` applies it, and rank 0 alone writes (`writer`)."""

    def __init__(self, ranks: setup.Ranks | None = None,
                 device: torch.device | None = None):
        self.ranks, self.device = ranks, device
        self.kind: str | None = None  # "ddp" or "fsdp" once chosen (None: unwrapped)
        self.reshard_after_forward = True  # FSDP2: free gathered layer weights after forward
        self.sync_each_micro_batch = False  # FSDP2 --full: reduce-scatter every micro-batch
        self.ddp = None

    @classmethod
    def start(cls, device: torch.device) -> "Parallel":
        """One process, or (under torchrun) this process's rank and device with the process
        group initialised; `device`: the run's --device, resolved."""
        ranks = setup.ranks_from_env()
        if ranks is None:
            return cls(None, device)
        device = setup.rank_device(device, ranks)
        setup.init_process_group(device)
        return cls(ranks, device)

    @property
    def launched(self) -> bool:
        return self.ranks is not None

    @property
    def writer(self) -> bool:
        return self.ranks is None or self.ranks.writer

    @property
    def rank(self) -> int:
        return self.ranks.rank if self.ranks else 0

    @property
    def world_size(self) -> int:
        return self.ranks.world_size if self.ranks else 1

    @property
    def sharded(self) -> bool:
        return self.kind == "fsdp"

    @property
    def grad_scale(self) -> int:
        """What each process's loss is multiplied by before backward (module docstring)."""
        return self.world_size if self.launched else 1

    def host_bytes(self) -> float | None:
        """Host memory this process may plan with: its share of what the host has free (None:
        one process, which plans with all of it)."""
        from ..engine.planner import host_memory_bytes

        if not self.launched:
            return None
        return host_memory_bytes() / self.ranks.local_world_size

    # --- set-up ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def agreeing(self):
        """Around checks every process runs: a LeantuneError in any process ends every process
        with that one line (setup.agree); leaving the block is a collective."""
        if not self.launched:
            yield
            return
        try:
            yield
        except LeantuneError as e:
            setup.agree(e, self.device)  # (raises: this error, or a lower rank's)
        else:
            setup.agree(None, self.device)

    def choose(self, cfg, model_config, dtype: torch.dtype, log) -> None:
        """DDP or FSDP2, per cfg.parallel (auto: module docstring), or neither at world size 1,
        said in one line; and
        whether FSDP2 keeps gathered weights from forward to backward (where the whole model
        fits beside this process's share of the rest)."""
        if not self.launched:
            return
        if self.world_size == 1 and os.environ.get(WRAP_AT_WORLD_SIZE_1) != "1":
            log("parallel: world size 1: " + (
                "no FSDP2 sharding (one process holds every weight anyway; sharding over one "
                "rank only costs)" if cfg.parallel == "fsdp" else
                "no DDP wrap (nothing to all-reduce)"))
            return
        kind, why = cfg.parallel, f"--parallel {cfg.parallel}"
        need = budget = None
        if self.device.type == "cuda":
            from ..engine.planner import gpu_budget_bytes

            budget = gpu_budget_bytes(self.device, cfg.max_memory_gib)
            need, weights = one_gpu_bytes(cfg, model_config, dtype, self.host_bytes())
            self.reshard_after_forward = weights + (need - weights) / self.world_size > budget
        if kind == "auto":
            state = "all weights' optimizer state" if cfg.full else "LoRA state"
            if need is None:
                kind, why = "ddp", "auto: the CPU has no memory budget"
            elif need <= budget:
                kind, why = "ddp", (f"auto: the model, its {state} and the leanest activation "
                                    f"plan need {_gib(need)} of one GPU's {_gib(budget)}")
            else:
                kind, why = "fsdp", (f"auto: the model, its {state} and the leanest activation "
                                     f"plan need {_gib(need)}, more than one GPU's "
                                     f"{_gib(budget)}")
        if kind == "fsdp" and dtype == torch.float16:
            raise LeantuneError("FSDP2 with float16 weights is not supported (its loss scaling "
                                "needs a sharded gradient scaler); use --dtype bfloat16, or "
                                "--parallel ddp")
        self.kind = kind
        self.sync_each_micro_batch = kind == "fsdp" and cfg.full
        backend = "NCCL" if self.device.type == "cuda" else "gloo"
        log(f"parallel: {NAMES[kind]} over {self.world_size} processes ({backend}; {why})")

    def engine_options(self, options):
        """The engine options under this parallel set-up: FSDP2 owns the weights' storage, so no
        packed projections (module docstring of dist/fsdp.py)."""
        from dataclasses import replace

        return replace(options, pack_projections=False) if self.sharded else options

    def fixed_bytes(self, model) -> float:
        """FSDP2: this process's GPU bytes of weights and optimizer state (dist/fsdp.py)."""
        from . import fsdp

        return fsdp.fixed_bytes(model, self.world_size, self.reshard_after_forward)

    def wrap(self, model, weights: Path | None = None, seed: int = 0):
        """Apply DDP or FSDP2 to `model` (after its trainables and executors are set); with
        `weights` (FSDP2, a meta model) load this process's rows of them. Returns the module to
        call for the training forward (the model itself but for DDP's wrapper). Unwrapped
        (one process, or world size 1): `model` as it is."""
        if self.kind is None:
            return model
        if self.kind == "ddp":
            from . import ddp

            self.ddp = ddp.wrap(model)
            return self.ddp
        from . import fsdp

        fsdp.shard(model, self.device, self.reshard_after_forward)
        if weights is not None:
            fsdp.materialise(model, self.device, weights, getattr(model, "lora_config", None),
                             seed)
        return model

    # --- each step ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, model, last: bool):
        """Around one micro-batch's forward and backward: gradients are reduced over the
        processes after the window's last one only (DDP's no_sync; FSDP2's gradient sync,
        except with --full, whose whole gradients would not fit: reduced every time)."""
        if self.ddp is not None and not last:
            with self.ddp.no_sync():
                yield
            return
        if self.sharded:
            model.set_requires_gradient_sync(last or self.sync_each_micro_batch)
        yield

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over the processes, in place (one process: unchanged)."""
        if self.launched:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def describe_batch(self, cfg) -> str:
        """The global batch and tokens per step, in one line."""
        rows = cfg.batch_size * self.world_size
        return (f"global batch: {rows} rows ({cfg.batch_size} per process x {self.world_size} "
                f"processes), {cfg.grad_accum} micro-batch(es) a step: up to "
                f"{rows * cfg.grad_accum * cfg.max_seq_len:,} tokens per step")
