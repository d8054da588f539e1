"""TrainConfig: every knob of `leantune train`, from flags and/or a YAML file (flags win).

Settings nest as they are used: the adapter's shape (`lora`, a LoRASettings), how the engine runs
the layers (`engine`, an EngineSettings) and what the run optimises (`objective`, an
ObjectiveSettings) are sections of their own. The flat names (`--lora-r`, `lora_r: 8` in YAML,
`TrainConfig(lora_r=8)`, `--kernels`, `--beta`...) keep working: FLAT_KEYS maps each into its
section. A saved config (run_config.json, a checkpoint's state.json) reads back through
`TrainConfig.from_dict`, nested or in the flat form runs wrote before the sections.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from ..engine.options import EngineOptions
from ..errors import LeantuneError
from ..utils.suggest import did_you_mean


@dataclass
class LoRASettings:
    """The adapter's shape (LoRA runs; --full refuses any of them changed). Checked when built
    (`build`), so a bad value is one line at validate(), not at construction."""

    r: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = "q,k,v,o,gate,up,down"  # comma list; `build` normalises the names
    use_rslora: bool = False

    def build(self):
        """The checked leantune.lora.LoRAConfig of these settings."""
        from ..lora import LoRAConfig

        return LoRAConfig(r=self.r, alpha=self.alpha, dropout=self.dropout,
                          targets=self.targets, use_rslora=self.use_rslora)


@dataclass
class EngineSettings:
    """How the engine runs the layers: leantune.engine.options.EngineOptions' fields (what each
    means is there), unchecked until built."""

    kernels: str = "auto"
    fused_layers: bool = True
    attention: str = "auto"
    pack_projections: bool = True
    pack_lora: bool = True
    pack_align: int = 64
    mlp_chunk_mib: float = 256.0
    mlp_forward_chunk_factor: float = 2.0
    link_gbs: float = 50.0
    link_duplex_gbs: float = 33.0
    trim_offload: bool = True
    fuse_glu_lora: bool = True
    fuse_lora_add: bool = True
    fuse_grad_quant: bool = True
    fuse_qkv_grad: bool = True
    gemm_residual: bool = False
    stream_weights: bool = False
    stream_max_layers: int = 0
    stream_fill_ahead: bool = False
    prefetch_depth: int = 0

    def build(self) -> EngineOptions:
        """The checked EngineOptions of these settings (a bad value: one line)."""
        return EngineOptions.from_dict(asdict(self))


LOSS_TYPES = ("sigmoid", "ipo", "hinge")  # --loss-type of the DPO family
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "gspo")  # --loss-type of GRPO


@dataclass
class ObjectiveSettings:
    """What the run optimises (train/objectives): `name` picks the objective; the rest are the
    preference objectives' and GRPO's settings (defaults as TRL's), refused with sft, which has
    none. beta and loss_type default by objective (None until validate() resolves them)."""

    name: str = "sft"
    # DPO/IPO/KTO: the KL weight; ORPO: the odds-ratio weight; SimPO: scale (0.1 for them);
    # GRPO: the KL weight to the reference (0: none, no reference pass)
    beta: float | None = None
    # the DPO family's loss: sigmoid (default) | ipo | hinge; GRPO's: dapo (default) | grpo |
    # dr_grpo | bnpo | gspo
    loss_type: str | None = None
    label_smoothing: float = 0.0  # DPO sigmoid: the assumed share of flipped labels
    simpo_gamma: float = 0.5  # SimPO: the target reward margin
    desirable_weight: float = 1.0  # KTO: the weight of desirable rows
    undesirable_weight: float = 1.0  # KTO: the weight of undesirable rows
    precompute_reference: bool = False  # reference log-probs once, before training
    max_prompt_len: int | None = None  # prompt tokens kept (cut from the left); None: no cap
    # pairs packed as one document [prompt | chosen | rejected], the prompt run once (DPO,
    # ORPO, SimPO; train/objectives/preference.py); false: two documents a pair, as before
    shared_prompt: bool = True
    # GRPO (train/objectives/grpo.py; defaults as TRL's GRPOConfig)
    reward: list = field(default_factory=list)  # FILE.py:FUNCTION or builtin:NAME, repeatable
    reward_weights: list | None = None  # one weight per --reward (default 1 each)
    num_generations: int = 8  # completions sampled per prompt (a group)
    max_completion_tokens: int = 256
    temperature: float = 1.0  # sampling temperature (the log-probs use it too, as TRL's)
    top_p: float = 1.0
    epsilon: float = 0.2  # clip range below 1 (and above it without epsilon_high)
    epsilon_high: float | None = None  # clip range above 1 (DAPO's clip-higher); None: epsilon
    num_iterations: int = 1  # updates per generation batch (the old log-probs kept)
    scale_rewards: str = "group"  # group | batch | none
    mask_truncated_completions: bool = False  # completions cut at the token limit train nothing
    log_completions_every: int = 0  # steps between completions written to samples.jsonl; 0 off


# The objectives each preference setting applies to (beta and max_prompt_len: all of them); a
# setting changed for another objective is refused, so a flag never goes silently unused.
APPLIES_TO = {"label_smoothing": ("dpo", "simpo"),
              "simpo_gamma": ("simpo",), "desirable_weight": ("kto",),
              "undesirable_weight": ("kto",), "precompute_reference": ("dpo",),
              "shared_prompt": ("dpo", "orpo", "simpo"),
              "loss_type": ("dpo", "grpo"),
              **{k: ("grpo",) for k in ("reward", "reward_weights", "num_generations",
                                        "max_completion_tokens", "temperature", "top_p",
                                        "epsilon", "epsilon_high", "num_iterations",
                                        "scale_rewards", "mask_truncated_completions",
                                        "log_completions_every")}}

SECTIONS = {"lora": LoRASettings, "engine": EngineSettings, "objective": ObjectiveSettings}

# flat name (flag / YAML key / keyword) -> (section, field)
FLAT_KEYS = {
    "lora_r": ("lora", "r"), "lora_alpha": ("lora", "alpha"),
    "lora_dropout": ("lora", "dropout"), "lora_targets": ("lora", "targets"),
    "use_rslora": ("lora", "use_rslora"),
    **{f.name: ("engine", f.name) for f in fields(EngineSettings)},
    **{f.name: ("objective", f.name) for f in fields(ObjectiveSettings) if f.name != "name"},
}
# (`objective` itself, as a name: `--objective dpo`, `objective: dpo`, is the section's name)
FLAT_NAMES = {v: k for k, v in FLAT_KEYS.items()} | {("objective", "name"): "objective"}


@dataclass(init=False)
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
    full: bool = False
    adapter: str | None = None  # continue from this (SFT) adapter, folded in (lora/fold.py)
    router_aux_loss_coef: float = 0.0  # MoE: weight of the router's load-balancing loss
    load_in_4bit: bool = False  # QLoRA: the decoder's linear weights quantised to NF4 on load
    precision: str = "bf16"  # bf16 | fp8: the frozen base's projections in e4m3 (FP8 GEMMs)
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
    lora: LoRASettings = field(default_factory=LoRASettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    objective: ObjectiveSettings = field(default_factory=ObjectiveSettings)

    def __init__(self, **values):
        """Fields by name. A section may be given as its dataclass (copied), a mapping of its
        fields, or (objective) its name; flat names (FLAT_KEYS) set one field of a section and
        win over the section given beside them (so dataclasses.replace(cfg, lora_r=8) works)."""
        flat = {k: values.pop(k) for k in list(values) if k in FLAT_KEYS}
        for f in fields(self):
            if f.name in values:
                value = values.pop(f.name)
            else:
                value = f.default_factory() if f.default is MISSING else f.default
            if f.name in SECTIONS:
                value = _section(f.name, value)
            setattr(self, f.name, value)
        if values:
            raise TypeError(f"TrainConfig: unknown option(s) {', '.join(sorted(values))}")
        for key, value in flat.items():
            section, name = FLAT_KEYS[key]
            setattr(getattr(self, section), name, value)

    @classmethod
    def keys(cls) -> set[str]:
        """Every name a flag, a YAML key or a keyword may set: the plain fields, the sections
        and the flat names of their fields."""
        return {f.name for f in fields(cls)} | set(FLAT_KEYS)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A saved config (`asdict` of one: run_config.json's and state.json's "config"),
        nested or flat as runs wrote it before the sections; names this version does not know
        are left out."""
        known = cls.keys()
        return cls(**{k: v for k, v in d.items() if k in known})

    def get(self, name: str):
        """The value of a plain field or a flat name (`get("lora_r")` is `lora.r`)."""
        if name in FLAT_KEYS:
            section, attr = FLAT_KEYS[name]
            return getattr(getattr(self, section), attr)
        if name == "objective":
            return self.objective.name
        return getattr(self, name)

    def _check_inputs_outside_output(self) -> None:
        """Refuse a local --adapter that is the output folder, or an --adapter or --model inside
        the checkpoints/ or merged/ folder it writes (a --model that is the output folder:
        check_output_folder's line): --overwrite sets a run's files aside and deletes
        them once the new run has a checkpoint, checkpoints rotate, and a --resume would read the
        new run's files as the old input (an adapter folded in twice, a wrong reference)."""
        from .checkpoint import CKPT_DIR
        from .merge_at_end import MERGED_DIR

        out = Path(self.output).expanduser().resolve()
        owned = (out / CKPT_DIR, out / MERGED_DIR)  # what a run writes inside its folder
        for flag, value in (("--adapter", self.adapter), ("--model", self.model)):
            path = Path(value).expanduser() if isinstance(value, (str, os.PathLike)) else None
            if path is None or not path.exists():  # a hub name, or missing (checked elsewhere)
                continue
            path = path.resolve()
            inside = next((d for d in owned if path == d or d in path.parents), None)
            # (a --model that is the output folder: check_output_folder's own line)
            if (path == out and flag == "--adapter") or inside is not None:
                where = ("is the output folder" if path == out else
                         f"lies in the output folder's {inside.name}/, which the run writes")
                raise LeantuneError(
                    f"{flag} {value} {where} ({self.output}): the run would replace what it "
                    "reads; copy it elsewhere or pick another --output")

    def engine_options(self) -> EngineOptions:
        """The engine options this config sets (checked: a bad value is a one-line error)."""
        return self.engine.build()

    FLOAT_KEYS = ("lr", "weight_decay", "max_grad_norm", "epochs", "lora_alpha", "lora_dropout",
                  "eval_fraction", "max_memory_gib", "router_aux_loss_coef", "beta",
                  "label_smoothing", "simpo_gamma", "desirable_weight", "undesirable_weight",
                  "temperature", "top_p", "epsilon", "epsilon_high")

    def validate(self) -> "TrainConfig":
        for name in self.FLOAT_KEYS:
            value = self.get(name)
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
            changed = _changed("lora", self.lora)
            if changed:
                raise LeantuneError(f"{_flag(changed[0])} is a LoRA setting, and --full trains "
                                    f"every weight without an adapter; drop {_flag(changed[0])} "
                                    "or --full")
        if self.full and self.load_in_4bit:
            raise LeantuneError("--load-in-4bit trains LoRA adapters on a frozen 4-bit base, and "
                                "--full trains every weight; drop one of them")
        if self.adapter and self.load_in_4bit:
            raise LeantuneError(f"--adapter {self.adapter}: continuing from an adapter folds it "
                                "into the base weights, which a 4-bit (NF4) base cannot take "
                                "without changing; drop --load-in-4bit (train on the 16-bit base)")
        self._check_inputs_outside_output()
        if self.precision not in ("bf16", "fp8"):
            raise LeantuneError(f"--precision must be bf16 or fp8, got {self.precision!r}")
        if self.precision == "fp8" and (self.full or self.load_in_4bit or self.adapter):
            what = ("--full trains every weight" if self.full else "--load-in-4bit makes an NF4 "
                    "base" if self.load_in_4bit else f"--adapter {self.adapter} folds into the "
                    "16-bit base")
            raise LeantuneError(f"--precision fp8 quantises a frozen LoRA base to e4m3, and "
                                f"{what}; drop one of them")
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
        self._validate_objective()
        return self

    def _validate_objective(self) -> None:
        from .objectives import objective_class

        o = self.objective
        objective_class(o.name)  # an unknown name: one line naming those there are
        if o.name == "sft":
            changed = _changed("objective", o)
            if changed and APPLIES_TO.get(changed[0]) == ("grpo",):
                raise LeantuneError(f"{_flag(changed[0])} is a setting of --objective grpo, and "
                                    f"--objective sft (the default) has none; drop "
                                    f"{_flag(changed[0])} or add --objective grpo")
            if changed:
                raise LeantuneError(f"{_flag(changed[0])} is a preference-objective setting, and "
                                    f"--objective sft (the default) has none; drop "
                                    f"{_flag(changed[0])} or pick the objective it is for "
                                    "(--objective dpo, ...)")
        for name in _changed("objective", o):
            owners = APPLIES_TO.get(name)
            if owners is not None and o.name not in owners:
                raise LeantuneError(f"{_flag(name)} is a setting of --objective "
                                    f"{' or '.join(owners)}, not of --objective {o.name}; drop "
                                    f"{_flag(name)}")
        if o.name == "grpo":
            self._validate_grpo()
            return
        if o.beta is None and o.name != "sft":  # the preference objective's default (TRL's)
            from .losses.preference import DEFAULT_BETAS, DPO_BETA
            o.beta = DEFAULT_BETAS.get(o.name, DPO_BETA)  # (an objective of one's own: 0.1)
        if o.name != "sft":
            for name in ("train_on_inputs", "format"):
                if getattr(self, name) not in (None, False):
                    raise LeantuneError(f"{_flag(name)} is an SFT setting; --objective {o.name} "
                                        "trains on the completions of its preference rows "
                                        f"(their fields say which is which): drop {_flag(name)}")
        if o.loss_type not in (None, "sigmoid") and o.label_smoothing:
            raise LeantuneError(f"--label-smoothing applies to --loss-type sigmoid, not "
                                f"{o.loss_type}; drop one of them")
        if o.beta is not None and not o.beta > 0:
            raise LeantuneError(f"--beta must be positive, got {o.beta}")
        if o.loss_type is not None and o.loss_type not in LOSS_TYPES:
            raise LeantuneError(f"--loss-type must be one of {', '.join(LOSS_TYPES)}, got "
                                f"{o.loss_type!r}")
        if not 0.0 <= o.label_smoothing <= 0.5:
            raise LeantuneError(f"--label-smoothing must be in [0, 0.5], got {o.label_smoothing}")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(o, name) > 0:
                raise LeantuneError(f"{_flag(name)} must be positive, got {getattr(o, name)}")
        if o.max_prompt_len is not None and not 0 < o.max_prompt_len < self.max_seq_len:
            raise LeantuneError(f"--max-prompt-len must be a positive number of tokens under "
                                f"--max-seq-len {self.max_seq_len}, got {o.max_prompt_len}")

    def _validate_grpo(self) -> None:
        """GRPO's settings (one line each); beta defaults to 0 and loss_type to dapo."""
        o = self.objective
        if o.beta is None:
            o.beta = 0.0
        if o.loss_type is None:
            o.loss_type = "dapo"
        for name in ("train_on_inputs", "format"):
            if getattr(self, name) not in (None, False):
                raise LeantuneError(f"{_flag(name)} is an SFT setting; --objective grpo trains "
                                    f"on the completions it samples: drop {_flag(name)}")
        if self.eval_data or self.eval_fraction:
            raise LeantuneError("--objective grpo does not evaluate yet: drop "
                                f"{'--eval-data' if self.eval_data else '--eval-fraction'} "
                                "(the per-step rewards in metrics.jsonl show its progress)")
        if o.loss_type not in GRPO_LOSS_TYPES:
            raise LeantuneError(f"--loss-type for --objective grpo must be one of "
                                f"{', '.join(GRPO_LOSS_TYPES)}, got {o.loss_type!r}")
        if not o.beta >= 0:
            raise LeantuneError(f"--beta must be 0 (no KL term, the default) or more, got "
                                f"{o.beta}")
        if o.scale_rewards not in ("group", "batch", "none"):
            raise LeantuneError(f"--scale-rewards must be group, batch or none, got "
                                f"{o.scale_rewards!r}")
        for name, least in (("num_generations", 2), ("max_completion_tokens", 1),
                            ("num_iterations", 1)):
            v = getattr(o, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise LeantuneError(f"{_flag(name)} must be an integer of at least {least}, got "
                                    f"{v!r}" + ("; GRPO compares completions within a group"
                                                if name == "num_generations" else ""))
        if o.log_completions_every < 0:
            raise LeantuneError(f"--log-completions-every must be 0 (off) or more, got "
                                f"{o.log_completions_every}")
        if not o.temperature > 0:
            raise LeantuneError(f"--temperature must be above 0 for GRPO (it samples), got "
                                f"{o.temperature}")
        if not 0 < o.top_p <= 1:
            raise LeantuneError(f"--top-p must be in (0, 1], got {o.top_p}")
        if not 0 <= o.epsilon < 1:
            raise LeantuneError(f"--epsilon must be in [0, 1), got {o.epsilon}")
        if o.epsilon_high is not None and not o.epsilon_high >= 0:
            raise LeantuneError(f"--epsilon-high must be 0 or more, got {o.epsilon_high}")
        if o.max_completion_tokens >= self.max_seq_len:
            raise LeantuneError(f"--max-completion-tokens {o.max_completion_tokens} must be "
                                f"below --max-seq-len {self.max_seq_len} (prompt + completion "
                                "fit in it)")
        if o.max_prompt_len is not None and (
                o.max_prompt_len <= 0 or o.max_prompt_len + o.max_completion_tokens
                > self.max_seq_len):
            raise LeantuneError(f"--max-prompt-len {o.max_prompt_len} plus "
                                f"--max-completion-tokens {o.max_completion_tokens} must fit in "
                                f"--max-seq-len {self.max_seq_len}")
        if not isinstance(o.reward, (list, tuple)) or not o.reward:
            raise LeantuneError("--objective grpo needs at least one --reward: FILE.py:FUNCTION "
                                "or builtin:NAME (builtin:exact-answer, builtin:format, "
                                "builtin:length-penalty)")
        w = o.reward_weights
        if w is not None and (not isinstance(w, (list, tuple)) or len(w) != len(o.reward)):
            raise LeantuneError(f"--reward-weights gives {len(w) if isinstance(w, list) else w!r}"
                                f" weights for {len(o.reward)} --reward functions; give one "
                                "weight per function, in order")
        if w is not None:
            for x in w:
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                    raise LeantuneError(f"--reward-weights: {x!r} is not a finite number")


def _section(name: str, value):
    """The section `name` from what a caller gave: its dataclass (copied, so a replaced config
    never shares a section with the original), a mapping of its fields, or an objective's
    name."""
    cls = SECTIONS[name]
    if isinstance(value, cls):
        return replace(value)
    if name == "objective" and isinstance(value, str):
        return cls(name=value)
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in value.items() if k in known})
    raise TypeError(f"TrainConfig.{name}: expected {cls.__name__} or a mapping, got {value!r}")


