"""Offloaded layers without q/k/v (LayerPlan.keep_qkv=False): backward projects q/k/v again from
the rebuilt norm1 output. The loss and LoRA gradients equal plain autograd's and are bit-identical
to keeping q/k/v (fp32, CPU; every family on the fused path, MoE, an FP8 base); the store holds
a third less; and the planner trims the fewest offloaded layers the host link needs, counting
the extra GEMMs as recompute."""

import pytest
import torch

from helpers import BASE, CONFIGS, check, loss_and_grads, model_for, packed_batch
from leantune import kernels
from leantune.engine import Engine, EngineOptions, Keep, LayerPlan, detach, lora_ranks
from leantune.engine.executor import FusedExecutor
from leantune.engine.planner import (Workload, describe, kept_bytes, link_budget_bytes,
                                     plan_kept_bytes, plan_memory, recompute_flops,
                                     trim_for_link)
from leantune.lora.base_weight import quantize_fp8_
from leantune.model.config import ModelConfig

GIB = 2**30
TRIMMED = [LayerPlan(1, offload=True, keep_qkv=False), LayerPlan(2, keep_qkv=False),
           LayerPlan(1, keep_qkv=False)]
KEPT = [LayerPlan(1, offload=True), LayerPlan(2), LayerPlan(1)]
FAMILIES = dict(CONFIGS,
                phi3=dict(BASE, model_type="phi3", head_dim=None, hidden_size=64,
                          partial_rotary_factor=0.75),  # partial rotary, no q/k norm
                qwen3_moe=dict(BASE, model_type="qwen3_moe", num_experts=5,
                               num_experts_per_tok=2, moe_intermediate_size=24))


def _grads(model, plans, backend="reference"):
    detach(model)
    engine = Engine(EngineOptions())
    engine.attach(model, plans)
    with kernels.backend(backend):
        return loss_and_grads(model, packed_batch())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trimmed_layers_match_autograd_and_keeping_qkv_bit_for_bit(family):
    model = model_for(FAMILIES[family])
    check(model, TRIMMED)
    loss_t, g_t = _grads(model, TRIMMED)
    loss_k, g_k = _grads(model, KEPT)
    assert torch.equal(loss_t, loss_k) and torch.equal(g_t, g_k)


def test_trimmed_layers_through_the_triton_kernels():
    model = model_for(CONFIGS["qwen3"])
    loss_t, g_t = _grads(model, TRIMMED, backend="triton")
    loss_k, g_k = _grads(model, KEPT, backend="triton")
    assert torch.equal(loss_t, loss_k) and torch.equal(g_t, g_k)


def test_trimmed_layers_on_an_fp8_base():
    """The codes the norm writes for q/k/v's GEMM are written again in backward: the same."""
    model = quantize_fp8_(model_for(CONFIGS["llama"]))
    with kernels.backend("reference"):
        check(model, TRIMMED, rtol=1e-4, atol=2e-4)
    loss_t, g_t = _grads(model, TRIMMED)
    loss_k, g_k = _grads(model, KEPT)
    assert torch.equal(loss_t, loss_k) and torch.equal(g_t, g_k)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_store_holds_no_qkv_and_the_planner_counts_it(family):
    cfgd = dict(CONFIGS[family], num_hidden_layers=1)
    held = {}
    for keep_qkv in (True, False):
        model = model_for(cfgd)
        engine = Engine()
        put = engine.store.put

        def count(state, off, keep_qkv=keep_qkv):
            assert (state.qkv is None) == (not keep_qkv)
            held[keep_qkv] = sum(t.numel() * t.element_size() for t in vars(state).values()
                                 if isinstance(t, torch.Tensor))
            return put(state, off)
        engine.store.put = count
        check(model, [LayerPlan(1, offload=True, keep_qkv=keep_qkv)], engine=engine)
        n = packed_batch().input_ids.numel()
        w = Workload(ModelConfig.from_dict(cfgd), n, itemsize=4,
                     lora_ranks=lora_ranks(model.layers[0]))
        stats = 4 * cfgd["num_attention_heads"] * n  # (the CPU keeps no softmax statistics)
        assert held[keep_qkv] == kept_bytes(w, Keep.ATTENTION, keep_qkv) - stats
    c = ModelConfig.from_dict(cfgd)
    assert held[True] - held[False] == 4 * n * (c.q_size + 2 * c.kv_size)


# --- the planner --------------------------------------------------------------------------------
def llama_8b() -> ModelConfig:
    return ModelConfig.from_dict(dict(BASE, model_type="llama", vocab_size=128256,
                                      hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, head_dim=128))


def _offloaded_bytes(w, plans):
    return sum(plan_kept_bytes(w, p) for p in plans if p.offload)


