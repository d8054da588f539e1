"""LoRA adapters in PEFT's on-disk format.

adapter_model.safetensors holds `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r], and in its metadata the base's name and weights fingerprint
(base_check.py); adapter_config.json is PEFT's LoraConfig. Files written here load
with `peft.PeftModel.from_pretrained` on the transformers model, and PEFT-trained adapters load
here.

LoRA on MoE experts targets transformers 5.x's stacked expert parameters through PEFT's
`target_parameters` (mlp.experts.gate_up_proj, mlp.experts.down_proj). PEFT wraps the experts
module once per parameter, in the order the module registers them, so the first (gate_up_proj)
is saved as `<experts>.base_layer.lora_*` and the last (down_proj) as `<experts>.lora_*`; its
tensors are 2-D: lora_A [E * r, in] (expert-major rows) and lora_B [out, r * E] (rank-major
columns), which are our A [E, r, in] and B [E, out, r] reshaped. Such an adapter does not load on
transformers 4.x, whose experts were separate modules.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from ..dist.tensors import full_tensor
from ..errors import LeantuneError
from .base_check import BASE_NAME_KEY, FINGERPRINT_KEY, model_fingerprint
from .config import ALL_TARGETS, EXPERTS, LoRAConfig, apply_lora, expert_layers, lora_layers

PREFIX = "base_model.model."
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj",
                                                                               "up_proj")}
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")  # model/moe.py Experts, in registration order
TARGET_PARAMETERS = [f"mlp.experts.{p}" for p in EXPERT_PROJECTIONS]
_PEFT_EXPERTS = re.compile(r"(.*\.experts)((?:\.base_layer)*)")
# a multimodal checkpoint's language model (Gemma 3), as PEFT on transformers 5 / 4 names it
_LANGUAGE_MODEL = re.compile(r"^(?:model\.language_model\.|language_model\.model\.)")


def parse_key(key: str) -> tuple[str, str, bool]:
    """A LoRA tensor name -> (the name of the base tensor it adapts, "A" or "B", whether it is
    PEFT's 2-D form of a stacked experts' LoRA). Takes PEFT adapter names and our own
    parameter names (training checkpoints), e.g.
        base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
            -> model.layers.0.self_attn.q_proj.weight, "A", False
        base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight
            -> model.layers.0.mlp.experts.gate_up_proj, "B", True
        model.layers.0.mlp.experts.lora_A.down_proj  -> model.layers.0.mlp.experts.down_proj
    PEFT's in-memory adapter name (".default.") is dropped."""
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    name = _LANGUAGE_MODEL.sub("model.", name)
    mod, _, which = name.replace(".default.", ".").rpartition(".lora_")
    ab = "A" if which.startswith("A") else "B"
    suffix = which[2:]  # "weight", or a projection of our stacked experts
    if suffix in EXPERT_PROJECTIONS:
        return f"{mod}.{suffix}", ab, False
    m = _PEFT_EXPERTS.fullmatch(mod)
    if m:
        depth = m[2].count(".base_layer")
        if depth < len(EXPERT_PROJECTIONS):
            return f"{m[1]}.{EXPERT_PROJECTIONS[-1 - depth]}", ab, True
    return f"{mod}.weight", ab, False


def peft_name(base: str, ab: str) -> str:
    """PEFT's tensor name for the A or B of the LoRA on base tensor `base` (parse_key's
    inverse)."""
    mod, _, proj = base.rpartition(".")
    if proj in EXPERT_PROJECTIONS:
        depth = len(EXPERT_PROJECTIONS) - 1 - EXPERT_PROJECTIONS.index(proj)
        mod += ".base_layer" * depth
    return f"{PREFIX}{mod}.lora_{ab}.weight"


def to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert LoRA A [E, r, in], B [E, out, r] -> PEFT's [E * r, in], [out, r * E]."""
    return a.flatten(0, 1), b.permute(1, 2, 0).flatten(1)


