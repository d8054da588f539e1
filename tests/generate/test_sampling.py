"""Sampling: the processors are transformers' (same scores, same order), seeded sampling is
reproducible (and, one prompt at a time, draws what transformers draws with the same seed),
top-k 1 is greedy, the repetition penalty matches transformers' in greedy generation, and
meaningless values are one-line errors."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread, random_ids, save_checkpoint  # noqa: F401  (autouse)

import leantune
from leantune.errors import LeantuneError
from leantune.generate.decode import decode
from leantune.generate.sampling import Sampler, Sampling

NEW = 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(leantune model, transformers model) of the tiny qwen3 checkpoint."""
    from helpers import load_hf

    folder = tmp_path_factory.mktemp("qwen3")
    save_checkpoint("qwen3", folder, seed=4)
    return leantune.load_model(folder, device="cpu", dtype=torch.float32).eval(), load_hf(folder)


def _prompt(model, n=6, seed=0):
    return random_ids(n, model.config.vocab_size, torch.Generator().manual_seed(seed))


def test_scores_equal_transformers_processors():
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 3
    held = torch.randint(0, 50, (3, 9), generator=g)
    for kw in (dict(temperature=0.7, top_k=10, top_p=0.8, repetition_penalty=1.3),
               dict(temperature=1.5, top_p=0.5), dict(temperature=0.9, top_k=3),
               dict(repetition_penalty=0.8)):
        s = Sampling(**kw)
        ref = LogitsProcessorList()
        if s.repetition_penalty != 1:
            ref.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
        if not s.greedy:
            ref.append(TemperatureLogitsWarper(s.temperature))
            if s.top_k:
                ref.append(TopKLogitsWarper(s.top_k))
            if s.top_p < 1:
                ref.append(TopPLogitsWarper(s.top_p))
        got = Sampler(s, held.tolist(), 50, torch.device("cpu")).scores(logits)
        torch.testing.assert_close(got, ref(held, logits.clone()), rtol=0, atol=0)
        assert torch.isinf(got).any() == (s.top_k > 0 or s.top_p < 1)


def test_same_seed_same_tokens_other_seed_other_tokens(pair):
    model, _ = pair
    prompts = [_prompt(model, 4), _prompt(model, 9, seed=1)]

    def sample(seed):
        rows = decode(model, prompts, NEW, Sampling(temperature=1.0, seed=seed))
        return [r.token_ids for r in rows]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_seeded_sampling_draws_what_transformers_draws(pair):
    """One prompt: the same processors, then one multinomial draw a step from a generator seeded
    alike, so transformers (seeded through torch.manual_seed) samples the same tokens."""
    model, hf = pair
    prompt = _prompt(model, 7, seed=2)
    kw = dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2)
    got = decode(model, [prompt], NEW, Sampling(**kw, seed=11))[0].token_ids
    torch.manual_seed(11)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=True,
                          pad_token_id=0, **kw)[0, len(prompt):].tolist()
    assert got == ref


def test_top_k_1_is_greedy(pair):
    model, _ = pair
    prompts = [_prompt(model, 5), _prompt(model, 8, seed=1)]
    greedy = decode(model, prompts, NEW)
    top1 = decode(model, prompts, NEW, Sampling(temperature=1.3, top_k=1, seed=3))
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]


def test_greedy_repetition_penalty_equals_transformers(pair):
    model, hf = pair
    prompt = _prompt(model, 6, seed=5)
    got = decode(model, [prompt], NEW, Sampling(repetition_penalty=1.5))[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                          repetition_penalty=1.5, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == ref
    assert got != decode(model, [prompt], NEW)[0].token_ids  # the penalty changed something


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=-0.5), "--temperature must be 0 (greedy) or more, got -0.5"),
    (dict(temperature=float("nan")), "--temperature must be 0 (greedy) or more, got nan"),
    (dict(top_k=-1), "--top-k must be 0 (off) or more, got -1"),
    (dict(top_p=0.0), "--top-p must be in (0, 1] (1: off), got 0.0"),
    (dict(top_p=1.5), "--top-p must be in (0, 1] (1: off), got 1.5"),
    (dict(repetition_penalty=0.0), "--repetition-penalty must be positive (1: off), got 0.0"),
    (dict(top_k=5), "--top-k applies to sampling, and --temperature 0 (the default) is greedy; "
                    "give a --temperature above 0, or drop --top-k"),
    (dict(seed=1, repetition_penalty=1.2), "--seed applies to sampling, and --temperature 0 "
     "(the default) is greedy; give a --temperature above 0, or drop --seed"),
])
def test_meaningless_values_are_refused(kw, message):
    with pytest.raises(LeantuneError) as e:
        Sampling(**kw).check()
    assert str(e.value) == message
