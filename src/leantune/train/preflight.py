"""Checks that read no weights: the flags against config.json (`check_settings`), and the
checkpoint itself, config.json and the safetensors headers (a few KiB per shard). Run before a training run touches its output folder, so that a truncated shard
or a config that does not match its weights fails in a second, not after minutes of loading."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LeantuneError
from ..model.config import ModelConfig
from ..model.loader import (CHECKPOINT_PATTERNS, bnb_compute_dtype, bnb_quant_states,
                            plan_checkpoint, read_headers, resolve_checkpoint,
                            safetensors_files)
from ..model.transformer import CausalLM


def check_weights(folder: Path) -> bool:
    """Every weight the model needs is in a readable shard, with the shape config.json implies
    (the loader's own weight plan, built from the headers; a 4-bit weight's shape is in its
    quant_state). Returns whether the checkpoint is pre-quantised (bnb-4bit)."""
    cfg = ModelConfig.from_file(folder / "config.json")
    bnb_compute_dtype(cfg, folder / "config.json")  # (a quantisation leantune does not read)
    with torch.device("meta"):
        model = CausalLM(cfg)
    files = safetensors_files(folder)
    states = bnb_quant_states(files)
    headers = read_headers(files)
    for name, state in states.items():  # the packed uint8 weight: its 16-bit shape is here
        headers.shapes[name] = tuple(state["shape"])
    plan_checkpoint(model, files, headers)
    return bool(states)


def locate_model(name: str) -> Path:
    """The checkpoint folder, for its config and tokenizer: a local folder as it is; for a hub id,
    a snapshot without the weights (`resolve_checkpoint` fetches them once the data is checked).
    Errors are `resolve_checkpoint`'s one-liners."""
    if not Path(name).expanduser().exists():
        try:
            from huggingface_hub import snapshot_download

            light = [p for p in CHECKPOINT_PATTERNS if not p.endswith(".safetensors")]
            return Path(snapshot_download(name, allow_patterns=light))
        except Exception:
            pass  # not a hub id, or not reachable: resolve_checkpoint says which
    return resolve_checkpoint(name)


def check_kernels(kernels: str, device: torch.device, name: str = "--kernels") -> None:
    """Triton kernels compile for a GPU: `kernels` "triton" off CUDA is refused in one line
    (TRITON_INTERPRET=1, the tests' CPU interpreter, excepted). `name`: where it was set."""
    import os

    if (kernels == "triton" and device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        raise LeantuneError(f"{name} triton needs a CUDA GPU (this run is on the "
                            f"{device.type.upper()}); use {name} auto or reference")


def check_settings(cfg, model_config: ModelConfig, device: torch.device) -> None:
    """Flags that make no sense for this model or device, refused in one line before any weight
    loads (from config.json alone: the model is built on the meta device, which allocates
    nothing):
    - --max-memory-gib budgets GPU memory for the auto activation plan: on the CPU, or with
      --activations other than auto, it would be silently ignored;
    - --lora-targets experts on a dense model (no mixture-of-experts layers);
    - --lora-r above the width of a targeted projection (min of its inputs and outputs): the
      update B @ A of an [out, in] weight has rank at most that width, so the extra rank is
      only memory and time;
    - --kernels triton off CUDA (Triton compiles for a GPU; TRITON_INTERPRET=1, the tests'
      interpreter, excepted);
    - --router-aux-loss-coef on a dense model."""
    check_kernels(cfg.engine.kernels, device)
    if cfg.router_aux_loss_coef > 0 and model_config.moe is None:
        raise LeantuneError(f"--router-aux-loss-coef: {cfg.model or 'the model'} is not a "
                            f"mixture-of-experts model ({model_config.model_type}); leave the "
                            "flag out")
    if cfg.max_memory_gib is not None:
        if device.type != "cuda":
            raise LeantuneError(f"--max-memory-gib {cfg.max_memory_gib:g} budgets GPU memory, "
                                f"and this run is on the {device.type.upper()} ({device}); "
                                "leave it out, or train on a GPU (--device cuda)")
        if cfg.activations != "auto":
            raise LeantuneError(f"--max-memory-gib budgets the plan --activations auto picks, "
                                f"and this run keeps --activations {cfg.activations}; leave "
                                "one of them out")
    if cfg.full:
        return
    from ..lora.config import EXPERTS, expert_layers, lora_layers, normalize_targets

    targets = normalize_targets(cfg.lora.targets)
    name = cfg.model or "the model"
    if EXPERTS in targets and model_config.moe is None:
        raise LeantuneError(f"--lora-targets experts: {name} is a dense model "
                            f"({model_config.model_type}, no mixture-of-experts layers), so it "
                            "has no experts; leave experts out of --lora-targets")
    with torch.device("meta"):
        model = CausalLM(model_config)
    widths = []  # (width, projection, its --lora-targets name, inputs, outputs)
    for qualified, layer in lora_layers(model, targets):
        proj = qualified.rsplit(".", 1)[-1]
        widths.append((min(layer.in_features, layer.out_features), proj,
                       proj.removesuffix("_proj"), layer.in_features, layer.out_features))
    if EXPERTS in targets:
        for _, experts in expert_layers(model):
            for proj in experts.PROJECTIONS:
                n_in, n_out = experts.in_out(proj)
                widths.append((min(n_in, n_out), f"the experts' {proj}", EXPERTS, n_in, n_out))
    if not widths:
        return  # (apply_lora says that none of the targets is there)
    width, proj, target, n_in, n_out = min(widths)
    if cfg.lora.r > width:
        raise LeantuneError(f"--lora-r {cfg.lora.r} is above the width of {proj} ({n_in} inputs, "
                            f"{n_out} outputs): its LoRA update has rank at most {width}, so "
                            f"the rest is only memory and time; use --lora-r {width} or less"
                            f" (or leave {target} out of --lora-targets)")