def from_peft(a: torch.Tensor, b: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's [E * r, in], [out, r * E] -> stacked A [E, r, in], B [E, out, r]."""
    E = a.shape[0] // r
    return a.view(E, r, a.shape[1]), b.view(b.shape[0], r, E).permute(2, 0, 1)


def adapted_tensors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base tensor name: (A, B) parameters} of every adapter attached to `model`."""
    out = {}
    for name, layer in lora_layers(model):
        if layer.has_lora:
            out[f"{name}.weight"] = (layer.lora_A.weight, layer.lora_B.weight)
    for name, layer in expert_layers(model):
        for proj in layer.lora_A:
            out[f"{name}.{proj}"] = (layer.lora_A[proj], layer.lora_B[proj])
    return out


def lora_pairs(tensors: dict[str, torch.Tensor], r: int,
               where: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base tensor name: (A, B)} in the model's layout from the tensors of an adapter file
    (PEFT names) or a training checkpoint (our names)."""
    pairs: dict[str, list] = {}
    peft_experts = set()
    for key, t in tensors.items():
        base, ab, peft_expert = parse_key(key)
        pairs.setdefault(base, [None, None])[ab == "B"] = t
        if peft_expert:
            peft_experts.add(base)
    for base, (a, b) in pairs.items():
        if a is None or b is None:
            raise LeantuneError(f"{where}: {base} has only one of lora_A / lora_B")
        if base in peft_experts:
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] % r or b.shape[1] != a.shape[0]:
                raise LeantuneError(f"{where}: {base}: lora_A {tuple(a.shape)} and lora_B "
                                    f"{tuple(b.shape)} are not a rank-{r} expert adapter")
            pairs[base] = list(from_peft(a, b, r))
    return {k: (a, b) for k, (a, b) in pairs.items()}


def unmatched(where, base: str) -> LeantuneError:
    """The error for an adapter tensor whose base tensor `base` the model does not have."""
    if re.search(r"\.experts\.\d+\.", base):
        return LeantuneError(f"{where}: {base}: an adapter of separate expert modules "
                             "(transformers 4.x); leantune reads expert adapters in transformers "
                             "5.x's stacked form (PEFT target_parameters)")
    return LeantuneError(f"{where}: adapter layers not found in the base model (e.g. {base}); "
                         "is it the adapter of another model?")


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    """PEFT-named LoRA tensors (contiguous, on the CPU; whole where FSDP2 shards them: a
    collective, which every process calls). A family whose checkpoint fuses projections (Phi-3's
    qkv_proj, gate_up_proj) gets their LoRA fused as PEFT holds it (`fuse_pairs`); a multimodal
    checkpoint's language model its prefix (Gemma 3: model.language_model.)."""
    pairs = {}
    for base, (a, b) in adapted_tensors(model).items():
        a, b = full_tensor(a.detach()).cpu(), full_tensor(b.detach()).cpu()  # (FSDP2: whole)
        if a.dim() == 3:
            a, b = to_peft(a, b)
        pairs[base] = (a, b)
    fam = model.config.family
    pairs = fuse_pairs(pairs, fam.fused)
    out = {}
    for base, (a, b) in pairs.items():
        name = fam.checkpoint_names(base)[1] if fam.prefixes else base
        out[peft_name(name, "A")] = a.contiguous()
        out[peft_name(name, "B")] = b.contiguous()
    return out


_FUSED_LAYER = re.compile(r"(model\.layers\.\d+)\.(.+)\.weight")


def fuse_pairs(pairs: dict, fused: dict) -> dict:
    """{base: (A, B)} with the LoRA of the projections a checkpoint tensor fuses (Family.fused,
    e.g. q/k/v -> qkv_proj) as one LoRA of that tensor: A = the parts' A stacked [sum r, in],
    B block-diagonal [sum out, sum r] (zero rows for a part without LoRA); the same update."""
    if not fused:
        return pairs
    out = dict(pairs)
    layers = {m[1] for m in map(_FUSED_LAYER.fullmatch, pairs) if m}
    for layer in sorted(layers):
        for theirs, ours in fused.items():
            names = [f"{layer}.{o}.weight" for o in ours]
            present = [n for n in names if n in pairs]
            if not present:
                continue
            like = pairs[present[0]]
            outs = [pairs[n][1].shape[0] if n in pairs else None for n in names]
            if None in outs:  # a part without LoRA: its rows come from the others' shapes
                raise LeantuneError(f"{layer}: LoRA on {', '.join(ours)} must be all or none "
                                    f"for the checkpoint's fused {theirs}; target them together")
            A = torch.cat([pairs[n][0] for n in names])
            B = like[1].new_zeros(sum(outs), A.shape[0])
            r0 = c0 = 0
            for n in names:
                a, b = out.pop(n)
                B[r0:r0 + b.shape[0], c0:c0 + a.shape[0]] = b
                r0, c0 = r0 + b.shape[0], c0 + a.shape[0]
            out[f"{layer}.{theirs}.weight"] = (A, B)
    return out


