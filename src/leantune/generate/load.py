"""A model to generate with, from the command line's --model and --adapter: the base checkpoint,
the adapter attached unmerged (a PEFT adapter folder, a run folder or one training checkpoint),
and the tokenizer. `locate` checks everything and loads the tokenizer (so prompts can be checked
too, against the context of `Located.config`) before `Located.load` reads the weights; it also
reads the prompt format the run was trained with (prompts.trained_prompt_format)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LeantuneError


def check_adapter_path(adapter: str | Path) -> Path:
    """--adapter as a Path, refused in one line when there is no such folder (before anything
    else is read: a typo should not surface as a missing adapter_config.json or a base model)."""
    path = Path(adapter)
    if not path.exists():
        raise LeantuneError(f"--adapter {path}: no such folder; give the output folder of "
                            "`leantune train` (or a PEFT adapter folder, or RUN/checkpoints/step-N)")
    if not path.is_dir():
        raise LeantuneError(f"--adapter {path}: a file, not a folder; give the folder that holds "
                            "adapter_config.json and adapter_model.safetensors")
    return path


def adapter_base(adapter: Path) -> str:
    """The base model named by an adapter: adapter_config.json's base_model_name_or_path, or
    the --model of the run a run folder or checkpoint was written by."""
    for config, key in ((adapter / "adapter_config.json", "base_model_name_or_path"),
                        (adapter / "run_config.json", "model"), (adapter / "state.json", "model")):
        if config.exists():
            try:
                d = json.loads(config.read_text())
                base = d.get(key) if key != "model" else d["config"].get("model")
            except (ValueError, KeyError, AttributeError, TypeError):
                raise LeantuneError(f"{config}: unreadable; give the base model with --model"
                                    ) from None
            if base:
                return str(base)
            raise LeantuneError(f"{config}: names no base model ({key}); give it with --model")
    raise LeantuneError(f"{adapter}: not an adapter folder (no adapter_config.json), so its base "
                        "model is unknown; give --model, and --adapter an adapter folder written "
                        "by `leantune train` or PEFT")


@dataclass
class Located:
    """A checked base checkpoint, adapter and device; the tokenizer already loaded."""

    folder: Path
    lora: tuple | None  # (LoRAConfig, weights file) of the adapter
    device: torch.device
    dtype: torch.dtype
    tokenizer: object
    trained_format: str | None = None  # "chat" | "alpaca" | "text": the run's, when it says
    precision: str = "bf16"  # "fp8": the projections quantised to e4m3 as they load

    def prompt_format(self, requested: str | None = None, log=print,
                      untrained: str | None = None) -> str:
        """The prompt format typed prompts take (--prompt-format `requested`, else the run's,
        else `untrained` or the tokenizer's default: prompts.resolve_prompt_format), said in
        one note when it comes from the run."""
        from .prompts import DESCRIBE, resolve_prompt_format

        fmt = resolve_prompt_format(requested, self.trained_format, self.tokenizer, untrained)
        if (requested in (None, "auto")) and self.trained_format:
            log(f"prompt format: {DESCRIBE[fmt]} ({fmt}), as the run was trained "
                "(--prompt-format overrides)")
        return fmt

    def config(self):
        """The base's ModelConfig, from config.json alone: its context is known before the
        weights load (a prompt too long for it is refused without waiting for them)."""
        from ..model.config import ModelConfig

        return ModelConfig.from_file(self.folder / "config.json")

    def load(self):
        """The model in eval mode, the adapter attached unmerged."""
        from ..lora.peft_io import attach_adapter
        from ..model.loader import load_model

        model = load_model(self.folder, dtype=self.dtype, device=self.device,
                           precision=self.precision)
        if self.lora is not None:
            attach_adapter(model, *self.lora)
        return model.eval()


def locate(model: str | None, adapter: str | None, device: str | None = None,
           dtype: str | None = None, log=print, force_base: bool = False,
           precision: str = "bf16") -> Located:
    """Check --model (default: the base named by --adapter), --adapter (that it fits the base's
    shapes, and that the base is the one it was trained on: lora/base_check.py, a warning only
    with `force_base`), --device and --dtype ("bfloat16" | "float16" | "float32"; default by
    device), --precision (fp8: where the device has FP8 matrix units, on a 16-bit
    checkpoint) and load the tokenizer."""
    from ..export.merge import MergedWeights, adapter_source
    from ..lora.base_check import check_base
    from ..model.loader import DTYPES, default_dtype, resolve_checkpoint
    from ..train.preflight import check_weights
    from ..train.trainer import VOCAB_FILES, load_tokenizer, resolve_device

    from .prompts import trained_prompt_format

    adapter_dir = check_adapter_path(adapter) if adapter else None
    if model is None:
        if adapter_dir is None:
            raise LeantuneError("--model is required (or --adapter, whose adapter_config.json "
                                "names its base model)")
        model = adapter_base(adapter_dir)
        log(f"model: {model} (the base named by the adapter)")
    dev = resolve_device(device)
    folder = resolve_checkpoint(model)
    from ..lora.base_weight import check_precision

    check_precision(precision, dev, prequantized=check_weights(folder))
    lora = None
    if adapter_dir is not None:
        MergedWeights(folder, adapter_dir, log)  # checks the adapter fits this base (headers)
        lora = adapter_source(adapter_dir, log=lambda _: None)
        check_base(lora[1], model, folder, force=force_base, log=log)
    # the base's tokenizer; a run folder keeps a copy for a base that has none
    has_own = any((folder / f).exists() for f in VOCAB_FILES)  # (its vocabulary: trainer's)
    tokenizer = load_tokenizer(str(folder if has_own or adapter_dir is None else adapter_dir))
    return Located(folder, lora, dev, DTYPES[dtype] if dtype else default_dtype(dev), tokenizer,
                   trained_prompt_format(adapter_dir if adapter_dir is not None else folder),
                   precision)
