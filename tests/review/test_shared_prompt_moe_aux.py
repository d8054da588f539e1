"""Review finding (fixed): with the MoE router's load-balancing loss on (`router_aux_loss`), the
shared-prompt layout changed the aux loss the preference objectives add: the prompt's tokens are
routed once instead of twice and the padding differs. Preference batches now weight the router
statistics (PackedBatch.token_weights: a shared prompt twice, padding never), so both layouts
give the same aux loss, as they give the same log-probs; and it is the statistics of the pairs'
sequences alone, as transformers computes them with an attention mask."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

from helpers import BASE, model_for, one_torch_thread  # noqa: E402,F401
from test_shared_prompt import _batch, _cfg, _pairs  # noqa: E402

from leantune.train.objectives.preference import DPOObjective, policy_logps  # noqa: E402

MIXTRAL = dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)


def test_moe_aux_loss_is_the_same_shared_or_not(tmp_path):
    model = model_for(MIXTRAL)
    model.router_aux_loss = True
    obj = DPOObjective(_cfg(tmp_path))
    with torch.no_grad():
        a, aux_a = policy_logps(model, _batch(obj, _pairs(), False))
        b, aux_b = policy_logps(model, _batch(obj, _pairs(), True))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # (this part holds)
    torch.testing.assert_close(aux_b, aux_a, rtol=1e-5, atol=1e-5)


def test_moe_aux_loss_counts_the_sequences_not_the_padding(tmp_path):
    """The unshared batch's aux loss is that of its documents run alone, one a row with no
    padding (each row's statistics summed): padding tokens, which route like any token, do
    not count."""
    from leantune.batch import PackedBatch
    from leantune.model.moe import MoEBlock, load_balancing_loss

    model = model_for(MIXTRAL)
    model.router_aux_loss = True
    obj = DPOObjective(_cfg(tmp_path))
    pb = _batch(obj, _pairs(), False)
    assert (pb.doc_index < 0).any()  # (the batch has padding)
    with torch.no_grad():
        _, aux = policy_logps(model, pb)
        blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
        stats, n = [], 0
        for p in _pairs():
            for completion in (p.chosen, p.rejected):
                ids = p.prompt + completion
                b = PackedBatch.from_documents([[(ids, [-100] * len(ids))]], pad_to_multiple=1)
                for blk in blocks:
                    blk.router_stats = []
                model.hidden_states(b.input_ids, b.position_ids, b)
                stats.append([s for blk in blocks for s in blk.router_stats])
                n += len(ids)
        for blk in blocks:
            blk.router_stats = None
        per_layer = [(sum(s[j][0] for s in stats), sum(s[j][1] for s in stats))
                     for j in range(len(stats[0]))]
    want = load_balancing_loss(per_layer, n, model.config.moe.num_experts)
    torch.testing.assert_close(aux, want, rtol=1e-5, atol=1e-6)


def test_a_batch_of_padding_alone_gives_a_zero_aux_loss_not_nan():
    from leantune.batch import PackedBatch

    model = model_for(MIXTRAL)
    model.router_aux_loss = True
    b = PackedBatch.from_documents([[([5, 6, 7, 8], [-100] * 4)]], pad_to_multiple=1)
    b.token_weights = torch.zeros(b.input_ids.shape)
    with torch.no_grad():
        out = model(batch=b, token_logps=True)
    assert torch.isfinite(out.aux_loss) and out.aux_loss == 0
