"""One decoder-only transformer for every supported family, driven by ModelConfig.

    input_ids [B, T] -> embed -> L x [norm -> attention -> + -> norm -> gated MLP -> +] -> norm
      -> logits [B, T, V]   (or, for training, fused linear cross-entropy without full logits)

Module and parameter names mirror Hugging Face's (model.embed_tokens, model.layers.N.self_attn.
q_proj, ..., lm_head), so checkpoints load and export by name. Per-batch work (rope cos/sin,
attention metadata) is done once in `CausalLM.hidden_states` and handed to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import kernels
from ..batch import IGNORE_INDEX, PackedBatch
from ..kernels.embedding import embedding_lookup
from ..lora.layer import LoRALinear
from .activation_store import ActivationStore
from .attention import AttentionMeta, attention
from .config import ModelConfig
from .fused_layer import LayerPlan, LayerRun, fused_unsupported, pack_layer
from .rope import rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, self.offset)


class Attention(nn.Module):
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
        self.window = cfg.window_for_layer(layer_idx)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, cos, sin, meta: AttentionMeta):
        """x: [B, T, H] -> [B, T, H]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = kernels.apply_rope(q, k, cos, sin)
        out = attention(q, k, v, meta, self.window, self.scale)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = LoRALinear(h, i, bias=cfg.mlp_bias)
        self.up_proj = LoRALinear(h, i, bias=cfg.mlp_bias)
        self.down_proj = LoRALinear(i, h, bias=cfg.mlp_bias)
        self.act = cfg.hidden_act

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.act == "silu":
            a = kernels.swiglu(g, u)
        else:  # gelu_pytorch_tanh / gelu
            a = kernels.geglu(g, u, "tanh" if "tanh" in self.act else "none")
        return self.down_proj(a)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None


class CausalLM(nn.Module):
    """The model. `model(input_ids)` -> `.logits` [B, T, V], as transformers' users expect;
    `model.loss_sum(batch)` -> summed next-token loss over a PackedBatch, logits never whole."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        # Per layer: None (autograd keeps every activation) or a LayerPlan (what the layer keeps
        # for backward and where; model/fused_layer.py). `fused` switches the hand-written layer
        # backward off: plans then fall back to torch.utils.checkpoint (keep < 2) or autograd.
        self.layer_plans: list[LayerPlan | None] = [None] * cfg.num_hidden_layers
        self.fused = True
        self.activation_store = ActivationStore()
        self._rope_cache: dict = {}

    # --- structure -------------------------------------------------------------------------
    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_checkpointing(self, enabled: bool | list[bool] = True) -> None:
        """Recompute each layer's activations in backward (True), or per layer with a list."""
        flags = enabled if isinstance(enabled, list) else [enabled] * len(self.layer_plans)
        self.set_layer_plans([LayerPlan(keep=0) if f else None for f in flags])

    def set_layer_plans(self, plans: list[LayerPlan | None]) -> None:
        """Per layer: None (plain autograd) or a LayerPlan (what it keeps for backward, where)."""
        if len(plans) != len(self.layer_plans):
            raise ValueError(f"{len(plans)} layer plans for {len(self.layer_plans)} layers")
        self.layer_plans = list(plans)

    def fused_unsupported(self) -> str | None:
        """Why the fused layer path can't run (None if it can)."""
        for layer in self.model.layers:
            why = fused_unsupported(layer)
            if why:
                return why
        return None

    def pack_projections(self, all_layers: bool = False) -> None:
        """Pack the projection weights of every layer the fused path runs (fused_layer.py:
        packed_weight) now rather than in the first step; nothing for autograd layers. With
        `all_layers`, every layer the fused path supports, whatever its plan (e.g. before
        plans exist, so that memory is measured with the packed layout)."""
        for layer, plan in zip(self.model.layers, self.layer_plans):
            if (self.fused and (plan is not None or all_layers)
                    and fused_unsupported(layer) is None):
                pack_layer(layer)

    def offload_embedding(self) -> bool:
        """Keep the input embedding table in pinned host memory (1 GiB of GPU memory at
        Llama-3.1-8B size); each forward gathers its tokens' rows over the host link
        (kernels/embedding.py). Only for a frozen CUDA table that the output layer does not
        share, and only where the Triton gather runs (without it every lookup would round-trip
        through the host). Returns whether the table moved."""
        w = self.model.embed_tokens.weight
        if self.lm_head is None or w.requires_grad or not w.is_cuda or not kernels.use_triton(w):
            return False
        host = torch.empty(w.shape, dtype=w.dtype, pin_memory=True)
        host.copy_(w.data)
        w.data = host
        return True

    def compile_layers(self, **kwargs) -> None:
        """torch.compile each decoder layer as one region (layers share the compiled code).
        Compiled layers run as modules, so the fused layer path is switched off."""
        self.fused = False
        for layer in self.model.layers:
            layer.compile(**kwargs)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init as transformers does (normal(0, std) linears/embeddings, norms = 1)."""
        g = torch.Generator(device="cpu")
        if seed is not None:
            g.manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0 - self.config.norm_offset)
            elif "lora_" in name:
                continue
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g).mul_(std).to(p.dtype))

    # --- forward ---------------------------------------------------------------------------
    def _rope(self, device, dtype):
        key = (device, dtype)
        if key not in self._rope_cache:
            c = self.config
            inv, scale = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, device=device)
            self._rope_cache = {key: (inv, scale)}
        return self._rope_cache[key]

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      batch: PackedBatch | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, H]."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = embedding_lookup(input_ids, self.model.embed_tokens.weight)  # (table maybe on host)
        inv, scale = self._rope(x.device, x.dtype)
        cos, sin = rope_cos_sin(position_ids, inv, scale, x.dtype)  # once per batch
        windows = {layer.self_attn.window for layer in self.model.layers}
        meta = AttentionMeta.build(
            (B, T), x.device,
            seq_lens=batch.seq_lens if batch is not None else None,
            cu_seqlens=batch.cu_seqlens if batch is not None else None,
            max_seqlen=batch.max_seqlen if batch is not None else T,
            windows=windows, dtype=x.dtype)
        prev = None
        training = torch.is_grad_enabled()
        for layer, plan in zip(self.model.layers, self.layer_plans):
            if plan is None or not training:
                x = layer(x, cos, sin, meta)
            elif self.fused and fused_unsupported(layer) is None:
                prev = LayerRun(layer, cos, sin, meta, plan, self.activation_store, prev)
                x = prev(x)
            elif plan.keep < 2:
                x = checkpoint(layer, x, cos, sin, meta, use_reentrant=False)
            else:
                x = layer(x, cos, sin, meta)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                *, batch: PackedBatch | None = None, labels: torch.Tensor | None = None
                ) -> CausalLMOutput:
        """HF-style call: logits [B, T, V] (and the mean loss if unshifted `labels` are given)."""
        if batch is not None:
            input_ids, position_ids = batch.input_ids, batch.position_ids
        h = self.hidden_states(input_ids, position_ids, batch)
        logits = F.linear(h, self.output_weight())
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=IGNORE_INDEX)
        return CausalLMOutput(logits=logits, loss=loss)

    def loss_sum(self, batch: PackedBatch) -> torch.Tensor:
        """Summed (fp32) next-token loss over the batch's pre-shifted labels."""
        h = self.hidden_states(batch.input_ids, batch.position_ids, batch)
        return kernels.fused_linear_cross_entropy(h.flatten(0, 1), self.output_weight(),
                                                  batch.labels.flatten())

