"""A group of frozen projections that read one input, with their LoRA adapters, for the
hand-written layer forward and backward.

LoRA math per projection (x: input [n, in], W: [out, in], A: [r, in], B: [out, r], s: scaling):

    y = x W^T + s (x A^T) B^T;   ga = s dy B;   dB = s dy^T (x A^T);   dA = ga^T x;
    dx = dy W + ga A

The group concatenates its A's: xa = x A_cat^T is [n, R], R = sum r. Packed (engine/weights.py)
it is one GEMM over [W_cat | s B] with xa in the input buffer's extra columns; in backward the
same packed weight gives dx and ga from one GEMM (dy [W | s B] = [dy W | ga]). Unpacked, one GEMM
per projection plus a rank-r product each. Outputs are one tensor [n, sum out].

Where the LoRA term is not inside the GEMM (an FP8 base; the unpacked o projection), it is added
with the residual in one pass over y (kernels/lora_add.py: y + resid + xa B_cat^T, B_cat the
s B_i side by side), not one addmm_ per projection after a residual pass
(EngineOptions.fuse_lora_add).
"""

from __future__ import annotations

import torch

from ..kernels.lora_add import MAX_RANK as _LORA_ADD_MAX_RANK
from ..kernels.lora_add import lora_add_
from .weights import DenseWeights


