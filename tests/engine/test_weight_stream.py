"""Streamed base weights (engine/weight_stream.py; EngineOptions.stream_weights): some layers'
frozen weights live in host buffers and come into two shared slots one layer ahead of use.

On the CPU the copies are synchronous, so these tests check the bookkeeping: the loss and LoRA
gradients are bit-identical to the same engine without streaming (fp32, both kernel backends,
every keep level, offload), over several steps (the slots' LoRA columns rewritten after each
copy, after B changes), the no-grad plain path (a preference objective's reference pass with
the adapters off) too; modules never stay pointed at a slot; the slots take turns and the next
layer's copy starts ahead; unstream gives every layer its own buffer back; a streamed layer run
under autograd outside the fused path is refused; and the planner's choice of k."""

import pytest
import torch

from helpers import (CONFIGS, alpaca_file, loss_and_grads, model_for, packed_batch,  # noqa: F401
                     tiny_ckpt)
from leantune import kernels
from leantune.engine import Engine, EngineOptions, LayerPlan, detach
from leantune.engine.planner import (BudgetTooSmall, Workload, plan_memory, plan_streaming,
                                     recompute_flops, stream_cost_seconds)
from leantune.engine.weight_stream import stream_positions
from leantune.model.config import ModelConfig

CFG = dict(CONFIGS["llama"], num_hidden_layers=5)
PLANS = [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2), LayerPlan(1),
         LayerPlan(2, offload=True)]


def _engine(model, streamed, **options):
    detach(model)
    engine = Engine(EngineOptions(**options))
    engine.pack(model)
    engine.attach(model, PLANS)
    engine.stream_weights(model, streamed)
    return engine


def _steps(model, n=3, lr=0.05):
    """n forward/backward passes, with an SGD step on the LoRA weights between them (so B and
    the packed LoRA columns change): each pass's loss and gradients."""
    out = []
    params = [p for p in model.parameters() if p.requires_grad]
    for _ in range(n):
        loss, grads = loss_and_grads(model, packed_batch())
        out.append((loss, grads))
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g)
    return out


@pytest.mark.parametrize("backend,streamed", [("triton", [1, 3]), ("reference", [0, 2, 4]),
                                              ("reference", [4])])
def test_streaming_is_bit_identical(backend, streamed):
    with kernels.backend(backend):
        plain = model_for(CFG)
        _engine(plain, [])
        want = _steps(plain)
        model = model_for(CFG)
        engine = _engine(model, streamed)
        got = _steps(model)
    for (l1, g1), (l2, g2) in zip(want, got):
        assert torch.equal(l1, l2)
        assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    stream = engine.stream
    assert stream.copies > 0
    for i in streamed:  # between passes every streamed module reads its host buffer
        for g in stream.groups[id(model.layers[i])]:
            for m in g.mods:
                assert m.weight.untyped_storage().data_ptr() == g.host.untyped_storage().data_ptr()
    assert stream.current is None


def test_groups_of_one_shape_get_their_own_slot_buffers():
    """intermediate 48 = 4 heads x 12: q/k/v's and gate/up's packed weights are both [96, 64];
    each group still has a buffer of its own in a slot (keyed by role, not shape alone)."""
    cfg = dict(CFG, intermediate_size=48)
    with kernels.backend("reference"):
        plain = model_for(cfg)
        _engine(plain, [])
        want = _steps(plain, 2)
        model = model_for(cfg)
        engine = _engine(model, [1, 3])
        got = _steps(model, 2)
    for (l1, g1), (l2, g2) in zip(want, got):
        assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert len(engine.stream.slots[0]) == 4


def test_every_packed_group_reads_its_slot():
    """The fused forward's groups (q/k/v, gate/up and down, packed with their LoRA columns)
    read the slot itself: no private GPU copy of a streamed layer's weights lives from its
    forward to its backward."""
    from leantune.engine import executor as ex

    model = model_for(CFG)
    engine = _engine(model, [1, 3])
    stream = engine.stream
    runs = []
    real = ex._LayerRun.forward

    def forward(self, x):
        out = real(self, x)
        runs.append(self)
        return out

    ex._LayerRun.forward = forward
    try:
        loss = model(batch=packed_batch(), loss_only=True).loss_sum
    finally:
        ex._LayerRun.forward = real
    slots = {b.untyped_storage().data_ptr() for s in stream.slots for b in s.values()}
    for run in runs:
        if stream.streams(run.layer):
            for g in (run.qkv, run.gu, run.down):
                assert g.source.packed.untyped_storage().data_ptr() in slots
    loss.backward()


