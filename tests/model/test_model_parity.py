"""Logits parity with transformers for every supported family, on plain and packed batches."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    FAMILIES,
    SLIDING_WINDOW,
    max_abs,
    one_torch_thread,  # noqa: F401  (autouse)
    random_ids,
    save_checkpoint,
)

import leantune
from leantune.batch import IGNORE_INDEX, PackedBatch, shift_labels
from leantune.model.attention import AttentionMeta

TOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint folder, transformers model, leantune model), built once."""
    out = {}
    for i, fam in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(fam)
        hf = save_checkpoint(fam, folder, seed=i)
        model = leantune.load_model(folder, device="cpu").eval()
        out[fam] = (folder, hf, model)
    return out


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def _lt_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
    _, hf, model = checkpoints[family]
    cfg = model.config
    assert cfg.vocab_size == hf.config.vocab_size
    assert cfg.head_dim == hf.config.head_dim
    assert next(model.parameters()).dtype == torch.float32
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    ref, got = _hf_logits(hf, ids), _lt_logits(model, ids)
    assert got.shape == ref.shape == (2, 13, cfg.vocab_size)
    assert ref.abs().max() > 0.1  # the comparison is not between two near-zero tensors
    assert max_abs(got, ref) < TOL


def test_family_flags_are_read(checkpoints):
    llama = checkpoints["llama"][2].config
    assert llama.rope_scaling and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_theta == 500000.0
    assert llama.head_dim * llama.num_attention_heads != llama.hidden_size
    tied = checkpoints["llama_tied"][2]
    assert tied.config.tie_word_embeddings and tied.lm_head is None
    bias = checkpoints["llama_bias"][2].config
    assert bias.attention_bias and bias.o_bias and bias.mlp_bias
    mistral = checkpoints["mistral"][2].config
    assert [mistral.window_for_layer(i) for i in range(2)] == [SLIDING_WINDOW] * 2
    qwen2 = checkpoints["qwen2"][2]
    assert qwen2.config.attention_bias and not qwen2.config.o_bias and qwen2.lm_head is None
    qwen3 = checkpoints["qwen3"][2].config
    assert qwen3.qk_norm and not qwen3.attention_bias


def test_sliding_window_is_exercised(checkpoints):
    """The mistral parity test means something: without the window the logits differ."""
    _, hf, model = checkpoints["mistral"]
    ids = torch.randint(0, 101, (1, 13), generator=torch.Generator().manual_seed(2))
    ref = _hf_logits(hf, ids)
    layers = model.model.layers
    try:
        for layer in layers:
            layer.self_attn.window = None
        full = _lt_logits(model, ids)
    finally:
        for layer in layers:
            layer.self_attn.window = SLIDING_WINDOW
    assert max_abs(full[:, :SLIDING_WINDOW], ref[:, :SLIDING_WINDOW]) < TOL  # window not reached
    assert max_abs(full, ref) > 1e-3
    assert max_abs(_lt_logits(model, ids), ref) < TOL


