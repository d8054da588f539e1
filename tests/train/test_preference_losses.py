"""Preference losses (train/losses/preference.py) against TRL 1.16's own loss code.

TRL's loss methods are called unbound with a stand-in `self` that carries only the attributes
they read; DPO and KTO run their whole `_compute_loss` with a stand-in model whose output holds
the per-token log-probs. Values and gradients (w.r.t. the policy log-probs, and w.r.t. the LoRA
weights of a tiny Llama in the end-to-end checks) must agree.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from leantune.errors import LeantuneError
from leantune.train.losses import (
    dpo_loss,
    kto_kl,
    kto_loss,
    log1m_exp,
    orpo_loss,
    simpo_loss,
    sum_by_document,
)

trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

TOL = 1e-6
P = 6  # pairs


def _accelerator():
    return SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x,
                           gather_for_metrics=lambda x: x)


class _FakeModel:
    """Stands in for TRL's patched model: returns per-token log-probs chosen by the test."""

    training = True

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, input_ids, labels=None, **kwargs):
        log_probs = self.fn(input_ids, labels)
        n, t = log_probs.shape
        return SimpleNamespace(log_probs=log_probs, entropy=torch.zeros(n, t),
                               mean_logits=torch.zeros(n, t),
                               is_top1=torch.zeros(n, t, dtype=torch.bool))


def _spread(logps: torch.Tensor, width: int) -> torch.Tensor:
    """[N] summed log-probs as [N, width] per-token log-probs whose row sums are them."""
    return F.pad(logps[:, None], (0, width - 1))


def _trl_self(**attrs):
    base = dict(accelerator=_accelerator(), aux_loss_enabled=False, precompute_ref_logps=True,
                _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0,
                _tp_size=1, args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    base.update(attrs)
    return SimpleNamespace(**base)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    pc = (-torch.rand(P, generator=g) * 30).requires_grad_()
    pr = (-torch.rand(P, generator=g) * 30).requires_grad_()
    rc = -torch.rand(P, generator=g) * 30
    rr = -torch.rand(P, generator=g) * 30
    ct = torch.randint(1, 12, (P,), generator=g)
    rt = torch.randint(1, 12, (P,), generator=g)
    return pc, pr, rc, rr, ct, rt


def _grads(loss, *leaves):
    return torch.autograd.grad(loss, leaves)


def _close(a, b, tol=TOL):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ---- DPO ------------------------------------------------------------------------------------

def _trl_dpo(pc, pr, rc, rr, ct, rt, beta, loss_type):
    """TRL's DPOTrainer._compute_loss on a batch whose completions have ct / rt tokens."""
    prompt = 2
    width = prompt + int(max(ct.max(), rt.max()))
    mask = torch.zeros(2 * P, width, dtype=torch.long)
    for i, n in enumerate(torch.cat([ct, rt]).tolist()):
        mask[i, prompt:prompt + n] = 1
    logps = torch.cat([pc, pr])
    model = _FakeModel(lambda ids, labels: _spread(logps, width - 1))
    me = _trl_self(model=model, ld_alpha=None, f_divergence_type="reverse_kl",
                   loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=0.0,
                   use_weighting=False)
    inputs = {"input_ids": torch.zeros(2 * P, width, dtype=torch.long),
              "attention_mask": torch.ones(2 * P, width, dtype=torch.long),
              "completion_mask": mask, "ref_chosen_logps": rc, "ref_rejected_logps": rr}
    loss = DPOTrainer._compute_loss(me, model, inputs, False)
    return loss, me._metrics["train"]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_matches_trl(loss_type, beta):
    pc, pr, rc, rr, ct, rt = _inputs()
    ours = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type,
                    chosen_tokens=ct, rejected_tokens=rt)
    theirs, metrics = _trl_dpo(pc, pr, rc, rr, ct, rt, beta, loss_type)
    _close(ours.mean(), theirs)
    for a, b in zip(_grads(ours.mean(), pc, pr), _grads(theirs, pc, pr)):
        _close(a, b)
    m = ours.metrics
    assert m["rewards_chosen"].mean().item() == pytest.approx(metrics["rewards/chosen"][0], abs=TOL)
    assert m["rewards_rejected"].mean().item() == pytest.approx(metrics["rewards/rejected"][0],
                                                                abs=TOL)
    assert m["reward_margin"].mean().item() == pytest.approx(metrics["rewards/margins"][0],
                                                             abs=TOL)
    assert m["reward_accuracy"].mean().item() == pytest.approx(metrics["rewards/accuracies"][0],
                                                               abs=TOL)
    assert not m["rewards_chosen"].requires_grad


