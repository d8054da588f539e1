"""Under torchrun with one process (world size 1) the model runs unwrapped: no DDP (nothing to
all-reduce), no FSDP2 (nothing to shard over), no memory kept back for DDP's gradient copies;
the losses are the plain run's. LEANTUNE_WRAP_AT_WORLD_SIZE_1=1 (benchmarks) wraps it anyway.
Each test runs the Trainer in this process with torchrun's variables for one process (gloo)."""

from __future__ import annotations

import pytest
import torch
from helpers import (alpaca_file, free_port, read_metrics, tiny_ckpt,  # noqa: F401
                     train_cfg)
from torch.nn.parallel import DistributedDataParallel

from leantune.dist import setup
from leantune.dist.parallel import WRAP_AT_WORLD_SIZE_1
from leantune.train.trainer import Trainer

UNWRAPPED = "parallel: world size 1: no DDP wrap (nothing to all-reduce)"


@pytest.fixture
def one_process_env(monkeypatch):
    """launch(): torchrun's variables for a world of one process from here on (MASTER_PORT: a
    free port); the process group is ended after the test."""

    def launch():
        for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
            monkeypatch.setenv(key, value)

    monkeypatch.delenv(WRAP_AT_WORLD_SIZE_1, raising=False)
    yield launch
    setup.shutdown()


def trainer_bytes_kept(trainer, monkeypatch) -> float:
    """The trainer's fixed bytes beside the activation plan, less the (here: none) weights on the
    GPU."""
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    return trainer._fixed_bytes()


def test_world_size_1_runs_unwrapped_with_the_plain_losses(one_process_env, tiny_ckpt,  # noqa: F811
                                                           alpaca_file, tmp_path,  # noqa: F811
                                                           monkeypatch):
    flags = dict(max_steps=3, grad_accum=2, eval_every=0)
    plain = Trainer(train_cfg(tiny_ckpt, alpaca_file, tmp_path / "plain", **flags),
                    log=lambda *_: None)
    plain.train()
    one_process_env()
    lines = []
    trainer = Trainer(train_cfg(tiny_ckpt, alpaca_file, tmp_path / "ws1", **flags),
                      log=lines.append)
    assert trainer.parallel.launched and trainer.parallel.world_size == 1
    assert trainer.parallel.kind is None and trainer.forward_model is trainer.model
    assert not isinstance(trainer.forward_model, DistributedDataParallel)
    assert [line for line in lines if line.startswith("parallel:")] == [UNWRAPPED]
    n = sum(p.numel() for p in trainer.params)
    assert trainer_bytes_kept(trainer, monkeypatch) == 12 * n  # fp32 gradient + AdamW moments
    trainer.train()
    want = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "plain") if "loss" in r]
    got = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "ws1") if "loss" in r]
    assert len(want) == 3 and got == want


@pytest.mark.parametrize("parallel,line", [
    ("fsdp", "parallel: world size 1: no FSDP2 sharding (one process holds every weight "
             "anyway; sharding over one rank only costs)"),
    ("ddp", UNWRAPPED)])
def test_explicit_parallel_at_world_size_1_unwrapped_too(one_process_env, tiny_ckpt,  # noqa: F811
                                                         alpaca_file, tmp_path,  # noqa: F811
                                                         parallel, line):
    one_process_env()
    lines = []
    trainer = Trainer(train_cfg(tiny_ckpt, alpaca_file, tmp_path, parallel=parallel),
                      log=lines.append)
    assert trainer.parallel.kind is None and not trainer.parallel.sharded
    assert trainer.forward_model is trainer.model
    assert [x for x in lines if x.startswith("parallel:")] == [line]


def test_the_benchmark_can_still_wrap_at_world_size_1(one_process_env, tiny_ckpt,  # noqa: F811
                                                      alpaca_file, tmp_path,  # noqa: F811
                                                      monkeypatch):
    """LEANTUNE_WRAP_AT_WORLD_SIZE_1=1: DDP as before, with its gradient copies kept back."""
    one_process_env()
    monkeypatch.setenv(WRAP_AT_WORLD_SIZE_1, "1")
    lines = []
    trainer = Trainer(train_cfg(tiny_ckpt, alpaca_file, tmp_path), log=lines.append)
    assert isinstance(trainer.forward_model, DistributedDataParallel)
    assert [x for x in lines if x.startswith("parallel:")] == [
        "parallel: DDP over 1 processes (gloo; auto: the CPU has no memory budget)"]
    n = sum(p.numel() for p in trainer.params)
    assert trainer_bytes_kept(trainer, monkeypatch) == (12 + 8) * n
    del trainer  # DDP goes before the process group it uses
