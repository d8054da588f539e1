"""The decoder layer as one autograd Function with a hand-written backward: selective recompute
and offloaded activations for LoRA training.

To autograd a layer is a single node. Forward runs the layer without building a graph and keeps
only what the layer's `LayerPlan` asks for; backward recomputes the rest and back-propagates by
hand through our kernels (RMSNorm, RoPE, GLU), cuBLAS and flash or cuDNN attention. Per layer, with
x: [N, H] (N = B*T tokens), h_mid = x + attn(norm1(x)), out = h_mid + mlp(norm2(h_mid)):

    keep 0 "input":      x                          backward recomputes norm1, q/k/v, RoPE,
                                                    attention, o, norm2, gate/up
    keep 1 "attention":  x, h_mid, q, k, v (rotated), attention output (+ its log-sum-exp)
                                                    backward recomputes norm1, norm2, gate/up
                                                    (and, off the flash and cuDNN paths, attention)
    keep 2 "all":        keep 1 + gate and up       backward recomputes the norms (the
                                                    activation comes out of the GLU backward)

The down projection is never recomputed (its output is not needed in backward), nor, from keep 1
up, the o projection; torch.utils.checkpoint reruns the whole layer. Kept tensors stay on the
GPU or, with `offload`, are copied to pinned host memory on a side stream as soon as they exist
and copied back one layer ahead during backward (double-buffered: while layer i back-propagates,
layer i-1's tensors load). The MLP runs over row chunks when its [rows, intermediate] tensors
would be large, so its working set stays small.

Gradients: LoRA A/B only, accumulated in the adapters' dtype (fp32 masters in the Trainer); the
base weights and norms are frozen. LoRA math
per projection (x: input, W: [out, in], A: [r, in], B: [out, r], s: scaling):
    y = x W^T + s (x A^T) B^T;   ga = s dy B;   dB = s dy^T (x A^T);   dA = ga^T x;
    dx = dy W + ga A
Projections that share an input (q/k/v; gate/up) concatenate their A's: one x A^T and one
ga A product for all of them. With packed weights (PACK_PROJECTIONS, below) q/k/v, gate/up and
down are one GEMM each with the LoRA term inside it; the residual adds ride in the GEMMs (addmm)
and in the RMSNorm backward. In backward the same packed weight gives dx and ga from one GEMM
(dy [W | s B] = [dy W | ga]), q/k/v's gradients sit side by side for it, and from keep 1 on the
x A^T products come from the forward (kept: R columns per group), so the rank-r side products
read the large [N, intermediate] tensors as few times as they can. Kept tensors are let go as
soon as backward is done with them (gate/up after the MLP), not when the layer ends.

Used when a layer qualifies (`fused_unsupported` says why not: trainable base weights, LoRA
dropout, q/k norm); otherwise the model falls back to autograd (+ torch.utils.checkpoint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..kernels.rmsnorm import rms_norm_bwd, rms_norm_fwd
from ..kernels.rope import rope_
from ..kernels.swiglu import ACTS, glu_bwd_, glu_fwd
from .activation_store import ActivationStore
from .attention import AttentionMeta, attention_backward, attention_forward

# The MLP runs in row chunks whose [rows, intermediate] tensors stay under this many bytes in
# backward, and MLP_FWD_CHUNK_FACTOR times that in forward, which holds less beside the chunk (no
# gradients, no prefetched layer). Fewer, taller GEMMs run faster: at Llama-3.1-8B over 8192
# tokens (H200) 256 MiB (one chunk) gave 0.6% more tokens/s than 128 MiB for 0.3 GiB more peak.
# LEANTUNE_MLP_CHUNK_MIB / LEANTUNE_MLP_FWD_CHUNK_FACTOR override.
MLP_CHUNK_BYTES = int(float(os.environ.get("LEANTUNE_MLP_CHUNK_MIB", 256)) * 2**20)
MLP_FWD_CHUNK_FACTOR = float(os.environ.get("LEANTUNE_MLP_FWD_CHUNK_FACTOR", 2))


@dataclass(frozen=True)
class LayerPlan:
    """What one layer keeps for backward (0 input, 1 attention, 2 all) and where."""

    keep: int = 0
    offload: bool = False

    def __post_init__(self):
        if self.keep not in (0, 1, 2):
            raise ValueError(f"LayerPlan.keep must be 0, 1 or 2, got {self.keep}")


def _act_code(name: str) -> int | None:
    if name == "silu":
        return ACTS["silu"]
    if name.startswith("gelu"):
        return ACTS["gelu_tanh"] if "tanh" in name else ACTS["gelu"]
    return None


def _autocast_on() -> bool:
    try:
        return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled()


def fused_unsupported(layer) -> str | None:
    """Why `layer` can't take the fused path (None if it can)."""
    if _autocast_on():
        return "torch.autocast"
    attn, mlp = layer.self_attn, layer.mlp
    if attn.q_norm is not None:
        return "q/k norm"
    if _act_code(mlp.act) is None:
        return f"activation {mlp.act}"
    for name, p in layer.named_parameters():
        if "lora_" not in name and p.requires_grad:
            return f"trainable base weight {name}"
    for proj in _projections(layer):
        if proj.has_lora and not isinstance(proj.lora_dropout, torch.nn.Identity):
            return "LoRA dropout"
    return None


