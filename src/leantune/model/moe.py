"""The mixture-of-experts block: a router picks top-k experts per token, the tokens are grouped
by expert once, each expert's gated MLP runs on its group, and the outputs come back weighted.

    x [N, H] -> router: logits [N, E] -> weights [N, k], experts [N, k]
      -> Grouping (once per layer): the N*k assignments sorted by expert (one stable argsort),
         counts by one bincount (a scatter-add: torch.bincount syncs on CUDA), group ends by
         cumsum
      -> xs = x[tokens of the sorted assignments]                        [N*k, H]  (one gather)
      -> per expert group: gate/up, GLU, down (grouped GEMMs, or a loop)  [N*k, H]
      -> times the routing weights, back to token order (the inverse permutation), summed
         over k                                                            [N, H]

No per-expert `nonzero` / `where`. The expert matmuls run as one grouped GEMM each
(`torch.nn.functional.grouped_mm`, or `torch._grouped_mm` in older builds) on CUDA in bf16, with
the group ends on the device: no host sync in the layer. Elsewhere (the CPU, fp32, shapes the
grouped kernel cannot take) a loop over the non-empty experts slices the groups with host-side
counts, read once per layer (on CUDA that read is the layer's one sync).

Parameters are stacked per layer and named as transformers 5.x names them, whatever layout the
checkpoint has (model/weight_map.py maps per-expert 2-D and MXFP4 tensors onto them):
    Qwen3-MoE, Mixtral: gate.weight [E, H]; experts.gate_up_proj [E, 2I, H] ([gate; up] rows),
        experts.down_proj [E, H, I]                                  (each [out, in] per expert)
    gpt-oss: router.weight [E, H], router.bias [E]; experts.gate_up_proj [E, H, 2I] (gate and
        up columns interleaved), gate_up_proj_bias [E, 2I], down_proj [E, I, H],
        down_proj_bias [E, H]                                        (each [in, out] per expert)
LoRA on the experts (`add_lora`) keeps per expert A [E, r, in] and B [E, out, r] for each
stacked projection; its products are grouped the same way as the base matmuls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import kernels
from ..lora.layer import lora_scaling
from .config import ModelConfig, MoESpec

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclass
class Grouping:
    """One layer's top-k assignments in expert order (module docstring). M = N * k.

    order [M]: flat assignment indices (token * k + slot), stably sorted by expert.
    tokens [M]: the token of each sorted assignment.
    experts [M]: its expert.
    inverse [M]: where each flat assignment sits in the sorted order.
    counts [E] (int64), ends [E] (int32, cumulative): the groups, on the device.
    grouped: True / False run every matmul as a grouped GEMM / the loop over `host_counts`;
        None chooses per matmul (`grouped_mm_fits`)."""

    order: torch.Tensor
    tokens: torch.Tensor
    experts: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    ends: torch.Tensor
    grouped: bool | None
    _host_counts: list[int] | None = None

    @classmethod
    def build(cls, expert_idx: torch.Tensor, num_experts: int,
              grouped: bool | None = None) -> "Grouping":
        """expert_idx [N, k] (int64) -> the grouping: one argsort, one bincount, one cumsum."""
        k = expert_idx.shape[1]
        flat = expert_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        counts = expert_counts(flat, num_experts)
        return cls(order, order // k, flat[order], inverse, counts,
                   torch.cumsum(counts, 0, dtype=torch.int32), grouped)

    @property
    def host_counts(self) -> list[int]:
        """Tokens per expert on the host (the loop path; read once per layer)."""
        if self._host_counts is None:
            self._host_counts = self.counts.tolist()
        return self._host_counts


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many of `experts` (int64 ids) name each expert: [num_experts] int64. A bincount, as
    a scatter-add (torch.bincount reads the largest id back to the host on CUDA)."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, experts, torch.ones_like(experts))


def grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the grouped GEMM kernel takes x [M, in] @ w [E, in, out] (the auto choice): CUDA,
    bf16, in and out 16-byte multiples (w may be a transposed view)."""
    return (_GROUPED_MM is not None and x.is_cuda and x.dtype == w.dtype == torch.bfloat16
            and all(d * x.element_size() % 16 == 0 for d in (w.shape[1], w.shape[2])))


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, g: Grouping) -> torch.Tensor:
    """x [M, in] (rows in expert order) @ w[e] [E, in, out] per expert group -> [M, out]."""
    if g.grouped or (g.grouped is None and grouped_mm_fits(x, w)):
        return _GROUPED_MM(x, w, offs=g.ends)
    out, start = [], 0
    for e, n in enumerate(g.host_counts):
        if n:
            out.append(x[start:start + n] @ w[e])
            start += n
    return torch.cat(out) if out else x.new_zeros(0, w.shape[2])


