"""The projections of a decode step with fewer, wider kernels (the decode loop's `projections`).

A decode step is a few hundred small kernels; on the GPU each costs a few microseconds even
inside a CUDA graph, so their number, not the bytes read, sets the step time of small models.
The plain LoRALinear path runs, per adapted projection, two casts of the adapter (fp32 master
weights under a bf16 base), x A^T, x W^T and the rank-r addmm: 5 kernels, 35 a layer. Modes:

    "plain"    the model's own forward (the reference).
    "precast"  each adapter cast to the compute dtype once per decode call, into buffers the
               step keeps (so the graph reads them by address): 3 kernels a projection.
    "packed"   (default) where the engine has packed a layer's weights (a trainer's FusedExecutor:
               engine/weights.py, [W_cat | s B_blockdiag] with LoRA columns), q/k/v, gate/up and
               down each run as [x | x A_pad^T] @ packed^T: one GEMM for A, one concat, one wide
               GEMM for the group, and the MLP's GLU reads the gate/up halves in place; the
               others (o, layers without a packed provider) as "precast". A layer whose q/k/v
               (gate/up) are FP8 bases (--precision fp8) runs each group as ONE weight-only FP8
               GEMV over the members' stacked e4m3 codes (`_PackedFP8`; the members' buffers are
               views of one storage: engine/weights.DenseWeights.fp8_packed, no copy kept), the
               LoRA term its residual (an adapted FP8 o / down: the same, one member);
               LEANTUNE_FP8_PACKED_DECODE=0 keeps the model's own forward, one GEMV a
               projection. With FP8 projections the LM head of a step runs as an FP8 GEMV too
               (`_FP8Head`: an e4m3 copy of the untied head, kept with the model; half the
               16-bit head's bytes a token); LEANTUNE_FP8_DECODE_HEAD=0 keeps the 16-bit head.

`refresh()` copies the live adapter into the buffers (A casts, the packed weight's LoRA
columns); the decode loop calls it at every call, before the prefill, so a graph captured in an
earlier call sees the adapter as trained since. `installed()` sets the modules' forwards (and,
with the FP8 head, the model's `logits`) for the duration of a decode (instance attributes,
removed after); nothing else of the model changes, beyond FP8 groups' codes stacked once.
"""

from __future__ import annotations

import contextlib
import os
import weakref

import torch

from ..kernels.fp8 import fp8_mm
from ..lora.function import lora_linear

MODES = ("packed", "precast", "plain")


class _Precast:
    """One LoRALinear with a 16-bit (or fp32) base whose adapter is cast once per call."""

    def __init__(self, m, dtype: torch.dtype):
        self.m = m
        self.a = m.lora_A.weight.detach().to(dtype)  # (the parameter itself where dtypes match)
        self.b = m.lora_B.weight.detach().to(dtype)

    def refresh(self) -> None:
        for buf, p in ((self.a, self.m.lora_A.weight), (self.b, self.m.lora_B.weight)):
            if buf.data_ptr() != p.data_ptr():
                buf.copy_(p)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        return lora_linear(x, m.weight, m.bias, self.a, self.b, m.scaling)


def _lora_cols(ranks) -> tuple[list, int]:
    """Each member's LoRA columns (a slice, None for rank 0) in a packed group, and their sum."""
    cols, c = [], 0
    for r in ranks:
        cols.append(slice(c, c + r) if r else None)
        c += r
    return cols, c


def _bias_buffer(mods, dtype, dev) -> torch.Tensor | None:
    """The group's stacked bias [sum out] (zeros; refresh fills it), None where none has one."""
    if not any(m.bias is not None for m in mods):
        return None
    return torch.zeros(sum(m.out_features for m in mods), dtype=dtype, device=dev)