def _projections(layer):
    a, m = layer.self_attn, layer.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


def lora_params(layer) -> list[torch.nn.Parameter]:
    """The layer's trainable LoRA weights, in the order the fused Function takes them."""
    out = []
    for proj in _projections(layer):
        if proj.has_lora:
            out += [proj.lora_A.weight, proj.lora_B.weight]
    return [p for p in out if p.requires_grad]


# Projections that share an input (q/k/v; gate/up) and the down projection run as one GEMM each
# over a packed weight: the modules' base weights become row blocks of one buffer [sum out,
# in + sum r], whose extra columns hold s * B (block-diagonal), and the input buffer [n, in + sum r]
# carries x A_cat^T beside x, so the GEMM adds the LoRA term too:
#     [x | x A_cat^T] @ [W_cat | s B_blockdiag]^T = x W_cat^T + s (x A^T) B^T per projection.
# One wide GEMM runs faster than several narrow ones, and no pass over the output adds the LoRA
# term. The modules' `weight` Parameters are views into the buffer: no copy of the weights
# (the LoRA columns and padding add ~1%: 4.75 MiB a layer at Llama-3.1-8B).
# LEANTUNE_PACK_PROJECTIONS=0 (or set_pack_projections(False)) keeps separate GEMMs.
PACK_PROJECTIONS = os.environ.get("LEANTUNE_PACK_PROJECTIONS", "1") != "0"
# The packed width in + R is padded with zero columns to a multiple of this many (64 bf16 values
# = 128 bytes: whole GEMM K tiles, aligned rows); LEANTUNE_PACK_ALIGN=1 pads nothing.
PACK_ALIGN = int(os.environ.get("LEANTUNE_PACK_ALIGN", 64))
# LEANTUNE_PACK_LORA=0: packed weights without the LoRA columns (K = in exactly); the LoRA
# term is then added by one rank-r product per projection, as unpacked (measured 2.7% slower at
# Llama-3.1-8B on an H200: 13.6k vs 14.0k tok/s).
PACK_LORA = os.environ.get("LEANTUNE_PACK_LORA", "1") != "0"


def set_pack_projections(enabled: bool) -> None:
    global PACK_PROJECTIONS
    PACK_PROJECTIONS = enabled


def _lora_rank(m) -> int:
    return m.r if m.has_lora else 0


