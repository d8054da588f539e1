"""Fused ops, one per file: the Triton kernel(s), the autograd.Function, and a plain-PyTorch
reference of the same math. Each public function picks Triton or the reference (see dispatch)."""

from .dispatch import backend, get_backend, set_backend, use_triton
from .rmsnorm import rms_norm, rms_norm_reference
from .rope import apply_rope, apply_rope_reference
from .swiglu import act_code, geglu, geglu_reference, glu, swiglu, swiglu_reference
from .cross_entropy import fused_linear_cross_entropy, linear_cross_entropy_reference
from .token_logprobs import segment_sum, token_logprobs, token_logprobs_reference
from .decode_attention import decode_attention, decode_attention_reference
from .softcap_attention import (softcap_attention_bwd, softcap_attention_fwd,
                                softcap_attention_reference)

__all__ = [
    "backend", "get_backend", "set_backend", "use_triton",
    "rms_norm", "rms_norm_reference",
    "apply_rope", "apply_rope_reference",
    "act_code", "glu", "swiglu", "swiglu_reference", "geglu", "geglu_reference",
    "fused_linear_cross_entropy", "linear_cross_entropy_reference",
    "token_logprobs", "token_logprobs_reference", "segment_sum",
    "decode_attention", "decode_attention_reference",
    "softcap_attention_fwd", "softcap_attention_bwd", "softcap_attention_reference",
]
