"""Every optimisation has a switch, and on and off agree (fp32, CPU):
- Triton kernels (through the interpreter) vs reference ops: the same 20-step loss curve;
- activation checkpointing: none, all layers, some layers -> the same loss and LoRA gradients;
- torch.compile of the decoder layers -> the same loss and gradients;
- the memory-budgeted checkpoint plan recomputes fewer layers as the budget grows.
"""

import math

import pytest
import torch

from leantune import LoRAConfig, apply_lora, kernels
from leantune.batch import PackedBatch
from leantune.model import fused_layer
from leantune.model.config import ModelConfig
from leantune.model.fused_layer import LayerPlan
from leantune.model.loader import build_empty
from helpers import BASE, check, loss_and_grads, model_for, packed_batch
from leantune.train.memory import kept_bytes, offload_capacity, plan_layers

CFG = dict(model_type="qwen3", vocab_size=97, hidden_size=40, intermediate_size=72,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
           rms_norm_eps=1e-6, tie_word_embeddings=False)


def llama_8b(**overrides) -> ModelConfig:
    """Llama-3.1-8B's layer shapes over CFG (the planner tests' model)."""
    shape = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    return ModelConfig.from_dict({**CFG, **shape, **overrides})


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
    model.set_checkpointing(plan)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


def test_compiled_layers_agree():
    model = tiny_lora_model()
    batch = packed_batch()
    ref_loss, ref_grads = loss_and_grads(model, batch)
    model.compile_layers(backend="eager")  # dynamo tracing without a C++ toolchain
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


def test_layer_plans_fit_the_budget():
    cfg = llama_8b()
    gib = 2**30
    fixed, tokens = 16 * gib, 8192
    for host in (512 * gib, 4 * gib):  # room to offload, or not
        plans = [plan_layers(cfg, tokens, b * gib, fixed, host_bytes=host)
                 for b in (10, 17, 20, 40, 80, 140)]
        kept_all = [sum(p.keep == 2 for p in ps) for ps in plans]
        assert kept_all[0] == 0 and kept_all[-1] == 32  # nothing fits / everything fits
        assert kept_all == sorted(kept_all)
        for ps in plans:  # whole layers kept last (their backward comes first)
            assert [p.keep == 2 for p in ps] == sorted(p.keep == 2 for p in ps)
            rest = {p for p in ps if p.keep < 2}
            if host > gib * 100:
                assert rest <= {LayerPlan(1, offload=True), LayerPlan(1), LayerPlan(0)}
                assert ps[-1].offload is False
                # offloaded layers come first, no more than the host link takes
                n_off = sum(p.offload for p in ps)
                assert all(p.offload for p in ps[:n_off])
                assert n_off <= offload_capacity(cfg, tokens)
            else:
                assert rest <= {LayerPlan(0)}
        # what the plan keeps on the GPU fits the budget
        for b, ps in zip((10, 17, 20, 40, 80, 140), plans):
            on_gpu = sum(kept_bytes(cfg, tokens, p.keep) for p in ps if not p.offload)
            if b > 17:
                assert fixed + on_gpu <= b * gib


def test_slow_host_link_offloads_fewer_layers(monkeypatch):
    """Layers beyond what the host link takes during a forward keep their state on the GPU (or,
    without room, their input) instead of holding the forward up."""
    from leantune.train import memory

    cfg = ModelConfig.from_dict(dict(CFG, hidden_size=2048, intermediate_size=8192,
                                     num_hidden_layers=16, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=64))
    gib = 2**30
    fast = plan_layers(cfg, 8192, 4 * gib, 2.5 * gib, host_bytes=512 * gib)
    monkeypatch.setattr(memory, "LINK_BYTES_PER_S", memory.LINK_BYTES_PER_S / 4)
    slow = plan_layers(cfg, 8192, 4 * gib, 2.5 * gib, host_bytes=512 * gib)
    n_fast, n_slow = (sum(p.offload for p in ps) for ps in (fast, slow))
    assert n_slow == offload_capacity(cfg, 8192) < n_fast
    assert {p for p in slow[n_slow:]} <= {LayerPlan(0), LayerPlan(1), LayerPlan(2)}


