"""Every optimisation has a switch, and on and off agree (fp32, CPU):
- Triton kernels (through the interpreter) vs reference ops: the same 20-step loss curve;
- recompute (torch.utils.checkpoint around the plain layer): none, all layers, some layers ->
  the same loss and LoRA gradients;
- torch.compile of the decoder layers -> the same loss and gradients.
(The fused layers' switches: tests/engine/test_fused_layer*.py; the planner: test_planner.py.)
"""

import pytest
import torch

from helpers import loss_and_grads, packed_batch
from leantune import LoRAConfig, apply_lora, kernels
from leantune.batch import PackedBatch
from leantune.engine import EngineOptions, LayerPlan, attach, compile_layers
from leantune.model.config import ModelConfig
from leantune.model.loader import build_empty

CFG = dict(model_type="qwen3", vocab_size=97, hidden_size=40, intermediate_size=72,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
           rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_lora_model(seed=0):
    torch.manual_seed(seed)
    m = build_empty(ModelConfig.from_dict(CFG), torch.float32, torch.device("cpu"))
    m.init_weights(std=0.1, seed=seed)
    apply_lora(m, LoRAConfig(r=4, alpha=8), seed=seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return m


def test_kernels_vs_reference_same_20_step_loss_curve():
    curves = {}
    for name in ("triton", "reference"):
        model = tiny_lora_model()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        curve = []
        with kernels.backend(name):
            for step in range(20):
                loss = model.loss_sum(packed_batch(step % 3)) / packed_batch(step % 3).num_target_tokens
                loss.backward()
                opt.step()
                opt.zero_grad()
                curve.append(loss.item())
        curves[name] = torch.tensor(curve)
    assert curves["reference"][-1] < curves["reference"][0]  # it learns
    torch.testing.assert_close(curves["triton"], curves["reference"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("plan", [True, [True, False, True], [False, True, False]])
def test_checkpointing_on_and_off_agree(plan):
    model = tiny_lora_model()
    batch = packed_batch()
    ref_loss, ref_grads = loss_and_grads(model, batch)
    flags = plan if isinstance(plan, list) else [plan] * 3
    attach(model, [LayerPlan(0) if f else None for f in flags],
           EngineOptions(fused_layers=False))  # the autograd path's recompute
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


def test_compiled_layers_agree():
    model = tiny_lora_model()
    batch = packed_batch()
    ref_loss, ref_grads = loss_and_grads(model, batch)
    compile_layers(model, backend="eager")  # dynamo tracing without a C++ toolchain
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


def test_hand_built_batch_without_host_lengths_keeps_documents_apart():
    model = tiny_lora_model()
    full = packed_batch()
    bare = PackedBatch(input_ids=full.input_ids, labels=full.labels,
                       position_ids=full.position_ids, cu_seqlens=full.cu_seqlens, max_seqlen=0)
    assert bare.seq_lens == full.seq_lens and bare.max_seqlen == full.max_seqlen
    with torch.no_grad():
        torch.testing.assert_close(model(batch=bare).logits, model(batch=full).logits)


def test_prefetch_depth_two_agrees_and_counts_in_the_planner():
    """EngineOptions.prefetch_depth 2 (two offloaded layers below brought back at once) gives
    the same loss and gradients as 1, and the planner's backward peak counts the extra layer."""
    from leantune.engine import Keep
    from leantune.engine.planner import Workload, kept_bytes, plan_peak_bytes

    batch = packed_batch()
    plans = [LayerPlan(Keep.ATTENTION, offload=True)] * 3
    results = []
    for depth in (1, 2):
        model = tiny_lora_model()
        attach(model, plans, EngineOptions(prefetch_depth=depth))
        results.append(loss_and_grads(model, batch))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)
    cfg = ModelConfig.from_dict(dict(CFG, num_hidden_layers=6))
    six = [LayerPlan(Keep.ATTENTION, offload=True)] * 5 + [LayerPlan(Keep.ALL)]
    one, two = (plan_peak_bytes(Workload(cfg, 4096, 2, options=EngineOptions(prefetch_depth=d)),
                                six) for d in (1, 2))
    assert two - one == kept_bytes(Workload(cfg, 4096, 2), Keep.ATTENTION)
    with pytest.raises(Exception, match="--prefetch-depth must be 0"):
        EngineOptions(prefetch_depth=3)
    # 0 (the default): 2 where base weights stream, else 1 (planner and executor alike)
    auto = EngineOptions()
    assert (auto.prefetch_layers(True), auto.prefetch_layers(False)) == (2, 1)
    streamed = plan_peak_bytes(Workload(cfg, 4096, 2, streaming=True), six)
    assert streamed == two and plan_peak_bytes(Workload(cfg, 4096, 2), six) == one