def test_slots_take_turns_and_copies_start_ahead():
    model = model_for(CFG)
    engine = _engine(model, [0, 2, 4])
    stream = engine.stream
    seen = []
    real = stream._fill

    def fill(layer):
        seen.append((list(model.layers).index(layer), stream.order[id(layer)] % 2))
        return real(layer)

    stream._fill = fill
    loss_and_grads(model, packed_batch())
    streamed = [i for i, _ in seen]
    # forward: 0 (resident at its turn, 2 started ahead), 2, then 4 started while 2 runs;
    # backward starts with 4 and 2 still in their slots, so the first copy back is 0's
    assert streamed[:3] == [0, 2, 4] or streamed[:2] == [0, 2]
    assert {slot for i, slot in seen if i == 2} == {1} and {slot for i, slot in seen
                                                           if i in (0, 4)} == {0}
    fwd_copies = stream.copies
    assert fwd_copies >= 3


def test_reference_pass_no_grad_plain_path():
    """The no-grad forward with the adapters off (a preference objective's reference pass) runs
    the plain layer path: its modules read the slots for the call, and the result equals the
    unstreamed model's bit for bit."""
    from leantune.lora import adapters_disabled

    plain, model = model_for(CFG), model_for(CFG)
    _engine(plain, [])
    engine = _engine(model, [1, 3])
    batch = packed_batch()
    with torch.no_grad(), adapters_disabled(plain):
        want = plain(batch=batch, loss_only=True).loss_sum
    with torch.no_grad(), adapters_disabled(model):
        got = model(batch=batch, loss_only=True).loss_sum
    assert torch.equal(want, got) and engine.stream.current is None


def test_unstream_restores_the_model():
    plain, model = model_for(CFG), model_for(CFG)
    _engine(plain, [])
    engine = _engine(model, [1, 3])
    engine.unstream(model)
    assert engine.stream is None
    for a, b in zip(plain.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    # each module's own storage again (no slot, no shared host buffer between layers)
    ptrs = {model.layers[i].mlp.down_proj.weight.untyped_storage().data_ptr() for i in (1, 3)}
    assert len(ptrs) == 2
    detach(model)  # plain autograd runs again (no hook left to refuse it)
    detach(plain)
    torch.testing.assert_close(loss_and_grads(model, packed_batch()),
                               loss_and_grads(plain, packed_batch()), rtol=0, atol=0)


def test_autograd_outside_the_fused_path_is_refused():
    model = model_for(CFG)
    _engine(model, [1])
    model.layers[1].executor = None  # as if the layer ran plain autograd
    with pytest.raises(RuntimeError, match="outside the fused path"):
        loss_and_grads(model, packed_batch())


def test_stream_positions_spread():
    assert stream_positions(32, 0) == []
    assert stream_positions(32, 4) == [4, 12, 20, 28]
    p = stream_positions(40, 20)
    assert len(p) == 20 and all(b - a == 2 for a, b in zip(p, p[1:]))
    assert stream_positions(5, 9) == [0, 1, 2, 3, 4]


# --- the planner ---------------------------------------------------------------------------
def _work(layers=32, **kw):
    """The Llama-3.1-8B shape at 8192 tokens (the planner's numbers only: nothing allocated)."""
    cfg = ModelConfig.from_dict(dict(CONFIGS["llama"], hidden_size=4096, intermediate_size=14336,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     num_hidden_layers=layers, vocab_size=128256))
    return Workload(cfg, 8192, 2, lora_ranks=112, **kw)


LAYER = 436 * 2**20  # Llama-3.1-8B's packed bf16 layer
FIXED = 15.6 * 2**30
HOST = 256 * 2**30


def test_planner_streams_where_the_budget_forces_recompute():
    w = _work()
    tight = 17 * 2**30
    base = plan_memory(w, tight, FIXED, HOST)
    mem, streamed = plan_streaming(w, tight, FIXED, LAYER, list(range(32)), HOST)
    assert streamed and len(streamed) % 2 == 0 and len(streamed) <= 16
    assert recompute_flops(w, mem.layers) < recompute_flops(w, base.layers)
    assert (stream_cost_seconds(w, mem.layers, len(streamed), LAYER)
            < stream_cost_seconds(w, base.layers, 0, LAYER))
    assert streamed == stream_positions(32, len(streamed))


def test_planner_does_not_stream_where_everything_fits():
    w = _work()
    mem, streamed = plan_streaming(w, 60 * 2**30, FIXED, LAYER, list(range(32)), HOST)
    assert streamed == [] and recompute_flops(w, mem.layers) == 0


def test_planner_streaming_rescues_a_budget_too_small():
    w = _work()
    least = FIXED + 0.8 * 2**30  # below the leanest plan without streaming
    with pytest.raises(BudgetTooSmall):
        plan_memory(w, least, FIXED, HOST)
    mem, streamed = plan_streaming(w, least, FIXED, LAYER, list(range(32)), HOST)
    assert streamed


def test_planner_respects_host_memory_and_streamable_layers():
    w = _work()
    tight = 17 * 2**30
    _, none = plan_streaming(w, 20 * 2**30, FIXED, LAYER, list(range(32)), host_bytes=3 * LAYER)
    assert none == []  # (two layers' weights would take more than half the host's memory)
    only = [5, 6, 7, 8]
    _, some = plan_streaming(w, tight, FIXED, LAYER, only, HOST)
    assert set(some) <= set(only)
    _, off = plan_streaming(_work(autograd=True), 30 * 2**30, FIXED, LAYER, list(range(32)),
                            HOST)
    assert off == []


def test_cli_flag_is_saved_and_said_to_be_ignored_off_cuda(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                          capsys):
    """`--stream-weights` reaches the engine options (run_config.json); on the CPU, where the
    planner does not run, the run says the flag does nothing there."""
    import json

    from helpers import FAST, run_cli

    out = tmp_path / "run"
    rc, text, err = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file,
                            "--output", out, *FAST, "--max-steps", "1", "--stream-weights")
    assert rc == 0, err
    assert "--stream-weights is for --activations auto on a CUDA device" in text + err
    saved = json.loads((out / "run_config.json").read_text())
    assert saved["engine_options"]["stream_weights"] is True