def test_dpo_label_smoothing_is_conservative_dpo():
    """TRL 1.16's DPO sigmoid takes no smoothing; TRL's CPO sigmoid loss is the cDPO formula on
    whatever log-prob differences it is given, so feed it the DPO log-ratios."""
    pc, pr, rc, rr, _, _ = _inputs(1)
    ours = dpo_loss(pc, pr, rc, rr, beta=0.2, label_smoothing=0.15)
    me = _trl_self(alpha=0.0, loss_type="sigmoid", beta=0.2, label_smoothing=0.15,
                   simpo_gamma=0.5)
    theirs, _, _ = CPOTrainer.cpo_loss(me, pc - rc, pr - rr)
    _close(ours.losses, theirs)
    for a, b in zip(_grads(ours.mean(), pc, pr), _grads(theirs.mean(), pc, pr)):
        _close(a, b)


def test_dpo_rejects_bad_settings():
    pc, pr, rc, rr, _, _ = _inputs()
    with pytest.raises(LeantuneError, match="--loss-type 'robust'"):
        dpo_loss(pc, pr, rc, rr, loss_type="robust")
    with pytest.raises(LeantuneError, match="--beta must be a positive number"):
        dpo_loss(pc, pr, rc, rr, beta=0)
    with pytest.raises(LeantuneError, match="--label-smoothing"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)


# ---- ORPO -----------------------------------------------------------------------------------

@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_matches_trl(beta):
    pc, pr, _, _, ct, rt = _inputs(2)
    pc = (pc.detach() / 10).requires_grad_()  # averaged log-probs near 0 test log1m_exp's branch
    ours = orpo_loss(pc, pr, ct, rt, beta=beta)
    me = _trl_self(beta=beta)
    losses, chosen_r, rejected_r, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
        me, pc / ct, pr / rt)
    nll = -pc.sum() / ct.sum()  # the NLL over the chosen completions, as a token mean
    theirs = nll - losses.mean()
    _close(ours.mean(), theirs)
    for a, b in zip(_grads(ours.mean(), pc, pr), _grads(theirs, pc, pr)):
        _close(a, b)
    _close(ours.metrics["rewards_chosen"], chosen_r)
    _close(ours.metrics["rewards_rejected"], rejected_r)
    _close(ours.metrics["log_odds_ratio"].mean(), ratio.detach())
    _close(ours.metrics["log_odds_chosen"].mean(), log_odds.detach())


def test_log1m_exp_is_accurate_at_both_ends():
    x = torch.tensor([-50.0, -1.0, -0.6931, -1e-3, -1e-7], dtype=torch.float64)
    _close(log1m_exp(x), torch.log(1 - torch.exp(x)), tol=1e-9)
    assert torch.isfinite(log1m_exp(torch.tensor([-1e-30]))).all()


# ---- SimPO ----------------------------------------------------------------------------------

@pytest.mark.parametrize("beta,gamma,smoothing,nll_weight", [
    (2.0, 0.5, 0.0, 0.0), (2.5, 1.4, 0.1, 0.0), (0.1, 0.5, 0.0, 1.0)])
def test_simpo_matches_trl(beta, gamma, smoothing, nll_weight):
    pc, pr, _, _, ct, rt = _inputs(3)
    ours = simpo_loss(pc, pr, ct, rt, beta=beta, gamma=gamma, label_smoothing=smoothing,
                      nll_weight=nll_weight)
    me = _trl_self(alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma,
                   label_smoothing=smoothing)
    losses, chosen_r, rejected_r = CPOTrainer.cpo_loss(me, pc / ct, pr / rt)
    # CPOTrainer adds cpo_alpha * the chosen completions' token-mean NLL
    theirs = losses.mean() + nll_weight * (-pc.sum() / ct.sum())
    _close(ours.mean(), theirs)
    for a, b in zip(_grads(ours.mean(), pc, pr), _grads(theirs, pc, pr)):
        _close(a, b)
    _close(ours.metrics["rewards_chosen"], chosen_r)
    _close(ours.metrics["reward_accuracy"], (chosen_r > rejected_r).float())


# ---- KTO ------------------------------------------------------------------------------------

