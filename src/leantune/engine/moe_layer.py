"""The fused executor's mixture-of-experts layer: attention as in every fused layer
(engine/executor.py), then the sparse MLP run by hand, routing grouped once per pass.

Per layer, with N tokens, k experts per token, M = N k routed rows, H hidden, I expert width:

    forward   xn = norm2(h_mid); weights [N, k], experts [N, k] = router(xn)
              Grouping (model/moe.py): one argsort by expert, counts, group ends
              xs = xn[tokens in expert order]                  [M, H]   one gather
              gu = xs @ W_gate_up[e]                           [M, 2I]  one grouped GEMM
              y  = act(gu) @ W_down[e]                         [M, H]   one grouped GEMM
              out = h_mid + sum_k weights * y  (token order)   [N, H]   one gather + sum
    backward  the router and grouping again (a small GEMM, N x H x E), gu kept (Keep.ALL) or
              again (one grouped GEMM), then
              dy = dout[tokens in expert order]                [M, H]
              G  = dy @ W_down[e]^T                            [M, I]   (unweighted)
              d weights = rowsum(G * act(gu)) (+ dy . down bias): the routing weights'
                gradient, which reaches xn through the frozen router (autograd over the
                router's few ops)
              d gu = weights * act'(gu) G; dxs = d gu @ W_gate_up[e]^T   [M, H]
              d xn = sum_k dxs (token order) + the router's part; d h_mid by norm2's backward

y itself is never kept nor recomputed: d weights needs only G and act(gu), which backward has.
What the layer keeps (`moe_kept_bytes`): its input (INPUT); h_mid, q/k/v, attention output and
statistics as dense layers (ATTENTION); and gate | up of the routed rows, [M, 2I] (ALL). The
router's choice is made again in backward from the same inputs, so it is the forward's.

LoRA on the experts (A [E, r, in], B [E, out, r] per projection, scale s) adds s (x A_e^T) B_e^T
to each projection: forward through Experts.project; backward adds s (dy B_e) A_e to the input
gradient and takes dB_e = s dy_e^T (x A_e^T)_e, dA_e = s (dy B_e)_e^T x_e per expert group
(`grouped_outer`: one 2-D grouped GEMM on CUDA) with the down projection's dy weighted by
the routing weights (its unweighted G still carries the LoRA term, for d weights).

Off the fused MoE path (the layer falls back to autograd, `moe_unsupported` says why): the
router's load-balancing loss and router jitter noise. gpt-oss's attention sinks (frozen) run in
the attention backend (engine/attention.py), its clamped SwiGLU's backward under autograd.
"""

from __future__ import annotations

import torch

from ..kernels.rmsnorm import rms_norm_bwd, rms_norm_fwd
from ..kernels.swiglu import glu_bwd_
from ..model.moe import _GROUPED_MM, Grouping, grouped_matmul
from .executor import Kept, Keep, _LayerRun
from .projections import ProjectionGroup
from .weights import layer_groups


def moe_unsupported(layer) -> str | None:
    """Why the fused MoE layer can't run `layer` (None if it can)."""
    moe = layer.mlp
    if moe.record_router_stats:
        return "the router's load-balancing loss (--router-aux-loss-coef)"
    if moe.spec.jitter_noise > 0:
        return "router jitter noise"
    return None


def moe_kept_bytes_per_token(cfg, keep: Keep, itemsize: int = 2, lora_ranks: int = 0) -> int:
    """Bytes per token a MoE layer keeps at `keep` (module docstring; lora_ranks: the q/k/v
    group's LoRA columns)."""
    values = cfg.hidden_size
    extra = 0
    if keep >= Keep.ATTENTION:
        from .attention import AttentionBackend

        values += cfg.hidden_size + 2 * cfg.q_size + 2 * cfg.kv_size + lora_ranks
        extra = AttentionBackend.state_bytes_per_token(cfg.num_attention_heads)
    if keep >= Keep.ALL:  # gate | up of the routed rows (of a dense layer's, where wider)
        values += 2 * cfg.mlp_width
    return itemsize * values + extra