class ProjectionGroup:
    """Projections `mods` (LoRALinear, frozen base) reading one input, their LoRA weights cast to
    the compute dtype once per layer run; weights from `weights` (the provider), packed where
    `pack`."""

    def __init__(self, mods, dtype: torch.dtype, weights: DenseWeights, pack: bool):
        self.mods = mods
        self.in_f = mods[0].in_features
        self.outs = [m.out_features for m in mods]
        self.source = weights.source(mods, dtype, pack)
        self.packed = self.source.packed is not None
        self.width = self.source.width if self.packed else self.in_f
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
        self.lora_in_gemm = self.packed and self.width > self.in_f
        if self.lora_in_gemm:
            self.source.write_lora_columns(self.in_f, self.cols)
        # the LoRA term (and a residual) added by one kernel where it is not in the GEMM
        self.fuse_add = (weights.options.fuse_lora_add and self.R > 0
                         and not self.lora_in_gemm and self.R <= _LORA_ADD_MAX_RANK)
        self.fuse_grad_quant = weights.options.fuse_grad_quant
        # a residual (one projection) added by the GEMM, or by one add pass after it
        self.resid_in_gemm = self.source.adds_residual_free or weights.options.gemm_residual
        self.bias_cat = None
        if any(b is not None for b in self.bias):
            dev = mods[0].base_device
            self.bias_cat = torch.cat([torch.zeros(o, dtype=dtype, device=dev) if b is None
                                       else b for b, o in zip(self.bias, self.outs)])

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
        """A buffer for this group's input, [n, width] ([n, in] + R columns for x A^T and zero
        padding when packed): the caller writes x into [:, :in], then calls fill_lora."""
        X = torch.empty(n, self.width, dtype=like.dtype, device=like.device)
        if self.width > self.in_f + self.R:
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

    def quantized_input(self, X: torch.Tensor):
        """Buffers for the e4m3 codes of input X (new_input's buffer) where this group's
        forward GEMMs would quantise X themselves (the cuBLAS FP8 path: WeightSource.
        quantized_input), for the kernel that writes X to fill as it does (then pass it to
        project as `xq`); else None."""
        return self.source.quantized_input(X[:, :self.in_f])

    def project(self, X: torch.Tensor, resid: torch.Tensor | None = None,
                out: torch.Tensor | None = None, xq=None, lora: bool = True) -> torch.Tensor:
        """X: new_input's buffer after fill_lora (or [n, in] if not packed) -> y [n, sum out]
        = x W_cat^T + bias + LoRA; with `resid` (one projection): resid + y, into `out`.
        xq: X's quantized_input, filled (the base GEMMs read its codes), or None. lora=False
        (LoRA not inside the GEMM): without the LoRA terms, which the caller adds where it reads
        y (glu_terms)."""
        if not lora and self.lora_in_gemm:
            raise ValueError("lora=False: this group's LoRA term is inside its packed GEMM")
        if resid is not None and len(self.mods) != 1:
            raise ValueError("resid needs a group of one projection")
        # the LoRA term after the GEMM (not inside it), with the residual in the same pass
        # (unless the GEMM writes over the residual: out is resid; then the GEMM adds it)
        fused = self.fuse_add and lora
        in_place = (out is not None and resid is not None and out.untyped_storage().data_ptr()
                    == resid.untyped_storage().data_ptr())
        if in_place or (not fused and self.resid_in_gemm):
            gemm_resid, resid = resid, None  # added by the GEMM
        else:
            gemm_resid = None  # added after it: by lora_add_ (fused), else by an add pass
        if self.packed:
            if X.shape[1] != self.width:
                raise ValueError("packed group: pass new_input's buffer (after fill_lora)")
            y = self.source.mm_packed(X if xq is None else xq, out=out, resid=gemm_resid)
            if self.bias_cat is not None:
                y.add_(self.bias_cat)
            if self.a is not None and not self.lora_in_gemm and lora:
                xa = X[:, :self.in_f] @ self.a.t()
                if fused:
                    lora_add_(y, xa, self.b_cat(), resid)
                else:
                    self._addmm_lora(self.split(y), xa)
            if resid is not None and not fused:
                y.add_(resid)
            return y
        x = X[:, :self.in_f]
        xa = x @ self.a.t() if self.a is not None and lora else None
        xin = x if xq is None else xq
        if len(self.mods) == 1:
            y = self.source.mm(0, xin, out=out, resid=gemm_resid)
            ys = [y]
        else:
            y = out if out is not None else torch.empty(x.shape[0], sum(self.outs),
                                                        dtype=x.dtype, device=x.device)
            ys = self.split(y)
            for i, yi in enumerate(ys):
                self.source.mm(i, xin, out=yi)
        for yi, bias in zip(ys, self.bias):
            if bias is not None:
                yi.add_(bias)
        if fused:
            lora_add_(y, xa, self.b_cat(), resid)
        else:
            if xa is not None:
                self._addmm_lora(ys, xa)
            if resid is not None:
                y.add_(resid)
        return y

    def _addmm_lora(self, ys: list, xa: torch.Tensor) -> None:
        """ys[i] += s_i xa_i B_i^T, one rank-r addmm_ per projection (fuse_add off)."""
        for yi, m, b, cols in zip(ys, self.mods, self.b, self.cols):
            if b is not None:
                yi.addmm_(xa[:, cols], b.t(), alpha=m.scaling)

    def b_cat(self) -> torch.Tensor:
        """[sum out, R]: each projection's s B_i in its rows and its own R columns (zeros
        elsewhere), so that y + xa B_cat^T adds every projection's LoRA term (lora_add_). Made
        at each call, not held (a projection alone with s = 1: its B itself). s B is rounded to
        the compute dtype: exact for power-of-two scalings (alpha / r), as in glu_terms."""
        if len(self.mods) == 1 and self.mods[0].scaling == 1:
            return self.b[0].detach()
        t = torch.zeros(sum(self.outs), self.R, dtype=self.a.dtype, device=self.a.device)
        r = 0
        for o, m, b, cols in zip(self.outs, self.mods, self.b, self.cols):
            if b is not None:
                torch.mul(b.detach(), m.scaling, out=t[r:r + o, cols])
            r += o
        return t

    def lora_x(self, X: torch.Tensor) -> torch.Tensor | None:
        """x A_cat^T [n, R] for input X (a new_input buffer or [n, in]), None without LoRA."""
        return None if self.a is None else X[:, :self.in_f] @ self.a.t()

    @property
    def takes_glu_terms(self) -> bool:
        """Whether this is a gate | up pair with LoRA not inside its GEMM (glu_terms)."""
        return not (self.a is None or self.lora_in_gemm or len(self.mods) != 2
                    or self.outs[0] != self.outs[1])

    def glu_terms(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a gate | up group whose LoRA is not inside its GEMM (takes_glu_terms): (bg, bu)
        [I, R], the projections' s B placed in their own columns of x A_cat^T (zeros in the
        other's), the low-rank terms glu_fwd / glu_bwd_ add in the kernel (`lora` = (lora_x,
        bg, bu)); None where the group is not such a pair."""
        if not self.takes_glu_terms:
            return None
        bg, bu = self.b_cat().split(self.outs)  # (row blocks of one buffer)
        return bg, bu

    # --- backward ----------------------------------------------------------------------------
    def quantized_grad(self, dy: torch.Tensor):
        """Buffers for the e4m3 codes of an output gradient dy [n, sum out] (one tensor) where
        this group's input-gradient GEMM would quantise dy itself (an FP8 base on the cuBLAS
        path: WeightSource.quantized_grad; EngineOptions.fuse_grad_quant), for the kernel that
        writes dy to fill as it does (then pass it to input_grad / backward as `dyq`); else
        None."""
        return self.source.quantized_grad(dy) if self.fuse_grad_quant else None

    def grad_width(self) -> int:
        """Columns of the buffer input_grad writes dx into for one [n, sum out] gradient: the
        packed width where one GEMM over the whole packed weight gives dx and ga together (see
        input_grad), else in."""
        return self.width if self.has_lora_cols else self.in_f

    def input_grad(self, dys, out: torch.Tensor | None = None, need_dx: bool = True,
                   add_ga: bool = True, dyq=None):
        """dys: [n, sum out] or per-projection list -> (dx [n, in] = sum_i dy_i W_i + ga A_cat
        (into `out`, [n, grad_width()] for one tensor dys; None without need_dx), ga [n, R] =
        s dy_i B_i side by side, or None). add_ga=False: dx without ga A_cat, which the caller
        adds where it reads dx (glu_bwd_'s dy_lora). dyq: dys' quantized_grad, filled by the
        kernel that wrote dys (the GEMM reads its codes), or None.

        Packed with LoRA columns, dy @ [W | s B] = [dy W | s dy B] is dx and ga from one GEMM
        (K = sum out): ga needs no pass of its own over dy. dx and ga are then column views
        of one [n, packed width] buffer."""
        if need_dx and self.has_lora_cols and not isinstance(dys, (list, tuple)):
            wide = torch.mm(dys, self.source.get(), out=out)
            dx, ga = wide[:, :self.in_f], wide[:, self.in_f:self.in_f + self.R]
            if add_ga:
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
            if self.packed and not isinstance(dys, (list, tuple)):
                # one GEMM, K = sum out
                dx = self.source.mm_t_packed(dys if dyq is None else dyq, self.in_f, out=out)
            else:
                one = dyq if dyq is not None and len(self.mods) == 1 else parts[0]
                dx = self.source.mm_t(0, one, out=out)
                for i, dy in enumerate(parts[1:], 1):
                    self.source.mm_t(i, dy, out=dx, accumulate=True)
            if ga is not None and add_ga:
                dx.addmm_(ga, self.a)
        return dx, ga

    def lora_grads(self, x: torch.Tensor, dys, ga: torch.Tensor | None, grads: dict,
                   xa: torch.Tensor | None = None) -> None:
        """LoRA grads into `grads` (param -> its dtype, accumulated): dB_i = s dy_i^T xa_i,
        dA = ga^T x. x: [n, in]; xa = x A_cat^T if the caller has it."""
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
                 need_dx: bool = True, xa: torch.Tensor | None = None,
                 dyq=None) -> torch.Tensor | None:
        """Input gradient (into `out`, [n, grad_width()] for one tensor dys; None without
        need_dx) and LoRA grads for input X (a new_input buffer after fill_lora, or [n, in];
        xa: its x A_cat^T where the caller has it; dyq: as input_grad's)."""
        dx, ga = self.input_grad(dys, out, need_dx, dyq=dyq)
        if xa is None and self.R and X.shape[1] > self.in_f:
            xa = X[:, self.in_f:self.in_f + self.R]
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