def test_fp8_at_12_gib_trims_the_fewest_layers_the_link_needs():
    """Llama-3.1-8B shape on an FP8 base at 12 GiB (fixed bytes as the Trainer counted them on
    an H200): with q/k/v kept, the copies of what the budget forces off the GPU outrun the
    faster FP8 forward; trimmed, they fit the link's budget, and one trimmed layer fewer would
    not."""
    fixed = 9.26 * GIB
    on = Workload(llama_8b(), 8192, lora_ranks=48, fp8=True)
    off = Workload(llama_8b(), 8192, lora_ranks=48, fp8=True,
                   options=EngineOptions(trim_offload=False))
    plans = plan_memory(on, 12 * GIB, fixed, host_bytes=512 * GIB).layers
    trimmed = [i for i, p in enumerate(plans) if not p.keep_qkv]
    assert trimmed and trimmed == list(range(len(trimmed)))  # the lowest layers
    assert all(plans[i].offload for i in trimmed)
    assert _offloaded_bytes(on, plans) <= link_budget_bytes(on)
    saved = kept_bytes(on, Keep.ATTENTION) - kept_bytes(on, Keep.ATTENTION, keep_qkv=False)
    assert _offloaded_bytes(on, plans) + saved > link_budget_bytes(on)
    assert "without q/k/v" in describe(plans)
    assert not any(p.keep == Keep.INPUT for p in plans)
    # the switch: no layer trimmed, and the plan from before trimming (the 16-bit forward rate:
    # the FP8 forward may wait on the copies, as it did)
    untrimmed = plan_memory(off, 12 * GIB, fixed, host_bytes=512 * GIB).layers
    assert all(p.keep_qkv for p in untrimmed)
    before = Workload(llama_8b(), 8192, lora_ranks=48, options=EngineOptions(trim_offload=False))
    assert untrimmed == plan_memory(before, 12 * GIB, fixed, host_bytes=512 * GIB).layers


def test_no_trim_where_the_link_keeps_up():
    """bf16 at 8192 tokens: 30 layers' attention state fit what the link carries (the
    planner's 8B @ 17 GiB plan is unchanged, test_planner); a fast link trims nothing."""
    w = Workload(llama_8b(), 8192)
    plans = [LayerPlan(1, offload=True)] * 30 + [LayerPlan(2)] * 2
    assert trim_for_link(w, plans) == plans
    fast = Workload(llama_8b(), 8192, fp8=True, options=EngineOptions(link_gbs=200.0))
    assert trim_for_link(fast, [LayerPlan(1, offload=True)] * 31 + [LayerPlan(1)]) == (
        [LayerPlan(1, offload=True)] * 31 + [LayerPlan(1)])


def test_trim_for_link_recounts_from_scratch_and_leaves_what_it_cannot_trim():
    slow = Workload(llama_8b(), 8192, options=EngineOptions(link_gbs=10.0))
    plans = ([LayerPlan(1, offload=True)] * 20 + [LayerPlan(0, offload=True)] * 4
             + [LayerPlan(2, keep_qkv=False)] * 8)
    once = trim_for_link(slow, plans)
    assert trim_for_link(slow, once) == once
    # only offloaded layers with attention state are trimmed; a GPU layer's flag is reset
    assert all(p.keep_qkv for p in once[20:])
    assert not any(p.keep_qkv for p in once[:20])  # a slow link: all of them, still over
    assert _offloaded_bytes(slow, once) > link_budget_bytes(slow)
    # recompute counts each layer without q/k/v once (here: the 20 trimmed, where the 8 GPU
    # layers' flags counted before)
    kept_all = [p if p.keep_qkv else LayerPlan(p.keep, p.offload) for p in plans]
    assert recompute_flops(slow, plans) - recompute_flops(slow, kept_all) == (
        8 * FusedExecutor.qkv_flops(slow.cfg, 8192))
    assert recompute_flops(slow, once) - recompute_flops(slow, kept_all) == (
        20 * FusedExecutor.qkv_flops(slow.cfg, 8192))


def test_the_switch_from_the_cli_and_the_environment(tmp_path, monkeypatch):
    """--no-trim-offload (and LEANTUNE_TRIM_OFFLOAD=0 for benchmarks) reach the engine options
    the planner reads; the default trims."""
    from leantune.cli import _config_from_args, build_parser

    args = build_parser().parse_args(["train", "--model", "m", "--data", "d.jsonl",
                                      "--output", str(tmp_path / "run"), "--no-trim-offload"])
    assert _config_from_args(args)[0].engine_options().trim_offload is False
    args = build_parser().parse_args(["train", "--model", "m", "--data", "d.jsonl",
                                      "--output", str(tmp_path / "run")])
    assert _config_from_args(args)[0].engine_options().trim_offload is True
    monkeypatch.setenv("LEANTUNE_TRIM_OFFLOAD", "0")
    opts, names = EngineOptions().with_env_overrides()
    assert opts.trim_offload is False and names == ["trim_offload"]


@pytest.mark.parametrize("raw,want", [("0", False), ("off", False), ("No", False),
                                      ("1", True), ("TRUE", True), (" on ", True)])
def test_boolean_environment_values(raw, want, monkeypatch):
    monkeypatch.setenv("LEANTUNE_FUSE_GLU_LORA", raw)
    opts, _ = EngineOptions().with_env_overrides()
    assert opts.fuse_glu_lora is want


def test_a_mistyped_boolean_environment_value_is_one_line(monkeypatch):
    from leantune.errors import LeantuneError

    monkeypatch.setenv("LEANTUNE_TRIM_OFFLOAD", "maybe")
    with pytest.raises(LeantuneError, match=r"LEANTUNE_TRIM_OFFLOAD='maybe' is not a valid "
                                            r"switch \(1/true/on/yes or 0/false/off/no\)"):
        EngineOptions().with_env_overrides()