class _Packed:
    """Projections reading one input (q/k/v, gate/up, down) over the engine's packed weight
    [sum out, width]: x [..., in] -> [..., sum out] = [x | x A_pad^T] @ packed^T (+ bias), where
    A_pad [width - in, in] holds the adapted members' A in their LoRA columns' order and zero
    rows for the padding. None from `make` where the group does not qualify."""

    def __init__(self, mods, source, cols, dtype):
        self.mods, self.source, self.cols = mods, source, cols
        self.in_f = mods[0].in_features
        width = source.packed.shape[1]
        dev = source.packed.device
        self.a = torch.zeros(width - self.in_f, self.in_f, dtype=dtype, device=dev)
        self.outs = [m.out_features for m in mods]
        self.bias = _bias_buffer(mods, dtype, dev)
        self.refresh()

    @staticmethod
    def make(mods, weights, dtype):
        from ..engine.weights import WeightSource, _lora_rank

        if weights is None or any(m.quantized is not None for m in mods):
            return None
        source = weights.source(mods, dtype, pack=True)
        if type(source) is not WeightSource or source.packed is None:  # (no NF4 / FP8 scratch)
            return None
        (rows, width), ranks = weights.layout(mods)
        if (tuple(source.packed.shape) != (rows, width)
                or list(ranks) != [_lora_rank(m) for m in mods]):
            return None  # LoRA columns off (pack_lora): the LoRA term is not in the GEMM
        return _Packed(mods, source, _lora_cols(ranks)[0], dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        for m, c in zip(self.mods, self.cols):
            if c is not None:
                self.a[c].copy_(m.lora_A.weight)
        if any(c is not None for c in self.cols):
            self.source.write_lora_columns(self.in_f, self.cols)
        if self.bias is not None:
            row = 0
            for m, o in zip(self.mods, self.outs):
                if m.bias is not None:
                    self.bias[row:row + o].copy_(m.bias)
                row += o

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_f)
        X = torch.cat([x2, x2 @ self.a.t()], 1) if self.a.shape[0] else x2
        y = self.source.mm_packed(X)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.outs, dim=-1))


def fp8_packing() -> bool:
    """Whether "packed" runs FP8 q/k/v and gate/up as one GEMV a group (LEANTUNE_FP8_PACKED_DECODE,
    default on; 0: each projection its own, the model's forward)."""
    return os.environ.get("LEANTUNE_FP8_PACKED_DECODE", "1") != "0"


class _PackedFP8:
    """Projections reading one input (q/k/v, gate/up) whose bases are all FP8, as one FP8
    product over their stacked codes (view: an FP8View [sum out, in]): x [..., in] ->
    [..., sum out] = x W_cat^T + (x A_cat^T) (s B_blockdiag)^T (+ bias). On a decode step
    (<= 16 rows) fp8_mm runs it as one GEMV whose residual is the LoRA term: 3 kernels a
    group with an adapter (x A_cat^T, its product with B, the GEMV), 1 without; the prefill
    runs the FP8 GEMM. A_cat [sum r, in] and s B_blockdiag [sum out, sum r] are the adapted
    members' adapters cast once per decode call (refresh). None from `make` where the group
    does not qualify (a member not FP8, mixed input sizes, an output not a multiple of 128).
    One member (view: its FP8Weight): an adapted FP8 o / down projection, 3 kernels instead
    of the LoRALinear forward's 7."""

    def __init__(self, mods, view, dtype):
        self.mods, self.view = mods, view
        self.in_f = mods[0].in_features
        self.outs = [m.out_features for m in mods]
        dev = view.device
        self.cols, c = _lora_cols([m.r if m.has_lora else 0 for m in mods])
        self.a = torch.zeros(c, self.in_f, dtype=dtype, device=dev) if c else None
        self.b = torch.zeros(sum(self.outs), c, dtype=dtype, device=dev) if c else None
        self.bias = _bias_buffer(mods, dtype, dev)
        self.refresh()

    @staticmethod
    def make(mods, weights, dtype):
        if len(mods) < 2 or not fp8_packing() or any(m.fp8 is None for m in mods):
            return None
        if weights is None:  # (no engine: plain generate)
            from ..engine.weights import plain_weights
            weights = plain_weights()
        view = weights.fp8_packed(mods)
        return None if view is None else _PackedFP8(mods, view, dtype)

    @torch.no_grad()
    def refresh(self) -> None:
        row = 0
        for m, c, o in zip(self.mods, self.cols, self.outs):
            if c is not None:
                self.a[c].copy_(m.lora_A.weight)
                self.b[row:row + o, c].copy_(m.lora_B.weight)
                self.b[row:row + o, c].mul_(m.scaling)
            if self.bias is not None and m.bias is not None:
                self.bias[row:row + o].copy_(m.bias)
            row += o

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_f)
        lora = None
        if self.a is not None:
            xa = x2 @ self.a.t()
            lora = (xa @ self.b.t() if self.bias is None
                    else torch.addmm(self.bias, xa, self.b.t()))
        y = fp8_mm(x2, self.view, resid=lora)
        if self.bias is not None and lora is None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])

    split = _Packed.split


