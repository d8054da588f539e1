"""Loading Hugging Face checkpoints into CausalLM.

The model is built on the meta device (no memory), given empty storage on the target device, and
filled with safetensors' lazy `safe_open`, one tensor at a time, following the weight plan
(model/weight_map.py: which checkpoint tensors fill which parameter, e.g. per-expert or MXFP4
expert weights into stacked ones); host memory peaks near one tensor, not the whole model.

4-bit (QLoRA) bases, NF4 in bitsandbytes' layout (kernels/nf4.py): with `load_in_4bit` the
decoder layers' projection weights are quantised as they are read, each on the target device, so
the GPU holds the 4-bit model and one 16-bit tensor at a time, never the 16-bit model. A
pre-quantised `*-bnb-4bit` checkpoint (transformers + bitsandbytes' save) is read as it is, without
bitsandbytes: its 4-bit weights are found by their quant_state tensors, and the modules it kept
16-bit (llm_int8_skip_modules), the embeddings and the LM head load as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from pathlib import Path

from contextlib import ExitStack
from dataclasses import dataclass

import torch

from ..errors import LeantuneError
from ..utils.words import count
from ..kernels.nf4 import NF4Weight, nf4_from_bnb_state, parse_bnb_state
from ..lora.layer import LoRALinear
from .config import ModelConfig
from .transformer import CausalLM
from .weight_map import fused_rows, plan_weights, read_piece_into

# --precision: the frozen base's projections in the checkpoint's 16-bit form, or in e4m3
PRECISIONS = ("bf16", "fp8")

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


# The files of a checkpoint that can name Python code of its own ("auto_map": class -> module.Name
# in a .py file beside them), which transformers runs only with trust_remote_code=True.
CODE_NAMING_FILES = ("tokenizer_config.json", "config.json")  # (the tokenizer's first)


def custom_code(folder: str | os.PathLike) -> str | None:
    """Where the checkpoint `folder` names code of its own, e.g. "tokenizer_config.json
    auto_map AutoTokenizer -> tokenization_x.XTokenizer", or None. leantune never runs such code:
    it builds models from config.json's fields (model_type) and loads tokenizers with
    trust_remote_code=False; this names the reason when a tokenizer cannot load without it."""
    for name in CODE_NAMING_FILES:
        try:
            d = json.loads((Path(folder) / name).read_text())
        except (OSError, ValueError):
            continue
        auto_map = d.get("auto_map") if isinstance(d, dict) else None
        if isinstance(auto_map, dict) and auto_map:
            key, value = next(iter(auto_map.items()))
            if isinstance(value, (list, tuple)):
                value = next((v for v in value if v), value)
            return f"{name} auto_map {key} -> {' '.join(str(value).split())[:80]}"
    return None


def custom_code_error(folder: str | os.PathLike, what: str = "tokenizer") -> LeantuneError | None:
    """The one-line refusal of a checkpoint whose `what` needs its own Python code, or None when
    the folder names no code (the failure has another cause)."""
    where = custom_code(folder)
    if where is None:
        return None
    return LeantuneError(f"{folder}: the {what} needs the checkpoint's own Python code ({where}), "
                         "which leantune never runs; use a checkpoint whose tokenizer "
                         "transformers reads from its files (tokenizer.json), or convert it")


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
               device: str | torch.device | None = None, load_in_4bit: bool = False,
               precision: str = "bf16") -> CausalLM:
    """Build the model from a checkpoint folder or hub id and load its weights.

    Args:
        name_or_path: folder with config.json and safetensors, or a hub id.
        dtype: parameter (and compute) dtype; default: a pre-quantised checkpoint's
            bnb_4bit_compute_dtype, else bf16 on capable GPUs, fp16 on older ones, fp32 on CPU.
        device: default "cuda" when available, else "cpu".
        load_in_4bit: quantise the decoder layers' projection weights to NF4 while loading
            (QLoRA); a pre-quantised bnb-4bit checkpoint is 4-bit either way.
        precision: "bf16" (the checkpoint's 16-bit weights) or "fp8": quantise them to e4m3
            with 128 x 128 block scales while loading (kernels/fp8.py), as load_in_4bit does to
            NF4; refused in one line (LeantuneError) on a device without FP8 matrix units
            (unless LEANTUNE_FP8_EMULATE=1), with load_in_4bit, or on a 4-bit checkpoint.
    """
    if precision not in PRECISIONS:
        raise LeantuneError(f"load_model: precision must be one of {', '.join(PRECISIONS)}, "
                            f"got {precision!r}")
    if precision == "fp8" and load_in_4bit:
        raise LeantuneError("load_model: precision='fp8' quantises the projections to e4m3 and "
                            "load_in_4bit to NF4; pass one of them")
    folder = resolve_checkpoint(name_or_path)
    cfg = ModelConfig.from_file(folder / "config.json")
    compute_dtype = bnb_compute_dtype(cfg, folder / "config.json")
    files = safetensors_files(folder)
    fam = cfg.family
    # (a multimodal checkpoint's 4-bit weights outside its language model are not read)
    states = {fam.our_name(k): st for k, st in bnb_quant_states(files).items()
              if not fam.prefixes or fam.our_name(k) != k}
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if precision == "fp8":
        from ..lora.base_weight import check_precision

        check_precision(precision, device, prequantized=bool(states))
    dtype = dtype or (compute_dtype if states else None) or default_dtype(device)
    nf4 = {name.removesuffix(".weight"): nf4_from_bnb_state(st, dtype, "meta")
           for name, st in states.items()}
    if load_in_4bit and not states:
        with torch.device("meta"):
            projections = [name for name, _ in nf4_projections(CausalLM(cfg))]
        nf4 = {name: None for name in projections}
    fp8 = precision == "fp8" and not nf4  # (FP8: e4m3 placeholders before any storage)
    model = build_empty(cfg, dtype, torch.device("meta") if fp8 else device, nf4)
    if fp8:
        from ..lora.base_weight import quantize_fp8_

        model = quantize_fp8_(model).to_empty(device=device)
    load_safetensors_into(model, files, prequantized=set(states))
    model.source_path = folder
    return model


def nf4_projections(model: CausalLM):
    """(name, LoRALinear) of the projections a 4-bit base quantises: q/k/v/o and gate/up/down of
    every decoder layer (the embeddings and the LM head stay 16-bit, as in bitsandbytes' QLoRA)."""
    for name, mod in model.named_modules():
        if isinstance(mod, LoRALinear) and name.startswith("model.layers."):
            yield name, mod


@torch.no_grad()
def quantize_nf4_(model: CausalLM) -> CausalLM:
    """Quantise the model's decoder projections to NF4 in place, one weight at a time (each
    16-bit weight is freed as its 4-bit copy is made)."""
    for _, mod in nf4_projections(model):
        if mod.nf4 is None:
            w = mod.weight
            mod.set_nf4_base(NF4Weight(w.shape, w.dtype, device=w.device).quantize_(w))
    return model


def build_empty(cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                nf4: dict | None = None) -> CausalLM:
    """The model with uninitialised storage of `dtype` on `device` (built on meta first).
    nf4: {projection name: NF4Weight on the meta device, or None for an NF4 weight of `dtype`}:
    those projections hold a 4-bit weight instead of the 16-bit one."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to(dtype)
    for name, w in (nf4 or {}).items():
        mod = model.get_submodule(name) if name.startswith("model.layers.") else None
        if not isinstance(mod, LoRALinear):
            raise LeantuneError(f"{name}.weight: a 4-bit weight where leantune reads a 16-bit "
                                "one (only the decoder layers' projections are 4-bit; the "
                                "embeddings and the LM head stay 16-bit); use the 16-bit "
                                "checkpoint with --load-in-4bit")
        shape = (mod.out_features, mod.in_features)
        if w is not None and w.shape != shape:
            raise LeantuneError(f"{name}.weight: 4-bit weight of shape {w.shape} (its "
                                f"quant_state), config.json implies {shape}")
        mod.set_nf4_base(w if w is not None else NF4Weight(shape, dtype, device="meta"))
    model = model.to_empty(device=device)
    model.source_path = None
    return model


@dataclass
class Headers:
    """What the safetensors headers of a checkpoint say, per tensor name: its shape, its dtype
    (safetensors' string: "BF16", "F32", "U8", ...) and its file."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]
    files: dict[str, Path]


def read_headers(files: list[Path]) -> Headers:
    """The headers of `files` (no tensor data is read)."""
    from safetensors import safe_open

    h = Headers({}, {}, {})
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for key in sf.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    sl = sf.get_slice(key)
                    h.shapes[key], h.dtypes[key], h.files[key] = (
                        tuple(sl.get_shape()), sl.get_dtype(), f)
        except Exception as e:
            raise _unreadable(f, e) from None
    return h


def _unreadable(f: Path, e: Exception) -> LeantuneError:
    return LeantuneError(f"{f}: cannot read safetensors file ({type(e).__name__}: "
                         f"{str(e)[:120]}); the file is truncated or corrupt, re-download it")


def plan_checkpoint(model: CausalLM, files: list[Path], headers: Headers | None = None):
    """(the weight plan of `files` for `model`'s parameters (model/weight_map.py), the
    tensors' files); checks names and shapes from the headers alone."""
    h = headers or read_headers(files)
    params = {n: tuple(p.shape) for n, p in model.named_parameters() if "lora_" not in n}
    return plan_weights(model.config.model_type, params, h.shapes, h.files,
                        files[0].parent), h.files


def _read_rows_into(p: torch.Tensor, piece, sf, rows) -> None:
    """This process's rows (dim 0) of parameter `p` from checkpoint piece `piece`: a whole
    tensor's slice of rows, or, for one expert of a stacked parameter (dim 0: experts), that
    expert when it is among this process's rows."""
    dst, part = rows(p)
    if piece.expert is None:
        a = piece.fused_rows[0] if piece.fused_rows else 0  # (rows of a fused tensor)
        if part.stop > part.start:
            dst.copy_(sf.get_slice(piece.key)[a + part.start:a + part.stop])
    elif part.start <= piece.expert < part.stop:
        local = dataclasses.replace(piece, expert=piece.expert - part.start)
        local.target(dst).copy_(sf.get_tensor(piece.key))


def bnb_compute_dtype(cfg: ModelConfig, where: Path) -> torch.dtype | None:
    """The compute dtype of a bitsandbytes 4-bit checkpoint (config.json's quantization_config;
    None when it names none, or there is no quantization_config); any other quantisation is
    one line saying what leantune reads."""
    q = cfg.raw.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method == "mxfp4":  # gpt-oss's released experts: dequantised on load (model/mxfp4.py)
        return None
    if method != "bitsandbytes" or q.get("load_in_8bit") or q.get("_load_in_8bit"):
        what = "8-bit bitsandbytes" if method == "bitsandbytes" else f"{method!r}"
        raise LeantuneError(f"{where}: quantization_config: {what} checkpoints are not "
                            "supported; leantune reads bitsandbytes 4-bit (nf4) and gpt-oss's "
                            "MXFP4 checkpoints, or quantises a 16-bit checkpoint with "
                            "--load-in-4bit")
    return DTYPES.get(str(q.get("bnb_4bit_compute_dtype")).replace("torch.", ""))


@contextlib.contextmanager
def open_shard(f: Path):
    """safe_open of shard `f` (tensors read to the host); a file that cannot be read, or a
    failure while reading it, is one line naming the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            yield sf
    except LeantuneError:
        raise
    except Exception as e:
        raise _unreadable(f, e) from None


QUANT_STATE = ".quant_state.bitsandbytes__"


def bnb_quant_states(files: list[Path]) -> dict[str, dict]:
    """{weight name: its parsed quant_state} of the 4-bit weights of a bitsandbytes checkpoint
    (empty for a 16-bit one). Each is checked to be NF4 as leantune reads it, stored as uint8
    (kernels/nf4.parse_bnb_state): anything else is one line naming the tensor."""
    states, dtypes = {}, {}
    for f in files:
        with open_shard(f) as sf:
            for key in sf.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                if QUANT_STATE in key:
                    states[key.partition(QUANT_STATE)[0]] = parse_bnb_state(
                        sf.get_tensor(key), key)
                else:
                    dtypes[key] = sf.get_slice(key).get_dtype()
    for name in states:
        if dtypes.get(name, "U8") != "U8":
            raise LeantuneError(f"{name}: 4-bit weight stored as {dtypes[name]}; leantune reads "
                                "bnb_4bit_quant_storage uint8 only")
    return states


@torch.no_grad()
def load_safetensors_into(model: CausalLM, files: list[Path],
                          prequantized: set[str] = frozenset(), rows=None) -> None:
    """Fill every parameter from the checkpoint tensors the weight plan names (a tied head or
    rotary buffers saved anyway are not read); one tensor (or one MXFP4 expert) at a time. A
    4-bit projection reads its bitsandbytes tensors (weight names in `prequantized`), or
    quantises its 16-bit weight as it is read.

    rows(param) -> (tensor, slice): for a parameter of which this process holds only some rows
    (FSDP2: leantune.dist.fsdp), the tensor holding them and which rows of dim 0 they are; only
    those rows are read from the file."""
    from safetensors import safe_open

    headers = read_headers(files)
    plan, file_of = plan_checkpoint(model, files, headers)
    params = dict(model.named_parameters())
    nf4 = {name + ".weight": m.quantized for name, m in nf4_projections(model)
           if m.quantized is not None}  # (NF4, or FP8: quantised as read)
    fam = model.config.family
    # a 4-bit weight's checkpoint name (Gemma 3 multimodal: prefixed), or for a 16-bit one
    # quantised as it loads, the rows of a fused checkpoint tensor (Phi-3's qkv_proj) it is
    fused = fused_rows(fam, {w: tuple(q.shape) for w, q in nf4.items()})
    stored = {w: next((k for k in fam.checkpoint_names(w) if k in file_of), w) for w in nf4}
    for w in nf4:
        if w in fused and stored[w] not in file_of:
            if w in prequantized or fused[w][0] not in file_of:
                raise LeantuneError(f"{files[0].parent}: {fused[w][0]} is a 4-bit fused tensor "
                                    "(or missing); leantune reads 4-bit Phi-3 checkpoints from "
                                    "their 16-bit original with --load-in-4bit")
            stored[w] = fused[w][0]
    keys = {w: [f"{stored[w]}.{p}".rstrip(".")
                for p in (q.bnb_parts() if w in prequantized else [""])]
            for w, q in nf4.items()}
    missing = sorted(k for ks in keys.values() for k in ks if k not in file_of)
    if missing:
        raise LeantuneError(f"{files[0].parent}: {count(len(missing), 'weight')} missing from "
                            f"the checkpoint (e.g. {missing[0]}); the download is incomplete: "
                            "re-download the model")
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def handle(key: str):
            f = file_of[key]
            if f not in handles:
                handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            return handles[f]

        if rows is not None and (nf4 or any(piece.scales for pieces in plan.values()
                                             for piece in pieces)):
            raise LeantuneError(f"{files[0].parent}: FSDP2 (--parallel fsdp) does not load 4-bit "
                                "bases or MXFP4 experts yet; use --parallel ddp")
        for name, pieces in plan.items():
            for piece in pieces:
                try:
                    if rows is None:
                        read_piece_into(params[name], piece, handle(piece.key),
                                        handle(piece.scales) if piece.scales else None)
                    else:
                        _read_rows_into(params[name], piece, handle(piece.key), rows)
                except LeantuneError:
                    raise
                except Exception as e:
                    raise _unreadable(file_of[piece.key], e) from None
        for w, q in nf4.items():
            for key in keys[w]:
                try:
                    if key != w and w in fused and key == fused[w][0]:
                        a, b = fused[w][1]
                        t = handle(key).get_slice(key)[a:b]
                    else:
                        t = handle(key).get_tensor(key)
                except Exception as e:
                    raise _unreadable(file_of[key], e) from None
                if w in prequantized:
                    q.load_bnb_(key[len(stored[w]):].lstrip("."), t, key)
                elif tuple(t.shape) != tuple(q.shape):
                    raise LeantuneError(f"{file_of[key]}: tensor {key} has shape "
                                        f"{tuple(t.shape)}, config.json implies {tuple(q.shape)}")
                else:
                    q.quantize_(t)
