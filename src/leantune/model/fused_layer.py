"""The decoder layer as one autograd Function with a hand-written backward: selective recompute
and offloaded activations for LoRA training.

To autograd a layer is a single node. Forward runs the layer without building a graph and keeps
only what the layer's `LayerPlan` asks for; backward recomputes the rest and back-propagates by
hand through our kernels (RMSNorm, RoPE, GLU), cuBLAS and flash attention. Per layer, with
x: [N, H] (N = B*T tokens), h_mid = x + attn(norm1(x)), out = h_mid + mlp(norm2(h_mid)):

    keep 0 "input":      x                          backward recomputes norm1, q/k/v, RoPE,
                                                    attention, o, norm2, gate/up
    keep 1 "attention":  x, h_mid, q, k, v (rotated), attention output (+ its log-sum-exp)
                                                    backward recomputes norm1, norm2, gate/up
                                                    (and, off the flash path, attention)
    keep 2 "all":        keep 1 + gate and up       backward recomputes the norms and activation

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
ga A product for all of them.

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

# The MLP runs in row chunks whose [rows, intermediate] tensors stay under this many bytes
# (LEANTUNE_MLP_CHUNK_MIB overrides, for benchmarks).
MLP_CHUNK_BYTES = int(float(os.environ.get("LEANTUNE_MLP_CHUNK_MIB", 128)) * 2**20)


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


class _Group:
    """Frozen projections (LoRALinear) reading one input, with their LoRA weights cast to the
    compute dtype once per step. The LoRA A's are concatenated: xa = x @ A_cat^T is [N, sum r]."""

    def __init__(self, mods, dtype: torch.dtype):
        self.mods = mods
        self.w = [m.base_weight() for m in mods]
        self.bias = [None if m.bias is None else m.bias.to(dtype) for m in mods]
        lora = [m for m in mods if m.has_lora]
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

    def forward(self, x: torch.Tensor, resid: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """x: [n, in] -> [y_i: [n, out_i]]; with `resid` (one projection): resid + y, in `out`."""
        xa = x @ self.a.t() if self.a is not None else None
        ys = []
        for m, w, bias, b, cols in zip(self.mods, self.w, self.bias, self.b, self.cols):
            if resid is not None:
                y = torch.addmm(resid, x, w.t(), out=out)
                if bias is not None:
                    y.add_(bias)
            elif bias is not None:
                y = torch.addmm(bias, x, w.t())
            else:
                y = x @ w.t()
            if b is not None:
                y.addmm_(xa[:, cols], b.t(), alpha=m.scaling)
            ys.append(y)
        return ys

    def backward(self, x: torch.Tensor, dys: list[torch.Tensor], grads: dict,
                 out: torch.Tensor | None = None, need_dx: bool = True) -> torch.Tensor | None:
        """Input gradient sum_i dy_i W_i + ga A_cat (into `out` if given; None without
        `need_dx`); LoRA grads into `grads` (param -> fp32 tensor, accumulated)."""
        dx = None
        if need_dx:
            dx = torch.mm(dys[0], self.w[0], out=out)
            for dy, w in zip(dys[1:], self.w[1:]):
                dx.addmm_(dy, w)
        if self.a is None:
            return dx
        xa = x @ self.a.t()
        gas = []
        for m, dy, b, cols in zip(self.mods, dys, self.b, self.cols):
            if b is None:
                continue
            ga = dy @ b
            if m.scaling != 1:
                ga.mul_(m.scaling)
            gas.append(ga)
            _accumulate(grads, m.lora_B.weight, dy.t() @ xa[:, cols], m.scaling)
        ga = gas[0] if len(gas) == 1 else torch.cat(gas, 1)
        ga_x = ga.t() @ x  # [sum r, in]
        for m, cols in zip(self.mods, self.cols):
            if cols is not None:
                _accumulate(grads, m.lora_A.weight, ga_x[cols], 1.0)
        if dx is not None:
            dx.addmm_(ga, self.a)
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
        return (_Group([a.q_proj, a.k_proj, a.v_proj], dtype), _Group([a.o_proj], dtype),
                _Group([m.gate_proj, m.up_proj], dtype), _Group([m.down_proj], dtype))

    def _norm(self, which, x2):
        n = getattr(self.layer, which)
        return rms_norm_fwd(x2, n.weight, n.eps, n.offset)

    def _attention(self, x2, shape, for_backward: bool = False):
        """norm1 -> q, k, v -> RoPE -> attention; returns xn1, rstd1, q4, k4, v4, out4, aux."""
        B, T, _ = shape
        at = self.layer.self_attn
        xn1, rstd1 = self._norm("input_layernorm", x2)
        q, k, v = self.qkv.forward(xn1)
        q4 = q.view(B, T, at.num_heads, at.head_dim)
        k4 = k.view(B, T, at.num_kv_heads, at.head_dim)
        v4 = v.view(B, T, at.num_kv_heads, at.head_dim)
        rope_(q4, k4, self.cos, self.sin)
        out4, aux = attention_forward(q4, k4, v4, self.meta, at.window, at.scale,
                                      for_backward)
        return xn1, rstd1, q4, k4, v4, out4, aux

    def _chunks(self, n: int, keep_gu: bool, itemsize: int = 2):
        """Row slices for the MLP: equal parts, multiples of 256 rows (whole GEMM tiles)."""
        if n == 0:
            return [slice(0, 0)]
        inter = self.layer.mlp.up_proj.out_features
        parts = 1 if keep_gu else max(1, -(-n * itemsize * inter // MLP_CHUNK_BYTES))
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
        _, _, q4, k4, v4, out4, aux = self._attention(x2, x.shape)
        attn2 = out4.reshape(B * T, -1)  # [N, Hq * D] (a copy only if attention returned a view)
        h_mid = self.o.forward(attn2, resid=x2)[0]
        keep = self.plan.keep
        xn2, _ = self._norm("post_attention_layernorm", h_mid)
        out = torch.empty_like(h_mid)
        for rows in self._chunks(B * T, keep >= 2, x.element_size()):
            g, u = self.gu.forward(xn2[rows])
            a = glu_fwd(g, u, self.act)
            self.down.forward(a, resid=h_mid[rows], out=out[rows])
        kept = {"x": x2}
        if keep >= 1:
            kept.update(h_mid=h_mid, q=q4, k=k4, v=v4, attn=attn2)
            self.aux = aux  # flash log-sum-exp (fp32 [Hq, N]) and rng state: small, stays here
        if keep >= 2:
            kept.update(g=g, u=u)
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
        if keep == 0:
            xn1, rstd1, q4, k4, v4, out4, aux = self._attention(x2, self.shape, True)
            h_mid = self.o.forward(out4.reshape(N, -1), resid=x2)[0]
        else:
            xn1, rstd1 = self._norm("input_layernorm", x2)
            q4, k4, v4, h_mid = (kept[n] for n in ("q", "k", "v", "h_mid"))
            out4 = kept["attn"].view(q4.shape)
            aux = self.aux

        # MLP: out = h_mid + down(act(gate(xn2)) * up(xn2))
        xn2, rstd2 = self._norm("post_attention_layernorm", h_mid)
        dxn2 = torch.empty_like(xn2)
        for rows in self._chunks(N, keep >= 2, dout.element_size()):
            if keep >= 2:
                g, u = kept["g"], kept["u"]
            else:
                g, u = self.gu.forward(xn2[rows])
            a = glu_fwd(g, u, self.act)
            da = self.down.backward(a, [dout[rows]], grads)
            del a
            glu_bwd_(da, g, u, self.act)  # g, u <- d gate, d up
            del da
            self.gu.backward(xn2[rows], [g, u], grads, out=dxn2[rows])
            del g, u
        post = self.layer.post_attention_layernorm
        dh_mid = rms_norm_bwd(dxn2, h_mid, post.weight, rstd2, post.offset).add_(dout)
        del dxn2, xn2, h_mid

        # attention: h_mid = x + o(attn(rope(q, k), v))
        at = self.layer.self_attn
        dattn = self.o.backward(out4.reshape(N, -1), [dh_mid], grads)
        dq, dk, dv = attention_backward(dattn.view(out4.shape), q4, k4, v4, out4, aux,
                                        self.meta, at.window, at.scale)
        del dattn, q4, k4, v4, out4, aux
        dq, dk, dv = dq.contiguous(), dk.contiguous(), dv.contiguous()
        rope_(dq, dk, self.cos, self.sin, inverse=True)
        dxn1 = self.qkv.backward(xn1, [dq.view(N, -1), dk.view(N, -1), dv.view(N, -1)], grads,
                                 need_dx=need_dx)
        del dq, dk, dv
        dx = None
        if need_dx:  # not for the first layer: its input is the (frozen) embedding
            norm = self.layer.input_layernorm
            dx = rms_norm_bwd(dxn1, x2, norm.weight, rstd1, norm.offset).add_(dh_mid).view(B, T, H)
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