def _changed(section: str, value) -> list[str]:
    """The flat names of the fields of `value` (a section) that differ from their defaults."""
    default = SECTIONS[section]()
    return [FLAT_NAMES[(section, f.name)] for f in fields(value)
            if f.name != "name" and getattr(value, f.name) != getattr(default, f.name)]


# settings whose flag turns them off (the CLI's store_false flags)
_OFF_FLAGS = {"shared_prompt", "offload_embedding", "fused_layers", "pack_projections",
              "progress"}


def _flag(name: str) -> str:
    """The CLI flag that sets `name` (a setting on by default: its --no- flag)."""
    return ("--no-" if name in _OFF_FLAGS else "--") + name.replace("_", "-")


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
        if key in SECTIONS and (isinstance(v, dict) or key != "objective"):
            out[key] = _coerce_section(p, k, key, v)
            continue
        out[key] = _coerce(p, k, key, v)
    return out


def _coerce_section(path: Path, raw_key, section: str, value) -> dict:
    """A section written as a mapping (`lora: {r: 8, alpha: 16}`): each field checked as a flag
    would be."""
    cls = SECTIONS[section]
    if not isinstance(value, dict):
        raise LeantuneError(f"{path}: option {raw_key!r} must be a mapping of its settings "
                            f"({', '.join(f.name for f in fields(cls))})")
    kinds = {f.name: str(f.type) for f in fields(cls)}
    out = {}
    for k, v in value.items():
        name = str(k).replace("-", "_")
        if name not in kinds:
            raise LeantuneError(f"{path}: unknown option {raw_key}.{k}; {raw_key} holds "
                                f"{', '.join(kinds)}")
        out[name] = _coerce(path, f"{raw_key}.{k}", name, v, kinds[name])
    return out


def _kind(key: str) -> str:
    """The type (as written in the dataclass) of the plain field or flat name `key`."""
    if key == "objective":
        return "str"  # (its name)
    if key in FLAT_KEYS:
        section, name = FLAT_KEYS[key]
        return {f.name: str(f.type) for f in fields(SECTIONS[section])}[name]
    return {f.name: str(f.type) for f in fields(TrainConfig)}[key]


def _coerce(path: Path, raw_key, key: str, value, kind: str | None = None):
    """Check a YAML value against the field's type. YAML 1.1 reads `1e-4` (no dot) as a string,
    so numbers written as strings are converted; anything else of the wrong type is an error."""
    kind = kind or _kind(key)
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