def test_generation_on_a_streamed_model():
    """Decoding mid-training (the sample prompts) on a model whose weights stream: the packed
    decode projections leave the streamed layers alone (their modules read the slots per call),
    and the tokens equal the unstreamed model's."""
    from leantune.generate.decode import decode
    from leantune.generate.projections import DecodeProjections

    plain, model = model_for(CFG), model_for(CFG)
    _engine(plain, [])
    _engine(model, [1, 3])
    # (on a GPU a packed group would hold the host buffer, or a slot another layer takes over)
    per_layer = DecodeProjections(plain).packed_groups // 5
    assert per_layer and DecodeProjections(model).packed_groups == 3 * per_layer
    prompts = [[1, 5, 9, 2], [7, 3]]
    want = [d.token_ids for d in decode(plain, prompts, 6, cuda_graphs=False)]
    got = [d.token_ids for d in decode(model, prompts, 6, cuda_graphs=False)]
    assert got == want


def test_both_ways_seconds():
    """One direction at link_gbs; both at once at link_duplex_gbs each way for the shared part."""
    from leantune.engine.planner import both_ways_seconds

    w = _work(options=EngineOptions(link_gbs=50.0, link_duplex_gbs=25.0))
    assert both_ways_seconds(w, 50e9, 0.0) == pytest.approx(1.0)
    assert both_ways_seconds(w, 0.0, 50e9) == pytest.approx(1.0)
    assert both_ways_seconds(w, 25e9, 25e9) == pytest.approx(1.0)
    assert both_ways_seconds(w, 75e9, 25e9) == pytest.approx(2.0)  # 1 s shared, 1 s alone
    # a duplex rate above the one-way rate counts as the one-way rate
    fast = _work(options=EngineOptions(link_gbs=50.0, link_duplex_gbs=80.0))
    assert both_ways_seconds(fast, 50e9, 50e9) == pytest.approx(1.0)


def test_planner_streams_less_where_the_link_shares_badly():
    """The weights come up the link while the offloaded activations go down it: the slower the
    link both ways at once, the fewer layers streamed (none at 10 GB/s each way)."""
    tight = 17 * 2**30
    ks = []
    for duplex in (10.0, 33.0, 50.0):
        w = _work(options=EngineOptions(link_duplex_gbs=duplex))
        _, streamed = plan_streaming(w, tight, FIXED, LAYER, list(range(32)), HOST)
        ks.append(len(streamed))
    assert ks[0] == 0 and ks[0] <= ks[1] <= ks[2] and ks[2] > 0


def test_duplex_option_checked_and_from_env(monkeypatch):
    from leantune.errors import LeantuneError

    with pytest.raises(LeantuneError, match="--link-duplex-gbs must be positive"):
        EngineOptions(link_duplex_gbs=0.0)
    monkeypatch.setenv("LEANTUNE_LINK_DUPLEX_GBS", "50")
    opts, names = EngineOptions().with_env_overrides()
    assert opts.link_duplex_gbs == 50.0 and "link_duplex_gbs" in names