def packed_weight(mods) -> torch.Tensor | None:
    """The packed weight of projections reading one input (made, or remade after the weights,
    their dtype/device or the LoRA ranks changed, on first use), or None where packing is off or
    impossible (a quantised or trainable base, mixed input sizes or dtypes).

    The modules hold no reference to the buffer, only their weights' views of its storage (and
    the layout as plain numbers): after `.to()` gives the weights fresh storage, nothing keeps
    the old buffer alive."""
    from ..lora.layer import LoRALinear

    if not PACK_PROJECTIONS or any(type(m).base_weight is not LoRALinear.base_weight
                                   or m.weight.requires_grad for m in mods):
        return None
    w0 = mods[0].weight
    if any(m.in_features != mods[0].in_features or m.weight.dtype != w0.dtype
           or m.weight.device != w0.device for m in mods):
        return None
    in_f = mods[0].in_features
    ranks = tuple(_lora_rank(m) if PACK_LORA else 0 for m in mods)
    width = in_f + sum(ranks)
    if width > in_f:
        width += -width % PACK_ALIGN
    shape = (sum(m.out_features for m in mods), width)
    layout = (shape, ranks)
    if getattr(mods[0], "_lt_packed_layout", None) == layout:
        storage, row, ok = w0.untyped_storage(), 0, True
        for m in mods:
            ok = ok and (m.weight.untyped_storage().data_ptr() == storage.data_ptr()
                         and m.weight.storage_offset() == row * width
                         and m.weight.stride() == (width, 1))
            row += m.out_features
        if ok and storage.nbytes() >= shape[0] * width * w0.element_size():
            return torch.empty(0, dtype=w0.dtype, device=w0.device).set_(
                storage, 0, shape, (width, 1))
    buf = torch.zeros(shape, dtype=w0.dtype, device=w0.device)  # LoRA columns and padding: 0
    row = 0
    with torch.no_grad():
        for m in mods:
            view = buf[row:row + m.out_features, :in_f]
            view.copy_(m.weight)
            m.weight.data = view  # the old storage is freed: no extra memory
            row += m.out_features
    mods[0]._lt_packed_layout = layout
    return buf


def pack_layer(layer) -> None:
    """Pack a layer's q/k/v, gate/up and down weights now (as the first fused forward would),
    so a training step never allocates them."""
    a, m = layer.self_attn, layer.mlp
    for mods in ([a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj], [m.down_proj]):
        packed_weight(mods)