def test_hand_built_batch_without_host_lengths_keeps_documents_apart():
    model = tiny_lora_model()
    full = packed_batch()
    bare = PackedBatch(input_ids=full.input_ids, labels=full.labels,
                       position_ids=full.position_ids, cu_seqlens=full.cu_seqlens, max_seqlen=0)
    assert bare.seq_lens == full.seq_lens and bare.max_seqlen == full.max_seqlen
    with torch.no_grad():
        torch.testing.assert_close(model(batch=bare).logits, model(batch=full).logits)


def test_autograd_plans_never_offload_and_budget_autograd_activations():
    cfg = llama_8b()
    gib = 2**30
    for budget in (20, 40, 80):
        plans = plan_layers(cfg, 8192, budget * gib, 16 * gib, host_bytes=512 * gib, autograd=True)
        assert {p for p in plans} <= {LayerPlan(0), LayerPlan(2)}
        kept = sum(p.keep == 2 for p in plans)
        used = (kept * kept_bytes(cfg, 8192, 2, autograd=True)
                + (32 - kept) * kept_bytes(cfg, 8192, 0))
        assert 16 * gib + used <= budget * gib
    # fp32 activations are twice the size: fewer layers fit
    bf16 = plan_layers(cfg, 8192, 40 * gib, 16 * gib, host_bytes=512 * gib)
    fp32 = plan_layers(cfg, 8192, 40 * gib, 16 * gib, host_bytes=512 * gib, itemsize=4)
    assert sum(p.keep == 2 for p in fp32) < sum(p.keep == 2 for p in bf16)


def test_host_memory_reads_available_memory(tmp_path):
    from leantune.train.memory import host_memory_bytes

    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       131072000 kB\nMemFree:          1000 kB\n"
                    "MemAvailable:    65536000 kB\n")
    assert host_memory_bytes(str(info)) == 65536000 * 1024
    assert host_memory_bytes(str(tmp_path / "missing")) > 0  # falls back to physical memory


@pytest.mark.parametrize("layers,tokens", [(30, 8192), (30, 262144), (1, 8192), (2, 4096)])
def test_plans_never_exceed_a_budget_that_inputs_alone_fit(layers, tokens):
    """Offloading holds two layers' state in flight: where that costs more GPU memory than
    keeping inputs (small models, one layer) and only the inputs fit, the planner recomputes."""
    from leantune.train.memory import least_plan_bytes, plan_peak_bytes

    cfg = ModelConfig.from_dict(dict(CFG, hidden_size=576, intermediate_size=1536,
                                     num_hidden_layers=layers, num_attention_heads=9,
                                     num_key_value_heads=3, head_dim=64))
    gib, fixed = 2**30, 0.3 * 2**30
    inputs_alone = least_plan_bytes(cfg, tokens, host_bytes=0)  # working set + every input
    assert inputs_alone == math.ceil(plan_peak_bytes(cfg, tokens, [LayerPlan(0)] * layers))
    assert least_plan_bytes(cfg, tokens, host_bytes=512 * gib) <= inputs_alone
    for extra in (0.0, 0.01, 0.05, 0.2, 1.0, 8.0):
        budget = fixed + inputs_alone + extra * gib
        plans = plan_layers(cfg, tokens, budget, fixed, host_bytes=512 * gib)
        assert fixed + plan_peak_bytes(cfg, tokens, plans) <= budget, (
            extra, [(p.keep, p.offload) for p in plans])


