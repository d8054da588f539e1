"""TrainConfig: every knob of `leantune train`, from flags and/or a YAML file (flags win)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from ..errors import LeantuneError


@dataclass
class TrainConfig:
    model: str | None = None
    data: str | None = None
    data_split: str = "train"  # split of a hub dataset or dataset folder
    data_subset: str | None = None  # its config name (for --eval-data too)
    output: str = "leantune-output"
    format: str | None = None  # alpaca | messages | text; None = detect
    max_seq_len: int = 2048
    batch_size: int = 4  # packed rows per micro-batch
    grad_accum: int = 1
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | linear | constant
    max_grad_norm: float = 1.0
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    lora_r: int = 16
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "q,k,v,o,gate,up,down"
    use_rslora: bool = False
    full: bool = False
    merge_at_end: bool = False  # LoRA: write OUTPUT/merged (base + adapter) at the end
    train_on_inputs: bool = False
    eval_data: str | None = None
    eval_split: str = "test"  # split of --eval-data when it is a hub dataset or dataset folder
    eval_fraction: float = 0.0
    eval_every: int = 50
    save_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 2
    log_every: int = 1
    report_to: str = "none"  # none | tensorboard | wandb, or a comma list
    resume: bool = False
    overwrite: bool = False
    seed: int = 42
    device: str | None = None  # default cuda if available
    dtype: str | None = None  # bfloat16 | float16 | float32; default by device
    checkpointing: str = "auto"  # auto | none | recompute | offload
    fused_layers: bool = True  # hand-written layer backward (off: autograd + torch checkpoint)
    offload_embedding: bool = True  # frozen, untied input embedding in pinned host memory (CUDA)
    max_memory_gib: float | None = None  # GPU memory the run may use (auto checkpointing)
    compile: bool = False  # torch.compile each decoder layer
    progress: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    @classmethod
    def keys(cls) -> set[str]:
        return {f.name for f in fields(cls)} - {"extra"}

    def validate(self) -> "TrainConfig":
        if self.max_seq_len <= 0:
            raise LeantuneError(f"--max-seq-len must be a positive integer, got {self.max_seq_len}")
        for name in ("batch_size", "grad_accum"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise LeantuneError(f"{flag} must be a positive integer, got {getattr(self, name)}")
        if self.log_every <= 0:
            raise LeantuneError(f"--log-every must be a positive integer, got {self.log_every}")
        for name in ("eval_every", "save_every", "warmup_steps", "keep_checkpoints"):
            if getattr(self, name) < 0:
                flag = "--" + name.replace("_", "-")
                raise LeantuneError(f"{flag} must be 0 or more, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise LeantuneError(f"--max-steps must be a positive integer, got {self.max_steps}")
        if self.epochs <= 0:
            raise LeantuneError(f"--epochs must be positive, got {self.epochs}")
        if self.lr <= 0:
            raise LeantuneError(f"--lr must be positive, got {self.lr}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise LeantuneError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise LeantuneError(f"--schedule must be cosine, linear or constant, got {self.schedule!r}")
        if self.checkpointing not in ("auto", "none", "recompute", "offload"):
            raise LeantuneError(f"--checkpointing must be auto, none, recompute or offload, "
                                f"got {self.checkpointing!r}")
        if self.dtype not in (None, "bfloat16", "float16", "float32"):
            raise LeantuneError(f"--dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        return self


def load_yaml_config(path: str) -> dict:
    """Read a YAML config whose keys are TrainConfig fields (dashes or underscores)."""
    import yaml

    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise LeantuneError(f"{p}: config file not found") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f"{p}:{line + 1}" if line is not None else str(p)
        raise LeantuneError(f"{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise LeantuneError(f"{p}: the config must be a mapping of option: value")
    out = {}
    for k, v in raw.items():
        key = str(k).replace("-", "_")
        if key not in TrainConfig.keys() and key.startswith("no_") and key[3:] in TrainConfig.keys():
            # a switch-off flag as a key (`no-fused-layers: true`) = the field set to false
            value = _coerce(p, k, key[3:], v)
            if not isinstance(value, bool):
                raise LeantuneError(f"{p}: option {k!r} is not a switch; use {key[3:]!r}")
            out[key[3:]] = not value
            continue
        if key not in TrainConfig.keys():
            raise LeantuneError(f"{p}: unknown option {k!r}; options are the `leantune train` "
                                "flags without the leading dashes")
        out[key] = _coerce(p, k, key, v)
    return out


def _coerce(path: Path, raw_key, key: str, value):
    """Check a YAML value against the field's type. YAML 1.1 reads `1e-4` (no dot) as a string,
    so numbers written as strings are converted; anything else of the wrong type is an error."""
    kind = {f.name: str(f.type) for f in fields(TrainConfig)}[key]
    if value is None:
        if "None" in kind:
            return None
        raise LeantuneError(f"{path}: option {raw_key!r} needs a value")
    want = kind.split("|")[0].strip()
    if want == "bool":
        if isinstance(value, bool):
            return value
    elif want in ("int", "float"):
        conv = int if want == "int" else float
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                out = conv(value)
            except (ValueError, OverflowError):
                pass
            else:
                if want == "float" or not isinstance(value, float) or value == out:
                    return out
    else:
        return value
    what = {"int": "an integer", "float": "a number", "bool": "true or false"}[want]
    raise LeantuneError(f"{path}: option {raw_key!r} must be {what}, got {value!r}")
