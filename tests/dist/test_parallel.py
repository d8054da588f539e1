"""--parallel auto: DDP where the model, its trainable state and the leanest activation plan fit
one GPU at the budget, FSDP2 otherwise (the GPU's budget stood in for: no GPU here)."""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIGS, one_torch_thread  # noqa: F401  (autouse)

from leantune.dist.parallel import Parallel, one_gpu_bytes
from leantune.dist.setup import Ranks
from leantune.engine import planner
from leantune.errors import LeantuneError
from leantune.model.config import ModelConfig
from leantune.model.transformer import CausalLM
from leantune.train.config import TrainConfig

HOST = 64 * 2**30  # the host's free memory, shared by its 4 processes


@pytest.fixture
def budget(monkeypatch):
    """The GPU's budget, set by the test."""
    value = {}
    monkeypatch.setattr(planner, "gpu_budget_bytes", lambda device, gib: value["bytes"])
    monkeypatch.setattr(planner, "host_memory_bytes", lambda: HOST)
    return value


def choose(cfg, mcfg, dtype=torch.bfloat16) -> tuple[Parallel, list[str]]:
    lines = []
    p = Parallel(Ranks(rank=0, world_size=4, local_rank=0, local_world_size=4),
                 torch.device("cuda"))
    p.choose(cfg, mcfg, dtype, lines.append)
    return p, lines


def test_auto_takes_ddp_where_one_gpu_fits_else_fsdp2(budget):
    cfg = TrainConfig(max_seq_len=256, batch_size=2)
    mcfg = ModelConfig.from_dict(CONFIGS["llama"])
    need, weights = one_gpu_bytes(cfg, mcfg, torch.bfloat16, HOST / 4)
    with torch.device("meta"):
        base = sum(p.numel() for p in CausalLM(mcfg).parameters())
    h, q, kv, i = mcfg.hidden_size, mcfg.q_size, mcfg.kv_size, mcfg.intermediate_size
    lora = 16 * mcfg.num_hidden_layers * (  # r = 16 on q, k, v, o, gate, up, down
        (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    assert weights == 2 * base + 4 * lora  # bf16 base, fp32 adapters
    assert need > weights + 12 * lora  # + gradients and AdamW moments + activations
    budget["bytes"] = need
    p, lines = choose(cfg, mcfg)
    assert p.kind == "ddp" and not p.sharded
    assert lines == [f"parallel: DDP over 4 processes (NCCL; auto: the model, its LoRA state and "
                     f"the leanest activation plan need {need / 2**30:.1f} GiB of one GPU's "
                     f"{need / 2**30:.1f} GiB)"]
    budget["bytes"] = need - 1
    p, lines = choose(cfg, mcfg)
    assert p.kind == "fsdp" and p.sharded and "more than one GPU's" in lines[0]
    # the whole model fits beside a quarter of the rest: FSDP2 keeps layers gathered from
    # forward to backward; below the weights alone it frees them after each layer's forward
    assert not p.reshard_after_forward
    budget["bytes"] = weights - 1
    assert choose(cfg, mcfg)[0].reshard_after_forward
    # --full counts every weight's gradient and AdamW moments
    full, _ = one_gpu_bytes(TrainConfig(max_seq_len=256, batch_size=2, full=True), mcfg,
                            torch.bfloat16, HOST / 4)
    assert full > need


def test_explicit_choice_and_what_fsdp2_refuses(budget):
    budget["bytes"] = 2**40
    mcfg = ModelConfig.from_dict(CONFIGS["llama"])
    p, lines = choose(TrainConfig(parallel="fsdp"), mcfg)
    assert p.kind == "fsdp" and lines == [
        "parallel: FSDP2 over 4 processes (NCCL; --parallel fsdp)"]
    with pytest.raises(LeantuneError, match="FSDP2 with float16 weights is not supported"):
        choose(TrainConfig(parallel="fsdp"), mcfg, torch.float16)
    with pytest.raises(LeantuneError, match="--parallel must be auto, ddp or fsdp"):
        TrainConfig(parallel="zero3").validate()
    # one process: nothing is chosen, nothing said
    one = Parallel(None, torch.device("cpu"))
    one.choose(TrainConfig(parallel="fsdp"), mcfg, torch.float32, print)
    assert one.kind is None and not one.launched and one.writer and one.grad_scale == 1


def test_world_size_1_wraps_nothing_and_plans_nothing(budget):
    """Under torchrun with one process the model runs unwrapped, said in one line; nothing is
    planned for a wrapper (the budget is not even read: the fixture holds none)."""
    mcfg = ModelConfig.from_dict(CONFIGS["llama"])
    for parallel, what in (("auto", "no DDP wrap (nothing to all-reduce)"),
                           ("ddp", "no DDP wrap (nothing to all-reduce)"),
                           ("fsdp", "no FSDP2 sharding (one process holds every weight anyway; "
                                    "sharding over one rank only costs)")):
        lines = []
        p = Parallel(Ranks(rank=0, world_size=1, local_rank=0, local_world_size=1),
                     torch.device("cuda"))
        p.choose(TrainConfig(parallel=parallel), mcfg, torch.bfloat16, lines.append)
        assert lines == [f"parallel: world size 1: {what}"]
        assert p.kind is None and not p.sharded and p.launched and p.grad_scale == 1
        model = torch.nn.Linear(2, 2)
        assert p.wrap(model) is model
