"""Layer executors: how a DecoderLayer runs while gradients are recorded.

`FusedExecutor` runs the layer as one autograd node with a hand-written backward (selective
recompute and offloaded activations for LoRA training): forward runs without building a graph
and keeps only what the layer's `LayerPlan` asks for; backward recomputes the rest and
back-propagates by hand through our kernels (RMSNorm, q/k norm + RoPE, GLU), cuBLAS and flash
or cuDNN attention. Per layer, with x: [N, H] (N = B*T tokens),
h_mid = x + attn(norm1(x)), out = h_mid + mlp(norm2(h_mid)) (Gemma: the attention's and the
MLP's outputs normed too, their inputs rebuilt in backward for those norms), the keep levels
(`Keep`):

    INPUT       x                                    backward recomputes norm1, q/k/v, q/k
                                                     norm and RoPE, attention, o, norm2, gate/up
    ATTENTION   x, h_mid, q/k/v, attention output    backward recomputes norm1, norm2, gate/up
                (+ its softmax statistics)           (and, off the flash and cuDNN paths, attention)
    ALL         ATTENTION + gate and up              backward recomputes the norms (the activation
                                                     comes out of the GLU backward)

What each level keeps, and its bytes, is `Kept` below (the planner asks `FusedExecutor` for
them). From ATTENTION up a plan may leave q/k/v out (LayerPlan.keep_qkv=False: backward projects
them again from the rebuilt norm1 output, bit for bit), for offloaded layers whose copies the
host link cannot carry in time. The down projection is never recomputed (its output is not
needed in backward), nor, from ATTENTION up, the o projection. Kept tensors stay on the GPU or, with `offload`, are copied
to pinned host memory on a side stream as soon as they exist and copied back one layer ahead
during backward (engine/activation_store.py). The MLP runs over row chunks when its
[rows, intermediate] tensors would be large, so its working set stays small.

Gradients: LoRA A/B only (engine/projections.py), accumulated in the adapters' dtype (fp32
masters in the Trainer); base weights and norms are frozen. Kept tensors are let go as soon as
backward is done with them (gate/up after the MLP), not when the layer ends.

On an FP8 base whose GEMMs run on cuBLAS, the norms before q/k/v and gate/up and the GLU
before down write their output's e4m3 codes as they write it, in forward and in recompute
(`_normed`, `_down_input`; ProjectionGroup.quantized_input), so those GEMMs run no quantisation
pass of their own (LEANTUNE_FP8_FUSED_QUANT=0: they do; the results are bit-identical). In
backward likewise kernels/qkv_grad.py writes d q | d k | d v's codes for q/k/v's
input-gradient GEMM (ProjectionGroup.quantized_grad, EngineOptions.fuse_grad_quant;
bit-identical too). Where
gate/up's LoRA is not inside their GEMM (FP8, unpacked), the GLU kernels add its low-rank terms,
and the GLU backward the down projection's dX term (`_gate_up`, EngineOptions.fuse_glu_lora): a
kept gate | up is then the GEMM's output without them.

`CheckpointExecutor` is the autograd path's recompute (torch.utils.checkpoint around the
layer's plain forward), for layers the fused path cannot take (`fused_unsupported`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch
from torch.utils.checkpoint import checkpoint

from ..kernels.qk_norm_rope import qk_norm_rope_bwd_, qk_norm_rope_fwd
from ..kernels.qkv_grad import qkv_grad, quantizable
from ..kernels.rmsnorm import rms_norm_bwd, rms_norm_fwd
from ..kernels.rope import rope_
from ..kernels.swiglu import MAX_LORA_RANK, glu_bwd_, glu_fwd
from ..model.attention import AttentionMeta
from ..model.moe import MoEBlock
from .activation_store import ActivationStore
from .attention import AttentionBackend
from .options import EngineOptions
from .projections import ProjectionGroup
from .weights import DenseWeights, layer_groups


class Keep(enum.IntEnum):
    """What a layer keeps for backward (module docstring); ordered: more keeps more."""

    INPUT = 0
    ATTENTION = 1
    ALL = 2


@dataclass(frozen=True)
class LayerPlan:
    """What one layer keeps for backward and where (offload: in pinned host memory).

    keep_qkv=False (from ATTENTION up): q/k/v are not kept; backward projects them again from
    the rebuilt norm1 output (one GEMM and RoPE a layer, bit-identical to the forward's). For
    offloaded layers where the host link, not the GPU, bounds the forward: a third less to copy
    (Llama-3.1-8B: 12,336 instead of 18,480 values a token)."""

    keep: Keep = Keep.INPUT
    offload: bool = False
    keep_qkv: bool = True

    def __post_init__(self):
        object.__setattr__(self, "keep", Keep(self.keep))  # a bare 0/1/2 becomes its level


@dataclass
class Kept:
    """The tensors one layer keeps for backward (N tokens, H hidden, D head_dim, I intermediate,
    R = LoRA ranks of the group; the compute dtype unless noted):

        x        [N, H]                layer input                                  every level
        h_mid    [N, H]                x + attention's o projection                 ATTENTION+
        qkv      [N, (Hq + 2 Hk) D]    q, k (rotated; before the q/k norm where the layer has
                                       one: it is redone in backward) and v          ATTENTION+
        attn     [N, Hq D]             attention output                             ATTENTION+
        attn_state                     its softmax statistics, fp32 [Hq, N]: stays
                                       on the GPU (small), None off flash/cuDNN      ATTENTION+
        xa_qkv, xa_gu, xa_down [N, R]  LoRA input products x A^T of each packed
                                       group (packed with LoRA columns only)         ATTENTION+
        gu       [N, 2 I]              gate | up projections                        ALL
    """

    x: torch.Tensor
    h_mid: torch.Tensor | None = None
    qkv: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    attn_state: object = None
    xa_qkv: torch.Tensor | None = None
    xa_gu: torch.Tensor | None = None
    xa_down: torch.Tensor | None = None
    gu: torch.Tensor | None = None

    @staticmethod
    def bytes_per_token(cfg, keep: Keep, itemsize: int = 2, lora_ranks: int = 0,
                        keep_qkv: bool = True) -> int:
        """Bytes per token the fields above hold at `keep` (lora_ranks: the LoRA columns of the
        three packed groups together; the attention statistics count at 4 bytes per q head;
        keep_qkv=False: without qkv, LayerPlan). A MoE layer's gate | up are its routed rows'
        ([M, 2 I], M = k N): 2 mlp_width a token."""
        values = cfg.hidden_size
        extra = 0
        if keep >= Keep.ATTENTION:
            values += cfg.hidden_size + 2 * cfg.q_size + 2 * cfg.kv_size + lora_ranks
            if not keep_qkv:
                values -= cfg.q_size + 2 * cfg.kv_size
            extra = AttentionBackend.state_bytes_per_token(cfg.num_attention_heads)
        if keep >= Keep.ALL:
            values += 2 * cfg.mlp_width
        return itemsize * values + extra


def _autocast_on() -> bool:
    try:
        return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled()


# The parts of a layer the fused path runs: its modules by role, and the attention's own parts
# (a part not listed here, e.g. a norm a new family adds, keeps the layer off the fused path)
FUSED_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}
FUSED_NORM_ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out")


def structure_unsupported(layer) -> str | None:
    """Why the structure of `layer` is not one the fused executor runs (None if it is): every
    child module must be a part it knows by role (the attn_in and mlp_in norms, attention's
    projections and q/k norms, the MLP or MoE block), and the layer must not need what it does
    not do (attention-out / MLP-out norms, soft-capping, partial rotary)."""
    roles = layer.norm_roles
    known = {getattr(roles, r) for r in FUSED_NORM_ROLES} | {"self_attn", "mlp"}
    for name, _ in layer.named_children():
        if name not in known:
            return f"layer part {name!r}, which the fused executor does not run"
    at = layer.self_attn
    for name, _ in at.named_children():
        if name not in FUSED_ATTENTION_PARTS:
            return f"attention part {name!r}, which the fused executor does not run"
    if isinstance(layer.mlp, MoEBlock) and (roles.attn_out or roles.mlp_out):
        return "a mixture-of-experts layer with output norms"
    if getattr(at, "softcap", None) and at.sinks is not None:
        return "attention soft-capping with sinks"
    if getattr(at, "rotary_dim", None) is not None and at.q_norm is not None:
        return "partial rotary with q/k norms"
    return None


def fused_unsupported(layer) -> str | None:
    """Why `layer` can't take the fused path (None if it can)."""
    why = structure_unsupported(layer)
    if why:
        return why
    if isinstance(layer.mlp, MoEBlock):
        from .moe_layer import moe_unsupported

        why = moe_unsupported(layer)
        if why:
            return why
    if _autocast_on():
        return "torch.autocast"
    for name, p in layer.named_parameters():
        if "lora_" not in name and p.requires_grad:
            return f"trainable base weight {name}"
    for mods in layer_groups(layer):
        for proj in mods:
            if proj.has_lora and not isinstance(proj.lora_dropout, torch.nn.Identity):
                return "LoRA dropout"
    return None


def lora_params(layer) -> list[torch.nn.Parameter]:
    """The layer's trainable LoRA weights, in the order the fused Function takes them."""
    out = []
    for mods in layer_groups(layer):
        for proj in mods:
            if proj.has_lora:
                out += [proj.lora_A.weight, proj.lora_B.weight]
    experts = getattr(layer.mlp, "experts", None)  # a MoE layer's expert LoRA
    if experts is not None and experts.has_lora:
        for name in experts.PROJECTIONS:
            out += [experts.lora_A[name], experts.lora_B[name]]
    return [p for p in out if p.requires_grad]


def has_expert_lora(model) -> bool:
    """Whether any MoE layer of `model` carries LoRA on its experts."""
    return any(getattr(getattr(layer.mlp, "experts", None), "has_lora", False)
               for layer in model.layers)


def lora_ranks(layer) -> int:
    """LoRA columns of the layer's packed groups (q/k/v, gate/up, down; a MoE layer: q/k/v)
    together."""
    qkv, _, gu, down = layer_groups(layer)
    return sum(m.r for m in (*qkv, *gu, *down) if m.has_lora)


class FusedExecutor:
    """Runs a layer by hand with `plan` (module docstring). Shared by every layer of a model:
    the store, the weight provider and the attention backend (engine/__init__.Engine)."""

    kind = "fused"

    def __init__(self, plan: LayerPlan, store: ActivationStore, weights: DenseWeights,
                 attention: AttentionBackend, options: EngineOptions):
        self.plan, self.store, self.weights = plan, store, weights
        self.attention, self.options = attention, options
        self.stream = None  # the engine's WeightStream where base weights stream from the host

    def __call__(self, layer, x, cos, sin, meta: AttentionMeta) -> torch.Tensor:
        if isinstance(layer.mlp, MoEBlock):
            from .moe_layer import MoELayerRun

            return MoELayerRun(self, layer, cos, sin, meta)(x)
        return _LayerRun(self, layer, cos, sin, meta)(x)

    # --- what the planner asks ---------------------------------------------------------------
    @staticmethod
    def kept_bytes(cfg, tokens: int, keep: Keep, itemsize: int = 2, lora_ranks: int = 0,
                   keep_qkv: bool = True) -> int:
        """GPU (or host) bytes one layer keeps for backward at `keep` (keep_qkv: LayerPlan)."""
        return tokens * Kept.bytes_per_token(cfg, keep, itemsize, lora_ranks, keep_qkv)

    @staticmethod
    def qkv_flops(cfg, tokens: int) -> float:
        """Matmul FLOPs of one layer's q/k/v projection over `tokens` tokens (what a layer with
        keep_qkv=False spends again in backward)."""
        return 2.0 * tokens * cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size)

    @staticmethod
    def rebuilt_bytes(cfg, tokens: int, itemsize: int = 2, lora_ranks: int = 0) -> int:
        """What backward holds of a layer that kept less than its attention state: it rebuilds
        that state first (ATTENTION's bytes)."""
        return FusedExecutor.kept_bytes(cfg, tokens, Keep.ATTENTION, itemsize, lora_ranks)

    @staticmethod
    def mlp_chunk_bytes(cfg, tokens: int, options: EngineOptions, itemsize: int = 2,
                        forward: bool = False, expert_lora: bool = False) -> int:
        """The MLP row chunk's working bytes: in backward gate | up and the down projection's
        input gradient, in forward gate | up and the down projection's input (chunks
        mlp_forward_chunk_factor times larger). A MoE layer's block runs whole: its working set
        (engine/moe_layer.py; `expert_lora`: with LoRA on the experts), or a dense layer's
        chunk where larger."""
        if cfg.moe is not None:
            from .moe_layer import moe_working_bytes

            dense = FusedExecutor.mlp_chunk_bytes(replace(cfg, moe=None), tokens, options,
                                                  itemsize, forward) if cfg.moe.dense_layers else 0
            return max(dense, moe_working_bytes(cfg, tokens, itemsize, expert_lora))
        one = tokens * cfg.intermediate_size * itemsize  # one [tokens, intermediate] tensor
        limit = options.mlp_chunk_bytes * (options.mlp_forward_chunk_factor if forward else 1)
        return 3 * min(one, int(limit))

    @staticmethod
    def qk_norm_bytes(cfg, tokens: int, itemsize: int = 2) -> int:
        """Layers with a q/k norm hold normed, rotated copies of q and k while attention runs
        (forward, and backward where it is redone)."""
        return tokens * itemsize * (cfg.q_size + cfg.kv_size) if cfg.qk_norm else 0

    @staticmethod
    def forward_flops(cfg, tokens: int) -> float:
        """Matmul FLOPs of one layer's forward over `tokens` tokens (projections only)."""
        if cfg.moe is not None:
            from .moe_layer import moe_forward_flops

            return moe_forward_flops(cfg, tokens)
        h, i = cfg.hidden_size, cfg.intermediate_size
        return 2.0 * tokens * (h * (2 * cfg.q_size + 2 * cfg.kv_size) + 3 * h * i)


