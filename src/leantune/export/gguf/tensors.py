"""Hugging Face tensors -> GGUF tensors: names, llama's q/k row order, the llama3 rope factors,
and the GGML type each tensor is stored in for a --quant choice.

Names (llama.cpp's): model.embed_tokens -> token_embd, model.norm -> output_norm, lm_head ->
output (absent when the embedding is tied), model.layers.N.<module> -> blk.N.<name> below.

Row order: llama.cpp's `llama` architecture (Llama and Mistral) rotates adjacent pairs of q/k
features, where Hugging Face rotates the two halves of each head; so q and k rows (weights,
biases and a LoRA B) are reordered per head from [first half, second half] to interleaved pairs.
Qwen2 and Qwen3 rotate halves in llama.cpp too: no reordering.

Types (`tensor_type`): 1-D tensors (norms, biases, rope factors) stay f32, as llama.cpp's
converter keeps them. 2-D tensors get the --quant type; q4_k_m follows llama.cpp's Q4_K_M mix:
q4_k everywhere except q6_k for output.weight (token_embd.weight when the output is tied to it)
and for attn_v and ffn_down in the layers i of n where i < n/8, i >= 7n/8 or (i - n/8) % 3 == 2
(integer division: the first and last eighth and every third layer between get more bits).
A K-quant needs rows of a multiple of 256 elements and the others a multiple of 32: a tensor
whose rows do not split falls back as llama.cpp's quantiser does (q4_k -> q5_0, q6_k -> q8_0),
then to f16.
"""

from __future__ import annotations

import re

import torch

from ...errors import LeantuneError
from ...model.config import ModelConfig
from ...model.families import FAMILIES, GGUF_ARCHITECTURES
from ...model.rope import rope_inv_freq
from .quants import QUANT_TYPES, QuantType

# model_type -> llama.cpp architecture (the family registry's)
ARCHITECTURES = GGUF_ARCHITECTURES
PERMUTED_ARCHITECTURES = tuple(sorted({f.gguf_arch for f in FAMILIES.values()
                                       if f.gguf_permute_qk}))

TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_MODULES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    # Phi-3's fused projections: llama.cpp's phi3 splits ffn_up into gate | up itself
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
}
# llama.cpp's name of each norm role (model/families.py Norms): Gemma's post_attention_layernorm
# is its attention-out norm, Llama's its MLP-in norm
NORM_ROLES = {"attn_in": "attn_norm", "attn_out": "post_attention_norm", "mlp_in": "ffn_norm",
              "mlp_out": "post_ffw_norm"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")

# --quant -> (llama.cpp file type id, the type of 2-D tensors)
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q5_0": 8, "q4_k_m": 15,
              "q6_k": 18}
FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0", "q4_0": "f16", "q5_0": "f16", "q8_0": "f16"}


def architecture(cfg: ModelConfig, source: str = "config.json") -> str:
    if cfg.model_type not in ARCHITECTURES:
        raise LeantuneError(f"{source}: GGUF export covers model types "
                            f"{', '.join(ARCHITECTURES)}, not {cfg.model_type!r}")
    return ARCHITECTURES[cfg.model_type]


def gguf_name(hf_name: str, cfg: ModelConfig | None = None) -> str | None:
    """llama.cpp's name for a Hugging Face tensor (norms by their role in `cfg`'s family;
    default Llama's); None for tensors GGUF does not store (rotary inv_freq buffers; a
    multimodal checkpoint's vision tower and projector, which llama.cpp keeps in an mmproj
    file of their own)."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    if cfg is not None and cfg.family.prefixes:
        ours = cfg.family.our_name(hf_name)
        if ours == hf_name and not hf_name.startswith(("model.layers.", "model.embed_tokens.",
                                                       "model.norm.", "lm_head.")):
            return None  # (not the language model's)
        hf_name = ours
    m = _LAYER.fullmatch(hf_name)
    if cfg is not None and m:
        for role, module in cfg.norms.items():
            if m.group(2) == module:
                return f"blk.{m.group(1)}.{NORM_ROLES[role]}.{m.group(3)}"
    module, _, kind = hf_name.rpartition(".")
    if module in TOP_LEVEL and kind == "weight":
        return f"{TOP_LEVEL[module]}.weight"
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in LAYER_MODULES:
        return f"blk.{m.group(1)}.{LAYER_MODULES[m.group(2)]}.{m.group(3)}"
    raise LeantuneError(f"tensor {hf_name} has no GGUF counterpart; GGUF export covers the "
                        "decoder of Llama, Mistral, Qwen2, Qwen3, Gemma 2 / 3 and Phi-3 "
                        "checkpoints")


def norm_shift(cfg: ModelConfig, gguf: str) -> float:
    """What llama.cpp adds to a stored norm weight: Gemma's (1 + w) norms are written as 1 + w
    (its RMSNorm multiplies by the weight as stored), as llama.cpp's converter does."""
    return cfg.norm_offset if gguf.endswith("norm.weight") else 0.0


def longrope_factors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """LongRoPE's factors as llama.cpp's rope_factors_short / rope_factors_long tensors
    [rotated dims / 2]; {} for other rope types."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type") != "longrope":
        return {}
    return {f"rope_factors_{k}.weight": torch.tensor(s[f"{k}_factor"], dtype=torch.float32)
            for k in ("short", "long")}


def permute_rows(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection (weight [H*d, ...], bias [H*d] or LoRA B [H*d, r])
    per head from Hugging Face's [half 1, half 2] to llama.cpp's interleaved rotary pairs."""
    d = t.shape[0] // n_heads
    return t.reshape(n_heads, 2, d // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def rows_heads(cfg: ModelConfig, gguf: str) -> int | None:
    """Heads whose rows `permute_rows` reorders for this GGUF tensor, or None (no reordering)."""
    if architecture(cfg) not in PERMUTED_ARCHITECTURES:
        return None
    if ".attn_q." in gguf:
        return cfg.num_attention_heads
    if ".attn_k." in gguf:
        return cfg.num_key_value_heads
    return None


def rope_factors(cfg: ModelConfig) -> torch.Tensor | None:
    """llama3 rope scaling as llama.cpp's `rope_freqs` tensor [head_dim / 2]: the factor each
    rotary frequency is divided by; None for other rope types."""
    if not cfg.rope_scaling or cfg.rope_scaling.get("rope_type") != "llama3":
        return None
    plain, _ = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    scaled, _ = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return plain / scaled


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(gguf: str, shape: tuple[int, ...], quant: str, n_layers: int,
                tied: bool) -> QuantType:
    """The GGML type tensor `gguf` of `shape` (numpy order) is stored in under --quant."""
    if len(shape) == 1:
        return QUANT_TYPES["f32"]
    name = quant
    if quant == "q4_k_m":
        name = "q4_k"
        m = re.match(r"blk\.(\d+)\.(attn_v|ffn_down)\.weight", gguf)
        if gguf == "output.weight" or (tied and gguf == "token_embd.weight") \
                or (m and _more_bits(int(m.group(1)), n_layers)):
            name = "q6_k"
    while not QUANT_TYPES[name].fits(shape[-1]):
        name = FALLBACK[name]
    return QUANT_TYPES[name]