def test_plan_peak_is_the_largest_phase():
    """The peak model against hand sums: the backward of a layer holds the layers below, its own
    state and the prefetched next one; the loss holds everything kept; a layer kept whole gives
    its gate/up back to the working set in its own backward."""
    from leantune.train.memory import (kept_bytes, loss_working_bytes, plan_peak_bytes,
                                       working_set_bytes)

    cfg = llama_8b(num_hidden_layers=4)
    n = 8192
    k0, k1, k2 = (kept_bytes(cfg, n, k) for k in (0, 1, 2))
    ws, loss_ws = working_set_bytes(cfg, n), loss_working_bytes(cfg, n)
    off, gpu1, whole = LayerPlan(1, offload=True), LayerPlan(1), LayerPlan(2)
    # offloaded below, state on the GPU on top: a backward with its state and the next one's
    assert plan_peak_bytes(cfg, n, [off, off, off, gpu1]) == max(2 * k1 + ws, k1 + 2 * k1 + loss_ws)
    # inputs only: the top layer's backward holds the inputs below and rebuilds its attention
    # state (or the loss, holding every input, is the peak)
    assert plan_peak_bytes(cfg, n, [LayerPlan(0)] * 4) == max(3 * k0 + k1 + ws, 4 * k0 + loss_ws)
    # two whole layers on top: the loss holds both; the top one's backward reuses its gate/up
    peak = plan_peak_bytes(cfg, n, [off, off, whole, whole])
    assert peak == max(2 * k2 + loss_ws, 2 * k2 + ws - (k2 - k1), k2 + k1 + ws)


def test_planner_keeps_the_last_layers_whole_at_8b_17gib():
    """Llama-3.1-8B shapes, 8192 tokens, 17 GiB: the peak model is at or above the peaks
    measured on an H200 (bench/memory_peak.py, speed.py) and within 0.3 GiB of them, and with
    room for it the planner keeps the last two layers whole."""
    from leantune.train.memory import describe, plan_peak_bytes

    cfg = llama_8b(vocab_size=128256)
    gib, mib = 2**30, 2**20
    fixed = 15187 * mib  # the Trainer's count for this run: weights, LoRA fp32 + grads + moments
    for plan, peak_mib in (([LayerPlan(1, offload=True)] * 31 + [LayerPlan(1)], 16696),
                           ([LayerPlan(1, offload=True)] * 30 + [LayerPlan(2)] * 2, 17101),
                           ([LayerPlan(0)] * 32, 18319)):  # offload, auto@17, recompute
        measured = peak_mib * mib - fixed
        assert measured <= plan_peak_bytes(cfg, 8192, plan) <= measured + 0.3 * gib
    plans = plan_layers(cfg, 8192, 17 * gib, fixed, host_bytes=512 * gib)
    assert describe(plans) == "30 offload attention state, 2 keep all"
    assert fixed + plan_peak_bytes(cfg, 8192, plans) <= 17 * gib


def test_least_plan_counts_offloading():
    """Llama-3.1-8B shapes, 8192 tokens: with host memory to offload into, the leanest plan fits
    17 GiB beside 14.6 GiB of weights and optimizer state (measured peak 16.3 GiB); keeping
    every layer's input on the GPU would not."""
    from leantune.train.memory import least_plan_bytes

    cfg = llama_8b()
    gib, fixed = 2**30, 14.61 * 2**30
    assert fixed + least_plan_bytes(cfg, 8192, host_bytes=512 * gib) < 17 * gib
    assert fixed + least_plan_bytes(cfg, 8192, host_bytes=0) > 17 * gib


_REAL_GLU_BWD = fused_layer.glu_bwd_


def _mlp_bytes_at_glu_backward(monkeypatch, keep, I=512):
    """Bytes of the two [rows, *] MLP buffers live at each GLU backward of the fused layer
    (gate|up, and the down projection's input-gradient buffer `da` it writes into)."""

    cfgd = dict(BASE, model_type="llama", intermediate_size=I, num_hidden_layers=1)
    monkeypatch.setattr(fused_layer, "PACK_ALIGN", 1)
    monkeypatch.setattr(fused_layer, "MLP_CHUNK_BYTES", 8 * I * 4)  # 8 fp32 rows a chunk
    seen = []
    real = _REAL_GLU_BWD  # (not the attribute: the second call would wrap the first's wrapper)

    def glu_bwd_(dy, gate, up, act, h_out=None):
        seen.append(gate.untyped_storage().nbytes() + dy.untyped_storage().nbytes())
        return real(dy, gate, up, act, h_out=h_out)

    monkeypatch.setattr(fused_layer, "glu_bwd_", glu_bwd_)
    model = model_for(cfgd)
    with kernels.backend("reference"):
        check(model, [LayerPlan(keep)])
    return ModelConfig.from_dict(cfgd), seen