class _Group:
    """Frozen projections (LoRALinear) reading one input, with their LoRA weights cast to the
    compute dtype once per step. The LoRA A's are concatenated: xa = x @ A_cat^T is [n, R],
    R = sum r. Packed (see PACK_PROJECTIONS) the group is one GEMM over `packed`; else one GEMM
    per projection plus a rank-r product each. Outputs are one tensor [n, sum out]."""

    def __init__(self, mods, dtype: torch.dtype, pack: bool):
        self.mods = mods
        self.in_f = mods[0].in_features
        self.outs = [m.out_features for m in mods]
        self.packed = packed_weight(mods) if pack else None
        if self.packed is not None and self.packed.dtype != dtype:
            self.packed = None
        self.w = [m.base_weight() for m in mods]  # views into `packed` when packed
        self.bias = [None if m.bias is None else m.bias.to(dtype) for m in mods]
        lora = [m for m in mods if m.has_lora]
        self.R = sum(m.r for m in lora)
        self.a = torch.cat([m.lora_A.weight for m in lora]).to(dtype) if lora else None
        self.b, self.cols = [], []
        c = 0
        for m in mods:
            if m.has_lora:
                self.b.append(m.lora_B.weight.to(dtype))
                self.cols.append(slice(c, c + m.r))
                c += m.r
            else:
                self.b.append(None)
                self.cols.append(None)
        # whether the LoRA term rides in the packed GEMM (extra K columns) or is added after it
        self.lora_in_gemm = self.packed is not None and self.packed.shape[1] > self.in_f
        if self.lora_in_gemm:
            row = 0
            with torch.no_grad():
                for m, cols in zip(mods, self.cols):
                    if cols is not None:  # s * B in this projection's own LoRA columns
                        self.packed[row:row + m.out_features,
                                    self.in_f + cols.start:self.in_f + cols.stop].copy_(
                            m.lora_B.weight * m.scaling)
                    row += m.out_features
        self.bias_cat = None
        if any(b is not None for b in self.bias):
            self.bias_cat = torch.cat([torch.zeros(o, dtype=dtype, device=self.w[0].device)
                                       if b is None else b for b, o in zip(self.bias, self.outs)])

    def split(self, y: torch.Tensor | list) -> list[torch.Tensor]:
        """[n, sum out] -> per-projection column views (a list passes through)."""
        if isinstance(y, (list, tuple)):
            return list(y)
        out, c = [], 0
        for o in self.outs:
            out.append(y[:, c:c + o])
            c += o
        return out

    # --- forward -----------------------------------------------------------------------------
    def new_input(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer for this group's input, [n, in] (+ R columns for x A^T and zero padding
        when packed): the caller writes x into [:, :in], then calls fill_lora."""
        width = self.in_f if self.packed is None else self.packed.shape[1]
        X = torch.empty(n, width, dtype=like.dtype, device=like.device)
        if width > self.in_f + self.R:
            X[:, self.in_f + self.R:].zero_()  # times the weight's zero columns: no NaN from
        return X                                # uninitialised memory

    @property
    def has_lora_cols(self) -> bool:
        """Whether input buffers carry x A_cat^T (packed with LoRA columns)."""
        return bool(self.lora_in_gemm and self.R)

    def lora_cols(self, X: torch.Tensor) -> torch.Tensor | None:
        """The x A_cat^T columns [n, R] of an input buffer (has_lora_cols), else None."""
        return X[:, self.in_f:self.in_f + self.R] if self.has_lora_cols else None

    def fill_lora(self, X: torch.Tensor, xa: torch.Tensor | None = None) -> None:
        """X[:, in:] = X[:, :in] @ A_cat^T, or a copy of `xa` (that product, kept from the
        forward: backward then need not read X again for it). Packed groups with LoRA only."""
        cols = self.lora_cols(X)
        if cols is None:
            return
        if xa is not None:
            cols.copy_(xa)
        else:
            torch.mm(X[:, :self.in_f], self.a.t(), out=cols)

    def project(self, X: torch.Tensor, resid: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """X: new_input's buffer after fill_lora (or [n, in] if not packed) -> y [n, sum out]
        = x W_cat^T + bias + LoRA; with `resid` (one projection): resid + y, into `out`."""
        if self.packed is not None:
            if X.shape[1] != self.packed.shape[1]:
                raise ValueError("packed group: pass new_input's buffer (after fill_lora)")
            y = (torch.addmm(resid, X, self.packed.t(), out=out) if resid is not None
                 else torch.mm(X, self.packed.t(), out=out))
            if self.bias_cat is not None:
                y.add_(self.bias_cat)
            if self.a is not None and not self.lora_in_gemm:
                xa = X @ self.a.t()
                for yi, m, b, cols in zip(self.split(y), self.mods, self.b, self.cols):
                    if b is not None:
                        yi.addmm_(xa[:, cols], b.t(), alpha=m.scaling)
            return y
        x = X[:, :self.in_f]
        xa = x @ self.a.t() if self.a is not None else None
        if len(self.mods) == 1:
            w = self.w[0]
            y = (torch.addmm(resid, x, w.t(), out=out) if resid is not None
                 else torch.mm(x, w.t(), out=out))
            ys = [y]
        else:
            if resid is not None:
                raise ValueError("resid needs a group of one projection")
            y = out if out is not None else torch.empty(x.shape[0], sum(self.outs),
                                                        dtype=x.dtype, device=x.device)
            ys = self.split(y)
            for yi, w in zip(ys, self.w):
                torch.mm(x, w.t(), out=yi)
        for yi, m, bias, b, cols in zip(ys, self.mods, self.bias, self.b, self.cols):
            if bias is not None:
                yi.add_(bias)
            if b is not None:
                yi.addmm_(xa[:, cols], b.t(), alpha=m.scaling)
        return y

    # --- backward ----------------------------------------------------------------------------
    def grad_width(self) -> int:
        """Columns of the buffer input_grad writes dx into for one [n, sum out] gradient: the
        packed width where one GEMM over the whole packed weight gives dx and ga together (see
        input_grad), else in."""
        return self.packed.shape[1] if self.has_lora_cols else self.in_f

    def input_grad(self, dys, out: torch.Tensor | None = None, need_dx: bool = True):
        """dys: [n, sum out] or per-projection list -> (dx [n, in] = sum_i dy_i W_i + ga A_cat
        (into `out`, [n, grad_width()] for one tensor dys; None without need_dx), ga [n, R] =
        s dy_i B_i side by side, or None).

        Packed with LoRA columns, dy @ [W | s B] = [dy W | s dy B] is dx and ga from one GEMM
        (K = sum out): ga needs no pass of its own over dy. dx and ga are then column views
        of one [n, packed width] buffer."""
        if need_dx and self.has_lora_cols and not isinstance(dys, (list, tuple)):
            wide = torch.mm(dys, self.packed, out=out)
            dx, ga = wide[:, :self.in_f], wide[:, self.in_f:self.in_f + self.R]
            dx.addmm_(ga, self.a)
            return dx, ga
        parts = self.split(dys)
        ga = None
        if self.a is not None:
            gas = []
            for m, dy, b in zip(self.mods, parts, self.b):
                if b is not None:
                    g = dy @ b
                    if m.scaling != 1:
                        g.mul_(m.scaling)
                    gas.append(g)
            ga = gas[0] if len(gas) == 1 else torch.cat(gas, 1)
        dx = None
        if need_dx:
            if self.packed is not None and not isinstance(dys, (list, tuple)):
                dx = torch.mm(dys, self.packed[:, :self.in_f], out=out)  # one GEMM, K = sum out
            else:
                dx = torch.mm(parts[0], self.w[0], out=out)
                for dy, w in zip(parts[1:], self.w[1:]):
                    dx.addmm_(dy, w)
            if ga is not None:
                dx.addmm_(ga, self.a)
        return dx, ga

    def lora_grads(self, x: torch.Tensor, dys, ga: torch.Tensor | None, grads: dict,
                   xa: torch.Tensor | None = None) -> None:
        """LoRA grads into `grads` (param -> fp32, accumulated): dB_i = s dy_i^T xa_i, dA = ga^T x.
        x: [n, in]; xa = x A_cat^T if the caller has it."""
        if self.a is None:
            return
        if xa is None:
            xa = x @ self.a.t()
        for m, dy, cols in zip(self.mods, self.split(dys), self.cols):
            if cols is not None:
                _accumulate(grads, m.lora_B.weight, dy.t() @ xa[:, cols], m.scaling)
        ga_x = ga.t() @ x  # [R, in]
        for m, cols in zip(self.mods, self.cols):
            if cols is not None:
                _accumulate(grads, m.lora_A.weight, ga_x[cols], 1.0)

    def backward(self, X: torch.Tensor, dys, grads: dict, out: torch.Tensor | None = None,
                 need_dx: bool = True) -> torch.Tensor | None:
        """Input gradient (into `out`, [n, grad_width()] for one tensor dys; None without
        need_dx) and LoRA grads for input X (a new_input buffer after fill_lora, or [n, in])."""
        dx, ga = self.input_grad(dys, out, need_dx)
        xa = X[:, self.in_f:self.in_f + self.R] if self.R and X.shape[1] > self.in_f else None
        self.lora_grads(X[:, :self.in_f], dys, ga, grads, xa)
        return dx


def _accumulate(grads: dict, param: torch.nn.Parameter, g: torch.Tensor, scale: float) -> None:
    if not param.requires_grad:
        return
    g = g.to(param.dtype)
    if scale != 1:
        g.mul_(scale)
    prev = grads.get(param)
    grads[param] = g if prev is None else prev.add_(g)


class LayerRun:
    """One layer's forward/backward within one model forward (made per call, dropped after its
    backward). `prev` is the layer before it, whose kept tensors backward prefetches."""

    def __init__(self, layer, cos, sin, meta: AttentionMeta, plan: LayerPlan,
                 store: ActivationStore, prev: "LayerRun | None"):
        self.layer, self.cos, self.sin, self.meta, self.plan = layer, cos, sin, meta, plan
        self.store, self.prev = store, prev
        self.handle = self.aux = None
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
        a, m = self.layer.self_attn, self.layer.mlp
        # o stays unpacked: its input comes from attention, which writes its own buffer
        return (_Group([a.q_proj, a.k_proj, a.v_proj], dtype, pack=True),
                _Group([a.o_proj], dtype, pack=False),
                _Group([m.gate_proj, m.up_proj], dtype, pack=True),
                _Group([m.down_proj], dtype, pack=True))

    def _normed(self, which: str, x2: torch.Tensor, group: _Group,
                xa: torch.Tensor | None = None):
        """norm(x2) in a new input buffer of `group`, x A^T filled in (computed, or copied from
        `xa` kept by the forward) -> (X, rstd)."""
        n = getattr(self.layer, which)
        X = group.new_input(x2.shape[0], x2)
        _, rstd = rms_norm_fwd(x2, n.weight, n.eps, n.offset, out=X[:, :x2.shape[1]])
        group.fill_lora(X, xa)
        return X, rstd

    def _split_qkv(self, qkv: torch.Tensor, shape):
        """[N, (Hq + 2 Hk) D] -> q [B, T, Hq, D], k, v [B, T, Hk, D] (views)."""
        B, T, _ = shape
        at = self.layer.self_attn
        q, k, v = self.qkv.split(qkv)
        return (q.view(B, T, at.num_heads, at.head_dim),
                k.view(B, T, at.num_kv_heads, at.head_dim),
                v.view(B, T, at.num_kv_heads, at.head_dim))

    def _attention(self, x2, shape, for_backward: bool = False):
        """norm1 -> q, k, v -> RoPE -> attention; returns X1, rstd1, qkv, out4, aux."""
        at = self.layer.self_attn
        X1, rstd1 = self._normed("input_layernorm", x2, self.qkv)
        qkv = self.qkv.project(X1)
        q4, k4, v4 = self._split_qkv(qkv, shape)
        rope_(q4, k4, self.cos, self.sin)
        out4, aux = attention_forward(q4, k4, v4, self.meta, at.window, at.scale,
                                      for_backward)
        return X1, rstd1, qkv, out4, aux

    def _chunks(self, n: int, keep_gu: bool, itemsize: int = 2, forward: bool = False):
        """Row slices for the MLP: equal parts, multiples of 256 rows (whole GEMM tiles)."""
        if n == 0:
            return [slice(0, 0)]
        inter = self.layer.mlp.up_proj.out_features
        limit = MLP_CHUNK_BYTES * (MLP_FWD_CHUNK_FACTOR if forward else 1)
        parts = 1 if keep_gu else max(1, int(-(-n * itemsize * inter // limit)))
        rows = -(-n // parts)
        if parts > 1 and rows > 256:
            rows = -(-rows // 256) * 256
        return [slice(r, min(n, r + rows)) for r in range(0, n, rows)]

    # --- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        x2 = x.reshape(B * T, H)
        self.qkv, self.o, self.gu, self.down = self._groups(x.dtype)
        self.act = _act_code(self.layer.mlp.act)
        inter = self.layer.mlp.up_proj.out_features
        keep = self.plan.keep
        X1, _, qkv, out4, aux = self._attention(x2, x.shape)
        # from keep 1 on, the LoRA input products x A^T of q/k/v, gate/up and down (R columns
        # each, ~0.5% of the kept bytes) are kept, so backward does not read the inputs for them
        xa1 = self.qkv.lora_cols(X1) if keep >= 1 and self.in_graph else None
        xa1 = None if xa1 is None else xa1.contiguous()
        del X1  # the q/k/v input buffer: not needed past attention
        attn2 = out4.reshape(B * T, -1)  # [N, Hq * D] (a copy only if attention returned a view)
        h_mid = self.o.project(attn2, resid=x2)
        X2, _ = self._normed("post_attention_layernorm", h_mid, self.gu)
        out = torch.empty_like(h_mid)
        xa_down = (x2.new_empty(B * T, self.down.R)
                   if keep >= 1 and self.in_graph and self.down.has_lora_cols else None)
        for rows in self._chunks(B * T, keep >= 2, x.element_size(), forward=True):
            gu = self.gu.project(X2[rows])  # [n, 2 I]: gate | up
            Hb = self.down.new_input(gu.shape[0], gu)
            glu_fwd(gu[:, :inter], gu[:, inter:], self.act, out=Hb[:, :inter])
            self.down.fill_lora(Hb)
            if xa_down is not None:
                xa_down[rows] = self.down.lora_cols(Hb)
            self.down.project(Hb, resid=h_mid[rows], out=out[rows])
            del Hb
        kept = {"x": x2}
        if keep >= 1:
            kept.update(h_mid=h_mid, qkv=qkv, attn=attn2)
            self.aux = aux  # attention log-sum-exp (fp32, [Hq, N]) and rng state: small, stays
            for name, cols in (("xa1", xa1), ("xa2", self.gu.lora_cols(X2)),
                               ("xa_down", xa_down)):
                if cols is not None:
                    kept[name] = cols.contiguous()  # not a view: X2 is freed
        del xa1, X2
        if keep >= 2:
            kept.update(gu=gu)
        if not self.in_graph:
            self.qkv = self.o = self.gu = self.down = self.aux = None
            return out.view(B, T, H)
        self.handle = self.store.put(kept, self.plan.offload)
        self.shape = x.shape
        return out.view(B, T, H)

    # --- backward ----------------------------------------------------------------------------
    def backward(self, dout: torch.Tensor, need_dx: bool = True
                 ) -> tuple[torch.Tensor | None, dict]:
        B, T, H = self.shape
        N = B * T
        kept = self.store.get(self.handle)
        if self.prev is not None:
            self.store.prefetch(self.prev.handle)  # load the next layer while this one runs
        grads: dict = {}
        dout = dout.reshape(N, H)
        x2 = kept["x"]
        keep = self.plan.keep
        inter = self.layer.mlp.up_proj.out_features
        # Kept tensors leave `kept` (the store's dict) as they are taken, so each is freed as
        # soon as this backward is done with it (gate/up after the MLP, h_mid after its norm),
        # not when the whole layer is released: the rest of the layer runs in less memory.
        if keep == 0:
            X1, rstd1, qkv, out4, aux = self._attention(x2, self.shape, True)
            h_mid = self.o.project(out4.reshape(N, -1), resid=x2)
        else:
            X1, rstd1 = self._normed("input_layernorm", x2, self.qkv, kept.pop("xa1", None))
            qkv, h_mid = kept.pop("qkv"), kept.pop("h_mid")
            aux = self.aux
        q4, k4, v4 = self._split_qkv(qkv, self.shape)
        if keep != 0:
            out4 = kept.pop("attn").view(q4.shape)
        kept_gu = kept.pop("gu", None)

        # MLP: out = h_mid + down(act(gate(xn2)) * up(xn2))
        X2, rstd2 = self._normed("post_attention_layernorm", h_mid, self.gu, kept.pop("xa2", None))
        xa_down = kept.pop("xa_down", None)
        # d norm2(h_mid), in a buffer as wide as the gate/up group's input-gradient GEMM writes
        dxn2 = h_mid.new_empty(N, self.gu.grad_width())
        for rows in self._chunks(N, keep >= 2, dout.element_size()):
            gu = kept_gu if keep >= 2 else self.gu.project(X2[rows])
            kept_gu = None
            da, ga = self.down.input_grad(dout[rows])
            # gate, up <- d gate, d up in place; da <- act(gate) * up, the down projection's input
            glu_bwd_(da, gu[:, :inter], gu[:, inter:], self.act, h_out=da)
            self.down.lora_grads(da, dout[rows], ga, grads,
                                 None if xa_down is None else xa_down[rows])
            del da, ga
            self.gu.backward(X2[rows], gu, grads, out=dxn2[rows])
            del gu
        dxn2 = dxn2[:, :H]
        post = self.layer.post_attention_layernorm
        dh_mid = rms_norm_bwd(dxn2, h_mid, post.weight, rstd2, post.offset, residual=dout)
        del dxn2, X2, h_mid

        # attention: h_mid = x + o(attn(rope(q, k), v))
        at = self.layer.self_attn
        dattn = self.o.backward(out4.reshape(N, -1), [dh_mid], grads)
        dq, dk, dv = attention_backward(dattn.view(out4.shape), q4, k4, v4, out4, aux,
                                        self.meta, at.window, at.scale)
        del dattn, qkv, q4, k4, v4, out4, aux
        # d q | d k | d v side by side: the q/k/v group's input gradient is one GEMM
        dqkv = dq.new_empty(N, sum(self.qkv.outs))
        for dst, src in zip(self._split_qkv(dqkv, self.shape), (dq, dk, dv)):
            dst.copy_(src)
        del dq, dk, dv
        dq4, dk4, _ = self._split_qkv(dqkv, self.shape)
        rope_(dq4, dk4, self.cos, self.sin, inverse=True)
        dxn1 = self.qkv.backward(X1, dqkv, grads, need_dx=need_dx)
        del dqkv, dq4, dk4
        dx = None
        if need_dx:  # not for the first layer: its input is the (frozen) embedding
            norm = self.layer.input_layernorm
            dx = rms_norm_bwd(dxn1, x2, norm.weight, rstd1, norm.offset,
                              residual=dh_mid).view(B, T, H)
        self.store.release(self.handle)
        self.handle = self.qkv = self.o = self.gu = self.down = self.aux = None
        return dx, grads


class _FusedLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, run: LayerRun, *params):
        ctx.run = run
        return run.forward(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        run = ctx.run
        if run is None:
            raise RuntimeError("leantune's fused layers support one backward per forward "
                               "(retain_graph=True is not supported); set model.fused = False")
        ctx.run = None
        dx, grads = run.backward(dout.contiguous(), need_dx=ctx.needs_input_grad[0])
        return (dx, None, *[grads.get(p) for p in run.params])
