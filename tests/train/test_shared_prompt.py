"""The shared-prompt pass of paired preference training (issue 20): a pair packed as one document
[prompt | chosen | rejected] gives the same per-document log-probs, DPO / ORPO / SimPO loss and
LoRA gradients as the two-document packing, on the plain autograd path, through the fused
engine, and on the varlen path with flash attention emulated on the CPU (bottom-right causal
segments over the gathered keys, as flash-attn >= 2.1 aligns them), so the gather / index_add
glue around flash runs here. Besides: the gathered key segments imply exactly the mask path's
visibility, the switch off gives today's batch, KTO and unsupported models stay unshared, and a
precomputed reference is the same either way. fp32, tiny odd shapes."""

from types import SimpleNamespace

import pytest
import torch

from helpers import CONFIGS, model_for, one_torch_thread  # noqa: F401
from leantune.batch import IGNORE_INDEX
from leantune.data.preference import KTORow, PreferencePair, pack_preference_batch
from leantune.engine import Engine, EngineOptions, LayerPlan, detach
from leantune.engine import attention as engine_attention
from leantune.errors import LeantuneError
from leantune.model import attention as model_attention
from leantune.model.attention import AttentionMeta, attention, segment_masks, shared_kv_index
from leantune.train.objectives.preference import (DPOObjective, KTOObjective, ORPOObjective,
                                                  SimPOObjective, policy_logps)

TOL = 1e-5
VOCAB = 97


# ---- data -----------------------------------------------------------------------------------

def _pairs(seed=0):
    """Odd lengths, a one-token prompt, completions of different lengths, a one-token one, an
    empty prompt (nothing predicts either first token, as in the two-document packing)."""
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(3, VOCAB, (k,), generator=g).tolist()

    return [PreferencePair(ids(5), ids(3), ids(4)), PreferencePair(ids(1), ids(6), ids(2)),
            PreferencePair(ids(7), ids(5), ids(5)), PreferencePair(ids(3), ids(1), ids(7)),
            PreferencePair(ids(2), ids(4), ids(1)), PreferencePair([], ids(3), ids(2))]


class _Items:
    def __init__(self, items, kind="pairs"):
        self.items, self.kind, self.pad_id, self.source = items, kind, 0, "<rows>"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _cfg(tmp_path, name="dpo", seq=16, **settings):
    obj = dict(name=name, beta=0.1, loss_type="sigmoid", label_smoothing=0.0, simpo_gamma=None,
               desirable_weight=1.0, undesirable_weight=1.0, precompute_reference=False,
               max_prompt_len=None)
    obj.update(settings)
    return SimpleNamespace(objective=SimpleNamespace(**obj), max_seq_len=seq, batch_size=8,
                           seed=0, output=str(tmp_path), model="tiny", data=None)


def _batch(obj, pairs, shared):
    loader = obj.make_loader(_Items(pairs), None, shuffle=True)
    assert loader.shared_prompt  # (on by default)
    loader.shared_prompt = shared
    return loader.pack(list(range(len(pairs))))


def _loss_and_grads(obj, model, batch):
    model.zero_grad(set_to_none=True)
    out = obj.loss(model, batch)
    (out.loss_sum / batch.num_units).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss_sum.detach(), grads


def _same_loss_and_grads(obj, model, pairs):
    loss0, g0 = _loss_and_grads(obj, model, _batch(obj, pairs, False))
    loss1, g1 = _loss_and_grads(obj, model, _batch(obj, pairs, True))
    torch.testing.assert_close(loss1, loss0, rtol=TOL, atol=TOL)
    assert set(g0) == set(g1) and len(g0) > 0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=TOL, atol=TOL, msg=n)
    assert max(g.abs().max() for g in g0.values()) > 1e-4  # gradients carry signal


# ---- the layout -----------------------------------------------------------------------------