def fp8_head_on() -> bool:
    """Whether decoding a model with FP8 projections runs its LM head as an FP8 GEMV
    (LEANTUNE_FP8_DECODE_HEAD, default on; 0: the 16-bit head)."""
    return os.environ.get("LEANTUNE_FP8_DECODE_HEAD", "1") != "0"


_HEADS = weakref.WeakKeyDictionary()  # model -> its decode FP8 head (kept across decode calls)


class _FP8Head:
    """The logits of a decode step from an e4m3 copy of the untied, frozen LM head W [V, H]
    (128 x 128 block scales, quantised once and kept with the model: V * H bytes beside the
    16-bit head, which training and the prefill keep using). A step's <= 16 rows read the FP8
    codes (fp8_mm: the weight-only GEMV on the GPU, half the 16-bit head's bytes: the largest
    single read of a small-batch step); more rows (a prefill) take the 16-bit head. None from
    `make` where the switch is off, the model has no FP8 projection (--precision fp8) or its
    head is tied. refresh() (each decode call) re-quantises where the head has changed since
    (trained in place: its version counter; replaced: its address)."""

    def __init__(self, model, q):
        self.model = weakref.ref(model)  # (no reference to the model: it keys _HEADS)
        self.q, self.key = q, None
        self.refresh()

    @staticmethod
    def make(model):
        head = getattr(model, "lm_head", None)
        if (not fp8_head_on() or not isinstance(head, torch.nn.Linear)
                or head.bias is not None
                or not any(getattr(m, "fp8", None) is not None for m in model.modules())):
            return None
        if model not in _HEADS:
            from ..kernels.fp8 import FP8Weight

            w = head.weight
            _HEADS[model] = _FP8Head(model, FP8Weight(tuple(w.shape), w.dtype, device=w.device))
        return _HEADS[model]

    @torch.no_grad()
    def refresh(self) -> None:
        w = self.model().lm_head.weight
        key = (w.data_ptr(), w._version, w.device)
        if key != self.key:  # (in place: a captured graph reads the same buffers)
            self.q.to(w.device).quantize_(w)
            self.key = key

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, H] (the rows' last hidden states) -> logits [B, V] (model.logits' contract)."""
        from ..kernels.fp8_gemv import GEMV_MAX_ROWS

        model = self.model()
        if h.dim() != 2 or h.shape[0] > GEMV_MAX_ROWS:
            return type(model).logits(model, h)
        logits = fp8_mm(h, self.q)
        cap = model.config.final_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap


class DecodeProjections:
    """The forwards one decode installs on `model`'s projection modules (module docstring)."""

    def __init__(self, model, mode: str = "packed"):
        if mode not in MODES:
            raise ValueError(f"projections must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.forwards: list[tuple[torch.nn.Module, object]] = []  # (module, its forward)
        self.parts: list = []  # what refresh() refreshes
        self.packed_groups = 0
        self.model = weakref.ref(model)  # (no reference: the model keys the steps kept)
        self.head = _FP8Head.make(model) if mode == "packed" else None
        if self.head is not None:
            self.parts.append(self.head)
        if mode == "plain":
            return
        from ..engine.weights import layer_groups

        dtype = model.model.embed_tokens.weight.dtype
        for layer in model.layers:
            if (not hasattr(layer.mlp, "gate_proj")
                    or getattr(layer, "_compiled_call_impl", None) is not None):
                continue  # MoE layers, layers under torch.compile (--compile): the plain path
            weights = getattr(layer.executor, "weights", None) if mode == "packed" else None
            stream = getattr(layer.executor, "stream", None)
            if stream is not None and stream.streams(layer):  # base weights streamed from the
                weights = None  # host (engine/weight_stream.py): read per call, as "precast"
            qkv, o, gu, down = layer_groups(layer)
            done = set()
            fp8 = mode == "packed"  # (FP8 groups: with or without an engine)
            g = _Packed.make(qkv, weights, dtype) or (
                _PackedFP8.make(qkv, weights, dtype) if fp8 else None)
            if g is not None:
                self._attention(qkv, g)
                done.update(qkv)
            g = _Packed.make(gu, weights, dtype)
            d = _Packed.make(down, weights, dtype)
            if g is None and fp8 and layer.mlp.act is not None:
                g = _PackedFP8.make(gu, weights, dtype)
                d = d or down[0]  # (down: its own forward, precast below where it qualifies)
            if g is not None and d is not None and layer.mlp.act is not None:
                self._mlp(layer.mlp, g, d)
                done.update(gu + ([] if d is down[0] else down))
            for m in qkv + o + gu + down:
                if m in done or not m.has_lora:
                    continue
                p = None
                if m.quantized is None:
                    p = _Precast(m, dtype)
                elif m.fp8 is not None and fp8_packing():  # (o, down: one member, the same
                    p = _PackedFP8([m], m.fp8, dtype)      # GEMV + LoRA residual)
                if p is not None:
                    self.parts.append(p)
                    self.forwards.append((m, p))

    def _attention(self, mods, group: _Packed) -> None:
        """q_proj runs the whole q/k/v GEMM; k_proj and v_proj, called next with the same input
        (Attention.forward), return its other columns (else they compute their own)."""
        self.parts.append(group)
        self.packed_groups += 1
        held = {}

        def first(x):
            held["x"], held["parts"] = x, group.split(group(x))
            return held["parts"][0]

        def member(i):
            def fwd(x):
                if held.get("x") is x:
                    y = held["parts"][i]
                    if i == len(mods) - 1:
                        held.clear()
                    return y
                return type(mods[i]).forward(mods[i], x)
            return fwd

        self.forwards.append((mods[0], first))
        self.forwards += [(m, member(i)) for i, m in enumerate(mods) if i]

    def _mlp(self, mlp, gu, down) -> None:
        """down(act(gate) * up) with gate/up from one GEMM, the GLU reading its halves in place
        (gu a _Packed or _PackedFP8; down a _Packed, or the down_proj module itself)."""
        from ..kernels.swiglu import glu_fwd

        for part in (gu, down):
            if isinstance(part, (_Packed, _PackedFP8)):
                self.parts.append(part)
                self.packed_groups += 1
        inter = gu.outs[0]

        def fwd(x):
            y = gu(x)
            y2 = y.reshape(-1, y.shape[-1])
            h = glu_fwd(y2[:, :inter], y2[:, inter:], mlp.act)
            return down(h).view(*x.shape[:-1], -1)

        self.forwards.append((mlp, fwd))

    def refresh(self) -> None:
        """The live adapter into the buffers (every decode call, before the prefill)."""
        with torch.no_grad():
            for p in self.parts:
                p.refresh()

    @contextlib.contextmanager
    def installed(self):
        for m, f in self.forwards:
            m.forward = f
        if self.head is not None:
            self.model().logits = self.head
        try:
            yield self
        finally:
            for m, _ in self.forwards:
                m.__dict__.pop("forward", None)
            if self.head is not None:
                self.model().__dict__.pop("logits", None)