def split_fused_pairs(pairs: dict, fused: dict, params: dict, r: int, where) -> dict:
    """`fuse_pairs`' inverse for an adapter read from disk: the LoRA of a fused checkpoint
    tensor (base names) onto our parts of rank r each. A rank-r one (PEFT-trained) is exact as
    each part's (A, its rows of B); one of rank n r (ours, written by fuse_pairs) as the diagonal
    blocks, which must then be all of B. `params`: {our base name: (rows, in)}."""
    if not fused:
        return pairs
    out = {}
    for base, (a, b) in pairs.items():
        m = _FUSED_LAYER.fullmatch(base)
        ours = fused.get(m[2]) if m else None
        if ours is None:
            out[base] = (a, b)
            continue
        names = [f"{m[1]}.{o}.weight" for o in ours]
        rows = [params[n][0] for n in names]
        R = a.shape[0]
        if b.shape[0] != sum(rows) or R not in (r, r * len(names)):
            raise LeantuneError(f"{where}: {base}: lora_A {tuple(a.shape)} / lora_B "
                                f"{tuple(b.shape)} do not fit {', '.join(ours)} at rank {r}")
        r0 = 0
        for j, (n, k) in enumerate(zip(names, rows)):
            if R == r:
                out[n] = (a, b[r0:r0 + k])
            else:
                block = b[r0:r0 + k]
                diag = block[:, j * r:(j + 1) * r]
                if torch.count_nonzero(block).item() != torch.count_nonzero(diag).item():
                    raise LeantuneError(f"{where}: {base}: a rank-{R} LoRA that leantune's "
                                        f"rank-{r} {', '.join(ours)} cannot hold; train it with "
                                        "leantune, or merge it with PEFT")
                out[n] = (a[j * r:(j + 1) * r], diag)
            r0 += k
    return out


