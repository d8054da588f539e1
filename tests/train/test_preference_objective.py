"""The preference objectives (train/objectives/preference.py) end to end against TRL 1.16.

One tiny random Llama checkpoint is loaded twice: by transformers, with TRL's own fused log-prob
head (`add_fused_lm_head`) and a PEFT LoRA adapter on the 7 projections, and by leantune with the
same adapter weights. The same rows go through TRL's collators and loss code (DPOTrainer's and
KTOTrainer's `_compute_loss`, whose reference is the PEFT model with its adapter disabled;
CPOTrainer's and ORPOTrainer's `get_batch_loss_metrics`), called with a stand-in `self` that
holds only the attributes they read, and through the objective's `loss` on one packed
micro-batch. Loss and every LoRA gradient agree within 1e-5 (fp32). Besides: the precomputed
reference (saved, reused, refused when the data changes), and the one-line errors.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from helpers import one_torch_thread, randomize_  # noqa: F401
from leantune.data.preference import KTORow, PreferencePair
from leantune.errors import LeantuneError
from leantune.train.objectives.preference import (REFERENCE_FILE, DPOObjective, KTOObjective,
                                                  ORPOObjective, SimPOObjective)

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer  # noqa: E402
from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference, KTOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

TOL = 1e-5
VOCAB = 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# ---- the two models -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(PEFT model with TRL's fused head, leantune model with the same LoRA weights)."""
    import transformers

    import leantune

    folder = tmp_path_factory.mktemp("tiny-llama")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    randomize_(hf, seed=3)
    hf.save_pretrained(folder)
    add_fused_lm_head(hf, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))  # as DPOTrainer
    torch.manual_seed(0)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                 init_lora_weights=False))
    with torch.no_grad():  # B large enough that policy and reference differ clearly
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    ours = leantune.load_model(folder, dtype=torch.float32, device="cpu")
    leantune.apply_lora(ours, leantune.LoRAConfig(r=4, alpha=8, targets=TARGETS), seed=0)
    theirs = {_our_name(n): p for n, p in pm.named_parameters() if "lora_" in n}
    mine = dict((n, p) for n, p in ours.named_parameters() if "lora_" in n)
    assert set(mine) == set(theirs) and len(mine) == 2 * 7 * 2
    with torch.no_grad():
        for n, p in mine.items():
            p.copy_(theirs[n])
    return pm, ours.eval()


def _our_name(peft_name: str) -> str:
    return peft_name.replace("base_model.model.", "", 1).replace(".default", "")


def _grads(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            out[_our_name(n)] = p.grad.detach().clone()
            p.grad = None
    return out


def _close_grads(ours: dict, theirs: dict):
    assert set(ours) == set(theirs)
    for n in ours:
        torch.testing.assert_close(ours[n], theirs[n], rtol=TOL, atol=TOL, msg=n)
    assert max(g.abs().max() for g in ours.values()) > 1e-4  # gradients carry signal


# ---- leantune's side ------------------------------------------------------------------------

class _Items:
    """A stand-in PreferenceDataset: pre-tokenised items."""

    def __init__(self, items, kind):
        self.items, self.kind, self.pad_id, self.source = items, kind, 0, "<rows>"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _cfg(tmp_path, name, **settings):
    obj = dict(name=name, beta=None, loss_type="sigmoid", label_smoothing=0.0, simpo_gamma=None,
               desirable_weight=1.0, undesirable_weight=1.0, precompute_reference=False,
               max_prompt_len=None)
    obj.update(settings)
    return SimpleNamespace(objective=SimpleNamespace(**obj), max_seq_len=48, batch_size=8,
                           seed=0, output=str(tmp_path), model="tiny", data=None)


def _ours(objective, model, items, kind="pairs"):
    """One micro-batch of every item: (mean loss, metrics means, LoRA grads)."""
    loader = objective.make_loader(_Items(items, kind), None, shuffle=True)
    batch = loader.pack(list(range(len(items))))
    out = objective.loss(model, batch)
    n = objective.normaliser([batch])
    (out.loss_sum / n).backward()
    return ((out.loss_sum / n).detach(), {k: (v / n).item() for k, v in out.metrics.items()},
            _grads(model))


def _pairs(seed=0, n=4, prompt_len=None):
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(3, VOCAB, (k,), generator=g).tolist()

    return [PreferencePair(ids(prompt_len or 3 + i), ids(2 + 2 * i), ids(5 - i))
            for i in range(n)]


def _trl_self(model, **attrs):
    accel = SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x,
                            gather_for_metrics=lambda x: x, unwrap_model=lambda m: m,
                            autocast=lambda: __import__("contextlib").nullcontext())
    base = dict(accelerator=accel, aux_loss_enabled=False, precompute_ref_logps=False,
                model=model, ref_model=None, _metrics=defaultdict(lambda: defaultdict(list)),
                _total_train_tokens=0, _tp_size=1,
                args=SimpleNamespace(gradient_checkpointing_kwargs=None))
    base.update(attrs)
    return SimpleNamespace(**base)


