"""The one decoder-only transformer for every supported family, driven by ModelConfig.

    input_ids [B, T] -> embed -> L x DecoderLayer -> norm -> logits [B, T, V]
    (training: the summed next-token loss through the fused linear cross-entropy; logits are
    never materialised whole)

Per-batch work (RoPE cos/sin, attention metadata) is done once in `CausalLM.hidden_states` and
handed to every layer. Mixture-of-experts models can also return the router's load-balancing
loss (`router_aux_loss`). Parameter names mirror Hugging Face's (model.embed_tokens,
model.layers.N...., lm_head), so checkpoints load and export by name.
"""

from __future__ import annotations

import os

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import kernels
from ..batch import IGNORE_INDEX, PackedBatch
from ..kernels.embedding import embedding_lookup
from .attention import AttentionMeta
from .config import ModelConfig
from .layers import DecoderLayer, RMSNorm
from .moe import MoEBlock, load_balancing_loss
from .rope import longrope_original, rope_cos_sin, rope_inv_freq


def _shared_kv(batch: PackedBatch | None) -> dict:
    """A shared-prompt batch's key segments for AttentionMeta.build (empty for any other)."""
    if batch is None or getattr(batch, "kv_index", None) is None:
        return {}
    return {"kv_index": batch.kv_index, "cu_seqlens_k": batch.cu_seqlens_k,
            "max_seqlen_k": batch.max_seqlen_k, "seq_lens_k": batch.seq_lens_k}


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None = None    # [B, T, V]
    loss: torch.Tensor | None = None      # mean next-token loss (with `labels`)
    loss_sum: torch.Tensor | None = None  # summed fp32 next-token loss over a PackedBatch
    aux_loss: torch.Tensor | None = None  # MoE load-balancing loss (with `router_aux_loss`)
    token_logps: torch.Tensor | None = None  # [B*T] fp32 log p(label) per token (`token_logps`)
    # [N_t] fp32 log p(target) per entry of the batch's target list (`token_logps` on a batch
    # with target_ids: shared prompts; token_logps is None then)
    target_logps: torch.Tensor | None = None


