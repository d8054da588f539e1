"""The embedding row gather (Triton interpreter on CPU) against F.embedding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune.kernels.embedding import embedding_lookup, gather_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,H,ids_shape", [(97, 1030, (2, 5)), (11, 7, (1,)), (5, 3, (0,))])
def test_gather_rows_matches_embedding(dtype, V, H, ids_shape):
    weight = torch.randn(V, H).to(dtype)
    ids = torch.randint(0, V, ids_shape)
    if ids.numel():
        ids.view(-1)[0] = V - 1  # the last row too
    out = gather_rows(ids, weight)
    assert out.shape == (*ids_shape, H) and out.dtype == dtype
    assert torch.equal(out, F.embedding(ids, weight))  # a copy: bit-exact


def test_ids_outside_the_table_read_nothing():
    weight = torch.randn(16, 5)
    out = gather_rows(torch.tensor([3, 16, -1, 100000]), weight)
    assert torch.equal(out[0], weight[3]) and not out[1:].any()


def test_lookup_on_one_device_is_plain_embedding_with_grad():
    weight = torch.randn(13, 8, requires_grad=True)
    ids = torch.tensor([[1, 12, 3]])
    out = embedding_lookup(ids, weight)
    out.sum().backward()  # full fine-tuning: the table still gets its gradient
    assert weight.grad[12].eq(1).all() and weight.grad[0].eq(0).all()


def test_a_trainable_table_on_another_device_is_refused():
    weight = torch.randn(13, 8, requires_grad=True)
    ids = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="cannot be trained"):
        embedding_lookup(ids.to("meta"), weight)


def test_model_keeps_a_cpu_or_tied_table_where_it_is():
    from leantune.model.config import ModelConfig
    from leantune.model.loader import build_empty

    cfg = dict(model_type="llama", vocab_size=31, hidden_size=16, intermediate_size=24,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    for tied in (True, False):
        m = build_empty(ModelConfig.from_dict(dict(cfg, tie_word_embeddings=tied)),
                        torch.float32, torch.device("cpu"))
        m.requires_grad_(False)
        assert m.offload_embedding() is False  # CPU model (and, tied, the output layer needs it)
