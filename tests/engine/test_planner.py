"""The memory planner: what each layer keeps for a budget, and the peak model it plans with
(against hand sums, against what the fused layer holds as it runs, and against peaks measured
on an H200)."""

import math

import pytest
import torch

from helpers import BASE, check, chunk_options, model_for, packed_batch
from leantune import kernels
from leantune.engine import EngineOptions, Keep, LayerPlan
from leantune.engine import executor as executor_module
from leantune.engine.planner import (Workload, describe, host_memory_bytes, kept_bytes,
                                     least_plan_bytes, link_budget_bytes, loss_working_bytes,
                                     mlp_chunk_bytes, offload_capacity, plan_kept_bytes,
                                     plan_layers, plan_memory, plan_peak_bytes,
                                     recompute_flops, trim_for_link, working_set_bytes)
from leantune.model.config import ModelConfig

CFG = dict(model_type="qwen3", vocab_size=97, hidden_size=40, intermediate_size=72,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
           rms_norm_eps=1e-6, tie_word_embeddings=False)
GIB, MIB = 2**30, 2**20


def llama_8b(**overrides) -> ModelConfig:
    """Llama-3.1-8B's layer shapes (the planner tests' model)."""
    shape = dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128)
    return ModelConfig.from_dict({**CFG, **shape, **overrides})


def test_layer_plans_fit_the_budget():
    w = Workload(llama_8b(), 8192)
    fixed = 16 * GIB
    for host in (512 * GIB, 4 * GIB):  # room to offload, or not
        plans = [plan_layers(w, b * GIB, fixed, host_bytes=host)
                 for b in (10, 17, 20, 40, 80, 140)]
        kept_all = [sum(p.keep == Keep.ALL for p in ps) for ps in plans]
        assert kept_all[0] == 0 and kept_all[-1] == 32  # nothing fits / everything fits
        assert kept_all == sorted(kept_all)
        for ps in plans:  # whole layers kept last (their backward comes first)
            assert [p.keep == 2 for p in ps] == sorted(p.keep == 2 for p in ps)
            rest = {p for p in ps if p.keep < 2}
            if host > GIB * 100:
                assert rest <= {LayerPlan(1, offload=True), LayerPlan(1), LayerPlan(0),
                                LayerPlan(0, offload=True)}
                assert ps[-1].offload is False
                # offloaded layers come first, no more than the host link takes
                n_off = sum(p.offload for p in ps)
                assert all(p.offload for p in ps[:n_off])
                assert n_off <= max(offload_capacity(w), offload_capacity(w, Keep.INPUT))
            else:  # no room for attention state on the host; inputs may go
                assert rest <= {LayerPlan(0), LayerPlan(0, offload=True)}
        # what the plan keeps on the GPU fits the budget
        for b, ps in zip((10, 17, 20, 40, 80, 140), plans):
            on_gpu = sum(kept_bytes(w, p.keep) for p in ps if not p.offload)
            if b > 17:
                assert fixed + on_gpu <= b * GIB