# ---- DPO ------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_type,beta", [("sigmoid", 0.1), ("ipo", 0.5), ("hinge", 0.3)])
def test_dpo_matches_trl(models, tmp_path, loss_type, beta):
    pm, ours = models
    pairs = _pairs()
    obj = DPOObjective(_cfg(tmp_path, "dpo", beta=beta, loss_type=loss_type))
    loss, metrics, grads = _ours(obj, ours, pairs)

    rows = [{"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected}
            for p in pairs]
    inputs = DataCollatorForPreference(pad_token_id=0).torch_call(rows)
    me = _trl_self(pm, ld_alpha=None, f_divergence_type="reverse_kl", loss_types=[loss_type],
                   loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False)
    pm.train()  # (TRL reads the mode for its metrics' key; no dropout in this model)
    theirs = DPOTrainer._compute_loss(me, pm, inputs, False)
    theirs.backward()
    torch.testing.assert_close(loss, theirs.detach(), rtol=TOL, atol=TOL)
    _close_grads(grads, _grads(pm))
    m = me._metrics["train"]
    for ours_key, trl_key in (("rewards_chosen", "rewards/chosen"),
                              ("rewards_rejected", "rewards/rejected"),
                              ("reward_margin", "rewards/margins"),
                              ("reward_accuracy", "rewards/accuracies")):
        assert metrics[ours_key] == pytest.approx(m[trl_key][0], abs=TOL), ours_key


# ---- SimPO (TRL: CPOTrainer with loss_type "simpo", no NLL term) and ORPO --------------------

def _paired_batch(pairs):
    """The chosen_* / rejected_* batch of TRL's CPO and ORPO trainers."""
    batch = {}
    for side in ("chosen", "rejected"):
        seqs = [p.prompt + getattr(p, side) for p in pairs]
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100)
        for i, (p, s) in enumerate(zip(pairs, seqs)):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
            labels[i, len(p.prompt):len(s)] = torch.tensor(s[len(p.prompt):])
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask,
                      f"{side}_labels": labels})
    return batch


def _paired_trl_self(cls, model, **attrs):
    me = _trl_self(model, is_encoder_decoder=False, padding_value=0, pad_token_id=0,
                   label_pad_token_id=-100, concatenated_inputs=cls.concatenated_inputs,
                   get_batch_logps=cls.get_batch_logps, **attrs)
    me.concatenated_forward = lambda m, b: cls.concatenated_forward(me, m, b)
    return me


@pytest.mark.parametrize("beta,gamma,smoothing", [(2.0, 0.5, 0.0), (2.5, 1.2, 0.1)])
def test_simpo_matches_trl(models, tmp_path, beta, gamma, smoothing):
    pm, ours = models
    pairs = _pairs(1)
    obj = SimPOObjective(_cfg(tmp_path, "simpo", beta=beta, simpo_gamma=gamma,
                              label_smoothing=smoothing))
    loss, metrics, grads = _ours(obj, ours, pairs)
    me = _paired_trl_self(CPOTrainer, pm, loss_type="simpo", beta=beta, simpo_gamma=gamma,
                          label_smoothing=smoothing, cpo_alpha=0.0, alpha=0.0)
    me.cpo_loss = lambda c, r: CPOTrainer.cpo_loss(me, c, r)
    theirs, trl_metrics = CPOTrainer.get_batch_loss_metrics(me, pm, _paired_batch(pairs))
    theirs.backward()
    torch.testing.assert_close(loss, theirs.detach(), rtol=TOL, atol=TOL)
    _close_grads(grads, _grads(pm))
    assert metrics["reward_margin"] == pytest.approx(trl_metrics["rewards/margins"], abs=TOL)
    assert metrics["reward_accuracy"] == pytest.approx(trl_metrics["rewards/accuracies"],
                                                       abs=TOL)