def test_shared_layout_targets_positions_and_counts():
    pairs = _pairs()
    plain = pack_preference_batch(pairs, 16)
    pb = pack_preference_batch(pairs, 16, shared=True)
    b = pb.batch
    assert b.input_ids.shape[0] < len(pairs)  # several pairs a row
    assert any(int(n) > 0 for n in (b.input_ids == 0).sum(1))  # and rows with padding
    assert pb.completion_tokens.tolist() == plain.completion_tokens.tolist()
    assert pb.sequence_tokens == plain.sequence_tokens == plain.batch.num_real_tokens
    assert b.num_real_tokens == sum(len(p.prompt) + len(p.chosen) + len(p.rejected)
                                    for p in pairs)
    flat_ids, flat_pos = b.input_ids.flatten(), b.position_ids.flatten()
    cu = b.target_cu.tolist()
    for i, p in enumerate(pairs):
        for d, completion in ((2 * i, p.chosen), (2 * i + 1, p.rejected)):
            rows = b.target_rows[cu[d]:cu[d + 1]]
            # the rows read the sequence's tokens before each target, at positions Lp-1, ...
            seq, first = p.prompt + completion, max(len(p.prompt) - 1, 0)
            assert b.target_ids[cu[d]:cu[d + 1]].tolist() == seq[first + 1:]
            assert flat_ids[rows].tolist() == seq[first:-1]
            assert flat_pos[rows].tolist() == list(range(first, len(seq) - 1))
    # the prompt's last row carries both first targets; labels hold the chosen one
    assert b.target_rows.numel() == b.num_target_tokens > (b.labels != IGNORE_INDEX).sum()
    assert set(pb.doc_index.unique().tolist()) - {-1} == set(range(2 * len(pairs)))


def _visibility_from_kv(seq_lens, seq_lens_k, kv_index, N, window):
    """[N, N] what flash over the gathered keys lets each token row see: query j of segment s
    sees key i of its key segment when i <= j + (nk - nq) (bottom-right causal), within
    `window` of it."""
    vis = torch.zeros(N, N, dtype=torch.bool)
    q0 = k0 = 0
    for nq, nk in zip(seq_lens, seq_lens_k):
        for j in range(nq):
            for i in range(nk):
                d = j + nk - nq - i
                if d >= 0 and (window is None or d < window):
                    vis[q0 + j, kv_index[k0 + i]] = True
        q0, k0 = q0 + nq, k0 + nk
    return vis