def peft_config_dict(cfg: LoRAConfig, base_model_name: str | None, modules: list[str]) -> dict:
    """PEFT's LoraConfig for `cfg`; `modules`: the short names of the projections adapted,
    written as target_modules (not every target asked for: PEFT on transformers 5 reads a name
    such as gate_proj that a MoE model has no module of as its experts' projection)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": modules,
        "target_parameters": TARGET_PARAMETERS if EXPERTS in cfg.targets else None,
        "use_rslora": cfg.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }


def adapter_config(model, base_model_name: str | None = None) -> dict:
    """adapter_config.json of the LoRA attached to `model` (PEFT's LoraConfig fields): the
    projections adapted as target_modules; a family with fused checkpoint tensors (Phi-3) names
    those (qkv_proj, gate_up_proj), whose LoRA `adapter_state_dict` writes at the parts' ranks
    together (rank_pattern, with alpha_pattern keeping the update's scale)."""
    cfg = model.lora_config
    modules = {name.rsplit(".", 1)[-1] for name, layer in lora_layers(model) if layer.has_lora}
    d = peft_config_dict(cfg, base_model_name, [t for t in ALL_TARGETS if t in modules])
    fused = model.config.family.fused
    if fused:  # PEFT's names: qkv_proj and gate_up_proj, at the parts' ranks together
        ranks, alphas, names = {}, {}, list(d["target_modules"])
        for theirs, ours in fused.items():
            parts = [o.rsplit(".", 1)[-1] for o in ours]
            if any(p in names for p in parts):
                short = theirs.rsplit(".", 1)[-1]
                names = [n for n in names if n not in parts] + [short]
                R = cfg.r * len(parts)
                ranks[short] = R  # the same update scale: alpha / r (rsLoRA alpha / sqrt r)
                alphas[short] = cfg.alpha * (R / cfg.r) ** (0.5 if cfg.use_rslora else 1.0)
        d.update(target_modules=names, rank_pattern=ranks, alpha_pattern=alphas)
    if model.config.family.prefixes:  # a multimodal checkpoint: its language model alone
        d["target_modules"] = language_model_regex(d["target_modules"])
    return d


def language_model_regex(modules: list[str]) -> str:
    """PEFT's target_modules as a regex (matched against the whole module name) that takes the
    projections `modules` inside the language model alone: a list of names would also match the
    vision tower's q_proj ... (Gemma 3), which PEFT would give an untrained LoRA and warn of the
    adapter keys it misses."""
    names = "|".join(re.escape(m) for m in modules)
    return rf"(?:model\.language_model|language_model\.model)\.layers\.\d+\..*\.(?:{names})"


def save_adapter(model, out_dir: str | os.PathLike, base_model_name: str | None = None,
                 write: bool = True) -> None:
    """Write adapter_model.safetensors and adapter_config.json atomically into out_dir. Under
    torchrun every process calls this (FSDP2 gathers the adapters); only rank 0 (`write`)
    writes."""
    from safetensors.torch import save

    from ..utils.io import atomic_write_json, atomic_path

    out = Path(out_dir)
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise LeantuneError("the model has no LoRA adapter to save (trained with --full?)")
    tensors = adapter_state_dict(model)
    if not write:
        return
    out.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt"}
    fp = model_fingerprint(model)  # the base it was trained on (lora/base_check.py)
    if fp is not None:
        metadata[FINGERPRINT_KEY] = fp
    if base_model_name:
        metadata[BASE_NAME_KEY] = str(base_model_name)
    data = _sorted_metadata(save(tensors, metadata=metadata))
    with atomic_path(out / ADAPTER_WEIGHTS) as tmp:
        tmp.write_bytes(data)
    atomic_write_json(out / ADAPTER_CONFIG, adapter_config(model, base_model_name))


def _sorted_metadata(raw: bytes) -> bytes:
    """safetensors bytes with the header's metadata keys in sorted order. safetensors writes
    its metadata map in hash order, which differs from one write to the next once it holds more
    than one key; sorted, the same adapter gives the same bytes (a resumed run rewrites its
    adapter bit for bit). The header keeps its length (padded with spaces, as safetensors pads
    it); where it cannot, the bytes are returned as they are."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n], object_pairs_hook=dict)
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or list(meta) == sorted(meta):
        return raw
    header = {"__metadata__": dict(sorted(meta.items())),
              **{k: v for k, v in header.items() if k != "__metadata__"}}
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > n:
        return raw
    return raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:]


def read_adapter_config(adapter_dir: Path) -> LoRAConfig:
    path = adapter_dir / ADAPTER_CONFIG
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise LeantuneError(f"{path}: adapter_config.json not found; --adapter must be a folder "
                            "written by `leantune train` or PEFT") from None
    except json.JSONDecodeError as e:
        raise LeantuneError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise LeantuneError(f"{path}: JSON nested too deeply to read") from None
    if not isinstance(d, dict):
        raise LeantuneError(f"{path}: expected a JSON object, got {type(d).__name__}")
    targets = d.get("target_modules") or ([] if d.get("target_parameters") else ALL_TARGETS)
    if isinstance(targets, str):  # PEFT allows a regex string; we take the simple names in it
        targets = [t for t in ALL_TARGETS if t in targets]
    # a fused checkpoint tensor's LoRA (Phi-3) is its parts'
    targets = [p for t in targets for p in FUSED_TARGETS.get(t, (t,))]
    params = d.get("target_parameters") or []
    if params:
        projections = {p.rsplit(".", 1)[-1] for p in params}
        if projections != set(EXPERT_PROJECTIONS):
            raise LeantuneError(f"{path}: target_parameters {params}: leantune adapts the "
                                "experts' gate_up_proj and down_proj together (mlp.experts."
                                "gate_up_proj, mlp.experts.down_proj), not other parameters")
        targets = [*targets, EXPERTS]
    try:
        return LoRAConfig(r=int(d["r"]), alpha=float(d.get("lora_alpha", d["r"])),
                          dropout=float(d.get("lora_dropout", 0.0)), targets=targets,
                          use_rslora=bool(d.get("use_rslora", False)))
    except KeyError as e:
        raise LeantuneError(f"{path}: required field {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise LeantuneError(f"{path}: a field has an invalid value ({e})") from None
    except LeantuneError as e:  # e.g. a target this model family has no LoRA layer for
        raise LeantuneError(f"{path}: {e}") from None


def load_adapter(model, adapter_dir: str | os.PathLike) -> LoRAConfig:
    """Attach the adapter stored in adapter_dir (PEFT format) to `model`."""
    adapter_dir = Path(adapter_dir)
    cfg = read_adapter_config(adapter_dir)
    attach_adapter(model, cfg, adapter_dir / ADAPTER_WEIGHTS)
    return cfg


@torch.no_grad()
def attach_adapter(model, cfg: LoRAConfig, path: Path) -> None:
    """Attach LoRA layers of `cfg` to `model` and fill them from the safetensors file `path`
    (PEFT names, or the model's own parameter names as a training checkpoint keeps them)."""
    from safetensors.torch import load_file

    apply_lora(model, cfg)
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        raise LeantuneError(f"{path}: adapter weights not found") from None
    except Exception as e:
        raise LeantuneError(f"{path}: cannot read adapter weights ({type(e).__name__}); the file "
                            "is truncated or corrupt") from None
    targets = adapted_tensors(model)
    pairs = lora_pairs(tensors, cfg.r, path)
    pairs = split_fused_pairs(pairs, model.config.family.fused,
                              {n: tuple(t[1].shape[:1]) + tuple(t[0].shape[1:])
                               for n, t in targets.items()}, cfg.r, path)
    for base, pair in pairs.items():
        if base not in targets:
            raise unmatched(path, base)
        for ab, param, t in zip("AB", targets[base], pair):
            if param.shape != t.shape:
                raise LeantuneError(f"{path}: {peft_name(base, ab)} has shape "
                                    f"{tuple(t.shape)}, expected {tuple(param.shape)}; is it "
                                    "the adapter of another base model?")
            param.copy_(t)
    if len(pairs) != len(targets):
        raise LeantuneError(f"{path}: adapter holds {2 * len(pairs)} tensors, expected "
                            f"{2 * len(targets)}")
    return cfg