@pytest.mark.parametrize("beta", [0.1, 1.0])
def test_orpo_matches_trl(models, tmp_path, beta):
    """TRL's ORPO takes its NLL over the whole chosen sequence, prompt included, and leantune's
    over the chosen completion (the issue's definition): with one-token prompts (a BOS) the two
    are the same tokens, so everything else must match exactly."""
    pm, ours = models
    pairs = _pairs(2, prompt_len=1)
    obj = ORPOObjective(_cfg(tmp_path, "orpo", beta=beta))
    loss, metrics, grads = _ours(obj, ours, pairs)
    me = _paired_trl_self(ORPOTrainer, pm, beta=beta)
    me.odds_ratio_loss = lambda c, r: ORPOTrainer.odds_ratio_loss(me, c, r)
    theirs, trl_metrics = ORPOTrainer.get_batch_loss_metrics(me, pm, _paired_batch(pairs))
    theirs.backward()
    torch.testing.assert_close(loss, theirs.detach(), rtol=TOL, atol=TOL)
    _close_grads(grads, _grads(pm))
    assert metrics["rewards_chosen"] == pytest.approx(float(trl_metrics["rewards/chosen"]),
                                                      abs=TOL)


# ---- KTO ------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta,wd,wu", [(0.1, 1.0, 1.0), (0.5, 1.3, 0.7)])
def test_kto_matches_trl(models, tmp_path, beta, wd, wu):
    pm, ours = models
    g = torch.Generator().manual_seed(7)

    def ids(k):
        return torch.randint(3, VOCAB, (k,), generator=g).tolist()

    labels = [True, False, True, True, False]
    rows = [KTORow(ids(2 + i), ids(6 - i), lab) for i, lab in enumerate(labels)]
    obj = KTOObjective(_cfg(tmp_path, "kto", beta=beta, desirable_weight=wd,
                            undesirable_weight=wu))
    loss, metrics, grads = _ours(obj, ours, rows, kind="kto")

    # the KL sequences leantune packs: row i's prompt with row i-1's completion
    examples = [{"prompt_ids": r.prompt, "completion_ids": r.completion,
                 "KL_completion_ids": rows[i - 1].completion, "label": r.label}
                for i, r in enumerate(rows)]
    inputs = DataCollatorForUnpairedPreference(pad_token_id=0).torch_call(examples)
    me = _trl_self(pm, calculate_KL=True, loss_type="kto", beta=beta, desirable_weight=wd,
                   undesirable_weight=wu)
    me._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(me, m, b)
    pm.train()
    theirs = KTOTrainer._compute_loss(me, pm, inputs, False)
    theirs.backward()
    torch.testing.assert_close(loss, theirs.detach(), rtol=TOL, atol=TOL)
    _close_grads(grads, _grads(pm))
    m, n, n_des = me._metrics["train"], len(rows), sum(labels)
    assert metrics["kl"] == pytest.approx(m["kl"][0], abs=TOL)
    assert m["kl"][0] > 0  # the estimate is not clamped away at this seed
    # leantune's metrics are sums over rows / rows; TRL's are means over each label's rows
    assert metrics["rewards_chosen"] * n / n_des == pytest.approx(m["rewards/chosen"][0], abs=TOL)
    assert metrics["rewards_rejected"] * n / (n - n_des) == pytest.approx(
        m["rewards/rejected"][0], abs=TOL)


# ---- the precomputed reference --------------------------------------------------------------