def _trl_kto(logps, ref, label, kl_logps, ref_kl_logps, beta, wd, wu):
    n, width = len(logps), 5
    kl_ids = torch.ones(n, width, dtype=torch.long)

    def fn(ids, labels):
        return _spread(kl_logps if ids is kl_ids else logps, width - 1)

    model = _FakeModel(fn)
    me = _trl_self(model=model, calculate_KL=True, loss_type="kto", beta=beta,
                   desirable_weight=wd, undesirable_weight=wu)
    me._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(me, m, b)
    ones = torch.ones(n, width, dtype=torch.long)
    batch = {"input_ids": torch.zeros(n, width, dtype=torch.long), "attention_mask": ones,
             "completion_mask": ones, "KL_input_ids": kl_ids, "KL_attention_mask": ones,
             "KL_completion_mask": ones, "label": label, "ref_logps": ref,
             "ref_KL_logps": ref_kl_logps}
    return KTOTrainer._compute_loss(me, model, batch, False), me._metrics["train"]


@pytest.mark.parametrize("beta,wd,wu,kl_shift", [(0.1, 1.0, 1.0, 3.0), (0.5, 1.3, 0.7, -5.0)])
def test_kto_matches_trl(beta, wd, wu, kl_shift):
    g = torch.Generator().manual_seed(4)
    n = 7
    logps = (-torch.rand(n, generator=g) * 20).requires_grad_()
    ref = -torch.rand(n, generator=g) * 20
    label = torch.tensor([True, False, True, True, False, False, True])
    ref_kl = -torch.rand(n, generator=g) * 20
    kl_logps = ref_kl + kl_shift + torch.randn(n, generator=g)  # kl_shift < 0: clamped to 0
    kl = kto_kl(kl_logps, ref_kl)
    ours = kto_loss(logps, ref, label, kl=kl, beta=beta, desirable_weight=wd,
                    undesirable_weight=wu)
    theirs, metrics = _trl_kto(logps, ref, label, kl_logps, ref_kl, beta, wd, wu)
    _close(ours.mean(), theirs)
    _close(_grads(ours.mean(), logps)[0], _grads(theirs, logps)[0])
    assert kl.item() == pytest.approx(metrics["kl"][0], abs=TOL)
    assert (kl.item() == 0.0) == (kl_shift < 0)
    m = ours.metrics
    chosen = (m["rewards"] * m["desirable"]).sum() / m["desirable"].sum()
    assert chosen.item() == pytest.approx(metrics["rewards/chosen"][0], abs=TOL)


# ---- helpers --------------------------------------------------------------------------------

def test_sum_by_document_skips_padding_and_masked_tokens():
    logps = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0, -6.0])
    doc = torch.tensor([0, 0, 1, 1, 1, -1])
    mask = torch.tensor([True, False, True, True, False, True])
    sums, counts = sum_by_document(logps, doc, 3, mask)
    assert sums.tolist() == [-1.0, -7.0, 0.0]
    assert counts.tolist() == [1, 2, 0]


# ---- end to end on a tiny Llama with LoRA ---------------------------------------------------

@pytest.fixture(scope="module")
def lora_llama():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(cfg).float().eval()
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           init_lora_weights=False)  # B != 0: policy and reference differ
    return peft.get_peft_model(base, lcfg)


def _pairs(seed=5, n=3):
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(3, 64, (k,), generator=g).tolist()

    return [{"prompt_ids": ids(3 + i), "chosen_ids": ids(2 + 2 * i), "rejected_ids": ids(4 - i)}
            for i in range(n)]


def _our_logps(model, pairs, whole_sequence=False):
    """Per-document summed log-probs the leantune way: each document on its own, token
    log-probs flattened, then `sum_by_document` over the completion targets. Returns (logps,
    tokens), each [2P] as chosen then rejected; whole_sequence: every target, prompt too."""
    docs = [(p["prompt_ids"], p[key]) for key in ("chosen_ids", "rejected_ids") for p in pairs]
    token_logps, doc_index, mask = [], [], []
    for d, (prompt, completion) in enumerate(docs):
        ids = torch.tensor(prompt + completion)[None]
        logits = model(input_ids=ids).logits[0, :-1].float()
        targets = ids[0, 1:]
        token_logps.append(logits.log_softmax(-1).gather(1, targets[:, None])[:, 0])
        doc_index.append(torch.full((len(targets),), d))
        # target t is token t + 1: trained when it belongs to the completion
        mask.append(torch.arange(1, ids.shape[1]) >= len(prompt) if not whole_sequence
                    else torch.ones(len(targets), dtype=torch.bool))
    return sum_by_document(torch.cat(token_logps), torch.cat(doc_index), len(docs),
                           torch.cat(mask))


