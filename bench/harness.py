"""Shared pieces of the benchmarks: building leantune and HF + PEFT models over ONE set of base
weights (both freeze the base, so sharing is safe and costs no extra memory), identical LoRA
initialisation, the baseline's training step, timing and FLOP counting."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import torch

from leantune.lora import LoRAConfig, apply_lora
from leantune.model.config import ModelConfig
from leantune.model.loader import build_empty

from shapes import SHAPES

H200_BF16_FLOPS = 790e12
OUT = Path(os.environ.get("OUT", "bench-out"))


def record(section: str, **fields) -> None:
    """Append one result to $OUT/results.jsonl (read by report.py) and echo it."""
    OUT.mkdir(parents=True, exist_ok=True)
    row = {"section": section, **fields}
    with open(OUT / "results.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def hf_config(shape: str):
    """The transformers config of `shape` (LlamaConfig, Qwen3Config, ...)."""
    from transformers import AutoConfig

    d = dict(SHAPES[shape])
    model_type = d.pop("model_type")
    rope = d.pop("rope_scaling") or {"rope_type": "default"}
    theta = d.pop("rope_theta")
    cfg = AutoConfig.for_model(model_type, **d)
    # transformers 5 keeps rope settings in rope_parameters; 4.x in rope_scaling / rope_theta
    if "full_attention" in (getattr(cfg, "rope_parameters", None) or {}):  # per layer type
        cfg.rope_parameters["full_attention"].update(rope, rope_theta=theta)  # (Gemma 3)
    elif hasattr(cfg, "rope_parameters"):
        cfg.rope_parameters = dict(rope, rope_theta=theta)
    else:
        cfg.rope_scaling = None if rope["rope_type"] == "default" else dict(rope)
        cfg.rope_theta = theta
    return cfg


def leantune_model(shape: str, device, dtype=torch.bfloat16, seed: int = 0):
    """Random-init leantune model (normal(0, 0.02) drawn on the device)."""
    cfg = ModelConfig.from_dict(hf_config(shape).to_dict())
    model = build_empty(cfg, dtype, torch.device(device))
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def add_lora(model, r=16, alpha=16, seed=0):
    torch.manual_seed(seed)
    apply_lora(model, LoRAConfig(r=r, alpha=alpha), dtype=torch.float32)
    return model


def hf_peft_model(shape: str, base, device, gradient_checkpointing=True):
    """The transformers model of `shape` over `base`'s weights + PEFT LoRA on the projections
    `base` has LoRA on, with the same init. Attention: SDPA, or eager where the model has no SDPA
    path (gpt-oss's sinks). LoRA on the experts (leantune's `experts` target) becomes PEFT's
    `target_parameters` on the stacked expert parameters (lora/peft_io.py), its A and B copied in
    PEFT's 2-D layout."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from leantune.lora.peft_io import PREFIX, adapter_config, adapter_state_dict
    from leantune.model.weight_map import fused_state

    cfg = hf_config(shape)
    cls = AutoModelForCausalLM._model_mapping[type(cfg)]
    attn = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn,
                                              dtype=base.model.embed_tokens.weight.dtype)
    # .to(device): shares the tensors already there; a copy of a table leantune keeps in host
    # memory (the Trainer's offload_embedding), which HF reads on the GPU
    state = {k: v.to(device) for k, v in fused_state(base).items()}  # (Phi-3: qkv_proj, ...)
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, assign=True, strict=False)
    # non-persistent buffers (rotary inv_freq) are still on meta: rebuild them on the device
    rotary = type(hf.model.rotary_emb)
    hf.model.rotary_emb = rotary(config=cfg).to(device)
    for mod in hf.modules():  # and Gemma's embedding scale
        if getattr(mod, "scalar_embed_scale", None) is not None:
            mod.embed_scale = torch.tensor(mod.scalar_embed_scale, device=device)
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    for n, b in hf.named_buffers():
        assert b.device.type != "meta", n
    for n, p in hf.named_parameters():
        assert p.device.type != "meta", n
    hf.config.use_cache = False
    if gradient_checkpointing:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the adapter as leantune saves it for PEFT: PEFT's names (Phi-3: fused qkv_proj /
    # gate_up_proj at the parts' ranks together), the projections leantune adapted (not every
    # target asked for: a MoE model has no gate_proj), experts in PEFT's 2-D layout
    d = adapter_config(base)
    ours = adapter_state_dict(base)
    pm = get_peft_model(hf, LoraConfig(
        r=d["r"], lora_alpha=d["lora_alpha"], lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=d["target_modules"], target_parameters=d["target_parameters"],
        rank_pattern=d.get("rank_pattern") or {}, alpha_pattern=d.get("alpha_pattern") or {}))
    copied = 0
    with torch.no_grad():
        for name, mod in pm.named_modules():
            if isinstance(getattr(mod, "lora_A", None), torch.nn.ModuleDict):
                key = PREFIX + name.replace(PREFIX, "", 1)
                mod.lora_A["default"].weight.copy_(ours[key + ".lora_A.weight"])
                mod.lora_B["default"].weight.copy_(ours[key + ".lora_B.weight"])
                copied += 2
    assert copied == len(ours), (copied, len(ours))
    return pm


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def non_embedding_params(cfg: ModelConfig) -> int:
    return cfg.num_params(include_embeddings=False)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """LoRA step FLOPs per token as the issue defines MFU: 4 x non-embedding params (forward 2,
    backward to the inputs 2; the frozen base needs no weight gradient) + attention (score and
    value matmuls, causal: average context seq_len/2, forward 1x + backward 2x)."""
    attn = 3 * 2 * 2 * (seq_len / 2) * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 4 * non_embedding_params(cfg) + attn


def cuda_time(fn, warmup: int, steps: int) -> list[float]:
    """Wall seconds of each of `steps` calls after `warmup` calls, device-synchronised."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def mean_ms(fn, n: int = 20, warm: int = 3) -> float:
    """Mean ms of fn() over n back-to-back calls (CUDA events, after `warm` calls)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# --- timing a step on any device (host clock after a device sync) -------------------------
def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def step_times(fn, warmup: int, steps: int, device) -> list[float]:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times
