"""Greedy generation equals transformers' `generate` token for token (fp32, 32 new tokens) for
every family, with and without an adapter, batched prompts of different lengths; the KV cache
gives the logits of a full re-run; a merged model generates what base + adapter generates."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    FAMILIES,
    MOE_FAMILIES,
    load_hf,
    max_abs,
    one_torch_thread,  # noqa: F401  (autouse)
    random_ids,
    save_checkpoint,
    save_random_adapter,
)

import leantune
from leantune.generate.cache import KVCache
from leantune.generate.decode import decode

NEW = 32
LENGTHS = (5, 12, 8)  # one batch: left-padded to 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (checkpoint folder, adapter folder), built once."""
    out = {}
    for i, fam in enumerate(FAMILIES):
        folder = tmp_path_factory.mktemp(fam)
        save_checkpoint(fam, folder, seed=i)
        # MoE families: LoRA on attention and the experts (their dense MLP names mean experts
        # to PEFT)
        targets = "q,k,v,o,experts" if fam in MOE_FAMILIES else "q,k,v,o,gate,up,down"
        save_random_adapter(folder, folder.parent / f"{fam}-adapter", seed=i, targets=targets)
        out[fam] = (folder, folder.parent / f"{fam}-adapter")
    return out


def _models(folder, adapter):
    """(leantune model, transformers model), the adapter attached to both when given."""
    ours = leantune.load_model(folder, device="cpu", dtype=torch.float32)
    hf = load_hf(folder)
    if adapter is not None:
        from peft import PeftModel

        leantune.load_adapter(ours, adapter)
        hf = PeftModel.from_pretrained(hf, str(adapter)).eval()
    return ours.eval(), hf


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [random_ids(n, vocab, g) for n in LENGTHS]


def _hf_greedy(hf, prompt: list[int], eos: list[int]) -> list[int]:
    """transformers' greedy tokens for one prompt, up to and including its first EOS."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                          eos_token_id=eos or None, pad_token_id=0)[0, len(prompt):].tolist()
    cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    return out[:cut]


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(checkpoints, family, with_adapter):
    folder, adapter = checkpoints[family]
    ours, hf = _models(folder, adapter if with_adapter else None)
    eos = [e for e in [hf.generation_config.eos_token_id] if e is not None]
    prompts = _prompts(ours.config.vocab_size)
    got = decode(ours, prompts, NEW, eos_ids=eos)  # one batch of 3
    for prompt, row in zip(prompts, got):
        ref = _hf_greedy(hf, prompt, eos)
        assert row.token_ids == ref
        assert row.stopped == ("eos" if ref[-1:] and ref[-1] in eos else "length")
    assert any(len(r.token_ids) == NEW for r in got)  # the comparison ran for 32 tokens


def test_a_row_stops_at_its_eos_and_the_others_go_on(checkpoints):
    """An EOS id taken from the middle of row 0's greedy output ends that row there (the EOS
    kept as its last token); the other rows are unaffected by it."""
    folder, _ = checkpoints["llama"]
    ours, hf = _models(folder, None)
    prompts = _prompts(ours.config.vocab_size, seed=3)
    free = decode(ours, prompts, NEW)
    eos = free[0].token_ids[9]
    got = decode(ours, prompts, NEW, eos_ids=[eos])
    first = free[0].token_ids.index(eos)
    assert got[0].token_ids == free[0].token_ids[:first + 1] and got[0].stopped == "eos"
    for before, after in zip(free[1:], got[1:]):
        cut = before.token_ids.index(eos) + 1 if eos in before.token_ids else NEW
        assert after.token_ids == before.token_ids[:cut]
    assert got[0].token_ids == _hf_greedy(hf, prompts[0], [eos])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_cached_logits_equal_a_full_rerun(checkpoints, family):
    """Prefill two left-padded prompts, then 6 single-token steps: each step's logits equal the
    logits of the whole sequence run again without a cache (mistral: its window of 4 slides)."""
    folder, adapter = checkpoints[family]
    model, _ = _models(folder, adapter)
    g = torch.Generator().manual_seed(5)
    rows = [random_ids(n, model.config.vocab_size, g) for n in (3, 7)]
    steps = [random_ids(2, model.config.vocab_size, g) for _ in range(6)]  # 2 rows a step
    P = max(map(len, rows))
    cache = KVCache(model.config, 2, P + len(steps), torch.float32, torch.device("cpu"))
    cache.pad.copy_(torch.tensor([P - len(r) for r in rows]))
    ids = torch.tensor([[0] * (P - len(r)) + r for r in rows])
    with torch.no_grad():
        positions, meta = cache.meta(P)
        logits = model.forward_cached(ids, positions, meta)
        for i, new in enumerate([None, *steps]):
            if new is not None:
                rows = [r + [t] for r, t in zip(rows, new)]
                cache.start.fill_(P + i - 1)
                positions, meta = cache.meta(1)
                logits = model.forward_cached(torch.tensor(new)[:, None], positions, meta)
            for b, r in enumerate(rows):
                full = model(torch.tensor([r])).logits[0, -1]
                assert max_abs(logits[b], full) < 1e-5, (i, b)
    assert logits.abs().max() > 0.1


@pytest.mark.parametrize("family", ["llama_bias", "qwen2"])
def test_merged_model_generates_what_base_plus_adapter_does(checkpoints, tmp_path, family):
    folder, adapter = checkpoints[family]
    ours, _ = _models(folder, adapter)
    merged = leantune.export_merged(folder, adapter, tmp_path / "merged")
    merged_model = leantune.load_model(merged, device="cpu", dtype=torch.float32)
    base, _ = _models(folder, None)
    prompts = _prompts(ours.config.vocab_size, seed=7)
    with_adapter = decode(ours, prompts, NEW)
    assert [r.token_ids for r in decode(merged_model, prompts, NEW)] == \
        [r.token_ids for r in with_adapter]
    assert [r.token_ids for r in decode(base, prompts, NEW)] != \
        [r.token_ids for r in with_adapter]  # the adapter changes what is generated
