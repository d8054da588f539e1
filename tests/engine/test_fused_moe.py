"""The fused MoE layer (engine/moe_layer.py) against autograd over the plain MoE block (fp32,
CPU): loss and LoRA gradients at every keep level, offloaded, with dense layers between sparse
ones, renormalised and plain top-k, and what makes a MoE layer fall back."""

import pytest
import torch

from helpers import BASE, check, model_for
from leantune import kernels
from leantune.engine import Engine, Keep, LayerPlan, fused_unsupported
from leantune.engine.executor import FusedExecutor, Kept
from leantune.model.config import ModelConfig

MOE = dict(BASE, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24)
GPT_OSS = dict(BASE, model_type="gpt_oss", hidden_size=64, intermediate_size=32,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=6, swiglu_limit=0.5,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64},
               rope_theta=150000.0, attention_bias=True)
CONFIGS = {
    # sinks, alternating windows, biases, the clamped SwiGLU over interleaved gate/up
    "gpt_oss": GPT_OSS,
    # layer 1 dense (mlp_only_layers), top-2 of 5 not renormalised
    "qwen3_moe": dict(MOE, model_type="qwen3_moe", mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe_norm": dict(MOE, model_type="qwen3_moe", norm_topk_prob=True),
    "mixtral": dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=24, sliding_window=6),
}
PLANS = [
    [LayerPlan(0), LayerPlan(1), LayerPlan(2)],
    [LayerPlan(2, offload=True), LayerPlan(0, offload=True), LayerPlan(1, offload=True)],
]


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("plans", PLANS)
def test_fused_moe_layer_equals_autograd(family, plans):
    model = model_for(CONFIGS[family], targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert any(layer.mlp.__class__.__name__ == "MoEBlock" for layer in model.layers)
    engine = check(model, plans)
    assert all(isinstance(layer.executor, FusedExecutor) for layer in model.layers)
    assert engine.store is not None


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fused_moe_kernels(backend):
    model = model_for(CONFIGS["qwen3_moe_norm"], targets=["q_proj", "v_proj"])
    with kernels.backend(backend):
        check(model, [LayerPlan(2), LayerPlan(1, offload=True), LayerPlan(0)])


def test_attention_lora_only_and_frozen_lower_layer():
    """LoRA on attention only (the MoE benchmark's setup); the first layer frozen."""
    model = model_for(CONFIGS["mixtral"], targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    check(model, [LayerPlan(1), LayerPlan(2), LayerPlan(0)])


@pytest.mark.parametrize("family", ["qwen3_moe_norm", "mixtral", "gpt_oss"])
def test_lora_on_experts(family):
    """Expert LoRA (random B, so every gradient carries signal) on the fused MoE layer."""
    model = model_for(CONFIGS[family], targets=["q_proj", "v_proj", "experts"])
    experts = model.layers[0].mlp.experts
    assert experts.has_lora and experts.lora_B["down_proj"].abs().max() > 0
    check(model, [LayerPlan(0), LayerPlan(2, offload=True), LayerPlan(1)])


def _grouped_mm_on_cpu() -> bool:
    from leantune.model import moe

    if moe._GROUPED_MM is None:
        return False
    try:
        moe._GROUPED_MM(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2],
                                                                               dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _grouped_mm_on_cpu(), reason="this torch has no grouped GEMM on the CPU")
@pytest.mark.parametrize("family", ["qwen3_moe_norm", "gpt_oss"])
def test_grouped_gemm_path_with_empty_experts_and_expert_lora(family):
    """The grouped GEMM path the GPU takes (forced on the CPU), 16 experts over 48 tokens x 2
    (some get none), LoRA on the experts through the grouped matmuls' autograd."""
    cfg = dict(CONFIGS[family], **({"num_experts": 16} if "num_experts" in CONFIGS[family]
                                   else {"num_local_experts": 16}))
    model = model_for(cfg, targets=["q_proj", "experts"])
    for layer in model.layers:
        layer.mlp.grouped_mm = True
    check(model, [LayerPlan(0), LayerPlan(2), LayerPlan(1, offload=True)])


@pytest.mark.parametrize("frozen", ["lora_A", "lora_B"])
def test_expert_lora_with_a_frozen_half(frozen):
    model = model_for(CONFIGS["mixtral"], targets=["q_proj", "experts"])
    for name, p in model.named_parameters():
        if "experts" in name and frozen in name:
            p.requires_grad_(False)
    check(model, [LayerPlan(2), LayerPlan(0), LayerPlan(1)])


def test_what_falls_back():
    model = model_for(CONFIGS["qwen3_moe_norm"], targets=["q_proj"])
    model.layers[0].mlp.record_router_stats = True
    assert "load-balancing" in fused_unsupported(model.layers[0])
    assert fused_unsupported(model.layers[1]) is None
    # the engine gives a layer the fused path wants autograd's checkpoint instead
    engine = Engine()
    assert engine.executor(model.layers[0], LayerPlan(0)).kind == "checkpoint"
    assert engine.executor(model.layers[1], LayerPlan(0)).kind == "fused"


@pytest.mark.parametrize("keep", [Keep.INPUT, Keep.ATTENTION, Keep.ALL])
def test_declared_bytes_are_what_the_store_holds(keep, monkeypatch):
    """The planner's bytes per token for a MoE layer equal what its forward puts in the store."""
    cfg = CONFIGS["qwen3_moe_norm"]
    model = model_for(cfg, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    from helpers import packed_batch
    from leantune.engine import activation_store

    held = []
    real_put = activation_store.ActivationStore.put

    def put(self, kept: Kept, offload):
        held.append(sum(t.numel() * t.element_size() for t in vars(kept).values()
                        if isinstance(t, torch.Tensor)))
        return real_put(self, kept, offload)

    monkeypatch.setattr(activation_store.ActivationStore, "put", put)
    Engine().attach(model, [LayerPlan(keep)] * 3)
    batch = packed_batch()
    model.loss_sum(batch).backward()
    tokens = batch.input_ids.numel()
    mcfg = ModelConfig.from_dict(cfg)
    from leantune.engine import lora_ranks
    want = FusedExecutor.kept_bytes(mcfg, tokens, keep, 4, lora_ranks(model.layers[0]))
    # the attention statistics exist on the flash/cuDNN paths only (None on the CPU)
    stats = 4 * mcfg.num_attention_heads * tokens if keep >= Keep.ATTENTION else 0
    assert held == [want - stats] * 3
