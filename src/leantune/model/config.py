"""ModelConfig: the one config that drives the one decoder-only transformer.

Read from a Hugging Face `config.json`; each supported family is a set of flags on the same model
(qkv bias for Qwen2, q/k RMSNorm for Qwen3, sliding window for Mistral, ...), not a separate class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LeantuneError
from ..kernels.swiglu import act_code

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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

    def num_params(self, include_embeddings: bool = True) -> int:
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        attn = h * self.q_size * 2 + h * self.kv_size * 2
        per_layer = attn + 3 * h * i + 2 * h
        n = L * per_layer + h
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
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope_theta, rope_scaling = _rope_from_config(d)
            sliding = d.get("sliding_window")
            layer_types = list(d.get("layer_types") or [])
            if mt in ("qwen2", "qwen3"):
                if not d.get("use_sliding_window", False):
                    sliding, layer_types = None, []
                elif not layer_types and sliding:
                    # older configs: layers from max_window_layers on use the window
                    first = int(d.get("max_window_layers", 0))
                    layer_types = ["sliding_attention" if i >= first else "full_attention"
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
                o_bias=llama_bias if mt in ("llama", "mistral") else False,
                mlp_bias=bool(d.get("mlp_bias", False)),
                qk_norm=mt == "qwen3",
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


def _rope_from_config(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either transformers 5 `rope_parameters` or v4 fields."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type params
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        rtype = params.get("rope_type", params.get("type", "default"))
        scaling = None if rtype == "default" else dict(params, rope_type=rtype)
        return theta, scaling
    theta = float(d.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if scaling:
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rtype == "default" else dict(scaling, rope_type=rtype)
    return theta, scaling or None