def test_sharded_checkpoint_loads(tmp_path):
    hf = save_checkpoint("qwen3", tmp_path, seed=5, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    assert not (tmp_path / "model.safetensors").exists()
    model = leantune.load_model(tmp_path, device="cpu").eval()
    ids = torch.randint(0, 101, (2, 11), generator=torch.Generator().manual_seed(3))
    assert max_abs(_lt_logits(model, ids), _hf_logits(hf, ids)) < TOL


def test_load_model_dtype_argument(checkpoints):
    folder, _, _ = checkpoints["qwen2"]
    model = leantune.load_model(folder, device="cpu", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.source_path == folder


# --- packed rows -------------------------------------------------------------------------------

def _documents(vocab: int, lengths: list[list[int]], seed: int):
    """rows of (ids, shifted labels) documents; the first two tokens of each are a 'prompt'."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for row in lengths:
        docs = []
        for n in row:
            ids = random_ids(n, vocab, g)
            docs.append((ids, shift_labels(ids, [i >= 2 for i in range(n)])))
        rows.append(docs)
    return rows


ROWS = [[7, 5, 10], [9, 6]]  # row 0: 3 docs + 2 pad (T = 24); row 1: 2 docs + 9 pad


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_match_documents_alone(checkpoints, family):
    _, hf, model = checkpoints[family]
    rows = _documents(model.config.vocab_size, ROWS, seed=10)
    batch = PackedBatch.from_documents(rows, pad_id=0, pad_to_multiple=8)
    assert batch.shape == (2, 24)
    assert batch.seq_lens == [7, 5, 10, 2, 9, 6, 9]
    assert len(batch.seq_lens) > batch.shape[0]  # packed: more documents than rows
    with torch.no_grad():
        packed = model(batch=batch).logits
    assert packed.shape == (2, 24, model.config.vocab_size)
    for b, docs in enumerate(rows):
        t = 0
        for ids, _ in docs:
            n = len(ids)
            alone = torch.tensor([ids])
            got = packed[b:b + 1, t:t + n]
            assert max_abs(got, _lt_logits(model, alone)) < TOL, (b, t, n)
            assert max_abs(got, _hf_logits(hf, alone)) < TOL, (b, t, n)
            t += n


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_sum_matches_manual_cross_entropy(checkpoints, family):
    _, hf, model = checkpoints[family]
    rows = _documents(model.config.vocab_size, ROWS, seed=11)
    batch = PackedBatch.from_documents(rows, pad_id=0, pad_to_multiple=8)
    with torch.no_grad():
        logits = model(batch=batch).logits
        loss = model.loss_sum(batch)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    manual = F.cross_entropy(logits.flatten(0, 1).float(), batch.labels.flatten(),
                             ignore_index=IGNORE_INDEX, reduction="sum")
    assert torch.isfinite(loss)
    assert abs(loss.item() - manual.item()) < 1e-4 * max(1.0, abs(manual.item()))
    # Same loss as transformers on each document alone, summed (never across a boundary).
    ref = 0.0
    for docs in rows:
        for ids, lab in docs:
            doc_logits = _hf_logits(hf, torch.tensor([ids]))[0]
            ref += F.cross_entropy(doc_logits, torch.tensor(lab), ignore_index=IGNORE_INDEX,
                                   reduction="sum").item()
    assert abs(loss.item() - ref) < 1e-4 * max(1.0, abs(ref))
    # Every document's last token and all padding carry no target.
    expected_targets = sum(len(ids) - 2 for docs in rows for ids, _ in docs)
    assert batch.num_target_tokens == expected_targets


def test_default_attention_path_choice():
    dev = torch.device("cpu")
    single = AttentionMeta.build((2, 8), dev, seq_lens=[8, 8], cu_seqlens=None, max_seqlen=8,
                                 windows={None})
    packed = AttentionMeta.build((2, 8), dev, seq_lens=[3, 5, 8], cu_seqlens=None, max_seqlen=8,
                                 windows={None})
    windowed = AttentionMeta.build((2, 8), dev, seq_lens=[8, 8], cu_seqlens=None, max_seqlen=8,
                                   windows={4})
    assert single.path == "causal"
    assert packed.path == "mask" and packed.masks[None].shape == (2, 1, 8, 8)
    assert windowed.path == "mask"


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_attention_paths_agree(checkpoints, family):
    _, hf, model = checkpoints[family]
    g = torch.Generator().manual_seed(12)
    rows = [[(ids, shift_labels(ids, [True] * 16))] for ids in
            (random_ids(16, model.config.vocab_size, g) for _ in range(2))]
    batch = PackedBatch.from_documents(rows, pad_to_multiple=8)
    assert len(batch.seq_lens) == 2 and batch.shape == (2, 16)  # one document a row
    # The "causal" path has no sliding window: only exact (and only chosen) without one.
    paths = ["mask"] if model.config.sliding_window else ["mask", "causal"]
    out = {}
    for path in [None, *paths]:
        model.attention_path = path
        with torch.no_grad():
            out[path] = model(batch=batch).logits
    model.attention_path = None
    ref = _hf_logits(hf, batch.input_ids)
    for path, logits in out.items():
        assert max_abs(logits, ref) < TOL, path
        assert max_abs(logits, out[None]) < TOL, path


def test_qwen2_old_config_sliding_layers_from_max_window_layers():
    from leantune.model.config import ModelConfig

    d = dict(model_type="qwen2", vocab_size=11, hidden_size=8, intermediate_size=16,
             num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
             use_sliding_window=True, sliding_window=5, max_window_layers=2)
    cfg = ModelConfig.from_dict(d)
    assert [cfg.window_for_layer(i) for i in range(4)] == [None, None, 5, 5]
    assert ModelConfig.from_dict(dict(d, use_sliding_window=False)).window_for_layer(3) is None