def test_peak_model_counts_the_mlp_of_a_whole_kept_layer(monkeypatch):
    """A layer kept whole runs its MLP in one piece (its gate/up [N, 2I] and the down
    projection's input gradient [N, I]) where other layers run row chunks: the peak model counts
    that (one layer, 8-row chunks, 48 tokens: what keeping the layer whole adds to the MLP
    buffers the code holds is no more than what it adds to the modelled peak)."""
    from leantune.train.memory import plan_peak_bytes

    cfg, seen0 = _mlp_bytes_at_glu_backward(monkeypatch, 0)
    _, seen2 = _mlp_bytes_at_glu_backward(monkeypatch, 2)
    N = packed_batch().input_ids.numel()  # 2 rows x 24 tokens
    assert max(seen0) < max(seen2) / 4  # chunked vs one full-height chunk
    code_adds = max(seen2) - max(seen0)
    model_adds = (plan_peak_bytes(cfg, N, [LayerPlan(2)], itemsize=4)
                  - plan_peak_bytes(cfg, N, [LayerPlan(0)], itemsize=4))
    slack = N * cfg.hidden_size * 4  # one [N, hidden] tensor (LoRA columns are left to slack)
    assert code_adds <= model_adds + slack, (code_adds, model_adds)


def test_plan_layers_16k_tokens_count_whole_layers_mlp():
    """Llama-3.1-8B, 16384 tokens (MLP chunked), 20 GiB: each whole-kept layer's backward, with
    its MLP as the code runs it (3 full-height [N, I] tensors, not the working set's 3
    chunk-sized ones), fits the budget."""
    from leantune.train import memory

    cfg = llama_8b(vocab_size=128256)
    gib, n, fixed = 2**30, 16384, 15187 * 2**20
    plans = memory.plan_layers(cfg, n, 20 * gib, fixed, host_bytes=512 * gib)
    assert fixed + memory.plan_peak_bytes(cfg, n, plans) <= 20 * gib  # what the model says
    one = n * cfg.intermediate_size * 2
    short = 3 * (one - min(one, fused_layer.MLP_CHUNK_BYTES))
    k1, k2 = memory.kept_bytes(cfg, n, 1), memory.kept_bytes(cfg, n, 2)
    ws = memory.working_set_bytes(cfg, n)
    below = 0
    for i, p in enumerate(plans):  # each whole-kept layer's backward, as the code runs it
        kept = memory.kept_bytes(cfg, n, p.keep)
        if p.keep == 2:
            prefetch = (memory.kept_bytes(cfg, n, plans[i - 1].keep)
                        if i and plans[i - 1].offload else 0)
            as_run = below + kept + prefetch + ws - (k2 - k1) + short
            assert fixed + as_run <= 20 * gib, (i, memory.describe(plans), (fixed + as_run) / gib)
        below += 0 if p.offload else kept


def test_plan_layers_finds_a_fitting_plan_that_offloads_fewer_layers():
    """The peak is not monotone in the number of offloaded layers (the second-to-last layer's
    copy is still in flight at the loss, which is the peak where the cross-entropy chunk
    outweighs the MLP chunk): Llama-3.1-8B shapes, 2048 tokens, offloading 31 layers needs
    510 MiB, 29 or 30 need 478 MiB; with 490 MiB the planner offloads fewer, and the least it
    reports counts that."""
    from leantune.train import memory

    cfg = llama_8b(vocab_size=128256)
    mib, n, fixed, host = 2**20, 2048, 15187 * 2**20, 512 * 2**30
    fewer = [LayerPlan(1, offload=True)] * 29 + [LayerPlan(0)] * 3
    room = 490 * mib
    assert memory.plan_peak_bytes(cfg, n, fewer) <= room  # a fitting plan exists
    plans = memory.plan_layers(cfg, n, fixed + room, fixed, host_bytes=host)
    assert memory.plan_peak_bytes(cfg, n, plans) <= room, memory.describe(plans)
    assert memory.least_plan_bytes(cfg, n, host_bytes=host) <= math.ceil(
        memory.plan_peak_bytes(cfg, n, fewer))