def _semantic_mask(pairs, pb, window):
    """[N, N] from the pairs themselves: same pair, earlier-or-equal position, and never the
    other completion's tokens (tokens tagged prompt / chosen / rejected by their document)."""
    b = pb.batch
    N = b.input_ids.numel()
    doc, pos = pb.doc_index.flatten(), b.position_ids.flatten()
    T = b.input_ids.shape[1]
    row = torch.arange(N) // T
    pair = torch.where(doc >= 0, doc // 2, -1 - row)  # a row's padding: one segment
    role = torch.where(doc >= 0, doc % 2 + 1, 0)
    plen = torch.tensor([len(pairs[int(d) // 2].prompt) if d >= 0 else 0 for d in doc])
    role = torch.where((doc >= 0) & (doc % 2 == 0) & (pos < plen), 0, role)
    m = ((pair[:, None] == pair[None]) & (row[:, None] == row[None])
         & (pos[None] <= pos[:, None]) & ((role[None] == 0) | (role[None] == role[:, None])))
    if window is not None:
        m &= (pos[:, None] - pos[None]) < window
    return m


@pytest.mark.parametrize("window", [None, 3])
def test_gathered_key_segments_imply_the_mask_paths_visibility(window):
    pairs = _pairs(1)
    pb = pack_preference_batch(pairs, 16, shared=True)
    b = pb.batch
    B, T = b.input_ids.shape
    N = B * T
    vis = _visibility_from_kv(b.seq_lens, b.seq_lens_k, b.kv_index.tolist(), N, window)
    mask = segment_masks(b.seq_lens, b.seq_lens_k, B, T, {window})[window]  # [B, 1, T, T]
    dense = torch.zeros(N, N, dtype=torch.bool)
    for r in range(B):
        dense[r * T:(r + 1) * T, r * T:(r + 1) * T] = mask[r, 0]
    assert torch.equal(vis, dense)
    assert torch.equal(dense, _semantic_mask(pairs, pb, window))
    assert b.cu_seqlens_k[-1] == b.kv_index.numel() == sum(b.seq_lens_k)


def test_shared_kv_index_of_plain_segments_is_the_identity_and_bad_ones_are_refused():
    assert shared_kv_index([3, 2, 4], [3, 2, 4]).tolist() == list(range(9))
    assert shared_kv_index([3, 2], [3, 4]).tolist() == [0, 1, 2, 0, 1, 3, 4]
    with pytest.raises(ValueError):
        shared_kv_index([3, 2], [3, 6])  # a prefix longer than the previous segment
    with pytest.raises(ValueError):
        shared_kv_index([3, 2], [2, 2])


# ---- flash emulated on the CPU --------------------------------------------------------------

def _segments_attention(q, k, v, cu_q, cu_k, window, scale):
    """What flash's varlen op computes: q [N, Hq, D], k/v [Nk, Hk, D]; per segment causal
    attention bottom-right aligned (-> out [N, Hq, D], lse [Hq, N]), differentiable."""
    rep = q.shape[1] // k.shape[1]
    outs, lses = [], []
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]].float()
        ks = k[cu_k[s]:cu_k[s + 1]].float().repeat_interleave(rep, 1)
        vs = v[cu_k[s]:cu_k[s + 1]].float().repeat_interleave(rep, 1)
        nq, nk = qs.shape[0], ks.shape[0]
        d = torch.arange(nq)[:, None] + (nk - nq) - torch.arange(nk)[None]
        ok = d >= 0 if window is None else (d >= 0) & (d < window)
        scores = torch.einsum("qhd,khd->hqk", qs, ks).mul(scale).masked_fill(~ok, float("-inf"))
        lses.append(torch.logsumexp(scores, -1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vs))
    return torch.cat(outs).to(q.dtype), torch.cat(lses, 1)


def _cu_pair(cu_seqlens, cu_seqlens_k):
    return cu_seqlens, (cu_seqlens if cu_seqlens_k is None else cu_seqlens_k)


def _flash_forward(q, k, v, cu_seqlens, max_seqlen, window, scale, cu_seqlens_k=None,
                   max_seqlen_k=0):
    B, T, Hq, D = q.shape
    out, lse = _segments_attention(q.reshape(B * T, Hq, D), k.reshape(-1, *k.shape[-2:]),
                                   v.reshape(-1, *v.shape[-2:]),
                                   *_cu_pair(cu_seqlens, cu_seqlens_k), window, scale)
    return out.view(q.shape), lse, None


def _flash_backward(dout, q, k, v, out, lse, rng, cu_seqlens, max_seqlen, window, scale,
                    cu_seqlens_k=None, max_seqlen_k=0):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o, _, _ = _flash_forward(*leaves, cu_seqlens, max_seqlen, window, scale, cu_seqlens_k,
                                 max_seqlen_k)
        return torch.autograd.grad(o, leaves, dout)


def _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, 0),
                 enable_gqa=False):
    window = window_size[0] + 1 if window_size[0] >= 0 else None
    return _segments_attention(q, k, v, cu_q, cu_k, window, scale)[0]


@pytest.fixture
def emulated_flash(monkeypatch):
    """flash's ops replaced by the emulation: the engine backend's flash path and the model's
    plain varlen path run their shared-prompt glue on the CPU."""
    monkeypatch.setattr(engine_attention, "flash_ok", lambda q: True)
    monkeypatch.setattr(engine_attention, "flash_forward", _flash_forward)
    monkeypatch.setattr(engine_attention, "flash_backward", _flash_backward)
    monkeypatch.setattr(model_attention, "_varlen_attn", _varlen_attn)


def _metas(pb, window):
    b = pb.batch
    kw = dict(kv_index=b.kv_index, cu_seqlens_k=b.cu_seqlens_k, max_seqlen_k=b.max_seqlen_k,
              seq_lens_k=b.seq_lens_k)
    return [AttentionMeta.build(b.input_ids.shape, torch.device("cpu"), b.seq_lens, b.cu_seqlens,
                                b.max_seqlen, {window}, torch.float32, path=path, **kw)
            for path in ("mask", "varlen")]


@pytest.mark.parametrize("window", [None, 4])
def test_flash_glue_gathers_and_sums_back_like_the_mask_path(emulated_flash, window):
    pb = pack_preference_batch(_pairs(2), 16, shared=True)
    B, T = pb.batch.input_ids.shape
    mask_meta, varlen_meta = _metas(pb, window)
    assert varlen_meta.kv_index is not None and not varlen_meta.one_document_rows
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, T, h, 8, generator=g) for h in (4, 2, 2, 4))
    scale = 8 ** -0.5

    def autograd(meta):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, meta, window, scale)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout))

    want = autograd(mask_meta)
    # the model's plain varlen path: gather under autograd, the key segments to flash
    for got, ref in zip(autograd(varlen_meta), want):
        torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)
    # the engine backend: flash over the gathered keys, their dk / dv summed back (index_add)
    backend = engine_attention.AttentionBackend(EngineOptions())
    out, state = backend.forward(q, k, v, varlen_meta, window, scale)
    assert isinstance(state, engine_attention.FlashState)
    grads = backend.backward(dout, q, k, v, out, state, varlen_meta, window, scale)
    for got, ref in zip((out, *grads), want):
        torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)