def test_slow_host_link_offloads_fewer_layers():
    """Layers beyond what the host link takes during a forward keep their state on the GPU (or,
    without room, their input) instead of holding the forward up."""
    cfg = ModelConfig.from_dict(dict(CFG, hidden_size=2048, intermediate_size=8192,
                                     num_hidden_layers=16, num_attention_heads=32,
                                     num_key_value_heads=8, head_dim=64))
    fast_w = Workload(cfg, 8192, options=EngineOptions(trim_offload=False))
    slow_w = Workload(cfg, 8192, options=EngineOptions(link_gbs=50 / 4, trim_offload=False))
    fast = plan_layers(fast_w, 4 * GIB, 2.5 * GIB, host_bytes=512 * GIB)
    slow = plan_layers(slow_w, 4 * GIB, 2.5 * GIB, host_bytes=512 * GIB)
    n_fast, n_slow = (sum(p.offload for p in ps) for ps in (fast, slow))
    assert n_slow == offload_capacity(slow_w) < n_fast
    assert {p for p in slow[n_slow:]} <= {LayerPlan(0), LayerPlan(1), LayerPlan(2)}
    assert all(p.keep_qkv for p in fast + slow)
    # trimming on (the default): more layers offload, the fewest needed without q/k/v, so the
    # copies still fit what the slow link carries during the forward
    trim_w = Workload(cfg, 8192, options=EngineOptions(link_gbs=50 / 4))
    trim = plan_layers(trim_w, 4 * GIB, 2.5 * GIB, host_bytes=512 * GIB)
    off = [p for p in trim if p.offload]
    assert n_slow < len(off) <= offload_capacity(trim_w, keep_qkv=False)
    assert sum(plan_kept_bytes(trim_w, p) for p in off) <= link_budget_bytes(trim_w)
    trimmed = [i for i, p in enumerate(trim) if not p.keep_qkv]
    assert trimmed == list(range(len(trimmed))) and 0 < len(trimmed) <= len(off)
    # one trimmed layer fewer would not fit the link
    assert (sum(plan_kept_bytes(trim_w, p) for p in off)
            + kept_bytes(trim_w, Keep.ATTENTION) - kept_bytes(trim_w, Keep.ATTENTION, False)
            > link_budget_bytes(trim_w))


def test_autograd_plans_never_offload_and_budget_autograd_activations():
    w = Workload(llama_8b(), 8192, autograd=True)
    for budget in (20, 40, 80):
        plans = plan_layers(w, budget * GIB, 16 * GIB, host_bytes=512 * GIB)
        assert {p for p in plans} <= {LayerPlan(0), LayerPlan(2)}
        kept = sum(p.keep == 2 for p in plans)
        used = kept * kept_bytes(w, Keep.ALL) + (32 - kept) * kept_bytes(w, Keep.INPUT)
        assert 16 * GIB + used <= budget * GIB
    # fp32 activations are twice the size: fewer layers fit
    bf16 = plan_layers(Workload(llama_8b(), 8192), 40 * GIB, 16 * GIB, host_bytes=512 * GIB)
    fp32 = plan_layers(Workload(llama_8b(), 8192, itemsize=4), 40 * GIB, 16 * GIB,
                       host_bytes=512 * GIB)
    assert sum(p.keep == 2 for p in fp32) < sum(p.keep == 2 for p in bf16)


def test_host_memory_reads_available_memory(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       131072000 kB\nMemFree:          1000 kB\n"
                    "MemAvailable:    65536000 kB\n")
    assert host_memory_bytes(str(info)) == 65536000 * 1024
    assert host_memory_bytes(str(tmp_path / "missing")) > 0  # falls back to physical memory


@pytest.mark.parametrize("layers,tokens", [(30, 8192), (30, 262144), (1, 8192), (2, 4096)])
def test_plans_never_exceed_a_budget_the_leanest_plan_fits(layers, tokens):
    """Every budget at or above the least the planner reports gets a plan whose modelled peak
    fits it (offloading holds two layers' state in flight: where that costs more GPU memory
    than keeping inputs, small models, one layer, the planner keeps inputs instead)."""
    cfg = ModelConfig.from_dict(dict(CFG, hidden_size=576, intermediate_size=1536,
                                     num_hidden_layers=layers, num_attention_heads=9,
                                     num_key_value_heads=3, head_dim=64))
    w = Workload(cfg, tokens)
    fixed = 0.3 * GIB
    least_no_host = least_plan_bytes(w, host_bytes=0)  # working set + every input
    assert least_plan_bytes(w, host_bytes=512 * GIB) <= least_no_host
    for host in (0, 512 * GIB):
        least = least_plan_bytes(w, host_bytes=host)
        for extra in (0.0, 0.01, 0.05, 0.2, 1.0, 8.0):
            budget = fixed + least + extra * GIB
            mem = plan_memory(w, budget, fixed, host_bytes=host)
            assert fixed + plan_peak_bytes(w, mem.layers, mem.loss_chunk_bytes) <= budget, (
                host, extra, describe(mem.layers), mem.loss_chunk_bytes)


