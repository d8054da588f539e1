"""Rows with the same prompt share one prefill (decode's share_prompts, GRPO's G completions of
a prompt): the KV cache and the logits equal those of the prefill of every row, so greedy and
seeded sampled completions are the same with and without sharing."""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIGS, model_for, one_torch_thread  # noqa: F401  (autouse)

import leantune.generate.decode as D
from leantune.generate.sampling import Sampling

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [5, 6, 7], [8, 9, 10, 11, 12], [5, 6, 7], [4]]


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_shared_prefill_fills_the_cache_as_the_full_one(family):
    model = model_for(CONFIGS[family]).eval()
    caches, logits = [], []
    for share in (False, True):
        step = D.DecodeStep(model, len(PROMPTS), 16, CPU, False)
        step.cache.k[0].fill_(7.0)  # stale values from an earlier call must be overwritten
        with torch.no_grad():
            logits.append(D._prefill(model, step.cache, PROMPTS, CPU, share))
        caches.append(step.cache)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-6)
    P = max(map(len, PROMPTS))
    for full, shared in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        for row, p in enumerate(PROMPTS):  # the prompt's slots (padding slots are never read)
            torch.testing.assert_close(shared[row, P - len(p):P], full[row, P - len(p):P],
                                       rtol=1e-5, atol=1e-6)
    assert torch.equal(caches[0].pad, caches[1].pad)


def test_completions_are_the_same_with_and_without_sharing():
    model = model_for(CONFIGS["qwen3"])
    for sampling in (None, Sampling(temperature=1.0, seed=11)):
        runs = [[d.token_ids for d in D.decode(model, PROMPTS, 7, sampling, share_prompts=s)]
                for s in (False, True)]
        assert runs[0] == runs[1]
    sampled = runs[1]
    assert sampled[0] != sampled[2] or sampled[2] != sampled[4]  # repeats still sample apart
