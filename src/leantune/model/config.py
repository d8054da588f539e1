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

from .families import MOE_MODEL_TYPES, SUPPORTED_MODEL_TYPES, Family, Norms, family


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
    norms: Norms = field(default_factory=Norms)  # which checkpoint norm plays which role
    embed_scale: float | None = None  # Gemma: the embedding times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None  # Gemma 2: scores -> c * tanh(scores / c)
    final_softcap: float | None = None  # Gemma 2: logits -> c * tanh(logits / c)
    # per-layer-type RoPE (Gemma 3): layer type -> (base, scaling); {} = rope_theta everywhere
    layer_rope: dict = field(default_factory=dict)
    rotary_dim: int | None = None  # partial rotary (Phi-4-mini): the rotated dims of a head
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax
    moe: MoESpec | None = None  # mixture-of-experts families
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    raw: dict = field(default_factory=dict, repr=False)  # the config.json as read, for export

    @property
    def family(self) -> Family:
        return family(self.model_type)

    def rope_key(self, i: int) -> str:
        """Which RoPE table layer i reads: its layer type with per-layer-type RoPE, else
        "default" (one table for all)."""
        return self.layer_types[i] if self.layer_rope else "default"

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
        fam = family(mt)
        if fam.text_config:  # a multimodal checkpoint: its language model's fields
            text = d.get("text_config")
            if not isinstance(text, dict):
                text_only = f"{mt}_text"
                raise LeantuneError(
                    f"{source}: model_type {mt!r} (a multimodal checkpoint) needs a text_config "
                    "object holding its language model's fields" + (
                        f"; a text-only checkpoint says model_type {text_only!r} with those "
                        "fields at the top level" if text_only in SUPPORTED_MODEL_TYPES else ""))
            raw = d
            d = {**text, **{k: d[k] for k in ("tie_word_embeddings",) if k in d},
                 "model_type": mt}
        else:
            raw = d
        check_config_bounds(d, source)  # before any size is used: no list of 1e9 layers
        try:
            return cls._from_fields(d, mt, fam, raw, source)
        except KeyError as e:
            raise LeantuneError(f"{source}: required field {e.args[0]!r} is missing") from None
        except (TypeError, ValueError) as e:
            raise LeantuneError(f"{source}: a field has an invalid value ({e})") from None

    @classmethod
    def _from_fields(cls, d: dict, mt: str, fam: Family, raw: dict,
                     source: str) -> "ModelConfig":
        """The config of family `fam` from the language model's fields `d` (raw: config.json
        as read). KeyError / TypeError / ValueError: a missing or invalid field."""
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        layers = int(d["num_hidden_layers"])
        head_dim = int(d.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling = _rope_from_config(d, fam.default_rope_theta)
        sliding = d.get("sliding_window")
        layer_types = list(d.get("layer_types") or [])
        if fam.windows == "qwen":
            if not d.get("use_sliding_window", False):
                sliding, layer_types = None, []
            elif not layer_types and sliding:
                # older configs: layers from max_window_layers on use the window
                first = int(d.get("max_window_layers", 0))
                layer_types = ["sliding_attention" if i >= first else "full_attention"
                               for i in range(layers)]
        elif fam.windows == "alternate" and not layer_types:  # sliding on every other layer
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                           for i in range(layers)]
        elif fam.windows == "pattern6" and not layer_types:  # 5 sliding, then 1 full
            every = int(d.get("sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                           for i in range(layers)]
        layer_rope = {}
        if fam.local_rope_theta is not None and "sliding_attention" in layer_types:
            layer_rope = {"full_attention": (rope_theta, rope_scaling),
                          "sliding_attention": _local_rope(d, fam.local_rope_theta)}
        if layer_types and "sliding_attention" not in layer_types:
            layer_types = []
        llama_bias = bool(d.get("attention_bias", False))
        act = d.get(fam.act_field, d.get("hidden_act", "silu"))
        if act_code(act) is None:  # (not a string, or no kernel for it)
            raise LeantuneError(f"{source}: hidden_act {act!r} is not supported (supported: "
                                "silu, gelu, gelu_pytorch_tanh)")
        qkv_bias = {"always": True, "never": False}.get(fam.qkv_bias, llama_bias)
        rotary_dim = None
        if fam.partial_rotary:
            factor = (d.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                         d.get("partial_rotary_factor", 1.0))
            rotary_dim = int(head_dim * float(factor))
            rotary_dim = None if rotary_dim == head_dim else rotary_dim

        def opt_float(key):
            v = d.get(key) if fam.softcaps else None
            return float(v) if v else None

        return cls(
            model_type=mt,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", fam.tied_default)),
            attention_bias=qkv_bias,
            o_bias=llama_bias if fam.o_bias else False,
            mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=fam.qk_norm,
            attention_sinks=fam.attention_sinks,
            moe=_moe_from_config(d, mt) if fam.moe else None,
            hidden_act=act,
            sliding_window=int(sliding) if sliding else None,
            layer_types=layer_types,
            norm_offset=fam.norm_offset,
            norms=fam.norms,
            embed_scale=hidden ** 0.5 if fam.embed_scale else None,
            attn_scale=(float(d[fam.scale_field]) ** -0.5
                        if fam.scale_field and d.get(fam.scale_field) else None),
            attn_softcap=opt_float("attn_logit_softcapping"),
            final_softcap=opt_float("final_logit_softcapping"),
            layer_rope=layer_rope,
            rotary_dim=rotary_dim,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            raw=dict(raw),
        )

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
        except RecursionError:
            raise LeantuneError(f"{path}: JSON nested too deeply to read") from None
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


def _local_rope(d: dict, default_theta: float) -> tuple[float, dict | None]:
    """Gemma 3's sliding layers' RoPE: rope_parameters["sliding_attention"] (transformers 5) or
    rope_local_base_freq (v4), unscaled by default."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        return _rope_from_config({"rope_parameters": params["sliding_attention"]}, default_theta)
    return float(d.get("rope_local_base_freq", default_theta)), None


def _rope_from_config(d: dict, default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either transformers 5 `rope_parameters` or v4 fields.
    LongRoPE's original context sits at the config's top level in the hub's v4 layout (Phi-3
    128k, Phi-3.5-mini, Phi-4-mini: `rope_scaling` holds only the factors); it is copied into
    the scaling; where it is nowhere, max_position_embeddings stands in (as in transformers),
    and without either, a one-line error."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type params
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", d.get("rope_theta", default_theta)))
        rtype = params.get("rope_type", params.get("type", "default"))
        scaling = None if rtype == "default" else dict(params, rope_type=rtype)
    else:
        theta = float(d.get("rope_theta", default_theta))
        scaling = d.get("rope_scaling")
        if scaling:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            scaling = None if rtype == "default" else dict(scaling, rope_type=rtype)
    if scaling and scaling["rope_type"] == "longrope" \
            and not scaling.get("original_max_position_embeddings"):
        original = d.get("original_max_position_embeddings") or d.get("max_position_embeddings")
        if not original:
            raise LeantuneError("config.json: LongRoPE needs original_max_position_embeddings "
                                "(in rope_scaling or at the top level); add the checkpoint's "
                                "value")
        scaling["original_max_position_embeddings"] = int(original)
    return theta, scaling or None
