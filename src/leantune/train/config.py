"""TrainConfig: every knob of `leantune train`, from flags and/or a YAML file (flags win)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path

from ..engine.options import EngineOptions
from ..errors import LeantuneError
from ..utils.suggest import did_you_mean


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
    router_aux_loss_coef: float = 0.0  # MoE: weight of the router's load-balancing loss
    load_in_4bit: bool = False  # QLoRA: the decoder's linear weights quantised to NF4 on load
    merge_at_end: bool = False  # LoRA: write OUTPUT/merged (base + adapter) at the end
    train_on_inputs: bool = False
    eval_data: str | None = None
    eval_split: str = "test"  # split of --eval-data when it is a hub dataset or dataset folder
    eval_fraction: float = 0.0
    eval_every: int = 50
    save_every: int | None = None  # None = only at the end
    keep_checkpoints: int = 2
    sample_prompts: str | None = None  # prompts completed at each evaluation -> samples.jsonl
    sample_max_new_tokens: int = 64
    log_every: int = 1
    report_to: str = "none"  # none | tensorboard | wandb, or a comma list
    resume: bool = False
    overwrite: bool = False
    seed: int = 42
    device: str | None = None  # default cuda if available
    dtype: str | None = None  # bfloat16 | float16 | float32; default by device
    activations: str = "auto"  # what layers keep for backward: auto | keep | recompute | offload
    offload_embedding: bool = True  # frozen, untied input embedding in pinned host memory (CUDA)
    max_memory_gib: float | None = None  # GPU memory the run may use (auto activations)
    compile: bool = False  # torch.compile each decoder layer
    parallel: str = "auto"  # under torchrun: ddp | fsdp | auto (one process: ignored)
    progress: bool = True
    # engine options (leantune.engine.options.EngineOptions: what each means)
    kernels: str = "auto"
    fused_layers: bool = True
    attention: str = "auto"
    pack_projections: bool = True
    pack_lora: bool = True
    pack_align: int = 64
    mlp_chunk_mib: float = 256.0
    mlp_forward_chunk_factor: float = 2.0
    link_gbs: float = 50.0

    @classmethod
    def keys(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def engine_options(self) -> EngineOptions:
        """The engine options this config sets (checked: a bad value is a one-line error)."""
        return EngineOptions.from_dict({k: getattr(self, k) for k in EngineOptions().to_dict()})

    # LoRA's settings: with --full they would be silently ignored, so they are refused
    LORA_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "use_rslora")
    FLOAT_KEYS = ("lr", "weight_decay", "max_grad_norm", "epochs", "lora_alpha", "lora_dropout",
                  "eval_fraction", "max_memory_gib", "router_aux_loss_coef")

    def validate(self) -> "TrainConfig":
        for name in self.FLOAT_KEYS:
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise LeantuneError(f"{_flag(name)} must be a finite number, got {value}")
        if self.max_seq_len <= 0:
            raise LeantuneError(f"--max-seq-len must be a positive integer, got {self.max_seq_len}")
        for name in ("batch_size", "grad_accum"):
            if getattr(self, name) <= 0:
                raise LeantuneError(f"{_flag(name)} must be a positive integer, got "
                                    f"{getattr(self, name)}")
        if self.sample_max_new_tokens <= 0:
            raise LeantuneError(f"--sample-max-new-tokens must be a positive integer, got "
                                f"{self.sample_max_new_tokens}")
        if self.log_every <= 0:
            raise LeantuneError(f"--log-every must be a positive integer, got {self.log_every}")
        for name in ("eval_every", "warmup_steps", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise LeantuneError(f"{_flag(name)} must be 0 or more, got {getattr(self, name)}")
        if self.save_every is not None and self.save_every <= 0:
            raise LeantuneError(f"--save-every must be a positive number of steps, got "
                                f"{self.save_every}; leave it out to checkpoint only at the end")
        for name in ("weight_decay", "max_grad_norm", "router_aux_loss_coef"):
            if getattr(self, name) < 0:
                raise LeantuneError(f"{_flag(name)} must be 0 or more, got {getattr(self, name)}"
                                    + ("; 0 turns clipping off" if name == "max_grad_norm" else ""))
        if self.max_memory_gib is not None and self.max_memory_gib <= 0:
            raise LeantuneError(f"--max-memory-gib must be positive, got {self.max_memory_gib}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise LeantuneError(f"--max-steps must be a positive integer, got {self.max_steps}")
        if self.epochs <= 0:
            raise LeantuneError(f"--epochs must be positive, got {self.epochs}")
        if self.lr <= 0:
            raise LeantuneError(f"--lr must be positive, got {self.lr}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise LeantuneError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_data and self.eval_fraction > 0:
            raise LeantuneError("--eval-data and --eval-fraction both give an evaluation set; "
                                "keep one of them")
        if self.full:
            changed = [k for k in self.LORA_KEYS if getattr(self, k) != _DEFAULTS[k]]
            if changed:
                raise LeantuneError(f"{_flag(changed[0])} is a LoRA setting, and --full trains "
                                    f"every weight without an adapter; drop {_flag(changed[0])} "
                                    "or --full")
        if self.full and self.load_in_4bit:
            raise LeantuneError("--load-in-4bit trains LoRA adapters on a frozen 4-bit base, and "
                                "--full trains every weight; drop one of them")
        if self.resume and self.overwrite:
            raise LeantuneError("--resume continues the run in --output and --overwrite replaces "
                                "it; give one of them")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise LeantuneError(f"--schedule must be cosine, linear or constant, got {self.schedule!r}")
        if self.activations not in ("auto", "keep", "recompute", "offload"):
            raise LeantuneError(f"--activations must be auto, keep, recompute or offload, "
                                f"got {self.activations!r}")
        if self.parallel not in ("auto", "ddp", "fsdp"):
            raise LeantuneError(f"--parallel must be auto, ddp or fsdp, got {self.parallel!r}")
        if self.dtype not in (None, "bfloat16", "float16", "float32"):
            raise LeantuneError(f"--dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        self.engine_options()
        return self


_DEFAULTS = {f.name: f.default for f in fields(TrainConfig)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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
        raise LeantuneError(f"{p}: the config file is empty; write the options as `key: value` "
                            "lines, e.g. `model: org/name` and `data: train.jsonl`")
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
        if key == "checkpointing":  # renamed
            raise LeantuneError(f"{p}: option {k!r} is now 'activations' (auto, keep, recompute "
                                "or offload; none is now keep)")
        if key not in TrainConfig.keys():
            names = [n.replace("_", "-") if "-" in str(k) else n for n in TrainConfig.keys()]
            raise LeantuneError(f"{p}: unknown option {k!r}{did_you_mean(str(k), names, True)}; "
                                "options are the `leantune train` flags without the leading "
                                "dashes")
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