def test_precomputed_reference_equals_the_live_pass_and_is_checked(models, tmp_path):
    _, ours = models
    pairs = _pairs(3, n=5)
    data = _Items(pairs, "pairs")
    live = DPOObjective(_cfg(tmp_path, "dpo"))
    loss_live, _, grads_live = _ours(live, ours, pairs)

    cfg = _cfg(tmp_path, "dpo", precompute_reference=True)
    obj = DPOObjective(cfg, log=lambda *_: None)
    loader = obj.make_loader(data, None, shuffle=True)
    parallel = SimpleNamespace(device=torch.device("cpu"), writer=True)
    obj.prepare(ours, loader, parallel)
    assert (tmp_path / REFERENCE_FILE).exists()
    assert obj.reference_table.shape == (5, 2)
    loss, _, grads = _ours(obj, ours, pairs)
    torch.testing.assert_close(loss, loss_live, rtol=1e-6, atol=1e-6)
    for n in grads:
        torch.testing.assert_close(grads[n], grads_live[n], rtol=1e-6, atol=1e-7)

    # resume: the file is read back (the reference pass is not run again)
    again = DPOObjective(cfg, log=lambda *_: None)
    again.compute_reference_table = None  # would fail if called
    again.prepare(ours, loader, parallel)
    torch.testing.assert_close(again.reference_table, obj.reference_table)

    # other data: refused in one line
    other = DPOObjective(cfg, log=lambda *_: None)
    changed = _Items(_pairs(4, n=5), "pairs")
    with pytest.raises(LeantuneError, match="other data or another model") as e:
        other.prepare(ours, other.make_loader(changed, None, shuffle=True), parallel)
    assert "\n" not in str(e.value)


def test_reference_pass_leaves_no_graph_and_keeps_the_adapter(models, tmp_path):
    _, ours = models
    obj = DPOObjective(_cfg(tmp_path, "dpo"))
    batch = obj.make_loader(_Items(_pairs(), "pairs"), None, True).pack([0, 1])
    scalings = [m.scaling for m in ours.modules() if getattr(m, "has_lora", False)]
    ref = obj.reference(ours, batch)
    assert not ref.requires_grad and ref.shape == (4,)
    assert [m.scaling for m in ours.modules() if getattr(m, "has_lora", False)] == scalings
    from leantune.train.objectives.preference import policy_logps

    policy, _ = policy_logps(ours, batch)
    assert policy.requires_grad and not torch.allclose(policy.detach(), ref)


# ---- errors ---------------------------------------------------------------------------------

def test_bad_settings_and_mismatched_data_are_one_line(models, tmp_path):
    with pytest.raises(LeantuneError, match="--loss-type 'robust'"):
        DPOObjective(_cfg(tmp_path, "dpo", loss_type="robust"))
    with pytest.raises(LeantuneError, match="--beta must be a positive number"):
        DPOObjective(_cfg(tmp_path, "dpo", beta=-1))
    with pytest.raises(LeantuneError, match="uses no reference model"):
        ORPOObjective(_cfg(tmp_path, "orpo", precompute_reference=True))
    with pytest.raises(LeantuneError, match="does not apply to --objective kto"):
        KTOObjective(_cfg(tmp_path, "kto", precompute_reference=True))
    with pytest.raises(LeantuneError, match="holds KTO rows; use --objective kto"):
        DPOObjective(_cfg(tmp_path, "dpo")).check_kind(_Items([], "kto"))
    with pytest.raises(LeantuneError, match="holds preference pairs"):
        KTOObjective(_cfg(tmp_path, "kto")).check_kind(_Items([], "pairs"))
    with pytest.raises(LeantuneError, match="outside the model's vocabulary"):
        DPOObjective(_cfg(tmp_path, "dpo")).check_token_ids(
            _Items([PreferencePair([1, 99], [2], [3])], "pairs"), VOCAB, "train data")


def test_full_fine_tuning_without_precompute_is_refused(tmp_path):
    from helpers import CONFIGS
    from leantune.model.config import ModelConfig
    from leantune.model.loader import build_empty

    m = build_empty(ModelConfig.from_dict(CONFIGS["llama"]), torch.float32, torch.device("cpu"))
    m.init_weights(seed=0)
    obj = DPOObjective(_cfg(tmp_path, "dpo"))
    batch = obj.make_loader(_Items(_pairs(), "pairs"), None, True).pack([0])
    with pytest.raises(LeantuneError, match="train a LoRA adapter, or use --precompute-reference"):
        obj.loss(m, batch)
