"""The projection layer of every attention and MLP block: a frozen (or trainable) base weight
plus an optional LoRA adapter.

    y = x @ W^T + b + dropout(x) @ A^T @ B^T * scaling,   A: [r, in], B: [out, r]

Parameter names follow Hugging Face and PEFT (`weight`, `bias`, `lora_A.weight`, `lora_B.weight`),
so a state dict maps one-to-one onto HF checkpoints and PEFT adapter files. The base weight is
read only through `base` (lora/base_weight.py: its GEMMs mm / mm_t, its dense value, its
bytes), whatever its storage: the 16-bit `weight` Parameter, or after `set_quantized_base` a
4-bit NF4Weight (`nf4`, QLoRA, kernels/nf4.py) or an e4m3 FP8Weight (`fp8`, kernels/fp8.py) in
place of `weight` (then None); a quantised base computes through its own GEMMs, in backward
again (nothing 16-bit is kept between them).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.fp8 import FP8Weight
from ..kernels.nf4 import NF4Weight
from .base_weight import BaseWeight, base_linear, wrap
from .function import lora_linear


def lora_scaling(r: int, alpha: float, use_rslora: bool = False) -> float:
    """The factor on B @ A: alpha / r, or alpha / sqrt(r) for rsLoRA (as PEFT)."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


class LoRALinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
                     if bias else None)
        self.lora_A: nn.Linear | None = None
        self.lora_B: nn.Linear | None = None
        self.r = 0
        self.scaling = 0.0
        self.lora_dropout: nn.Module = nn.Identity()
        self.nf4: NF4Weight | None = None  # the 4-bit base, in place of `weight` (QLoRA)
        self.fp8: FP8Weight | None = None  # the e4m3 base, in place of `weight` (--precision fp8)

    @property
    def has_lora(self) -> bool:
        return self.lora_A is not None

    @property
    def quantized(self) -> NF4Weight | FP8Weight | None:
        """The quantised base's container (NF4 or FP8), or None for a 16-bit base."""
        return self.nf4 if self.nf4 is not None else self.fp8

    @property
    def base(self) -> BaseWeight:
        """The base weight as one object (lora/base_weight.py), made per call (a view)."""
        q = self.quantized
        return wrap(self.weight if q is None else q)

    def base_weight(self) -> torch.Tensor:
        """The dense base weight [out, in] (a quantised base: dequantised, a new tensor per
        call)."""
        return self.base.dequantize()

    def set_quantized_base(self, q: NF4Weight | FP8Weight) -> None:
        """Hold `q` (an NF4Weight or FP8Weight of this layer's [out, in]) as the base weight
        instead of the 16-bit Parameter, which is dropped (its memory freed)."""
        if q.shape != (self.out_features, self.in_features):
            raise ValueError(f"{type(q).__name__} of shape {q.shape} for a layer of "
                             f"{(self.out_features, self.in_features)}")
        self.weight = None
        self.nf4 = q if isinstance(q, NF4Weight) else None
        self.fp8 = q if isinstance(q, FP8Weight) else None

    set_nf4_base = set_quantized_base  # (the QLoRA loader's name)

    @property
    def base_device(self) -> torch.device:
        return self.base.device

    @property
    def base_dtype(self) -> torch.dtype:
        """The dtype the base weight computes in (a quantised base: its compute dtype)."""
        return self.base.dtype

    def add_lora(self, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        """Attach a LoRA adapter of rank r. A: kaiming-uniform (as PEFT), B: zeros, so the
        adapted layer starts equal to the base layer."""
        dev = self.base_device
        dtype = dtype or self.base_dtype
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=dev, dtype=dtype)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=dev, dtype=dtype)
        if dev.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)
        self.r = r
        self.scaling = lora_scaling(r, alpha, use_rslora)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        # an adapter switched off (adapters_disabled: the preference objectives' reference pass)
        # under no_grad: the base alone, without the rank-r products and a zero-scaled add over
        # the whole output
        off = self.lora_A is None or (self.scaling == 0 and not torch.is_grad_enabled())
        if self.quantized is not None:
            y = base_linear(x, self.base)
            y = y if self.bias is None else y + self.bias
            if off:
                return y
            a, b = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
            return y + F.linear(F.linear(self.lora_dropout(x), a), b) * self.scaling
        if off:
            return F.linear(x, self.base_weight(), self.bias)
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            # base matmul + LoRA product in one autograd Function (lora/function.py)
            return lora_linear(x, self.base_weight(), self.bias, self.lora_A.weight,
                               self.lora_B.weight, self.scaling)
        # Adapters may be kept in fp32 (master weights) under a bf16 base: compute in x.dtype.
        y = F.linear(x, self.base_weight(), self.bias)
        a = self.lora_A.weight.to(x.dtype)
        b = self.lora_B.weight.to(x.dtype)
        return y + F.linear(F.linear(self.lora_dropout(x), a), b) * self.scaling

    def extra_repr(self) -> str:
        s = f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"
        s += f", {self.base.kind}" if self.quantized is not None else ""
        return s + (f", lora_r={self.r}, scaling={self.scaling:g}" if self.has_lora else "")


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within the block, `model` computes as its base: every LoRA term (LoRALinear and the MoE
    experts' adapters) is scaled by 0. The preference objectives' reference model is the base
    with the adapter switched off: no second copy of the weights. Meant for no-grad passes
    (the plain layer path; the fused executors run only while gradients are recorded)."""
    mods = [m for m in model.modules() if getattr(m, "has_lora", False) and hasattr(m, "scaling")]
    saved = [m.scaling for m in mods]
    try:
        for m in mods:
            m.scaling = 0.0
        yield
    finally:
        for m, s in zip(mods, saved):
            m.scaling = s