def test_soft_capping_and_sinks_are_refused_on_shared_batches():
    pb = pack_preference_batch(_pairs(), 16, shared=True)
    meta = _metas(pb, None)[0]
    B, T = pb.batch.input_ids.shape
    q = torch.randn(B, T, 4, 8)
    k = torch.randn(B, T, 2, 8)
    with pytest.raises(ValueError, match="shared-prompt"):
        attention(q, k, k, meta, None, 1.0, softcap=30.0)
    with pytest.raises(ValueError, match="shared-prompt"):
        engine_attention.AttentionBackend(EngineOptions()).forward(q, k, k, meta, None, 1.0,
                                                                   sinks=torch.zeros(4))


# ---- shared == unshared, end to end ---------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_dpo_shared_equals_unshared_on_the_autograd_path(tmp_path, family):
    model = model_for(CONFIGS[family])
    obj = DPOObjective(_cfg(tmp_path))
    pairs = _pairs()
    with torch.no_grad():
        a = policy_logps(model, _batch(obj, pairs, False))[0]
        b = policy_logps(model, _batch(obj, pairs, True))[0]
    torch.testing.assert_close(b, a, rtol=TOL, atol=TOL)
    _same_loss_and_grads(obj, model, pairs)


@pytest.mark.parametrize("objective", [ORPOObjective, SimPOObjective])
def test_orpo_and_simpo_shared_equal_unshared(tmp_path, objective):
    model = model_for(CONFIGS["llama"])
    _same_loss_and_grads(objective(_cfg(tmp_path, objective.name)), model, _pairs(3))


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_dpo_shared_equals_unshared_through_the_fused_engine(tmp_path, family):
    model = model_for(CONFIGS[family])
    detach(model)
    Engine(EngineOptions()).attach(model, [LayerPlan(0), LayerPlan(1), LayerPlan(2)])
    assert {type(layer.executor).__name__ for layer in model.layers} == {"FusedExecutor"}
    _same_loss_and_grads(DPOObjective(_cfg(tmp_path)), model, _pairs(4))


def test_dpo_shared_equals_unshared_on_the_varlen_path(tmp_path, emulated_flash):
    """Flash (emulated) on both sides: the plain varlen path for the no-grad reference, the
    fused engine's flash backend for the policy."""
    model = model_for(CONFIGS["mistral"])
    model.attention_path = "varlen"
    Engine(EngineOptions()).attach(model, [LayerPlan(0), LayerPlan(2), LayerPlan(1)])
    obj = DPOObjective(_cfg(tmp_path))
    _same_loss_and_grads(obj, model, _pairs(5))
    model.attention_path = "mask"  # and the varlen path agrees with the mask path
    loss_mask, _ = _loss_and_grads(obj, model, _batch(obj, _pairs(5), True))
    model.attention_path = "varlen"
    loss_varlen, _ = _loss_and_grads(obj, model, _batch(obj, _pairs(5), True))
    torch.testing.assert_close(loss_varlen, loss_mask, rtol=TOL, atol=TOL)