class _LayerRun:
    """One layer's forward/backward within one model forward (made per call, dropped after its
    backward)."""

    def __init__(self, ex: FusedExecutor, layer, cos, sin, meta: AttentionMeta):
        self.ex, self.layer, self.cos, self.sin, self.meta = ex, layer, cos, sin, meta
        self.plan = ex.plan
        self.handle = None
        self.params = lora_params(layer)
        self.in_graph = True  # whether autograd will call backward (set per call)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # Without a trainable input or weight autograd never calls this layer's backward (e.g.
        # lower layers frozen): keep nothing, so no tensors are held, offloaded or prefetched for
        # a backward that never comes (a prefetch never waited for would free its GPU buffers
        # while the side stream still writes them).
        self.in_graph = torch.is_grad_enabled() and (x.requires_grad or bool(self.params))
        return _FusedLayerFunction.apply(x, self, *self.params)

    # --- pieces ------------------------------------------------------------------------------
    def _groups(self, dtype):
        qkv, o, gu, down = layer_groups(self.layer)
        w = self.ex.weights
        # o stays unpacked: its input comes from attention, which writes its own buffer
        self.qkv = ProjectionGroup(qkv, dtype, w, pack=True)
        self.o = ProjectionGroup(o, dtype, w, pack=False)
        self.gu = ProjectionGroup(gu, dtype, w, pack=True)
        self.down = ProjectionGroup(down, dtype, w, pack=True)
        self.act = self.layer.mlp.act
        # gate/up's LoRA where it is not inside their GEMM (an FP8 base; unpacked): added in the
        # GLU kernels instead of two passes over gate | up (EngineOptions.fuse_glu_lora)
        fuse = self.ex.options.fuse_glu_lora
        self.fuse_glu = fuse and self.gu.takes_glu_terms and self.gu.R <= MAX_LORA_RANK
        # and the down projection's dX LoRA term in the GLU backward (glu_bwd_'s dy_lora)
        self.fuse_dx = fuse and self.down.a is not None and self.down.R <= MAX_LORA_RANK
        self._glu_terms = None  # (made when first needed in forward and in backward)

    def _drop_groups(self):
        self.qkv = self.o = self.gu = self.down = self._glu_terms = None
        self.fuse_glu = self.fuse_dx = False

    def _terms(self):
        """gate/up's low-rank terms for the GLU kernels (ProjectionGroup.glu_terms), made on
        first use in forward and again in backward: not held between them (2 x [I, R] a layer
        for every layer of the step)."""
        if self._glu_terms is None:
            self._glu_terms = self.gu.glu_terms()
        return self._glu_terms

    def _normed(self, norm, x2: torch.Tensor, group: ProjectionGroup,
                xa: torch.Tensor | None = None, quantize: bool = False):
        """norm(x2) in a new input buffer of `group`, x A^T filled in (computed, or copied from
        `xa` kept by the forward) -> (X, rstd, xq). With `quantize` (X goes to the group's
        GEMMs next), where those GEMMs would quantise X (the cuBLAS FP8 path), the norm
        kernel writes X's e4m3 codes too: xq (ProjectionGroup.quantized_input, for project),
        else None."""
        X = group.new_input(x2.shape[0], x2)
        xq = group.quantized_input(X) if quantize else None
        _, rstd = rms_norm_fwd(x2, norm.weight, norm.eps, norm.offset, out=X[:, :x2.shape[1]],
                               quant=None if xq is None else xq.targets)
        group.fill_lora(X, xa)
        return X, rstd, xq

    def _split_qkv(self, qkv: torch.Tensor, shape):
        """[N, (Hq + 2 Hk) D] -> q [B, T, Hq, D], k, v [B, T, Hk, D] (views)."""
        B, T, _ = shape
        at = self.layer.self_attn
        q, k, v = self.qkv.split(qkv)
        return (q.view(B, T, at.num_heads, at.head_dim),
                k.view(B, T, at.num_kv_heads, at.head_dim),
                v.view(B, T, at.num_kv_heads, at.head_dim))

    def _rotated(self, qkv: torch.Tensor, shape, in_place: bool):
        """q, k as attention reads them (q/k norm where the layer has one, then RoPE) and v.
        Without a q/k norm q and k rotate in place (when `in_place`: qkv is then the kept
        rotated form); with one, the normed and rotated q, k are a new buffer and qkv keeps
        the raw projections."""
        q4, k4, v4 = self._split_qkv(qkv, shape)
        at = self.layer.self_attn
        if at.q_norm is not None:
            q4, k4 = qk_norm_rope_fwd(q4, k4, at.q_norm.weight, at.k_norm.weight,
                                      at.q_norm.eps, at.q_norm.offset, self.cos, self.sin)
        elif in_place:
            rope_(*self._rotary(q4, k4), self.cos, self.sin)
        return q4, k4, v4

    def _rotary(self, q4, k4):
        """The rotated dims of q and k: all, or the first rotary_dim (partial rotary, Phi-4-mini:
        views, rotated in place; cos/sin are that wide)."""
        r = self.layer.self_attn.rotary_dim
        return (q4, k4) if r is None else (q4[..., :r], k4[..., :r])

    def _attention(self, x2, shape, for_backward: bool = False):
        """norm1 -> q, k, v -> (q/k norm) -> RoPE -> attention.
        Returns X1, rstd1, qkv, (q4, k4, v4) as attention read them, out4, attention state."""
        at = self.layer.self_attn
        X1, rstd1, xq1 = self._normed(self.layer.norm("attn_in"), x2, self.qkv, quantize=True)
        qkv = self.qkv.project(X1, xq=xq1)
        del xq1
        q4, k4, v4 = self._rotated(qkv, shape, in_place=True)
        out4, state = self.ex.attention.forward(q4, k4, v4, self.meta, at.window, at.scale,
                                                for_backward, sinks=at.sinks,
                                                softcap=at.softcap)
        return X1, rstd1, qkv, (q4, k4, v4), out4, state

    def _o_residual(self, attn2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """h_mid = x + o(attn), or x + attn_out(o(attn)) with an attention-out norm (Gemma)."""
        norm = self.layer.norm("attn_out")
        if norm is None:
            return self.o.project(attn2, resid=x2)
        y, _ = rms_norm_fwd(self.o.project(attn2), norm.weight, norm.eps, norm.offset)
        return y.add_(x2)

    def _through_out_norm(self, role: str, y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        """d y from d norm(y) for the "out" norm of `role` (rstd recomputed from y)."""
        norm = self.layer.norm(role)
        _, rstd = rms_norm_fwd(y, norm.weight, norm.eps, norm.offset)
        return rms_norm_bwd(dy.contiguous(), y, norm.weight, rstd, norm.offset)

    def _gate_up(self, X2: torch.Tensor, xq=None):
        """gate | up [n, 2 I] for rows X2 of the gate/up input -> (gu, lora): with glu_terms,
        gu without the LoRA terms and lora = (x A^T, bg, bu) for the GLU kernels to add them;
        else gu with them and None."""
        if not self.fuse_glu:
            return self.gu.project(X2, xq=xq), None
        return self.gu.project(X2, xq=xq, lora=False), self._glu_lora(X2)

    def _glu_lora(self, X2: torch.Tensor):
        """The GLU kernels' `lora` for rows X2 of the gate/up input (None without glu_terms)."""
        return (self.gu.lora_x(X2), *self._terms()) if self.fuse_glu else None

    def _down_input(self, gu: torch.Tensor, lora=None):
        """act(gate) * up for gate | up `gu` [n, 2 I] (with `lora`: _gate_up's, its terms added
        in the kernel) in a new input buffer of the down group, x A^T filled in -> (Hb, xq): xq
        as _normed's (the GLU kernel writes the codes)."""
        inter = self.layer.mlp.up_proj.out_features
        Hb = self.down.new_input(gu.shape[0], gu)
        xq = self.down.quantized_input(Hb)
        glu_fwd(gu[:, :inter], gu[:, inter:], self.act, out=Hb[:, :inter],
                quant=None if xq is None else xq.targets, lora=lora)
        self.down.fill_lora(Hb)
        return Hb, xq

    def _down_out(self, gu: torch.Tensor, lora=None) -> torch.Tensor:
        """The down projection's output [n, H] for gate | up `gu` (its input rebuilt)."""
        Hb, xq = self._down_input(gu, lora)
        return self.down.project(Hb, xq=xq)

    @staticmethod
    def _rows(xq, rows: slice):
        """A row chunk of _normed's xq (None where it has none)."""
        return None if xq is None else xq.rows(rows)

    def _chunks(self, n: int, whole: bool, itemsize: int = 2, forward: bool = False):
        """Row slices for the MLP: equal parts, multiples of 256 rows (whole GEMM tiles)."""
        if n == 0:
            return [slice(0, 0)]
        opts = self.ex.options
        inter = self.layer.mlp.up_proj.out_features
        limit = opts.mlp_chunk_bytes * (opts.mlp_forward_chunk_factor if forward else 1)
        parts = 1 if whole else max(1, int(-(-n * itemsize * inter // limit)))
        rows = -(-n // parts)
        if parts > 1 and rows > 256:
            rows = -(-rows // 256) * 256
        return [slice(r, min(n, r + rows)) for r in range(0, n, rows)]

    # --- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        x2 = x.reshape(B * T, H)
        self._groups(x.dtype)
        keep = self.plan.keep
        X1, _, qkv, qkv4, out4, state = self._attention(x2, x.shape)
        del qkv4  # (with a q/k norm, its normed copies: not kept)
        # from ATTENTION on, the LoRA input products x A^T of q/k/v, gate/up and down (R
        # columns each, ~0.5% of the kept bytes) are kept, so backward does not read the inputs
        # for them
        keeps_state = keep >= Keep.ATTENTION and self.in_graph
        xa_qkv = self.qkv.lora_cols(X1) if keeps_state else None
        xa_qkv = None if xa_qkv is None else xa_qkv.contiguous()
        del X1  # the q/k/v input buffer: not needed past attention
        attn2 = out4.reshape(B * T, -1)  # [N, Hq * D] (a copy only if attention returned a view)
        h_mid = self._o_residual(attn2, x2)
        del out4
        if not keeps_state:  # q/k/v and attention's output are done with: free them before
            del qkv, attn2, state  # the MLP runs
        elif not self.plan.keep_qkv:  # q/k/v are projected again in backward
            qkv = None
        # the layer's output is returned as allocated, not as a view: FSDP2 warns about a module
        # returning a view (an in-place op on it would skip its pre-backward hook)
        out3 = x.new_empty(B, T, H)
        mlp_kept = self._mlp_forward(h_mid, out3.view(B * T, H), keeps_state)
        self._glu_terms = None  # (backward makes them again)
        if not self.in_graph:
            self._drop_groups()
            return out3
        kept = Kept(x=x2, **mlp_kept)
        if keep >= Keep.ATTENTION:
            kept.h_mid, kept.qkv, kept.attn, kept.attn_state = h_mid, qkv, attn2, state
            kept.xa_qkv = xa_qkv
        del xa_qkv, mlp_kept
        self.handle = self.ex.store.put(kept, self.plan.offload)
        self.shape = x.shape
        return out3

    def _mlp_forward(self, h_mid: torch.Tensor, out: torch.Tensor, keeps_state: bool) -> dict:
        """out [N, H] <- h_mid + down(act(gate(xn2)) * up(xn2)), xn2 = norm2(h_mid), over row
        chunks. Returns the `Kept` fields of the MLP the plan keeps (x A^T of gate/up and down
        from ATTENTION on, gate | up at ALL)."""
        N = h_mid.shape[0]
        keep = self.plan.keep
        X2, _, xq2 = self._normed(self.layer.norm("mlp_in"), h_mid, self.gu, quantize=True)
        xa_down = (h_mid.new_empty(N, self.down.R)
                   if keeps_state and self.down.has_lora_cols else None)
        out_norm = self.layer.norm("mlp_out")  # (Gemma: the MLP's output normed)
        for rows in self._chunks(N, keep >= Keep.ALL, h_mid.element_size(), forward=True):
            # [n, 2 I]: gate | up (with glu_terms, kept without their LoRA terms, as backward
            # recomputes them)
            gu, lora = self._gate_up(X2[rows], self._rows(xq2, rows))
            Hb, xq = self._down_input(gu, lora)
            del lora
            if xa_down is not None:
                xa_down[rows] = self.down.lora_cols(Hb)
            if out_norm is None:
                self.down.project(Hb, resid=h_mid[rows], out=out[rows], xq=xq)
            else:  # h_mid + mlp_out(down(...)) (Gemma)
                rms_norm_fwd(self.down.project(Hb, xq=xq), out_norm.weight, out_norm.eps,
                             out_norm.offset, out=out[rows])
                out[rows] += h_mid[rows]
            del Hb, xq
        del xq2
        if not self.in_graph:
            return {}
        kept = {}
        if keeps_state:
            xa_gu = self.gu.lora_cols(X2)
            # not a view: X2 is freed
            kept.update(xa_down=xa_down, xa_gu=None if xa_gu is None else xa_gu.contiguous())
        if keep >= Keep.ALL:
            kept["gu"] = gu
        return kept

    # --- backward ----------------------------------------------------------------------------
    def backward(self, dout: torch.Tensor, need_dx: bool = True
                 ) -> tuple[torch.Tensor | None, dict]:
        stream = self.ex.stream
        if stream is None:
            return self._backward(dout, need_dx)
        # streamed base weights: this layer's back in its slot (the one below's copy started);
        # the slot's copy brought the host buffer's LoRA columns, so they are written again
        with stream.using(self.layer, -1):
            if stream.streams(self.layer):
                for g in (self.qkv, self.gu, self.down):
                    if g is not None and g.lora_in_gemm:
                        g.source.write_lora_columns(g.in_f, g.cols)
            return self._backward(dout, need_dx)

    def _backward(self, dout: torch.Tensor, need_dx: bool
                  ) -> tuple[torch.Tensor | None, dict]:
        B, T, H = self.shape
        N = B * T
        store = self.ex.store
        kept = store.get(self.handle)
        store.prefetch(self.handle.prev)  # load the layer below while this one runs
        if (self.ex.options.prefetch_layers(self.ex.stream is not None) > 1
                and self.handle.prev is not None):
            # and the one below it (the order states were put: layer order, every layer being
            # fused in a planned run, as the planner counts it)
            store.prefetch(self.handle.prev.prev)
        grads: dict = {}
        dout = dout.reshape(N, H)
        x2 = kept.x
        keep = self.plan.keep
        at = self.layer.self_attn
        # Kept tensors leave `kept` (the store's object) as they are taken, so each is freed as
        # soon as this backward is done with it (gate/up after the MLP, h_mid after its norm),
        # not when the whole layer is released: the rest of the layer runs in less memory.
        if keep == Keep.INPUT:
            X1, rstd1, qkv, (q4, k4, v4), out4, state = self._attention(x2, self.shape, True)
            h_mid = self._o_residual(out4.reshape(N, -1), x2)
        else:
            qkv = kept.qkv
            again = qkv is None  # keep_qkv=False: q/k/v projected again from X1
            X1, rstd1, xq1 = self._normed(self.layer.norm("attn_in"), x2, self.qkv, kept.xa_qkv,
                                          quantize=again)
            h_mid, state = kept.h_mid, kept.attn_state
            kept.xa_qkv = kept.qkv = kept.h_mid = kept.attn_state = None
            if again:  # the forward's GEMM on the same input (LoRA columns copied): the same
                qkv = self.qkv.project(X1, xq=xq1)  # q/k/v, bit for bit
            del xq1
            # (a kept qkv is already rotated; projected again, it rotates in place as forward's)
            q4, k4, v4 = self._rotated(qkv, self.shape, in_place=again)
            out4 = kept.attn.view(q4.shape)
            kept.attn = None
        dh_mid = self._mlp_backward(h_mid, dout, kept, grads)
        del h_mid

        # attention: h_mid = x + o(attn(rope(qk_norm(q, k)), v))
        do = dh_mid
        if self.layer.norm("attn_out") is not None:  # through the attention-out norm
            do = self._through_out_norm("attn_out", self.o.project(out4.reshape(N, -1)), do)
        dattn = self.o.backward(out4.reshape(N, -1), [do], grads)
        del do
        # (with attention sinks, frozen, their gradient comes fourth and is dropped)
        dq, dk, dv = self.ex.attention.backward(dattn.view(out4.shape), q4, k4, v4, out4, state,
                                                self.meta, at.window, at.scale,
                                                sinks=at.sinks, softcap=at.softcap)[:3]
        # the q/k norm's backward reads the raw projections: only those layers hold them on
        q_raw, k_raw, _ = self._split_qkv(qkv, self.shape) if at.q_norm is not None else (
            None, None, None)
        del dattn, qkv, q4, k4, v4, out4, state
        # d q | d k | d v side by side: the q/k/v group's input gradient is one GEMM
        dqkv = dq.new_empty(N, sum(self.qkv.outs))
        dqkvq = None
        if q_raw is None and at.rotary_dim is None and self.ex.options.fuse_qkv_grad:
            # one pass: the copies, RoPE's backward and (FP8) the codes the GEMM reads
            dqkvq = (self.qkv.quantized_grad(dqkv) if need_dx and quantizable(at.head_dim)
                     else None)
            qkv_grad(dq, dk, dv, self.cos, self.sin, dqkv,
                     quant=None if dqkvq is None else dqkvq.targets)
            del dq, dk, dv
        else:
            for dst, src in zip(self._split_qkv(dqkv, self.shape), (dq, dk, dv)):
                dst.copy_(src)
            del dq, dk, dv
            dq4, dk4, _ = self._split_qkv(dqkv, self.shape)
            if q_raw is not None:  # through RoPE and the q/k norm
                qk_norm_rope_bwd_(dq4, dk4, q_raw, k_raw, at.q_norm.weight, at.k_norm.weight,
                                  at.q_norm.eps, at.q_norm.offset, self.cos, self.sin)
                del q_raw, k_raw
            else:
                rope_(*self._rotary(dq4, dk4), self.cos, self.sin, inverse=True)
            del dq4, dk4
        dxn1 = self.qkv.backward(X1, dqkv, grads, need_dx=need_dx, dyq=dqkvq)
        del dqkv, dqkvq
        dx = None
        if need_dx:  # not for the first layer: its input is the (frozen) embedding
            norm = self.layer.norm("attn_in")
            dx = rms_norm_bwd(dxn1, x2, norm.weight, rstd1, norm.offset,
                              residual=dh_mid).view(B, T, H)
        store.release(self.handle)
        self.handle = None
        self._drop_groups()
        return dx, grads

    def _mlp_backward(self, h_mid: torch.Tensor, dout: torch.Tensor, kept: Kept,
                      grads: dict) -> torch.Tensor:
        """The MLP's backward: dout [N, H] (the layer output's gradient) -> d h_mid [N, H]
        (through the MLP and its residual), LoRA gradients into `grads`. Takes the MLP's fields
        out of `kept` as it uses them."""
        N, H = dout.shape
        inter = self.layer.mlp.up_proj.out_features
        keep = self.plan.keep
        kept_gu, kept.gu = kept.gu, None
        X2, rstd2, xq2 = self._normed(self.layer.norm("mlp_in"), h_mid, self.gu, kept.xa_gu,
                                      quantize=keep < Keep.ALL)  # (ALL: gate | up kept)
        xa_down, kept.xa_gu, kept.xa_down = kept.xa_down, None, None
        # d norm2(h_mid), in a buffer as wide as the gate/up group's input-gradient GEMM writes
        dxn2 = h_mid.new_empty(N, self.gu.grad_width())
        for rows in self._chunks(N, keep >= Keep.ALL, dout.element_size()):
            if keep >= Keep.ALL:
                gu, lora = kept_gu, self._glu_lora(X2[rows])
            else:
                gu, lora = self._gate_up(X2[rows], self._rows(xq2, rows))
            kept_gu = None
            ddown = dout[rows]  # the down projection's output gradient
            if self.layer.norm("mlp_out") is not None:  # through the MLP-out norm
                ddown = self._through_out_norm("mlp_out", self._down_out(gu, lora), ddown)
            # (fuse_dx: da without its LoRA term ga A, which the GLU kernel adds)
            da, ga = self.down.input_grad(ddown, add_ga=not self.fuse_dx)
            # gate, up <- d gate, d up in place; da <- act(gate) * up, the down projection's input
            glu_bwd_(da, gu[:, :inter], gu[:, inter:], self.act, h_out=da, lora=lora,
                     dy_lora=(ga, self.down.a) if self.fuse_dx else None)
            self.down.lora_grads(da, ddown, ga, grads,
                                 None if xa_down is None else xa_down[rows])
            del ddown
            del da, ga
            self.gu.backward(X2[rows], gu, grads, out=dxn2[rows],
                             xa=None if lora is None else lora[0])
            del gu, lora
        del xq2
        dxn2 = dxn2[:, :H]
        post = self.layer.norm("mlp_in")
        return rms_norm_bwd(dxn2, h_mid, post.weight, rstd2, post.offset, residual=dout)


class _FusedLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, run: _LayerRun, *params):
        ctx.run = run
        return run.forward(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        run = ctx.run
        if run is None:
            raise RuntimeError("leantune's fused layers support one backward per forward "
                               "(retain_graph=True is not supported); train with "
                               "--no-fused-layers (EngineOptions(fused_layers=False))")
        ctx.run = None
        dx, grads = run.backward(dout.contiguous(), need_dx=ctx.needs_input_grad[0])
        return (dx, None, *[grads.get(p) for p in run.params])


class CheckpointExecutor:
    """The autograd path's recompute: the layer's plain forward under torch.utils.checkpoint
    (keeps its input, reruns the whole layer in backward)."""

    kind = "checkpoint"

    def __init__(self, plan: LayerPlan):
        self.plan = plan

    def __call__(self, layer, x, cos, sin, meta: AttentionMeta) -> torch.Tensor:
        return checkpoint(layer.plain_forward, x, cos, sin, meta, use_reentrant=False)