def test_tight_budgets_offload_inputs_and_shrink_the_loss_chunk():
    """Qwen3-0.6B shapes, 8192 tokens, 1.9 GiB with 1.3 GiB of weights and optimizer state:
    keeping every layer's input on the GPU does not fit beside the default 256 MiB logits
    chunk; the planner offloads inputs and takes a smaller chunk, and the plan fits."""
    cfg = ModelConfig.from_dict(dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                                     intermediate_size=3072, num_hidden_layers=28,
                                     num_attention_heads=16, num_key_value_heads=8,
                                     head_dim=128, tie_word_embeddings=True))
    w = Workload(cfg, 8192, lora_ranks=6 * 16)
    fixed, budget = 1.3 * GIB, 1.9 * GIB
    assert fixed + plan_peak_bytes(w, [LayerPlan(0)] * 28) > budget
    mem = plan_memory(w, budget, fixed, host_bytes=64 * GIB)
    assert fixed + plan_peak_bytes(w, mem.layers, mem.loss_chunk_bytes) <= budget
    assert any(p.offload for p in mem.layers)
    assert fixed + least_plan_bytes(w, host_bytes=64 * GIB) <= budget


def test_plan_peak_is_the_largest_phase():
    """The peak model against hand sums: the backward of a layer holds the layers below, its own
    state and the prefetched next one; the loss holds everything kept; a layer kept whole gives
    its gate/up back to the working set in its own backward."""
    w = Workload(llama_8b(num_hidden_layers=4), 8192)
    k0, k1, k2 = (kept_bytes(w, k) for k in (0, 1, 2))
    ws, loss_ws = working_set_bytes(w), loss_working_bytes(w)
    off, gpu1, whole = LayerPlan(1, offload=True), LayerPlan(1), LayerPlan(2)
    # offloaded below, state on the GPU on top: a backward with its state and the next one's
    assert plan_peak_bytes(w, [off, off, off, gpu1]) == max(2 * k1 + ws, k1 + 2 * k1 + loss_ws)
    # inputs only: the top layer's backward holds the inputs below and rebuilds its attention
    # state (or the loss, holding every input, is the peak)
    assert plan_peak_bytes(w, [LayerPlan(0)] * 4) == max(3 * k0 + k1 + ws, 4 * k0 + loss_ws)
    # two whole layers on top: the loss holds both; the top one's backward reuses its gate/up
    peak = plan_peak_bytes(w, [off, off, whole, whole])
    assert peak == max(2 * k2 + loss_ws, 2 * k2 + ws - (k2 - k1), k2 + k1 + ws)
    # inputs offloaded: in flight at the loss, prefetched in backward, rebuilt to k1
    inp = LayerPlan(0, offload=True)
    assert plan_peak_bytes(w, [inp, inp, inp, LayerPlan(0)]) == max(
        k0 + k1 + ws, k0 + 2 * k0 + loss_ws)


def test_kept_bytes_are_what_the_layer_keeps():
    """The executor's count is the bytes of the tensors it puts in the store (fp32, one layer
    per level, LoRA on every projection, with and without a q/k norm)."""
    from leantune.engine import Engine, lora_ranks

    for family in ("llama", "qwen3"):
        cfgd = dict(BASE, model_type=family, num_hidden_layers=1)
        for keep in Keep:
            model = model_for(cfgd)
            engine = Engine()
            seen = []
            put = engine.store.put

            def count(state, off):  # (backward lets go of the tensors: count them at put)
                seen.append(sum(t.numel() * t.element_size() for t in vars(state).values()
                                if isinstance(t, torch.Tensor)))
                return put(state, off)
            engine.store.put = count
            check(model, [LayerPlan(keep)], engine=engine)
            held = seen[0]
            n = packed_batch().input_ids.numel()
            w = Workload(ModelConfig.from_dict(cfgd), n, itemsize=4,
                         lora_ranks=lora_ranks(model.layers[0]))
            stats = 4 * cfgd["num_attention_heads"] * n if keep >= 1 else 0  # (CPU: none)
            assert held == kept_bytes(w, keep) - stats, (family, keep)