# ---- the switch -----------------------------------------------------------------------------

def _fields(pb):
    out = {}
    for name, v in vars(pb).items():
        if name == "batch":
            out.update({f"batch.{k}": x for k, x in vars(v).items()})
        else:
            out[name] = v
    return out


def _equal(a, b):
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        x, y = fa[k], fb[k]
        assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y), k


@pytest.mark.parametrize("how", ["env", "config"])
def test_switch_off_packs_todays_batch(tmp_path, monkeypatch, how):
    pairs = _pairs()
    if how == "env":
        monkeypatch.setenv("LEANTUNE_SHARED_PROMPT", "0")
        obj = DPOObjective(_cfg(tmp_path))
    else:
        obj = DPOObjective(_cfg(tmp_path, shared_prompt=False))
    loader = obj.make_loader(_Items(pairs), None, shuffle=True)
    assert not loader.shared_prompt
    batch = loader.pack(list(range(len(pairs))))
    _equal(batch, type(batch)(**vars(pack_preference_batch(pairs, 16)),
                              items=batch.items, split="train"))
    assert batch.batch.kv_index is None and batch.batch.target_ids is None


def test_kto_and_unsupported_models_stay_unshared(tmp_path):
    kto = KTOObjective(_cfg(tmp_path, "kto", beta=0.1))
    rows = [KTORow([5, 6, 7], [8, 9], True), KTORow([4], [3, 3, 3], False)]
    assert not kto.shared_prompt
    assert not kto.make_loader(_Items(rows, "kto"), None, shuffle=True).shared_prompt

    model = model_for(CONFIGS["llama"])
    model.layers[1].self_attn.softcap = 50.0  # as Gemma 2
    lines = []
    obj = DPOObjective(_cfg(tmp_path), log=lines.append)
    loader = obj.make_loader(_Items(_pairs()), None, shuffle=True)
    obj.prepare(model, loader, SimpleNamespace(device=torch.device("cpu"), writer=True))
    assert not loader.shared_prompt and not obj.shared_prompt
    assert len(lines) == 1 and "soft-capping" in lines[0]
    assert loader.pack([0, 1]).batch.kv_index is None


def test_precomputed_reference_is_the_same_shared_or_not(tmp_path):
    model = model_for(CONFIGS["llama"])
    pairs = _pairs(6)
    tables, prints = [], []
    for shared in (False, True):
        obj = DPOObjective(_cfg(tmp_path / str(shared), precompute_reference=True,
                                shared_prompt=shared), log=lambda *_: None)
        loader = obj.make_loader(_Items(pairs), None, shuffle=True)
        assert loader.shared_prompt == shared
        obj.prepare(model, loader, SimpleNamespace(device=torch.device("cpu"), writer=True))
        tables.append(obj.reference_table)
        prints.append(obj.fingerprint(model, loader.dataset))
    torch.testing.assert_close(tables[1], tables[0], rtol=TOL, atol=TOL)
    assert prints[0] == prints[1]


def test_the_setting_applies_to_the_pair_objectives_only():
    from leantune.train.config import TrainConfig

    assert TrainConfig(objective="dpo", shared_prompt=False).validate().objective.shared_prompt \
        is False
    assert TrainConfig(objective="simpo").validate().objective.shared_prompt is True
    with pytest.raises(LeantuneError, match="^--no-shared-prompt is a setting of --objective dpo"):
        TrainConfig(objective="kto", shared_prompt=False).validate()