class CausalLM(nn.Module):
    """The model. `model(input_ids)` -> `.logits` [B, T, V], as transformers' users expect;
    `model(batch=packed, loss_only=True)` -> `.loss_sum`, the training loss;
    `model(batch=packed, token_logps=True)` -> `.token_logps` [B*T], per-token log-probs of the
    labels (the preference objectives)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        # None: each batch's attention path is chosen by AttentionMeta.build; tests and
        # benchmarks may force "varlen", "causal" or "mask"
        self.attention_path: str | None = None
        # bytes of logits the fused cross-entropy computes at a time (None: its default); the
        # trainer lowers it where memory is short
        self.loss_chunk_bytes: int | None = None
        # the head on the target rows only (_head_rows); off: on every token
        self.head_target_rows = os.environ.get("LEANTUNE_HEAD_TARGET_ROWS", "1") != "0"
        self._router_aux_loss = False
        self._rope_cache: dict = {}

    @property
    def router_aux_loss(self) -> bool:
        """MoE: forward also returns the router's load-balancing loss as `aux_loss`, over all
        tokens of the batch (padding included, as transformers without an attention mask).
        Setting it marks the MoE blocks at once, so executors chosen afterwards see it."""
        return self._router_aux_loss

    @router_aux_loss.setter
    def router_aux_loss(self, on: bool) -> None:
        self._router_aux_loss = bool(on)
        for layer in self.layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.record_router_stats = self._router_aux_loss

    # --- structure -------------------------------------------------------------------------
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

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

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Random init as transformers does (normal(0, std) linears/embeddings, norms = 1)."""
        g = torch.Generator(device="cpu")
        if seed is not None:
            g.manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.fill_(1.0 - self.config.norm_offset)
            elif "lora_" in name:
                continue
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g).mul_(std).to(p.dtype))

    # --- forward ---------------------------------------------------------------------------
    def _rope(self, device) -> dict:
        """{rope key: (inverse frequencies, attention scaling)}: one table per layer type with
        per-layer-type RoPE (Gemma 3), else one ("default"); over the rotated dims only."""
        if device not in self._rope_cache:
            c = self.config
            dim = c.rotary_dim or c.head_dim
            params = c.layer_rope or {"default": (c.rope_theta, c.rope_scaling)}
            self._rope_cache = {device: {
                key: (*rope_inv_freq(dim, theta, scaling, device=device,
                                     max_positions=c.max_position_embeddings),
                      longrope_original(scaling))
                for key, (theta, scaling) in params.items()}}
        return self._rope_cache[device]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> [B, T, H]; times sqrt(H) in the table's dtype (Gemma)."""
        x = embedding_lookup(input_ids, self.model.embed_tokens.weight)  # (table maybe on host)
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states [..., H] -> logits [..., V] (soft-capped: Gemma 2)."""
        logits = F.linear(h, self.output_weight())
        cap = self.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      batch: PackedBatch | None = None,
                      meta: AttentionMeta | None = None) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, H]. `meta`: attention metadata
        built by the caller (generation's KV cache); by default built here for the batch."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids)
        tables = {key: rope_cos_sin(position_ids, inv, scale, x.dtype, long_from)  # once per
                  for key, (inv, scale, long_from) in self._rope(x.device).items()}  # batch, type
        if meta is None:
            meta = AttentionMeta.build(
                (B, T), x.device,
                seq_lens=batch.seq_lens if batch is not None else None,
                cu_seqlens=batch.cu_seqlens if batch is not None else None,
                max_seqlen=batch.max_seqlen if batch is not None else T,
                windows={layer.self_attn.window for layer in self.layers}, dtype=x.dtype,
                path=self.attention_path, **_shared_kv(batch))
        for layer in self.layers:
            x = layer(x, *tables[layer.rope_key], meta)
        return self.model.norm(x)

    def forward(self, input_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, batch: PackedBatch | None = None,
                labels: torch.Tensor | None = None, loss_only: bool = False,
                token_logps: bool = False) -> CausalLMOutput:
        """HF-style call: logits [B, T, V] (and the mean loss if unshifted `labels` are given).

        With a PackedBatch (`batch`) and `loss_only`: only `loss_sum`, the summed fp32
        next-token loss over batch.labels (pre-shifted per document), through the fused linear
        cross-entropy. Training calls the model this way, so DDP and FSDP2, which wrap
        `forward`, see the whole step.

        With a PackedBatch and `token_logps`: only `token_logps` [B*T] fp32, log p(labels[b, t])
        per token (0 where the label is IGNORE_INDEX), through `kernels.token_logprobs`: chunked
        over rows on the Triton path (no [tokens, vocab] tensor), with a per-token backward.
        A batch with an explicit target list (batch.target_ids: shared prompts, where a row
        predicts two targets) gives `target_logps` [N_t] instead, one per entry."""
        if batch is not None:
            input_ids, position_ids = batch.input_ids, batch.position_ids
        h, aux = self._hidden_states_and_aux(input_ids, position_ids, batch)
        if loss_only:
            if batch is None:
                raise ValueError("loss_only needs a PackedBatch (its labels are pre-shifted)")
            return CausalLMOutput(loss_sum=kernels.fused_linear_cross_entropy(
                h.flatten(0, 1), self.output_weight(), batch.labels.flatten(),
                softcap=self.config.final_softcap, chunk_bytes=self.loss_chunk_bytes),
                aux_loss=aux)
        if token_logps:
            if batch is None:
                raise ValueError("token_logps needs a PackedBatch (its labels are pre-shifted)")
            if batch.target_ids is not None:  # the target list: rows may repeat
                rows = batch.target_rows.to(h.device, non_blocking=True)
                return CausalLMOutput(target_logps=kernels.token_logprobs(
                    h.flatten(0, 1).index_select(0, rows), self.output_weight(),
                    batch.target_ids.to(h.device, non_blocking=True),
                    softcap=self.config.final_softcap, chunk_bytes=self.loss_chunk_bytes),
                    aux_loss=aux)
            h2, labels2, rows = self._head_rows(h, batch)
            logp = kernels.token_logprobs(h2, self.output_weight(), labels2,
                                          softcap=self.config.final_softcap,
                                          chunk_bytes=self.loss_chunk_bytes)
            if rows is not None:  # back onto every token, 0 off the targets
                logp = logp.new_zeros(h.shape[0] * h.shape[1]).index_put((rows,), logp)
            return CausalLMOutput(token_logps=logp, aux_loss=aux)
        logits = self.logits(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=IGNORE_INDEX)
        return CausalLMOutput(logits=logits, loss=loss, aux_loss=aux)

    def _head_rows(self, h: torch.Tensor, batch: PackedBatch):
        """(hidden [R, H], labels [R], rows [R] or None) the token log-prob head runs on: the
        batch's target rows where it knows them (PackedBatch.target_rows) and they are some but
        not all B*T tokens, else every token (rows None). Each row's log-prob is its own, so
        the sums are the same; `head_target_rows` (LEANTUNE_HEAD_TARGET_ROWS=0) switches it
        off. (The SFT loss keeps every row: a row subset changes the GEMM's blocking, ~1e-7 in
        fp32, and SFT's CPU curve stays bit-identical to the recorded one.)"""
        flat, labels = h.flatten(0, 1), batch.labels.flatten()
        rows = batch.target_rows
        if (not self.head_target_rows or rows is None
                or rows.numel() in (0, labels.numel())):
            return flat, labels, None
        rows = rows.to(h.device, non_blocking=True)
        return flat.index_select(0, rows), labels.index_select(0, rows), rows

    def _hidden_states_and_aux(self, input_ids, position_ids, batch):
        """hidden_states, and the load-balancing loss when `router_aux_loss` is on (else None).
        The MoE blocks compute their router statistics in every pass while it is on (so a
        recompute in backward runs the same ops) and hand them over only in this forward."""
        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]
        for b in blocks:
            b.record_router_stats = self.router_aux_loss
        if not (self.router_aux_loss and blocks):
            return self.hidden_states(input_ids, position_ids, batch), None
        weights = getattr(batch, "token_weights", None)  # (PackedBatch.token_weights)
        flat = None if weights is None else weights.reshape(-1)
        for b in blocks:
            b.router_stats, b.router_weights = [], flat
        try:
            h = self.hidden_states(input_ids, position_ids, batch)
            stats = [s for b in blocks for s in b.router_stats]
        finally:
            for b in blocks:
                b.router_stats = b.router_weights = None
        # (a batch of padding alone: no statistics, a zero loss rather than 0 / 0)
        tokens = input_ids.numel() if flat is None else flat.sum().clamp_min(1.0)
        return h, load_balancing_loss(stats, tokens, self.config.moe.num_experts)

    def forward_cached(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       meta: AttentionMeta) -> torch.Tensor:
        """Generation: the logits [B, V] of each row's last token, for new tokens input_ids
        [B, T] at position_ids [B, T]. `meta` (path "cache") carries the KV cache: every layer
        writes the new keys/values into it and attends over what it holds
        (leantune.generate: T = the prompts at once, then 1 token per step)."""
        h = self.hidden_states(input_ids, position_ids, meta=meta)
        return self.logits(h[:, -1])

    def loss_sum(self, batch: PackedBatch) -> torch.Tensor:
        """Summed (fp32) next-token loss over the batch's pre-shifted labels (through forward)."""
        return self(batch=batch, loss_only=True).loss_sum