def test_planner_keeps_the_last_layers_whole_at_8b_17gib():
    """Llama-3.1-8B shapes, 8192 tokens, 17 GiB: the peak model is at or above the peaks
    measured on an H200 (bench/memory_peak.py, speed.py) and within 0.3 GiB of them, and with
    room for it the planner keeps the last two layers whole."""
    w = Workload(llama_8b(vocab_size=128256), 8192)
    fixed = 15187 * MIB  # the Trainer's count for this run: weights, LoRA fp32 + grads + moments
    for plan, peak_mib in (([LayerPlan(1, offload=True)] * 31 + [LayerPlan(1)], 16696),
                           ([LayerPlan(1, offload=True)] * 30 + [LayerPlan(2)] * 2, 17101),
                           ([LayerPlan(0)] * 32, 18319)):  # offload, auto@17, recompute
        measured = peak_mib * MIB - fixed
        assert measured <= plan_peak_bytes(w, plan) <= measured + 0.3 * GIB
    plans = plan_layers(w, 17 * GIB, fixed, host_bytes=512 * GIB)
    assert describe(plans) == "30 offload attention state, 2 keep all"
    assert fixed + plan_peak_bytes(w, plans) <= 17 * GIB
    mem = plan_memory(w, 17 * GIB, fixed, host_bytes=512 * GIB)  # what the Trainer asks
    assert mem.layers == plans and mem.loss_chunk_bytes is None


def test_least_plan_counts_offloading():
    """Llama-3.1-8B shapes, 8192 tokens: with host memory to offload into, the leanest plan fits
    17 GiB beside 14.6 GiB of weights and optimizer state (measured peak 16.3 GiB); keeping
    every layer's input on the GPU would not."""
    w = Workload(llama_8b(), 8192)
    fixed = 14.61 * GIB
    assert fixed + least_plan_bytes(w, host_bytes=512 * GIB) < 17 * GIB
    assert fixed + least_plan_bytes(w, host_bytes=0) > 17 * GIB


_REAL_GLU_BWD = executor_module.glu_bwd_


def _mlp_bytes_at_glu_backward(monkeypatch, keep, I=512):
    """Bytes of the two [rows, *] MLP buffers live at each GLU backward of the fused layer
    (gate|up, and the down projection's input-gradient buffer `da` it writes into)."""
    cfgd = dict(BASE, model_type="llama", intermediate_size=I, num_hidden_layers=1)
    seen = []
    real = _REAL_GLU_BWD  # (not the attribute: the second call would wrap the first's wrapper)

    def glu_bwd_(dy, gate, up, act, h_out=None, **terms):
        seen.append(gate.untyped_storage().nbytes() + dy.untyped_storage().nbytes())
        return real(dy, gate, up, act, h_out=h_out, **terms)

    monkeypatch.setattr(executor_module, "glu_bwd_", glu_bwd_)
    model = model_for(cfgd)
    options = chunk_options(8, intermediate=I, pack_align=1)  # 8 fp32 rows a chunk
    with kernels.backend("reference"):
        check(model, [LayerPlan(keep)], options=options)
    return ModelConfig.from_dict(cfgd), options, seen


def test_peak_model_counts_the_mlp_of_a_whole_kept_layer(monkeypatch):
    """A layer kept whole runs its MLP in one piece (its gate/up [N, 2I] and the down
    projection's input gradient [N, I]) where other layers run row chunks: the peak model counts
    that (one layer, 8-row chunks, 48 tokens: what keeping the layer whole adds to the MLP
    buffers the code holds is no more than what it adds to the modelled peak)."""
    cfg, options, seen0 = _mlp_bytes_at_glu_backward(monkeypatch, 0)
    _, _, seen2 = _mlp_bytes_at_glu_backward(monkeypatch, 2)
    N = packed_batch().input_ids.numel()  # 2 rows x 24 tokens
    assert max(seen0) < max(seen2) / 4  # chunked vs one full-height chunk
    code_adds = max(seen2) - max(seen0)
    w = Workload(cfg, N, itemsize=4, options=options)
    model_adds = plan_peak_bytes(w, [LayerPlan(2)]) - plan_peak_bytes(w, [LayerPlan(0)])
    slack = N * cfg.hidden_size * 4  # one [N, hidden] tensor (LoRA columns are left to slack)
    assert code_adds <= model_adds + slack, (code_adds, model_adds)


