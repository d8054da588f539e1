"""ModelConfig: the one config that drives the one decoder-only transformer.

Read from a Hugging Face `config.json`; each supported family is a set of flags on the same model
(qkv bias for Qwen2, q/k RMSNorm for Qwen3, sliding window for Mistral, ...), not a separate class.
Mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss) add a `MoESpec`: their sparse layers
route each token to top-k experts (model/moe.py) instead of running one MLP.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LeantuneError
from ..kernels.swiglu import act_code
from .limits import check_config_bounds

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt_oss")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "gpt_oss")


@dataclass(frozen=True)
class MoESpec:
    """The experts of a sparse layer and how tokens are routed to them.

    router: "softmax_topk" (Qwen3-MoE, Mixtral: softmax over all experts in fp32, then top-k,
        renormalised to sum 1 when `norm_topk_prob`) or "topk_softmax" (gpt-oss: top-k logits,
        softmax over those k).
    bias: the router and the experts carry biases (gpt-oss).
    swiglu_limit: gpt-oss's clamped SwiGLU with interleaved gate/up columns
        ((up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit); None: the
        family's `hidden_act` GLU over [gate | up] halves.
    dense_layers: layers that run a dense MLP of `intermediate_size` instead (Qwen3-MoE's
        mlp_only_layers / decoder_sparse_step).
    transposed: the stacked expert weights hold each expert as [in, out] (gpt-oss), not
        [out, in] (model/moe.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # one expert's
    router: str = "softmax_topk"
    norm_topk_prob: bool = True
    bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    jitter_noise: float = 0.0  # Mixtral: training-time multiplicative noise on the layer input
    dense_layers: tuple[int, ...] = ()
    transposed: bool = False


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v (Qwen2 always; Llama optionally)
    o_bias: bool = False  # bias on o_proj (Llama's attention_bias covers o too)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "full_attention" | "sliding_attention"
    norm_offset: float = 0.0  # Gemma-style (1 + w) norms use 1.0
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax
    moe: MoESpec | None = None  # mixture-of-experts families
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    raw: dict = field(default_factory=dict, repr=False)  # the config.json as read, for export

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def window_for_layer(self, i: int) -> int | None:
        """Sliding-window size for layer i, or None for full causal attention."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[i] == "sliding_attention" else None
        return self.sliding_window

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and i not in self.moe.dense_layers

    @property
    def mlp_width(self) -> int:
        """Intermediate values one token's MLP computes in the widest layer: intermediate_size
        for dense models; for MoE, its top-k experts' together (top_k * the expert's
        intermediate size), or the dense layers' where wider (the planner's activation
        estimate)."""
        if self.moe is None:
            return self.intermediate_size
        routed = self.moe.top_k * self.moe.intermediate_size
        return max(routed, self.intermediate_size) if self.moe.dense_layers else routed

    def num_params(self, include_embeddings: bool = True) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        attn = h * self.q_size * 2 + h * self.kv_size * 2
        n = L * (attn + 2 * h) + h
        for layer in range(L):
            if self.is_moe_layer(layer):
                m = self.moe
                n += m.num_experts * (h + 3 * h * m.intermediate_size)  # router + experts
            else:
                n += 3 * h * i
        if include_embeddings:
            n += self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return n

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise LeantuneError(f"{source}: expected a JSON object, got {type(d).__name__}")
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise LeantuneError(
                f"{source}: model_type {mt!r} is not supported; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        check_config_bounds(d, source)  # before any size is used: no list of 1e9 layers
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope_theta, rope_scaling = _rope_from_config(d)
            sliding = d.get("sliding_window")
            layer_types = list(d.get("layer_types") or [])
            if mt in ("qwen2", "qwen3", "qwen3_moe"):
                if not d.get("use_sliding_window", False):
                    sliding, layer_types = None, []
                elif not layer_types and sliding:
                    # older configs: layers from max_window_layers on use the window
                    first = int(d.get("max_window_layers", 0))
                    layer_types = ["sliding_attention" if i >= first else "full_attention"
                                   for i in range(int(d["num_hidden_layers"]))]
            if mt == "gpt_oss" and not layer_types:  # its default: sliding on every other layer
                layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                               for i in range(int(d["num_hidden_layers"]))]
            if layer_types and "sliding_attention" not in layer_types:
                layer_types = []
            llama_bias = bool(d.get("attention_bias", False))
            act = d.get("hidden_act", "silu")
            if act_code(act) is None:  # (not a string, or no kernel for it)
                raise LeantuneError(f"{source}: hidden_act {act!r} is not supported (supported: "
                                    "silu, gelu, gelu_pytorch_tanh)")
            return cls(
                model_type=mt,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=True if mt == "qwen2" else llama_bias,
                o_bias=llama_bias if mt in ("llama", "mistral", "gpt_oss") else False,
                mlp_bias=bool(d.get("mlp_bias", False)),
                qk_norm=mt in ("qwen3", "qwen3_moe"),
                attention_sinks=mt == "gpt_oss",
                moe=_moe_from_config(d, mt) if mt in MOE_MODEL_TYPES else None,
                hidden_act=act,
                sliding_window=int(sliding) if sliding else None,
                layer_types=layer_types,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                pad_token_id=d.get("pad_token_id"),
                raw=dict(d),
            )
        except KeyError as e:
            raise LeantuneError(f"{source}: required field {e.args[0]!r} is missing") from None
        except (TypeError, ValueError) as e:
            raise LeantuneError(f"{source}: a field has an invalid value ({e})") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise LeantuneError(f"{path}: config.json not found; point --model at a Hugging Face "
                                "checkpoint folder") from None
        except json.JSONDecodeError as e:
            raise LeantuneError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        return cls.from_dict(d, source=str(path))


def _moe_from_config(d: dict, mt: str) -> MoESpec:
    """The MoESpec of a qwen3_moe / mixtral / gpt_oss config.json (transformers 4.x and 5.x
    names: num_experts or num_local_experts; experts_per_token in gpt-oss's own configs)."""
    layers = int(d["num_hidden_layers"])
    experts = int(d.get("num_local_experts") or d["num_experts"])
    top_k = int(d.get("num_experts_per_tok") or d["experts_per_token"])
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} with {experts} experts")
    if mt == "qwen3_moe":
        step = int(d.get("decoder_sparse_step") or 1)
        only = {int(i) for i in d.get("mlp_only_layers") or []}
        dense = tuple(i for i in range(layers) if i in only or (i + 1) % step != 0)
        return MoESpec(experts, top_k, int(d["moe_intermediate_size"]),
                       norm_topk_prob=bool(d.get("norm_topk_prob", False)), dense_layers=dense)
    if mt == "mixtral":
        return MoESpec(experts, top_k, int(d["intermediate_size"]),
                       jitter_noise=float(d.get("router_jitter_noise") or 0.0))
    return MoESpec(experts, top_k, int(d["intermediate_size"]), router="topk_softmax",
                   bias=True, swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                   swiglu_alpha=float(d.get("swiglu_alpha", 1.702)), transposed=True)


DEFAULT_ROPE_THETA = {"gpt_oss": 150000.0}


def _rope_from_config(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either transformers 5 `rope_parameters` or v4 fields."""
    params = d.get("rope_parameters")
    default_theta = DEFAULT_ROPE_THETA.get(d.get("model_type"), 10000.0)
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type params
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", d.get("rope_theta", default_theta)))
        rtype = params.get("rope_type", params.get("type", "default"))
        scaling = None if rtype == "default" else dict(params, rope_type=rtype)
        return theta, scaling
    theta = float(d.get("rope_theta", default_theta))
    scaling = d.get("rope_scaling")
    if scaling:
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rtype == "default" else dict(scaling, rope_type=rtype)
    return theta, scaling or None