def test_the_planner_counts_the_gathered_keys():
    from leantune.engine.planner import Keep, Workload, kept_bytes, working_set_bytes
    from leantune.model.config import ModelConfig

    cfg = ModelConfig.from_dict(CONFIGS["llama"])
    plain, shared = (Workload(cfg, 4096, shared_prompt=s) for s in (False, True))
    extra = working_set_bytes(shared) - working_set_bytes(plain)
    assert extra == 4 * 1.5 * 4096 * cfg.kv_size * 2
    auto = [Workload(cfg, 4096, autograd=True, shared_prompt=s) for s in (False, True)]
    assert kept_bytes(auto[1], Keep.ALL) > kept_bytes(auto[0], Keep.ALL)
    assert kept_bytes(shared, Keep.ATTENTION) == kept_bytes(plain, Keep.ATTENTION)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs CUDA")
@pytest.mark.parametrize("window", [None, 4])
def test_real_flash_on_shared_batches_matches_the_mask_path(window):
    """On a GPU: flash's own ops (bottom-right causal over the gathered keys) through the
    engine backend and the plain varlen path, bf16, against the mask path in fp32."""
    from leantune.model.flash import flash_ok

    pb = pack_preference_batch(_pairs(2), 16, shared=True)
    b = pb.batch.to("cuda")
    B, T = b.input_ids.shape
    kw = dict(kv_index=b.kv_index, cu_seqlens_k=b.cu_seqlens_k, max_seqlen_k=b.max_seqlen_k,
              seq_lens_k=b.seq_lens_k)
    metas = {path: AttentionMeta.build((B, T), torch.device("cuda"), b.seq_lens, b.cu_seqlens,
                                       b.max_seqlen, {window}, torch.bfloat16, path=path, **kw)
             for path in ("mask", "varlen")}
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, T, h, 64, generator=g, device="cuda", dtype=torch.bfloat16)
                     for h in (4, 2, 2, 4))
    if not flash_ok(q):
        pytest.skip("no flash attention ops in this build")

    def run(meta, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, meta, window, 0.125)
        return (out.detach(), *torch.autograd.grad(out, leaves, dout.to(dtype)))

    want = run(metas["mask"], torch.float32)
    for got, ref in zip(run(metas["varlen"], torch.bfloat16), want):
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
    backend = engine_attention.AttentionBackend(EngineOptions())
    out, state = backend.forward(q, k, v, metas["varlen"], window, 0.125)
    assert isinstance(state, engine_attention.FlashState)
    grads = backend.backward(dout, q, k, v, out, state, metas["varlen"], window, 0.125)
    for got, ref in zip((out, *grads), want):
        torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


def test_no_shared_prompt_flag_reaches_the_config(tmp_path):
    from leantune.cli import _config_from_args, build_parser

    argv = ["train", "--model", "m", "--data", "d.jsonl", "--objective", "orpo"]
    on = _config_from_args(build_parser().parse_args(argv))[0]
    off = _config_from_args(build_parser().parse_args(argv + ["--no-shared-prompt"]))[0]
    assert on.objective.shared_prompt is True and off.objective.shared_prompt is False


def test_a_dpo_run_is_the_same_shared_or_not(tmp_path):
    """The trainer end to end (steps, the eval loader, tokens counted): the bundled tiny Llama
    on the bundled pairs, two DPO steps with an eval, shared and unshared."""
    from helpers import quiet, read_metrics, train_cfg
    from leantune import assets
    from leantune.train.trainer import Trainer

    runs = []
    for shared in (True, False):
        out = tmp_path / str(shared)
        cfg = train_cfg(assets.path("tiny-llama"), assets.path("data/demo_preference.jsonl"),
                        out, objective="dpo", max_steps=2, lr=5e-3, batch_size=4,
                        max_seq_len=64, warmup_steps=0, shared_prompt=shared,
                        eval_fraction=0.1, eval_every=2)
        trainer = Trainer(cfg, log=quiet)
        assert trainer.loader.shared_prompt == shared == trainer.eval_loader.shared_prompt
        trainer.train()
        runs.append(read_metrics(out))
    assert len(runs[0]) == len(runs[1]) == 4
    for a, b in zip(*runs):
        assert a.keys() == b.keys() and a["step"] == b["step"]
        for k in a:
            if k.endswith("loss") or "reward" in k or k == "grad_norm":
                assert a[k] == pytest.approx(b[k], abs=1e-5), k
        assert a.get("tokens_seen") == b.get("tokens_seen")
