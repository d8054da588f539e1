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
              d gu = act'(gu) (weights G); dxs = d gu @ W_gate_up[e]^T   [M, H]
              d xn = sum_k dxs (token order) + the router's part; d h_mid by norm2's backward

The expert weights come from the engine's weight provider (`DenseWeights.experts`: the seam
where 4-bit experts would be dequantised, as 4-bit projections are). y itself is never kept nor
recomputed (but for expert LoRA's term, which backward runs again): d weights needs only G and
act(gu), which backward has. What the layer keeps (executor.Kept, per token): its input
(INPUT); h_mid, q/k/v, attention output and statistics as dense layers (ATTENTION); and gate |
up of the routed rows, [M, 2I] (ALL: 2 mlp_width values a token). The router's choice is made
again in backward from the same inputs, so it is the forward's.

LoRA on the experts (A [E, r, in], B [E, out, r] per projection, scale s) adds s (x A_e^T) B_e^T
to each projection: forward through Experts.project; backward runs that term again under
autograd (rank r: cheap), so its input gradient and dA, dB come from the grouped matmuls' own
backward, and the term itself joins d weights. (A first version took the per-group weight
gradients by hand, one 2-D grouped GEMM over zero-padded groups; with it the fused step ran at
11.5k tok/s against the autograd path's 13.2k on an H200: Qwen3-30B-A3B, 4 x 2048 tokens.)

Off the fused MoE path (the layer falls back to autograd, `moe_unsupported` says why): the
router's load-balancing loss and router jitter noise. gpt-oss's attention sinks (frozen) run in
the attention backend (engine/attention.py), its clamped SwiGLU's backward under autograd.
"""

from __future__ import annotations

import torch

from ..kernels.rmsnorm import rms_norm_bwd, rms_norm_fwd
from ..kernels.swiglu import glu_bwd_
from ..model.moe import Grouping, grouped_matmul
from .executor import Kept, Keep, _LayerRun
from .projections import ProjectionGroup
from ..utils.tensors import rowdot
from .weights import layer_groups


def moe_unsupported(layer) -> str | None:
    """Why the fused MoE layer can't run `layer` (None if it can)."""
    moe = layer.mlp
    if moe.record_router_stats:
        return "the router's load-balancing loss (--router-aux-loss-coef)"
    if moe.spec.jitter_noise > 0:
        return "router jitter noise"
    return None


def moe_forward_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of one MoE layer's forward: projections, router, the k experts' MLPs."""
    spec, h = cfg.moe, cfg.hidden_size
    return 2.0 * tokens * (h * (2 * cfg.q_size + 2 * cfg.kv_size) + h * spec.num_experts
                           + 3 * h * spec.top_k * spec.intermediate_size)


def moe_working_bytes(cfg, tokens: int, itemsize: int = 2, expert_lora: bool = False) -> int:
    """The MoE block's largest transient set, M = tokens * k routed rows. Forward: gu [M, 2I]
    with act(gu) [M, I] and y [M, H], then y, y times its weights and that in token order
    [M, H] each. Backward: xn [N, H] throughout, gu [M, 2I] (again, where not kept: the planner
    takes kept gate/up off), then dy, act(gu), d act ([M, H], [M, I], [M, I]) or dxs and its
    token-order copy [M, H] each plus d xn [N, H]. gpt-oss's clamped SwiGLU (elementwise ops
    under autograd) holds ~4 more [M, I] in forward and ~7 in backward. Expert LoRA adds xs
    [M, H] held through backward, its term and dy times the weights [M, H] each, and its input
    gradient [M, I]. The router's fp32 probabilities and gradients: [N, E] x3."""
    spec, H = cfg.moe, cfg.hidden_size
    M, I = tokens * spec.top_k, spec.intermediate_size
    clamped = spec.swiglu_limit is not None
    forward = max(M * (3 * I + H), M * (2 * I + 3 * H)) + (4 * M * I if clamped else 0)
    backward = (tokens * H + M * 2 * I + max(M * (H + 2 * I) + (7 * M * I if clamped else 0),
                                             2 * M * H + tokens * H))
    lora = M * (3 * H + I) if expert_lora else 0
    return itemsize * (max(forward, backward) + lora) + 12 * tokens * spec.num_experts


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
        moe, post = self.layer.mlp, self.layer.norm("mlp_in")
        xn, _ = rms_norm_fwd(h_mid, post.weight, post.eps, post.offset)
        weights, g = self._route(xn)
        gu = self._project("gate_up_proj", xn.index_select(0, g.tokens), g)
        del xn
        y = self._project("down_proj", moe.experts.activate(gu), g)
        torch.add(h_mid, moe.combine(y, weights, g), out=out)
        return {"gu": gu} if self.in_graph and self.plan.keep >= Keep.ALL else {}

    def _mlp_backward(self, h_mid: torch.Tensor, dout: torch.Tensor, kept: Kept,
                      grads: dict) -> torch.Tensor:
        moe, post = self.layer.mlp, self.layer.norm("mlp_in")
        experts, k = moe.experts, moe.spec.top_k
        N, H = dout.shape
        xn, rstd = rms_norm_fwd(h_mid, post.weight, post.eps, post.offset)
        with torch.enable_grad():  # the router under autograd: its gradient reaches xn (whose
            xn_leaf = xn.detach().requires_grad_()  # storage the graph holds to the end)
            weights, g = self._route(xn_leaf)
        lora = experts.has_lora
        gu, kept.gu = kept.gu, None
        xs = xn.index_select(0, g.tokens) if gu is None or lora else None  # [M, H]
        if gu is None:
            gu = self._project("gate_up_proj", xs, g)
        if not lora:  # (expert LoRA's backward reads xs again)
            xs = None
        w = weights.detach().reshape(-1).index_select(0, g.order)[:, None]  # [M, 1] fp32
        dy = dout.index_select(0, g.tokens)  # [M, H]: each routed row's output gradient
        act = experts.activate(gu)  # [M, I]: the down projection's input
        da = grouped_matmul(dy, self._weight("down_proj").transpose(1, 2), g)  # [M, I]
        # d of each row's routing weight: dy . y, y = act W_down (+ bias, + LoRA's s act A^T B^T)
        d_w = rowdot(da, act)
        bias = experts.down_proj_bias
        if bias is not None:  # dy . bias[e] as [M, E] products, not an [M, H] gather of biases
            d_w += (dy @ bias.t()).gather(1, g.experts[:, None]).view(-1).float()
        da.mul_(w.to(da.dtype))  # the routing weight scales y: now d act
        if lora:
            y_lora, da_lora = self._lora_backward("down_proj", act, dy * w.to(dy.dtype), g,
                                                  grads)
            d_w += rowdot(dy, y_lora)
            da += da_lora
            del y_lora, da_lora
        del dy, act
        dgu = self._activation_backward(da, gu)  # [M, 2I]
        del da, gu
        dxs = grouped_matmul(dgu, self._weight("gate_up_proj").transpose(1, 2), g)
        if lora:
            dxs += self._lora_backward("gate_up_proj", xs, dgu, g, grads)[1]
        del dgu, xs
        dxn = dxs.index_select(0, g.inverse).view(N, k, H).sum(1)
        del dxs
        (d_router,) = torch.autograd.grad(weights, xn_leaf,
                                          d_w.index_select(0, g.inverse).view(N, k))
        dxn += d_router
        del d_router
        return rms_norm_bwd(dxn, h_mid, post.weight, rstd, post.offset, residual=dout)

    def _weight(self, name: str) -> torch.Tensor:
        """Expert projection `name`'s base weight [E, in, out], from the weight provider."""
        return self.ex.weights.experts(self.layer.mlp.experts, name)

    def _project(self, name: str, x: torch.Tensor, g: Grouping) -> torch.Tensor:
        return self.layer.mlp.experts.project(name, x, g, weight=self._weight(name))

    def _lora_backward(self, name: str, x: torch.Tensor, dy: torch.Tensor, g: Grouping,
                       grads: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The expert LoRA term of projection `name`, s (x A_e^T) B_e^T, again under autograd
        (its grouped matmuls' own backward): x [M, in], dy [M, out] its output's gradient ->
        (the term [M, out], its input gradient [M, in]); dA, dB into `grads`."""
        experts = self.layer.mlp.experts
        A, B = experts.lora_A[name], experts.lora_B[name]
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            xa = grouped_matmul(leaf, A.to(x.dtype).transpose(1, 2), g)  # [M, r]
            y = grouped_matmul(xa, B.to(x.dtype).transpose(1, 2), g) * experts.scaling
            wants = [leaf] + [p for p in (A, B) if p.requires_grad]
            got = torch.autograd.grad(y, wants, dy)
        for p, grad in zip(wants[1:], got[1:]):
            grads[p] = grad
        return y.detach(), got[0]

    def _activation_backward(self, da: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
        """d gu [M, 2I] for the gradient da [M, I] of act(gu): the [gate | up] GLU by our
        kernel, in place in gu; gpt-oss's clamped SwiGLU by autograd."""
        experts = self.layer.mlp.experts
        if experts.spec.swiglu_limit is None:
            inter = gu.shape[1] // 2
            glu_bwd_(da, gu[:, :inter], gu[:, inter:], experts.act)
            return gu
        with torch.enable_grad():
            leaf = gu.detach().requires_grad_()
            (dgu,) = torch.autograd.grad(experts.activate(leaf), leaf, da)
        return dgu