def moe_forward_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of one MoE layer's forward: projections, router, the k experts' MLPs."""
    spec, h = cfg.moe, cfg.hidden_size
    return 2.0 * tokens * (h * (2 * cfg.q_size + 2 * cfg.kv_size) + h * spec.num_experts
                           + 3 * h * spec.top_k * spec.intermediate_size)


def moe_working_bytes(cfg, tokens: int, itemsize: int = 2) -> int:
    """The MoE block's largest transient set (backward): the routed rows' dy and dxs [M, H],
    gu [M, 2I], G and act(gu) [M, I], and the router's fp32 probabilities and their gradient
    [N, E] (x3)."""
    spec = cfg.moe
    M = tokens * spec.top_k
    return (itemsize * M * (2 * cfg.hidden_size + 4 * spec.intermediate_size)
            + 12 * tokens * spec.num_experts)


class MoELayerRun(_LayerRun):
    """One MoE layer's forward/backward (module docstring)."""

    def _groups(self, dtype):
        qkv, o, _, _ = layer_groups(self.layer)
        w = self.ex.weights
        self.qkv = ProjectionGroup(qkv, dtype, w, pack=True)
        self.o = ProjectionGroup(o, dtype, w, pack=False)
        self.gu = self.down = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layer.mlp.record_router_stats:  # (moe_unsupported keeps such layers away)
            raise RuntimeError("the fused MoE layer computes no load-balancing loss: attach the "
                               "executors after setting CausalLM.router_aux_loss")
        return super().__call__(x)

    def _route(self, xn: torch.Tensor):
        """xn [N, H] -> (routing weights [N, k] fp32, Grouping)."""
        moe = self.layer.mlp
        _, weights, idx = moe.route(xn)
        return weights, Grouping.build(idx, moe.spec.num_experts, moe.grouped_mm)

    def _mlp_forward(self, h_mid: torch.Tensor, out: torch.Tensor, keeps_state: bool) -> dict:
        moe, post = self.layer.mlp, self.layer.post_attention_layernorm
        xn, _ = rms_norm_fwd(h_mid, post.weight, post.eps, post.offset)
        weights, g = self._route(xn)
        gu = moe.experts.project("gate_up_proj", xn.index_select(0, g.tokens), g)
        del xn
        y = moe.experts.project("down_proj", moe.experts.activate(gu), g)
        torch.add(h_mid, moe.combine(y, weights, g), out=out)
        return {"gu": gu} if self.in_graph and self.plan.keep >= Keep.ALL else {}

    def _mlp_backward(self, h_mid: torch.Tensor, dout: torch.Tensor, kept: Kept,
                      grads: dict) -> torch.Tensor:
        moe, post = self.layer.mlp, self.layer.post_attention_layernorm
        experts, k = moe.experts, moe.spec.top_k
        N, H = dout.shape
        xn, rstd = rms_norm_fwd(h_mid, post.weight, post.eps, post.offset)
        with torch.enable_grad():  # the router under autograd: its gradient reaches xn
            xn_leaf = xn.detach().requires_grad_()
            weights, g = self._route(xn_leaf)
        lora = experts.has_lora
        gu, kept.gu = kept.gu, None
        xs = xn.index_select(0, g.tokens) if gu is None or lora else None  # [M, H]
        if gu is None:
            gu = experts.project("gate_up_proj", xs, g)
        del xn
        w = weights.detach().reshape(-1).index_select(0, g.order)  # [M] fp32, expert order
        dy = dout.index_select(0, g.tokens)  # [M, H]: each routed row's output gradient
        G = self._input_grad("down_proj", dy, g)  # [M, I], unweighted (LoRA's term included)
        act, dgu = self._activation_backward(G, gu)  # act(gu) [M, I]; d gu for G, [M, 2I]
        del gu
        d_w = (G.float() * act.float()).sum(-1)  # [M]: d of each row's routing weight
        bias = experts.down_proj_bias
        if bias is not None:
            d_w += (dy.float() * bias.index_select(0, g.experts).float()).sum(-1)
        del G
        if lora:
            self._lora_grads("down_proj", act, dy.mul_(w.to(dy.dtype)[:, None]), g, grads)
        del act, dy
        dgu.mul_(w.to(dgu.dtype)[:, None])
        dxs = self._input_grad("gate_up_proj", dgu, g)  # [M, H]
        if lora:
            self._lora_grads("gate_up_proj", xs, dgu, g, grads)
        del dgu, xs
        dxn = dxs.index_select(0, g.inverse).view(N, k, H).sum(1)
        del dxs
        (d_router,) = torch.autograd.grad(weights, xn_leaf,
                                          d_w.index_select(0, g.inverse).view(N, k))
        dxn += d_router
        del d_router
        return rms_norm_bwd(dxn, h_mid, post.weight, rstd, post.offset, residual=dout)

    def _input_grad(self, name: str, dy: torch.Tensor, g: Grouping) -> torch.Tensor:
        """d input [M, in] of expert projection `name` for dy [M, out]: dy W_e (+ s (dy B_e) A_e
        with LoRA)."""
        experts = self.layer.mlp.experts
        dx = grouped_matmul(dy, experts.weight_in_out(name).transpose(1, 2), g)
        if name in experts.lora_A:
            t = grouped_matmul(dy, experts.lora_B[name].to(dy.dtype), g)  # [M, r]
            dx.add_(grouped_matmul(t, experts.lora_A[name].to(dy.dtype), g),
                    alpha=experts.scaling)
        return dx

    def _lora_grads(self, name: str, x: torch.Tensor, dy: torch.Tensor, g: Grouping,
                    grads: dict) -> None:
        """dA [E, r, in], dB [E, out, r] of projection `name`'s expert LoRA from its input x
        [M, in] and output gradient dy [M, out] (weighted), into `grads`."""
        experts = self.layer.mlp.experts
        A, B = experts.lora_A[name], experts.lora_B[name]
        s = experts.scaling
        xa = grouped_matmul(x, A.to(x.dtype).transpose(1, 2), g)  # [M, r]
        t = grouped_matmul(dy, B.to(dy.dtype), g)  # [M, r]
        if B.requires_grad:
            grads[B] = grouped_outer(dy, xa, g).mul_(s).to(B.dtype)
        if A.requires_grad:
            grads[A] = grouped_outer(t, x, g).mul_(s).to(A.dtype)

    def _activation_backward(self, G: torch.Tensor, gu: torch.Tensor):
        """(act(gu) [M, I], d gu [M, 2I]) for the upstream gradient G [M, I] of act(gu). The
        [gate | up] GLU by our kernel, in place in gu; gpt-oss's clamped SwiGLU by autograd."""
        experts = self.layer.mlp.experts
        if experts.spec.swiglu_limit is None:
            inter = gu.shape[1] // 2
            act = torch.empty_like(G)
            glu_bwd_(G, gu[:, :inter], gu[:, inter:], experts.act, h_out=act)
            return act, gu
        with torch.enable_grad():
            leaf = gu.detach().requires_grad_()
            act = experts.activate(leaf)
            (dgu,) = torch.autograd.grad(act, leaf, G)
        return act.detach(), dgu


