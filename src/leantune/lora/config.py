"""LoRA settings and attaching adapters to a model: LoRALinear projections by name, and (target
`experts`) the stacked expert weights of mixture-of-experts layers (model/moe.py Experts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LeantuneError
from .layer import LoRALinear

# Short target names -> module names (HF / PEFT spelling).
TARGETS = {
    "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
    "gate": "gate_proj", "up": "up_proj", "down": "down_proj", "experts": "experts",
}
EXPERTS = "experts"  # both stacked projections of every MoE layer's experts
ALL_TARGETS = [t for t in TARGETS.values() if t != EXPERTS]  # the default (experts: opt-in)
_ORDER = [*ALL_TARGETS, EXPERTS]
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


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
        if self.dropout > 0 and EXPERTS in self.targets:
            raise LeantuneError("--lora-dropout: LoRA on the experts has no dropout (PEFT cannot "
                                "load it with one); use --lora-dropout 0, or leave experts out "
                                "of --lora-targets")


def normalize_targets(targets) -> list[str]:
    """Accept "q,k,v", ["q_proj", "gate"], ... -> sorted module names; unknown names fail."""
    if isinstance(targets, str):
        targets = [t for t in targets.split(",") if t.strip()]
    out = []
    for t in targets:
        t = t.strip()
        name = TARGETS.get(t, t)
        if name not in _ORDER:
            raise LeantuneError(f"--lora-targets: unknown LoRA target {t!r}; choose from "
                                f"{', '.join(TARGETS)} (or {', '.join(ALL_TARGETS)})")
        out.append(name)
    if not out:
        raise LeantuneError("--lora-targets: no target given; e.g. --lora-targets q,k,v,o")
    return sorted(set(out), key=_ORDER.index)


def lora_layers(model, targets: list[str] | None = None):
    """(qualified name, LoRALinear) for every projection whose short name is in targets."""
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear) and (targets is None or name.rsplit(".", 1)[-1] in targets):
            yield name, mod


def expert_layers(model):
    """(qualified name, Experts) for every MoE layer's experts."""
    from ..model.moe import Experts  # (the model imports this package)

    for name, mod in model.named_modules():
        if isinstance(mod, Experts):
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
        if model.config.model_type == "qwen3_moe" and name.endswith(MLP_NAMES):
            # PEFT on transformers 5 reads these names as the experts' (fused) projections
            raise LeantuneError(
                f"--lora-targets: this Qwen3-MoE model has dense MLP layers ({name}), whose "
                "gate/up/down LoRA a PEFT adapter cannot hold (PEFT maps those names to the "
                "experts); leave gate, up and down out, e.g. --lora-targets q,k,v,o,experts")
        layer.add_lora(cfg.r, cfg.alpha, cfg.dropout, cfg.use_rslora, dtype=dtype)
        names.append(name)
    if EXPERTS in cfg.targets:
        experts = list(expert_layers(model))
        if not experts:
            raise LeantuneError("--lora-targets: experts given, but the model has no experts "
                                "(it is not a mixture-of-experts model)")
        for name, layer in experts:
            layer.add_lora(cfg.r, cfg.alpha, cfg.use_rslora, dtype=dtype)
            names.append(name)
    if not names:
        raise LeantuneError(f"--lora-targets {','.join(cfg.targets)}: the model has none of these "
                            "projections" + (" (its MLPs are experts: add experts)"
                                             if model.config.moe else ""))
    model.lora_config = cfg
    return names