def _trl_model(model):
    """TRL's fused-head output for a real model: per-token log-probs of the labels."""
    def fn(ids, labels):
        logits = model(input_ids=ids).logits[:, :-1].float()
        tgt = labels[:, 1:]
        lp = logits.log_softmax(-1).gather(2, tgt.clamp(min=0)[..., None])[..., 0]
        return lp * (tgt != -100)
    return _FakeModel(fn)


def _lora_grads(model, loss):
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_end_to_end_lora_grads_match_trl(lora_llama, loss_type):
    model, pairs = lora_llama, _pairs()
    with torch.no_grad(), model.disable_adapter():
        ref, _ = _our_logps(model, pairs)
    logps, tokens = _our_logps(model, pairs)
    ours = dpo_loss(*logps.chunk(2), *ref.chunk(2), beta=0.1, loss_type=loss_type,
                    chosen_tokens=tokens[:3], rejected_tokens=tokens[3:]).mean()

    inputs = DataCollatorForPreference(pad_token_id=0).torch_call(pairs)
    inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = ref.chunk(2)
    fake = _trl_model(model)
    me = _trl_self(model=fake, ld_alpha=None, f_divergence_type="reverse_kl",
                   loss_types=[loss_type], loss_weights=[1.0], beta=0.1, label_smoothing=0.0,
                   use_weighting=False)
    theirs = DPOTrainer._compute_loss(me, fake, inputs, False)
    _close(ours, theirs, tol=1e-5)
    for a, b in zip(_lora_grads(model, ours), _lora_grads(model, theirs)):
        _close(a, b, tol=1e-5)


def test_orpo_end_to_end_lora_grads_match_trl(lora_llama):
    """TRL's ORPO takes its NLL over the whole chosen sequence (prompt too): pass that NLL."""
    model, pairs = lora_llama, _pairs(6)
    logps, tokens = _our_logps(model, pairs)
    whole, whole_tokens = _our_logps(model, pairs, whole_sequence=True)
    ours = orpo_loss(*logps.chunk(2), *tokens.chunk(2), nll_logps=whole[:3],
                     nll_tokens=whole_tokens[:3]).mean()

    def padded(key, labels):
        seqs = [p["prompt_ids"] + p[key] for p in pairs]
        width = max(map(len, seqs))
        out = torch.full((len(seqs), width), -100 if labels else 0)
        for i, (p, s) in enumerate(zip(pairs, seqs)):
            out[i, :len(s)] = torch.tensor(s)
            if labels:
                out[i, :len(p["prompt_ids"])] = -100
        return out

    batch = {}
    for side in ("chosen", "rejected"):
        ids = padded(f"{side}_ids", False)
        batch[f"{side}_input_ids"] = ids
        batch[f"{side}_attention_mask"] = (padded(f"{side}_ids", True) != -100) | (
            torch.arange(ids.shape[1]) < torch.tensor([len(p["prompt_ids"]) for p in pairs])[:, None])
        batch[f"{side}_attention_mask"] = batch[f"{side}_attention_mask"].long()
        batch[f"{side}_labels"] = padded(f"{side}_ids", True)
    me = _trl_self(beta=0.1, is_encoder_decoder=False, padding_value=0,
                   concatenated_inputs=ORPOTrainer.concatenated_inputs,
                   get_batch_logps=ORPOTrainer.get_batch_logps)
    c, r, _, _, nll = ORPOTrainer.concatenated_forward(me, model, batch)
    losses, *_ = ORPOTrainer.odds_ratio_loss(me, c, r)
    theirs = nll - losses.mean()
    _close(ours, theirs, tol=1e-5)
    for a, b in zip(_lora_grads(model, ours), _lora_grads(model, theirs)):
        _close(a, b, tol=1e-5)


def test_default_betas_are_trls_and_agree_with_validate():
    """One default beta per preference objective (TRL 1.16's 0.1), the same whether the loss
    function's default or TrainConfig.validate() resolves it."""
    import inspect

    from leantune.train.config import TrainConfig
    from leantune.train.losses import preference as L

    assert L.DEFAULT_BETAS == {"dpo": 0.1, "orpo": 0.1, "simpo": 0.1, "kto": 0.1}
    assert inspect.signature(L.simpo_loss).parameters["beta"].default == L.DEFAULT_BETAS["simpo"]
    for name, beta in L.DEFAULT_BETAS.items():
        cfg = TrainConfig(objective=name)
        cfg.validate()
        assert cfg.objective.beta == beta