def test_plan_layers_16k_tokens_count_whole_layers_mlp():
    """Llama-3.1-8B, 16384 tokens (MLP chunked), 20 GiB: each whole-kept layer's backward, with
    its MLP as the code runs it (3 full-height [N, I] tensors, not the working set's 3
    chunk-sized ones), fits the budget."""
    n, fixed = 16384, 15187 * MIB
    w = Workload(llama_8b(vocab_size=128256), n)
    plans = plan_layers(w, 20 * GIB, fixed, host_bytes=512 * GIB)
    assert fixed + plan_peak_bytes(w, plans) <= 20 * GIB  # what the model says
    one = n * w.cfg.intermediate_size * 2
    short = 3 * (one - min(one, w.options.mlp_chunk_bytes))
    k1, k2 = kept_bytes(w, Keep.ATTENTION), kept_bytes(w, Keep.ALL)
    ws = working_set_bytes(w)
    assert 3 * min(one, w.options.mlp_chunk_bytes) == mlp_chunk_bytes(w)
    below = 0
    for i, p in enumerate(plans):  # each whole-kept layer's backward, as the code runs it
        kept = kept_bytes(w, p.keep)
        if p.keep == 2:
            prefetch = (kept_bytes(w, plans[i - 1].keep) if i and plans[i - 1].offload else 0)
            as_run = below + kept + prefetch + ws - (k2 - k1) + short
            assert fixed + as_run <= 20 * GIB, (i, describe(plans), (fixed + as_run) / GIB)
        below += 0 if p.offload else kept


def test_plan_layers_finds_a_fitting_plan_that_offloads_fewer_layers():
    """The peak is not monotone in the number of offloaded layers (the second-to-last layer's
    copy is still in flight at the loss, which is the peak where the cross-entropy chunk
    outweighs the MLP chunk): Llama-3.1-8B shapes, 2048 tokens, offloading 31 layers needs
    510 MiB, 29 or 30 need 478 MiB; with 490 MiB the planner offloads fewer, and the least it
    reports counts that."""
    w = Workload(llama_8b(vocab_size=128256), 2048)
    n, fixed, host = 2048, 15187 * MIB, 512 * GIB
    fewer = [LayerPlan(1, offload=True)] * 29 + [LayerPlan(0)] * 3
    room = 490 * MIB
    assert plan_peak_bytes(w, fewer) <= room  # a fitting plan exists
    plans = plan_layers(w, fixed + room, fixed, host_bytes=host)
    assert plan_peak_bytes(w, plans) <= room, describe(plans)
    assert least_plan_bytes(w, host_bytes=host) <= math.ceil(plan_peak_bytes(w, fewer))


def test_no_plan_fits_says_the_least_budget_that_would():
    from leantune.engine.planner import BudgetTooSmall
    from leantune.train.config import TrainConfig
    from leantune.train.trainer import budget_message

    w = Workload(llama_8b(), 8192)
    fixed = 15 * GIB
    least = fixed + least_plan_bytes(w, host_bytes=512 * GIB)
    with pytest.raises(BudgetTooSmall) as e:
        plan_memory(w, least - MIB, fixed, host_bytes=512 * GIB)
    assert e.value.least_bytes == least
    mem = plan_memory(w, least, fixed, host_bytes=512 * GIB)  # and at the least, a plan fits
    assert fixed + plan_peak_bytes(w, mem.layers, mem.loss_chunk_bytes) <= least
    msg = budget_message(TrainConfig(max_memory_gib=15.5), 15.5 * GIB, e.value)
    assert msg.startswith("--max-memory-gib 15.5 is too little for this run: it needs at least "
                          f"{least / GIB:.2f} GiB") and "raise --max-memory-gib" in msg