def gpt_oss_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU over interleaved columns [g0, u0, g1, u1, ...]:
    (up + 1) * gate * sigmoid(alpha * gate), gate clamped to <= limit, up to [-limit, limit]."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


class Router(nn.Module):
    """Top-k expert choice per token (MoESpec.router). weight [E, H], bias [E] (gpt-oss)."""

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(spec.num_experts)) if spec.bias else None
        self.spec = spec

    def forward(self, x: torch.Tensor):
        """x [N, H] -> (logits [N, E], weights [N, k] fp32, experts [N, k])."""
        logits = F.linear(x, self.weight, self.bias)
        k = self.spec.top_k
        if self.spec.router == "topk_softmax":
            top, idx = logits.topk(k, dim=-1)
            return logits, torch.softmax(top.float(), dim=-1), idx
        weights, idx = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)
        if self.spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights, idx


class Experts(nn.Module):
    """The stacked expert weights of one layer (module docstring) and their grouped forward."""

    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        spec, h = cfg.moe, cfg.hidden_size
        E, i = spec.num_experts, spec.intermediate_size
        self.transposed = spec.transposed  # each expert [in, out] (gpt-oss), else [out, in]
        shape = (lambda n_in, n_out: (E, n_in, n_out) if self.transposed else (E, n_out, n_in))
        self.gate_up_proj = nn.Parameter(torch.empty(shape(h, 2 * i)))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * i)) if spec.bias else None
        self.down_proj = nn.Parameter(torch.empty(shape(i, h)))
        self.down_proj_bias = nn.Parameter(torch.empty(E, h)) if spec.bias else None
        self.spec = spec
        self.act = kernels.act_code(cfg.hidden_act)
        # LoRA (add_lora): projection name -> A [E, r, in] / B [E, out, r]
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.r, self.scaling = 0, 0.0

    @property
    def has_lora(self) -> bool:
        return len(self.lora_A) > 0

    def in_out(self, name: str) -> tuple[int, int]:
        """(in, out) features of one expert's projection `name`."""
        w = getattr(self, name)
        return (w.shape[1], w.shape[2]) if self.transposed else (w.shape[2], w.shape[1])

    def add_lora(self, r: int, alpha: float, use_rslora: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        """Attach LoRA of rank r to both stacked projections: A per expert as PEFT initialises
        it (kaiming-uniform, bound 1 / sqrt(in)), B zeros, so the layer starts unchanged."""
        dev = self.gate_up_proj.device
        dtype = dtype or self.gate_up_proj.dtype
        E = self.spec.num_experts
        for name in self.PROJECTIONS:
            n_in, n_out = self.in_out(name)
            a = torch.empty(E, r, n_in, device=dev, dtype=dtype)
            b = torch.zeros(E, n_out, r, device=dev, dtype=dtype)
            if dev.type != "meta":
                a.uniform_(-1 / math.sqrt(n_in), 1 / math.sqrt(n_in))
            self.lora_A[name] = nn.Parameter(a)
            self.lora_B[name] = nn.Parameter(b)
        self.r, self.scaling = r, lora_scaling(r, alpha, use_rslora)

    def weight_in_out(self, name: str) -> torch.Tensor:
        """The stacked base weight of projection `name` as [E, in, out] (a view)."""
        w = getattr(self, name)
        return w if self.transposed else w.transpose(1, 2)

    def project(self, name: str, x: torch.Tensor, g: Grouping,
                weight: torch.Tensor | None = None) -> torch.Tensor:
        """Projection `name` of the grouped rows x [M, in] -> [M, out]: base + bias + LoRA.
        `weight`: the base weight [E, in, out] to use (default: this module's; the engine
        passes its weight provider's)."""
        w = self.weight_in_out(name) if weight is None else weight
        y = grouped_matmul(x, w, g)
        bias = getattr(self, name + "_bias")
        if bias is not None:
            y = y + bias.index_select(0, g.experts)
        if name in self.lora_A:
            a = self.lora_A[name].to(x.dtype).transpose(1, 2)  # [E, in, r]
            b = self.lora_B[name].to(x.dtype).transpose(1, 2)  # [E, r, out]
            y = y + grouped_matmul(grouped_matmul(x, a, g), b, g) * self.scaling
        return y

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation: gate_up [M, 2I] -> [M, I] (gpt-oss: its clamped SwiGLU over
        interleaved columns; else act(gate) * up over the [gate | up] halves)."""
        if self.spec.swiglu_limit is not None:
            return gpt_oss_swiglu(gate_up, self.spec.swiglu_alpha, self.spec.swiglu_limit)
        gate, up = gate_up.chunk(2, dim=-1)
        return kernels.glu(gate, up, self.act)

    def forward(self, xs: torch.Tensor, g: Grouping) -> torch.Tensor:
        """xs [M, H] (rows in expert order) -> each row's expert output [M, H]."""
        return self.project("down_proj", self.activate(self.project("gate_up_proj", xs, g)), g)


class MoEBlock(nn.Module):
    """The sparse MLP of one layer: router (`gate` in Qwen3-MoE and Mixtral, `router` in
    gpt-oss, as transformers names them) and experts.

    `grouped_mm`: None chooses per matmul (`grouped_mm_fits`); True / False force the grouped
    GEMM / the loop (tests). With `record_router_stats` set, forward computes what the
    load-balancing loss needs and appends it to the list `router_stats` when CausalLM has put
    one there for this forward (CausalLM.router_aux_loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        router = Router(cfg.hidden_size, cfg.moe)
        if cfg.moe.router == "topk_softmax":
            self.router = router
        else:
            self.gate = router
        self.experts = Experts(cfg)
        self.spec = cfg.moe
        self.grouped_mm: bool | None = None
        self.record_router_stats = False
        self.router_stats: list | None = None
        self.router_weights: torch.Tensor | None = None  # [N] per-token (CausalLM sets them)

    def route(self, x: torch.Tensor):
        return (self.router if self.spec.router == "topk_softmax" else self.gate)(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> [B, T, H]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.training and self.spec.jitter_noise > 0:
            j = self.spec.jitter_noise
            x = x * torch.empty_like(x).uniform_(1.0 - j, 1.0 + j)
        logits, weights, idx = self.route(x)
        if self.record_router_stats:
            stats = router_stats(logits, idx, self.router_weights)
            if self.router_stats is not None:
                self.router_stats.append(stats)
        g = Grouping.build(idx, self.spec.num_experts, self.grouped_mm)
        ys = self.experts(x.index_select(0, g.tokens), g)
        return self.combine(ys, weights, g).view(shape)

    def combine(self, ys: torch.Tensor, weights: torch.Tensor, g: Grouping) -> torch.Tensor:
        """The expert outputs ys [M, H] (expert order) weighted by their routing weights
        [N, k] and summed per token, in token order -> [N, H]."""
        ys = ys * weights.reshape(-1).index_select(0, g.order).to(ys.dtype)[:, None]
        return ys.index_select(0, g.inverse).view(-1, self.spec.top_k, ys.shape[-1]).sum(1)


def router_stats(logits: torch.Tensor, idx: torch.Tensor,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k choices per expert [E], summed router probabilities per expert [E], fp32) of one
    layer's N tokens: the load-balancing loss's ingredients. `weights` [N]: each token's
    choices and probabilities count that many times (PackedBatch.token_weights)."""
    E = logits.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1)
    if weights is None:
        return expert_counts(idx.reshape(-1), E).float(), probs.sum(0)
    w = weights.reshape(-1).float()
    chosen = torch.zeros(E, device=logits.device, dtype=torch.float32).index_add_(
        0, idx.reshape(-1), w.repeat_interleave(idx.shape[-1]))
    return chosen, (probs * w[:, None]).sum(0)


def load_balancing_loss(stats: list[tuple[torch.Tensor, torch.Tensor]],
                        tokens: "int | torch.Tensor", num_experts: int) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss as transformers computes it over all MoE layers
    together: E * sum_e f_e * P_e, where f_e is the share of top-k choices that went to expert
    e and P_e its mean router probability, both over every layer's `tokens` tokens (the
    choices' share sums to top_k; with token weights, `tokens` is their sum)."""
    rows = tokens * len(stats)
    chosen = sum(c for c, _ in stats) / rows
    prob = sum(p for _, p in stats) / rows
    return num_experts * (chosen * prob).sum()
