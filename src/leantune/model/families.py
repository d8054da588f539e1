"""The family registry: one entry per supported `model_type`, in one place.

A family says how its config.json fields and checkpoint tensors map onto the one decoder-only
transformer, and describes its decoder layer by *roles* rather than by checkpoint names:

    x -> x + attn_out(attn(attn_in(x))) -> h + mlp_out(mlp(mlp_in(h)))

with the "out" norms optional (Llama has none; Gemma 2 / 3 norm both outputs). The same
checkpoint name means different roles in different families: `post_attention_layernorm` is
Llama's MLP-in norm but Gemma 2 / 3's attention-out norm, so the layer asks its family which
module plays which role (`Norms`), and the fused executor runs a layer only when it knows every
part (engine/executor.py `fused_unsupported`).

Per family (`Family`):
- norms: the checkpoint module name of each norm role; the norm form (`norm_offset` 0: w,
  1: 1 + w, computed as Gemma does: (x_f32 * rstd * (1 + w_f32)).to(dtype));
- embed_scale: the embedding is multiplied by sqrt(hidden) (Gemma), in the compute dtype;
- attention: q/k/v bias (always, from `attention_bias`, never), o bias, q/k norms, sinks, the
  attention scale (`query_pre_attn_scalar`), attention and final-logit soft-capping;
- the MLP activation's config field (`hidden_act`, Gemma's `hidden_activation`);
- windows: how each layer's window is read (`layer_types`; Qwen's `use_sliding_window`;
  gpt-oss's alternating default);
- RoPE: default base, per-layer-type RoPE (Gemma 3: sliding layers 10k default, full layers
  1M with their scaling), partial rotary (`partial_rotary_factor`);
- weights: mixture-of-experts spec reader, per-expert checkpoint layouts, fused checkpoint
  tensors split into our projections (Phi-3's qkv_proj, gate_up_proj), checkpoint name
  prefixes (Gemma 3 multimodal keeps its language model under model.language_model.);
- GGUF: llama.cpp's architecture name and whether q/k rows are permuted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Norms:
    """Checkpoint module name (under model.layers.N.) of each norm role; None: absent."""

    attn_in: str = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str = "post_attention_layernorm"
    mlp_out: str | None = None

    def items(self) -> list[tuple[str, str]]:
        """(role, module name) of the norms present, in layer order."""
        roles = ("attn_in", "attn_out", "mlp_in", "mlp_out")
        return [(r, getattr(self, r)) for r in roles if getattr(self, r) is not None]


LLAMA_NORMS = Norms()
GEMMA_NORMS = Norms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")


@dataclass(frozen=True)
class Family:
    """One model_type (module docstring)."""

    model_type: str
    norms: Norms = LLAMA_NORMS
    norm_offset: float = 0.0
    embed_scale: bool = False
    tied_default: bool = False  # tie_word_embeddings when config.json does not say
    qkv_bias: str = "attention_bias"  # "always" | "attention_bias" | "never"
    o_bias: bool = False  # attention_bias covers o_proj too
    qk_norm: bool = False
    attention_sinks: bool = False
    scale_field: str | None = None  # config field whose ** -0.5 is the attention scale
    softcaps: bool = False  # attn_logit_softcapping / final_logit_softcapping are read
    act_field: str = "hidden_act"
    windows: str = "layer_types"  # "layer_types" | "qwen" | "alternate"
    default_rope_theta: float = 10000.0
    local_rope_theta: float | None = None  # per-layer-type RoPE: sliding layers' default base
    partial_rotary: bool = False  # partial_rotary_factor is read
    moe: bool = False
    # per-expert tensor names: (module under the layer, {stacked projection: its parts})
    per_expert: tuple | None = None
    router_module: str | None = None  # the router's checkpoint module, where not mlp.gate
    # checkpoint tensors that hold several of our parameters: checkpoint module (under the
    # layer) -> our modules it stacks, in row order
    fused: dict = field(default_factory=dict)
    # checkpoint name prefixes of the language model, tried in order ("" = ours as they are)
    prefixes: tuple[tuple[str, str], ...] = ()
    text_config: bool = False  # the language model's fields are under config.json text_config
    gguf_arch: str | None = None
    gguf_permute_qk: bool = False

    def our_name(self, key: str) -> str:
        """The parameter name of checkpoint tensor `key` (checkpoint_names' inverse)."""
        for ours, theirs in self.prefixes:
            if key.startswith(theirs):
                return ours + key[len(theirs):]
        return key

    def checkpoint_names(self, name: str) -> list[str]:
        """The checkpoint names parameter `name` may have, most likely first."""
        out = [name]
        for ours, theirs in self.prefixes:
            if name.startswith(ours):
                out.append(theirs + name[len(ours):])
        return out


GEMMA3_MM_PREFIXES = (("model.", "model.language_model."), ("model.", "language_model.model."),
                      ("lm_head.", "language_model.lm_head."))

# Gemma 2 / 3: (1 + w) norms on both sides of attention and MLP, scaled embedding, tied head,
# query_pre_attn_scalar, soft-caps, GeGLU (tanh); Gemma 3 adds q/k norms and per-layer-type RoPE
_GEMMA = dict(norms=GEMMA_NORMS, norm_offset=1.0, embed_scale=True, tied_default=True,
              scale_field="query_pre_attn_scalar", softcaps=True, act_field="hidden_activation")
_GEMMA3 = dict(_GEMMA, qk_norm=True, windows="pattern6", default_rope_theta=1_000_000.0,
               local_rope_theta=10000.0)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", o_bias=True, gguf_arch="llama", gguf_permute_qk=True),
    Family("mistral", o_bias=True, gguf_arch="llama", gguf_permute_qk=True),
    Family("qwen2", qkv_bias="always", windows="qwen", gguf_arch="qwen2"),
    Family("qwen3", qk_norm=True, windows="qwen", gguf_arch="qwen3"),
    Family("qwen3_moe", qk_norm=True, windows="qwen", moe=True,
           per_expert=("mlp", {"gate_up_proj": ("gate_proj", "up_proj"),
                               "down_proj": ("down_proj",)})),
    Family("mixtral", moe=True, router_module="block_sparse_moe.gate",
           per_expert=("block_sparse_moe", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)})),
    Family("gpt_oss", o_bias=True, attention_sinks=True, windows="alternate", moe=True,
           default_rope_theta=150000.0),
    Family("gemma2", **_GEMMA, windows="alternate", gguf_arch="gemma2"),
    Family("gemma3_text", **_GEMMA3, gguf_arch="gemma3"),
    Family("gemma3", **_GEMMA3, prefixes=GEMMA3_MM_PREFIXES, text_config=True,
           gguf_arch="gemma3"),
    Family("phi3", partial_rotary=True,
           fused={"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj",
                                         "self_attn.v_proj"),
                  "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")},
           gguf_arch="phi3"),
)}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
MOE_MODEL_TYPES = tuple(t for t, f in FAMILIES.items() if f.moe)
GGUF_ARCHITECTURES = {t: f.gguf_arch for t, f in FAMILIES.items() if f.gguf_arch}


def family(model_type: str) -> Family:
    """The registry entry of `model_type` (ModelConfig has checked that there is one)."""
    return FAMILIES[model_type]
