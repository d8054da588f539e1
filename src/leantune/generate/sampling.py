"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p; a repetition
penalty for either.

The logits go through the processors in the order transformers applies them (repetition
penalty, then temperature, top-k, top-p), then greedy takes the argmax and sampling draws from
the softmax with `torch.multinomial` and a generator seeded with `seed`: the same seed gives the
same tokens on the same device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import LeantuneError


@dataclass
class Sampling:
    """temperature 0: greedy; > 0: sample. top_k 0 and top_p 1.0: off. repetition_penalty 1.0:
    off; above 1 lowers (below 1 raises) the logits of every token already in the row (prompt
    included): positive ones divided by it, negative ones multiplied. seed: None draws from
    torch's global generator."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def check(self) -> "Sampling":
        """One-line errors for values that mean nothing."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise LeantuneError(f"--temperature must be 0 (greedy) or more, got {self.temperature}")
        if self.top_k < 0:
            raise LeantuneError(f"--top-k must be 0 (off) or more, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise LeantuneError(f"--top-p must be in (0, 1] (1: off), got {self.top_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise LeantuneError(f"--repetition-penalty must be positive (1: off), got "
                                f"{self.repetition_penalty}")
        if self.greedy:
            ignored = [flag for flag, on in (("--top-k", self.top_k), ("--top-p", self.top_p < 1),
                                             ("--seed", self.seed is not None)) if on]
            if ignored:
                raise LeantuneError(f"{ignored[0]} applies to sampling, and --temperature 0 "
                                    "(the default) is greedy; give a --temperature above 0, or "
                                    f"drop {ignored[0]}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """The next token of each row from its logits [B, V]; keeps which tokens each row holds
    (prompt and generated) for the repetition penalty."""

    def __init__(self, sampling: Sampling, prompts: list[list[int]], vocab: int,
                 device: torch.device):
        self.s = sampling.check()
        self.seen = None
        if self.s.repetition_penalty != 1.0:
            self.seen = torch.zeros(len(prompts), vocab, dtype=torch.bool, device=device)
            for row, ids in enumerate(prompts):
                self.seen[row, torch.tensor(ids, device=device)] = True
        self.generator = None
        if not self.s.greedy and self.s.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.s.seed)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] through the processors (fp32): what greedy takes the argmax of and
        sampling the softmax of."""
        s = self.s
        scores = logits.float()
        if self.seen is not None:
            p = s.repetition_penalty
            scores = torch.where(self.seen, torch.where(scores < 0, scores * p, scores / p),
                                 scores)
        if s.greedy:
            return scores
        if s.temperature != 1.0:  # (x / 1 is x: one kernel less per token)
            scores = scores / s.temperature
        if s.top_k:
            kth = torch.topk(scores, min(s.top_k, scores.shape[-1])).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if s.top_p < 1.0:
            scores = top_p_filter(scores, s.top_p)
        return scores

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] -> next tokens [B] (long), on the device, no host sync."""
        scores = self.scores(logits)
        if self.s.greedy:
            tokens = scores.argmax(-1)
        else:
            probs = torch.softmax(scores, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        if self.seen is not None:
            self.seen[torch.arange(len(tokens), device=tokens.device), tokens] = True
        return tokens


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probabilities sum to at least top_p
    (at least one token); the others get -inf. scores: [B, V]."""
    ordered, order = torch.sort(scores, descending=False)
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[:, -1] = False  # the most likely token stays
    return scores.masked_fill(drop.scatter(1, order, drop), -math.inf)
