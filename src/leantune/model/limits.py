"""Sane bounds on the sizes in a config.json, checked before anything is built.

A config.json is input like any other: a typo (`"num_hidden_layers": 1e9`, `"hidden_size": 0`)
must end in one line naming the file, the field and the allowed range, not in a hang while
layers are listed or a failure deep inside a tensor allocation. The bounds admit every real
model by a wide margin (Llama-3.1-405B: hidden 16384, 126 layers, 128 heads; vocabularies of
262k and more; contexts of millions of positions; MoE with hundreds of experts) and refuse
zero, negative, non-integer and absurd values.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import LeantuneError

# field -> (smallest, largest) allowed value. Every field is optional here: which ones a family
# requires is ModelConfig.from_dict's business.
INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "moe_intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "max_position_embeddings": (1, 1 << 30),
    "sliding_window": (0, 1 << 30),  # 0: no window
    "num_experts": (1, 1 << 14),
    "num_local_experts": (1, 1 << 14),
    "num_experts_per_tok": (1, 1 << 14),
    "experts_per_token": (1, 1 << 14),
    "decoder_sparse_step": (0, 1024),
    "max_window_layers": (0, 1 << 20),
}
FLOAT_BOUNDS: dict[str, tuple[float, float]] = {  # open at 0: strictly positive
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1e12),
}
# Sizes every family needs (from_dict reads them unconditionally): null counts as missing.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads")
# The largest model we agree to build, in parameters (Llama-3.1-405B has 4.1e11; the largest
# MoE checkpoints published have about 1e12-2e12).
MAX_PARAMS = 10 ** 13


def _bad(source: str, field: str, value: Any, allowed: str) -> LeantuneError:
    return LeantuneError(f"{source}: field {field!r} has an invalid value {value!r} ({allowed}); "
                         "fix it in config.json (is this the checkpoint you meant?)")


def _int_field(d: dict, field: str, source: str) -> int | None:
    """d[field] as an int within INT_BOUNDS, or None when absent or null."""
    value = d.get(field)
    if value is None:
        return None
    lo, hi = INT_BOUNDS[field]
    allowed = f"expected an integer in {lo}..{hi}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(source, field, value, allowed)
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise _bad(source, field, value, allowed)
    if not lo <= value <= hi:
        raise _bad(source, field, value, allowed)
    return int(value)


def _float_field(d: dict, field: str, source: str) -> None:
    value = d.get(field)
    if value is None:
        return
    lo, hi = FLOAT_BOUNDS[field]
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (math.isfinite(value) and lo < value <= hi)):
        raise _bad(source, field, value, f"expected a number above {lo:g} and at most {hi:g}")


def estimate_params(d: dict[str, int | None]) -> int:
    """A rough parameter count from the checked sizes (attention, MLP or experts, embeddings):
    within a few percent of ModelConfig.num_params, and computable before any list of layers
    is built."""
    h = d.get("hidden_size") or 1
    layers = d.get("num_hidden_layers") or 1
    heads = d.get("num_attention_heads") or 1
    head_dim = d.get("head_dim") or max(h // heads, 1)
    kv = d.get("num_key_value_heads") or heads
    attn = 2 * h * head_dim * (heads + kv)
    experts = d.get("num_local_experts") or d.get("num_experts")
    if experts:
        width = d.get("moe_intermediate_size") or d.get("intermediate_size") or 1
        mlp = experts * (h + 3 * h * width)
    else:
        mlp = 3 * h * (d.get("intermediate_size") or 1)
    return layers * (attn + mlp) + 2 * (d.get("vocab_size") or 1) * h


def check_config_bounds(d: dict, source: str = "config.json") -> None:
    """Refuse a config.json whose sizes no real model has, before anything is built.

    Checks that the REQUIRED sizes are given, each field of INT_BOUNDS / FLOAT_BOUNDS that is present, that the attention heads
    divide as the model needs (hidden_size by num_attention_heads when head_dim is not given,
    num_attention_heads by num_key_value_heads), that num_experts_per_tok <= the experts,
    that layer_types has one entry a layer, and that the whole model stays under MAX_PARAMS.

    Raises:
        LeantuneError: one line naming `source`, the field, its value and the allowed range.
    """
    for f in REQUIRED:
        if d.get(f) is None:
            raise LeantuneError(f"{source}: required field {f!r} is missing (or null); is this "
                                "a decoder-only checkpoint's config.json?")
    sizes = {f: _int_field(d, f, source) for f in INT_BOUNDS}
    for f in FLOAT_BOUNDS:
        _float_field(d, f, source)
    hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv = sizes["num_key_value_heads"]
    if hidden and heads and not sizes["head_dim"] and hidden % heads:
        raise _bad(source, "hidden_size", hidden, f"not a multiple of num_attention_heads "
                   f"{heads} (and no head_dim is given)")
    if heads and kv and heads % kv:
        raise _bad(source, "num_key_value_heads", kv,
                   f"expected a divisor of num_attention_heads {heads}")
    experts = sizes["num_local_experts"] or sizes["num_experts"]
    top_k = sizes["num_experts_per_tok"] or sizes["experts_per_token"]
    if experts and top_k and top_k > experts:
        raise _bad(source, "num_experts_per_tok", top_k, f"expected at most the {experts} experts")
    layer_types = d.get("layer_types")
    layers = sizes["num_hidden_layers"]
    if layer_types and layers and (not isinstance(layer_types, list)
                                               or len(layer_types) != layers):
        n = len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__
        raise LeantuneError(f"{source}: field 'layer_types' has {n} entries, expected one a "
                            f"layer (num_hidden_layers {layers}); fix it in config.json")
    params = estimate_params(sizes)
    if params > MAX_PARAMS:
        raise LeantuneError(
            f"{source}: the sizes describe a model of about {params:.2g} parameters, over the "
            f"limit of {MAX_PARAMS:.0e} (hidden_size {hidden}, num_hidden_layers {layers}, "
            f"vocab_size {sizes['vocab_size']}); fix config.json")