def grouped_outer(u: torch.Tensor, v: torch.Tensor, g: Grouping, kernel=None) -> torch.Tensor:
    """Per expert group e, u_e^T v_e: u [M, p], v [M, q] (rows in expert order) -> [E, p, q]
    fp32, zeros for an empty group (the weight gradient of a grouped matmul).

    On CUDA in bf16: one 2-D grouped GEMM (`kernel`, default torch's), whose groups split the
    contraction dimension and must start at 16-byte boundaries: the rows are first copied into
    groups padded with zero rows to multiples of 8 (on the device, no host sync). Elsewhere a
    loop over the groups."""
    E = g.counts.shape[0]
    if kernel is None and (_GROUPED_MM is not None and u.is_cuda
                           and u.dtype == v.dtype == torch.bfloat16
                           and u.shape[1] % 8 == 0 and v.shape[1] % 8 == 0):  # 16-byte rows
        kernel = _GROUPED_MM
    if kernel is not None:
        up, vp, ends = pad_groups(u, v, g, align=8)
        # bf16 out (fp32 accumulation inside): torch 2.11 refuses an fp32 out for bf16 inputs
        return kernel(up.t().contiguous(), vp, offs=ends).float()
    out = u.new_zeros(E, u.shape[1], v.shape[1], dtype=torch.float32)
    start = 0
    for e, n in enumerate(g.host_counts):
        if n:
            out[e] = u[start:start + n].t().float() @ v[start:start + n].float()
            start += n
    return out


def pad_groups(u: torch.Tensor, v: torch.Tensor, g: Grouping, align: int):
    """u [M, p], v [M, q] in expert order -> (u', v' [R, p|q], ends [E] int32): each group
    padded with zero rows to a multiple of `align` rows; R = M + align * E rounded up to
    `align` (room for the worst case; rows past ends[-1] are zeros)."""
    M, E = u.shape[0], g.counts.shape[0]
    padded = (g.counts + align - 1) // align * align
    ends = torch.cumsum(padded, 0)
    starts = g.ends.long() - g.counts  # each group's first row, unpadded
    pos = (torch.arange(M, device=u.device) - starts.index_select(0, g.experts)
           + (ends - padded).index_select(0, g.experts))
    rows = -(-(M + align * E) // align) * align
    up = u.new_zeros(rows, u.shape[1]).index_copy_(0, pos, u)
    vp = v.new_zeros(rows, v.shape[1]).index_copy_(0, pos, v)
    return up, vp, ends.to(torch.int32)
