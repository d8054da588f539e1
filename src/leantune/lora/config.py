"""LoRA settings and attaching adapters to a model."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LeantuneError
from .layer import LoRALinear

# Short target names -> module names (HF / PEFT spelling).
TARGETS = {
    "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "gate": "gate_proj", "up": "up_proj", "down": "down_proj",
}
ALL_TARGETS = list(TARGETS.values())


@dataclass
class LoRAConfig:
    r: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(ALL_TARGETS))
    use_rslora: bool = False

    def __post_init__(self):
        self.targets = normalize_targets(self.targets)
        if self.r <= 0:
            raise LeantuneError(f"--lora-r must be a positive integer, got {self.r}")
        if not 0.0 < self.alpha < float("inf"):
            raise LeantuneError(f"--lora-alpha must be a positive number, got {self.alpha} "
                                "(the adapter is scaled by alpha / r; alpha = r is a common "
                                "choice)")
        if not 0.0 <= self.dropout < 1.0:
            raise LeantuneError(f"--lora-dropout must be in [0, 1), got {self.dropout}")


def normalize_targets(targets) -> list[str]:
    """Accept "q,k,v", ["q_proj", "gate"], ... -> sorted module names; unknown names fail."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",") if t.strip()]
    out = []
    for t in targets:
        t = t.strip()
        name = TARGETS.get(t, t)
        if name not in ALL_TARGETS:
            raise LeantuneError(f"--lora-targets: unknown LoRA target {t!r}; choose from "
                                f"{', '.join(TARGETS)} (or {', '.join(ALL_TARGETS)})")
        out.append(name)
    if not out:
        raise LeantuneError("--lora-targets: no target given; e.g. --lora-targets q,k,v,o")
    return sorted(set(out), key=ALL_TARGETS.index)


def lora_layers(model, targets: list[str] | None = None):
    """(qualified name, LoRALinear) for every projection whose short name is in targets."""
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear) and (targets is None or name.rsplit(".", 1)[-1] in targets):
            yield name, mod


def apply_lora(model, cfg: LoRAConfig, seed: int | None = None,
               dtype=None) -> list[str]:
    """Freeze the whole model and attach trainable LoRA adapters to the target projections.

    dtype: adapter parameter dtype (default: the base weight's; the trainer keeps fp32 masters
    under a bf16/fp16 base). Returns the names of the adapted modules."""
    import torch

    if seed is not None:
        torch.manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for name, layer in lora_layers(model, cfg.targets):
        layer.add_lora(cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora, dtype=dtype)
        names.append(name)
    model.lora_config = cfg
    return names

