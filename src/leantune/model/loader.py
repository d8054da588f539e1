"""Loading Hugging Face checkpoints into CausalLM.

The model is built on the meta device (no memory), given empty storage on the target device, and
filled shard by shard with safetensors' lazy `safe_open`, one tensor at a time; host memory peaks
near one tensor, not the whole model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..errors import LeantuneError
from .config import ModelConfig
from .transformer import CausalLM

# What a hub download fetches. Weights: the files transformers loads (model.safetensors or the
# shards of model.safetensors.index.json), not every *.safetensors: Mistral repos, for one, also
# hold the whole model again as consolidated.safetensors.
CHECKPOINT_PATTERNS = ["config.json", "generation_config.json", "model*.safetensors",
                       "model.safetensors.index.json", "tokenizer*", "special_tokens_map.json",
                       "*.model", "vocab*", "merges.txt", "chat_template*"]


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs that support it, fp16 on older GPUs, fp32 on the CPU."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """A local folder, or a hub id downloaded through huggingface_hub (safetensors only)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    s = str(name_or_path)
    if p.exists():
        raise LeantuneError(f"{s}: is a file; --model must be the checkpoint folder holding "
                            "config.json and *.safetensors (or a Hugging Face hub id)")
    # org/name, or a bare name (the hub's legacy ids such as "gpt2")
    looks_like_hub_id = (not s.startswith((".", "/", "~"))
                         and (s.count("/") == 1 or re.fullmatch(r"[A-Za-z0-9][\w.-]*", s)))
    if not looks_like_hub_id:
        raise LeantuneError(f"{s}: model path does not exist; give a folder holding config.json "
                            "and *.safetensors, or a Hugging Face hub id like org/name")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(s, allow_patterns=CHECKPOINT_PATTERNS))
    except Exception as e:  # offline, unknown repo, gated, ...
        raise LeantuneError(f"{s}: no local folder of that name, and it could not be downloaded "
                            f"from the hub ({type(e).__name__}); check the path or id, your "
                            "network, or HF_TOKEN") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LeantuneError(f"{index}: unreadable shard index ({e}); re-download the model") from None
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise LeantuneError(f"{folder}: no *.safetensors weights found (only safetensors "
                                "checkpoints are supported; convert .bin with transformers)")
    for f in files:
        if not f.exists():
            raise LeantuneError(f"{f}: safetensors shard named in the index is missing; "
                                "re-download the model")
    return files


def load_model(name_or_path: str | os.PathLike, *, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None) -> CausalLM:
    """Build the model from a checkpoint folder or hub id and load its weights.

    Args:
        name_or_path: folder with config.json and safetensors, or a hub id.
        dtype: parameter dtype; default bf16 on capable GPUs, fp16 on older ones, fp32 on CPU.
        device: default "cuda" when available, else "cpu".
    """
    folder = resolve_checkpoint(name_or_path)
    cfg = ModelConfig.from_file(folder / "config.json")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or default_dtype(device)
    model = build_empty(cfg, dtype, device)
    load_safetensors_into(model, safetensors_files(folder))
    model.source_path = folder
    return model


def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """The model with uninitialised storage of `dtype` on `device` (built on meta first)."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.source_path = None
    return model


@torch.no_grad()
def load_safetensors_into(model: CausalLM, files: list[Path], rows=None) -> None:
    """Copy every tensor of `files` into the parameter of the same name; all must be filled.

    rows(param) -> (tensor, slice): for a parameter of which this process holds only some rows
    (FSDP2: leantune.dist.fsdp), the tensor holding them and which rows of dim 0 they are; only
    those rows are read from the file."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    missing = {n for n in params if "lora_" not in n}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():
                    if key not in params:
                        continue  # a tied head saved anyway, rotary buffers of old checkpoints
                    p = params[key]
                    sl = sf.get_slice(key)
                    shape = tuple(sl.get_shape())
                    if shape != tuple(p.shape):
                        raise LeantuneError(f"{f}: tensor {key} has shape {shape}, "
                                            f"config.json implies {tuple(p.shape)}")
                    if rows is None:
                        p.copy_(sf.get_tensor(key), non_blocking=False)
                    else:
                        dst, part = rows(p)
                        if part.stop > part.start:
                            dst.copy_(sl[part], non_blocking=False)
                    missing.discard(key)
        except LeantuneError:
            raise
        except Exception as e:
            raise LeantuneError(f"{f}: cannot read safetensors file ({type(e).__name__}: "
                                f"{str(e)[:120]}); the file is truncated or corrupt, "
                                "re-download it") from None
    if missing:
        example = sorted(missing)[0]
        raise LeantuneError(f"{files[0].parent}: {len(missing)} weights missing from the "
                            f"checkpoint (e.g. {example}); the download is incomplete")
