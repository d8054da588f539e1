"""The layers of the one decoder-only transformer: RMSNorm, Attention, MLP, DecoderLayer (whose
MLP is a MoEBlock, model/moe.py, in the sparse layers of mixture-of-experts families).

Shapes: x [B, T, H] (H = hidden_size); q [B, T, Hq, D], k/v [B, T, Hk, D] (D = head_dim).
Module and parameter names mirror Hugging Face's (self_attn.q_proj, mlp.gate_proj, ...), so
checkpoints load and export by name. The projections are LoRALinear: a frozen (or trainable)
base weight plus an optional LoRA adapter.

A DecoderLayer runs plainly (autograd) unless an executor is set on it: the engine
(leantune.engine) hands each layer one, which runs the same math with a hand-written backward
and keeps only what its plan says. The model itself never imports the engine.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import kernels
from ..lora.layer import LoRALinear
from .attention import AttentionMeta, attention
from .config import ModelConfig
from .moe import MoEBlock


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * (offset + w) over the last dim (offset 1: Gemma)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, self.offset)


class Attention(nn.Module):
    """q/k/v projections (bias: Qwen2), per-head q/k RMSNorm (Qwen3), RoPE, causal attention
    within documents (sliding window: Mistral; sinks [Hq]: gpt-oss), o projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        h = cfg.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = LoRALinear(h, cfg.q_size, bias=cfg.attention_bias)
        self.k_proj = LoRALinear(h, cfg.kv_size, bias=cfg.attention_bias)
        self.v_proj = LoRALinear(h, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = LoRALinear(cfg.q_size, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = (nn.Parameter(torch.empty(cfg.num_attention_heads))
                      if cfg.attention_sinks else None)
        self.window = cfg.window_for_layer(layer_idx)
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.softcap = cfg.attn_softcap  # Gemma 2: scores -> c tanh(scores / c)
        self.rotary_dim = cfg.rotary_dim  # partial rotary: RoPE on the first dims only
        self.layer_idx = layer_idx  # which buffers of a KV cache are this layer's

    def forward(self, x, cos, sin, meta: AttentionMeta):
        """x: [B, T, H], cos/sin: [B, T, D] -> [B, T, H]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim is None:
            q, k = kernels.apply_rope(q, k, cos, sin)
        else:  # (cos/sin are [B, T, rotary_dim])
            r = self.rotary_dim
            qr, kr = kernels.apply_rope(q[..., :r], k[..., :r], cos, sin)
            q, k = torch.cat([qr, q[..., r:]], -1), torch.cat([kr, k[..., r:]], -1)
        if meta.kv_cache is not None:  # generation: keep the new k/v, attend over all cached
            k, v = meta.kv_cache.update(self.layer_idx, k, v)
        out = attention(q, k, v, meta, self.window, self.scale, self.sinks, self.softcap)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act = SiLU (SwiGLU) or GELU (GeGLU)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = LoRALinear(h, i, bias=cfg.mlp_bias)
        self.up_proj = LoRALinear(h, i, bias=cfg.mlp_bias)
        self.down_proj = LoRALinear(i, h, bias=cfg.mlp_bias)
        self.act = kernels.act_code(cfg.hidden_act)  # (ModelConfig checks that there is one)

    def forward(self, x):
        return self.down_proj(kernels.glu(self.gate_proj(x), self.up_proj(x), self.act))


class DecoderLayer(nn.Module):
    """x -> h = x + attn_out(attn(attn_in(x))) -> h + mlp_out(mlp(mlp_in(h))); mlp: MLP, or
    MoEBlock in a sparse layer. The norms are described by role (model/families.py Norms): each
    is the module of its checkpoint name (Llama's post_attention_layernorm is its mlp_in,
    Gemma's its attn_out); the "out" norms are optional (None: identity).

    `executor`: None (plain autograd), or an object the engine sets, called as
    executor(layer, x, cos, sin, meta) while gradients are recorded; it computes the same
    output and owns what is kept for backward. It is called inside `forward`, so module hooks
    (FSDP2's unshard, for one) fire around it as around the plain path."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm_roles = cfg.norms
        names = dict(cfg.norms.items())
        for role in ("attn_in", "attn_out"):
            if role in names:
                self.add_module(names[role], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                     cfg.norm_offset))
        self.self_attn = Attention(cfg, layer_idx)
        for role in ("mlp_in", "mlp_out"):
            if role in names and names[role] not in self._modules:
                self.add_module(names[role], RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                     cfg.norm_offset))
        self.mlp = MoEBlock(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)
        self.rope_key = cfg.rope_key(layer_idx)  # which of the batch's RoPE tables it reads
        self.executor = None

    def norm(self, role: str) -> RMSNorm | None:
        """The norm playing `role` ("attn_in", "attn_out", "mlp_in", "mlp_out"), or None."""
        name = getattr(self.norm_roles, role)
        return None if name is None else getattr(self, name)

    def forward(self, x, cos, sin, meta: AttentionMeta):
        """x: [B, T, H] -> [B, T, H]."""
        if self.executor is not None and torch.is_grad_enabled():
            return self.executor(self, x, cos, sin, meta)
        return self.plain_forward(x, cos, sin, meta)

    def plain_forward(self, x, cos, sin, meta: AttentionMeta):
        """The layer's math under autograd (also what an executor may recompute through)."""
        a = self.self_attn(self.norm("attn_in")(x), cos, sin, meta)
        out_norm = self.norm("attn_out")
        x = x + (a if out_norm is None else out_norm(a))
        m = self.mlp(self.norm("mlp_in")(x))
        out_norm = self.norm("mlp_out")
        return x + (m if out_norm is None else out_norm(m))
