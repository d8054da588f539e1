"""The planner counts GRPO's generation (engine/planner.py): the KV cache of batch x G rows of
longest prompt + max completion tokens in every phase, and the decode phase's working set."""

from __future__ import annotations

import pytest

from leantune.engine.planner import (BudgetTooSmall, Workload, decode_working_bytes,
                                     kv_cache_bytes, least_plan_bytes, plan_memory, plan_peak_bytes, policy_plans)
from leantune.model.config import ModelConfig

GIB = 2**30


def llama_1b() -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=128256, hidden_size=2048,
                       intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
                       tie_word_embeddings=True)


def test_kv_cache_bytes_by_hand():
    # the workload: 2 prompts x 8 completions, 256 + 256 tokens, bf16
    assert kv_cache_bytes(llama_1b(), 16, 512, 2) == 2 * 16 * 16 * 512 * 8 * 64 * 2  # 256 MiB


def test_generation_adds_to_every_phase_and_can_break_the_budget():
    cfg = llama_1b()
    train = Workload(cfg, 16 * 512, 2, lora_ranks=16 * 7)
    gen = Workload(cfg, 16 * 512, 2, lora_ranks=16 * 7, generation=(16, 512, 256))
    plans = policy_plans("recompute", cfg.num_hidden_layers)
    kv = kv_cache_bytes(cfg, 16, 512, 2)
    base = plan_peak_bytes(train, plans)
    assert plan_peak_bytes(gen, plans) == kv + max(base, decode_working_bytes(gen))
    assert decode_working_bytes(gen) > 16 * cfg.vocab_size * 4  # the sampler's fp32 scores
    fixed, least = 3 * GIB, least_plan_bytes(train, host_bytes=0)
    assert plan_memory(train, fixed + least, fixed, host_bytes=0).layers  # fits without it ...
    with pytest.raises(BudgetTooSmall) as e:  # ... not with the generation
        plan_memory(gen, fixed + least, fixed, host_bytes=0)
    assert e.value.least_bytes >= fixed + least + kv
