"""Bounds on config.json sizes (model/limits.py): every real model's config is read, absurd
sizes end in one line naming config.json, the field and the allowed range, before anything is
built."""

from __future__ import annotations

import json
import time

import pytest

from leantune.errors import LeantuneError
from leantune.model.config import ModelConfig
from leantune.model.limits import INT_BOUNDS, MAX_PARAMS, estimate_params

# The sizes of published checkpoints (their config.json, the fields that matter here).
LLAMA_405B = dict(model_type="llama", vocab_size=128256, hidden_size=16384,
                  intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                  num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                  rms_norm_eps=1e-5)
QWEN3_235B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=4096,
                  intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                  num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
                  num_experts_per_tok=8, max_position_embeddings=40960, rope_theta=1e6)
GPT_OSS_120B = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                    intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, num_local_experts=128,
                    experts_per_token=4, max_position_embeddings=131072, sliding_window=128)
MIXTRAL_8X22B = dict(model_type="mixtral", vocab_size=32768, hidden_size=6144,
                     intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
                     num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                     max_position_embeddings=65536, rope_theta=1e6)
# Extremes seen in the wild: a 262k vocabulary with a 10M-token context, and 512 experts.
BIG_VOCAB_LONG_CONTEXT = dict(LLAMA_405B, hidden_size=5120, intermediate_size=8192,
                              num_hidden_layers=48, num_attention_heads=40,
                              vocab_size=262144, max_position_embeddings=10_485_760)
MANY_EXPERTS = dict(QWEN3_235B, hidden_size=2048, moe_intermediate_size=512,
                    num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=256, num_experts=512, num_experts_per_tok=10)
REAL = {"llama-405b": LLAMA_405B, "qwen3-235b": QWEN3_235B, "gpt-oss-120b": GPT_OSS_120B,
        "mixtral-8x22b": MIXTRAL_8X22B, "vocab262k-ctx10m": BIG_VOCAB_LONG_CONTEXT,
        "512-experts": MANY_EXPERTS}


@pytest.mark.parametrize("name", REAL)
def test_real_model_sizes_are_admitted(name):
    cfg = ModelConfig.from_dict(dict(REAL[name]))
    assert cfg.hidden_size == REAL[name]["hidden_size"]
    # the estimate the bound uses is the model's own count to within 5%
    est = estimate_params(REAL[name])
    assert abs(est - cfg.num_params()) / cfg.num_params() < 0.05
    assert cfg.num_params() < MAX_PARAMS


def test_llama_405b_parameter_count_is_right():
    assert 4.0e11 < ModelConfig.from_dict(dict(LLAMA_405B)).num_params() < 4.2e11


def _refusal(d: dict, tmp_path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(LeantuneError) as e:
        ModelConfig.from_file(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(path))
    return msg


@pytest.mark.parametrize("field,value", [
    ("num_hidden_layers", 1e9), ("num_hidden_layers", 0), ("hidden_size", 0),
    ("hidden_size", -4096), ("vocab_size", 2.5), ("num_attention_heads", "32"),
    ("num_key_value_heads", True), ("max_position_embeddings", 10 ** 12),
    ("intermediate_size", None), ("head_dim", 1e30),
])
def test_absurd_integer_sizes_are_refused(tmp_path, field, value):
    d = dict(LLAMA_405B, **{field: value})
    if value is None:  # an explicit null of a required field: reported as missing
        msg = _refusal(d, tmp_path)
        assert repr(field) in msg and "missing" in msg
        return
    msg = _refusal(d, tmp_path)
    lo, hi = INT_BOUNDS[field]
    assert repr(field) in msg and f"{lo}..{hi}" in msg and repr(value) in msg


def test_integral_floats_are_read_as_integers():
    cfg = ModelConfig.from_dict(dict(LLAMA_405B, hidden_size=16384.0))
    assert cfg.hidden_size == 16384 and isinstance(cfg.hidden_size, int)


@pytest.mark.parametrize("field,value", [("rms_norm_eps", 0), ("rms_norm_eps", -1e-6),
                                         ("rope_theta", float("inf")), ("rope_theta", "big")])
def test_bad_float_fields_are_refused(tmp_path, field, value):
    msg = _refusal(dict(LLAMA_405B, **{field: value}), tmp_path)
    assert repr(field) in msg and "expected a number above 0" in msg


def test_head_arithmetic_the_model_needs(tmp_path):
    msg = _refusal(dict(LLAMA_405B, hidden_size=16100), tmp_path)  # 16100 / 128 heads
    assert "'hidden_size'" in msg and "num_attention_heads 128" in msg
    msg = _refusal(dict(LLAMA_405B, num_key_value_heads=6), tmp_path)  # 128 % 6
    assert "'num_key_value_heads'" in msg and "divisor" in msg
    msg = _refusal(dict(QWEN3_235B, num_experts_per_tok=129), tmp_path)
    assert "'num_experts_per_tok'" in msg and "128 experts" in msg
    msg = _refusal(dict(LLAMA_405B, layer_types=["full_attention"] * 3), tmp_path)
    assert "'layer_types' has 3 entries" in msg and "126" in msg
    # with head_dim given, q width need not equal hidden_size (Qwen3 does this)
    assert ModelConfig.from_dict(dict(LLAMA_405B, hidden_size=16100, head_dim=128)).q_size == 16384


def test_parameter_product_is_bounded(tmp_path):
    """Each size in range, together too large: refused by the product, before building."""
    d = dict(LLAMA_405B, num_hidden_layers=1000, hidden_size=100000, num_attention_heads=1000,
             num_key_value_heads=1000, intermediate_size=400000)
    msg = _refusal(d, tmp_path)
    assert "parameters" in msg and "num_hidden_layers 1000" in msg


def test_a_billion_sliding_layers_fail_fast(tmp_path):
    """qwen2 with use_sliding_window listed every layer before: 1e9 layers hung."""
    d = dict(LLAMA_405B, model_type="qwen2", use_sliding_window=True, sliding_window=4096,
             num_hidden_layers=10 ** 9)
    t = time.perf_counter()
    msg = _refusal(d, tmp_path)
    assert time.perf_counter() - t < 3.0  # (the hang it guards against never ended)
    assert "'num_hidden_layers'" in msg and "1..1024" in msg