def test_stream_max_layers_caps_the_planners_choice():
    from dataclasses import replace

    from leantune.engine.options import EngineOptions
    from leantune.errors import LeantuneError

    tight = 17 * 2**30
    free = plan_streaming(_work(), tight, FIXED, LAYER, list(range(32)), HOST)[1]
    assert len(free) > 4
    for cap in (2, len(free) - 2):  # (a cap may leave too little gain to stream at all)
        w = _work(options=replace(EngineOptions(), stream_max_layers=cap))
        mem, streamed = plan_streaming(w, tight, FIXED, LAYER, list(range(32)), HOST)
        assert len(streamed) <= cap and streamed == stream_positions(32, len(streamed))
    assert streamed  # len(free) - 2 layers still gain
    with pytest.raises(LeantuneError, match="--stream-max-layers must be 0"):
        EngineOptions(stream_max_layers=-1)


@pytest.mark.parametrize("ahead", [True, False])
def test_a_layer_that_does_not_stream_starts_the_copy_two_ahead(ahead):
    """EngineOptions.stream_fill_ahead: at layer 1 (not streamed, between 0 and 2) layer 4's
    copy starts into the slot layer 0 used; off, it starts at layer 2. Losses and gradients
    are bit-identical either way."""
    plain = model_for(CFG)
    _engine(plain, [])
    want = _steps(plain, n=2)
    model = model_for(CFG)
    engine = _engine(model, [0, 2, 4], stream_fill_ahead=ahead)
    stream, layers = engine.stream, list(model.layers)
    at, fills = [None], []
    real_using, real_fill = stream.using, stream._fill

    def using(layer, direction=1):
        at[0] = (layers.index(layer), direction)
        return real_using(layer, direction)

    def fill(layer):
        fills.append((at[0], layers.index(layer)))
        return real_fill(layer)

    stream.using, stream._fill = using, fill
    got = _steps(model, n=2)
    for (l1, g1), (l2, g2) in zip(want, got):
        assert torch.equal(l1, l2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    first = next(where for where, filled in fills if filled == 4)
    assert first == ((1, 1) if ahead else (2, 1))


def test_streamed_plans_are_made_with_their_prefetch_depth(monkeypatch):
    """plan_streaming plans each k > 0 as streamed (Workload.streaming: the prefetch depth the
    executor then uses, 2 by default) and k = 0 as not."""
    import leantune.engine.planner as planner

    seen = []
    real = planner.plan_memory

    def spy(w, budget, fixed, host=None):
        seen.append((w.streaming, round((FIXED - fixed) / LAYER)))
        return real(w, budget, fixed, host)

    monkeypatch.setattr(planner, "plan_memory", spy)
    _, streamed = plan_streaming(_work(), 17 * 2**30, FIXED, LAYER, list(range(32)), HOST)
    assert streamed and seen[0] == (False, 0)
    assert all(s for s, k in seen[1:]) and len(seen) > 2  # (k layers less, two slots more)


def test_prefetch_depth_in_the_executor(monkeypatch):
    """The executor prefetches the two offloaded layers below with prefetch_depth 2, and by
    default where weights stream; one below otherwise."""
    from leantune.engine.activation_store import ActivationStore

    calls = []
    real = ActivationStore.prefetch

    def spy(self, h):
        calls.append(h)
        return real(self, h)

    monkeypatch.setattr(ActivationStore, "prefetch", spy)
    counts = {}
    for name, streamed, opts in (("one", [], {}), ("two", [], {"prefetch_depth": 2}),
                                 ("auto-streamed", [1, 3], {})):
        calls.clear()
        model = model_for(CFG)
        _engine(model, streamed, **opts)
        loss_and_grads(model, packed_batch())
        counts[name] = len(calls)
    assert counts["two"] > counts["one"] and counts["auto-streamed"] == counts["two"]


def test_fill_ahead_copies_the_same_and_never_into_a_slot_in_use():
    """With stream_fill_ahead, across a no-grad pass then training passes, a copy never lands in
    the slot whose weights the modules read now (stream.current's); and it makes as many copies
    as without."""
    copies = {}
    for ahead in (False, True):
        model = model_for(CFG)
        engine = _engine(model, [0, 2, 4], stream_fill_ahead=ahead)
        stream = engine.stream
        real_fill = stream._fill

        def fill(layer, stream=stream, real_fill=real_fill):
            slot = stream.order[id(layer)] % 2
            held = stream.holder[slot]
            assert held is layer or held is None or held is not stream.current
            return real_fill(layer)

        stream._fill = fill
        with torch.no_grad():
            model(batch=packed_batch(), loss_only=True)
        _steps(model, n=2)
        copies[ahead] = stream.copies
    assert copies[True] == copies[False]
