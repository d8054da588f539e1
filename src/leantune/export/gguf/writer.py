"""GGUF files for llama.cpp and Ollama, written with the `gguf` package (its GGUFWriter lays out
header, metadata and tensor index) and leantune's own tensors and quantisers.

`export_gguf`: base + adapter merged, one model-<quant>.gguf and an Ollama Modelfile beside it.
Tensors are merged, reordered and quantised one at a time as they are written (host memory near
the largest tensor, not the model). `export_gguf_lora`: the adapter alone, for llama.cpp's
`--lora`. Both publish as the merged export does (export/publish.py): written into a folder
beside the output, put in its place once complete (the previous export stays whole until then;
`--overwrite` replaces the files of the names the export writes and keeps the others), and the
next export mends whatever a killed one left, at every kill point.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ...errors import LeantuneError
from ...model.config import ModelConfig
from ...utils import faults
from ...utils.io import atomic_write_text, refuse_link_at
from ...utils.lock import lock_beside
from ...utils.paths import check_output_folder
from ..merge import MergedWeights
from ..publish import open_output, publishing
from ..serving import load_tokenizer
from .modelfile import default_system_prompt, modelfile_text, ollama_name, template_style
from .quants import QUANT_TYPES, QuantType, quantize
from .tensors import (
    FILE_TYPES,
    architecture,
    gguf_name,
    longrope_factors,
    norm_shift,
    permute_rows,
    rope_factors,
    rows_heads,
    tensor_type,
)
from .vocab import GGUFVocab, read_vocab

LORA_QUANTS = ("f32", "f16", "bf16", "q8_0")


@dataclass
class _Planned:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # numpy order
    qtype: QuantType
    make: Callable[[], torch.Tensor]  # the float tensor to store (reordered where needed)


@dataclass
class GGUFExport:
    """What an export wrote: the GGUF, its Modelfile (model exports), the ollama command."""

    gguf: Path
    modelfile: Path | None = None
    ollama_command: str | None = None
    types: dict[str, str] = field(default_factory=dict)  # GGUF tensor name -> type name
    warnings: list[str] = field(default_factory=list)


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise LeantuneError("GGUF export needs the gguf package: pip install 'leantune[gguf]'") \
            from None
    return gguf


def _check_quant(quant: str, allowed) -> None:
    if quant not in allowed:
        raise LeantuneError(f"--quant {quant!r} is not a GGUF type leantune writes here; choose "
                            f"one of {', '.join(allowed)}")


def _order(name: str) -> tuple:
    """token_embd and rope_freqs, then the blocks in order, then output_norm and output."""
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (2 if name.startswith("output") else 0, 0, name)


def _write(path: Path, arch: str, metadata: Callable, planned: list[_Planned],
           progress: bool) -> None:
    """Metadata and tensor index first, then each tensor produced, checked, quantised and
    appended in turn."""
    from tqdm import tqdm

    gguf = _import_gguf()
    writer = gguf.GGUFWriter(str(path), arch)
    metadata(writer)
    for p in planned:
        byte_shape = (*p.shape[:-1], p.qtype.row_bytes(p.shape[-1]))
        writer.add_tensor_info(p.name, byte_shape, np.dtype(np.uint8),
                               int(np.prod(byte_shape)), raw_dtype=gguf.GGMLQuantizationType(
                                   p.qtype.ggml_type))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        faults.point(f"write {path.name}")  # (a kill here leaves a partial GGUF)
        for p in tqdm(planned, desc=f"writing {path.name}", disable=not progress, unit="tensor"):
            t = p.make()
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise LeantuneError(f"{p.name}: the merged weights hold NaN or inf values; "
                                    "check the adapter (a diverged run?)")
            writer.write_tensor_data(quantize(t, p.qtype))
    finally:
        writer.close()


def _model_metadata(writer, cfg: ModelConfig, arch: str, quant: str, name: str,
                    vocab: GGUFVocab) -> None:
    w = writer
    for add, value in [
            (w.add_type, "model"), (w.add_name, name), (w.add_file_type, FILE_TYPES[quant]),
            (w.add_quantization_version, 2), (w.add_context_length, cfg.max_position_embeddings),
            (w.add_embedding_length, cfg.hidden_size), (w.add_block_count, cfg.num_hidden_layers),
            (w.add_feed_forward_length, cfg.intermediate_size),
            (w.add_head_count, cfg.num_attention_heads),
            (w.add_head_count_kv, cfg.num_key_value_heads), (w.add_key_length, cfg.head_dim),
            (w.add_value_length, cfg.head_dim),
            (w.add_rope_dimension_count, cfg.rotary_dim or cfg.head_dim),
            (w.add_rope_freq_base, cfg.rope_theta), (w.add_layer_norm_rms_eps, cfg.rms_norm_eps),
            (w.add_vocab_size, cfg.vocab_size)]:
        add(value)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":  # (Gemma 3: its full layers')
        w.add_rope_scaling_type(_import_gguf().RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    _family_metadata(w, cfg, arch)
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    if vocab.add_space_prefix is not None:
        w.add_add_space_prefix(vocab.add_space_prefix)
    for value, add in [(vocab.bos_id, w.add_bos_token_id), (vocab.eos_id, w.add_eos_token_id),
                       (vocab.pad_id, w.add_pad_token_id), (vocab.unk_id, w.add_unk_token_id),
                       (vocab.eot_id, w.add_eot_token_id)]:
        if value is not None:
            add(value)
    w.add_add_bos_token(vocab.add_bos)
    w.add_add_eos_token(vocab.add_eos)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def _family_metadata(w, cfg: ModelConfig, arch: str) -> None:
    """The keys llama.cpp's gemma2 / gemma3 / phi3 read beyond the common ones: sliding window,
    soft-caps (Gemma 2), LongRoPE's original context and attention factor (Phi-3). Gemma's
    embedding scale sqrt(hidden) and its (1 + w) norms need no key: llama.cpp's gemma graphs
    scale the embedding themselves, and the norms are stored as 1 + w."""
    if arch in ("gemma2", "gemma3", "phi3") and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_softcap or 0.0)
        w.add_final_logit_softcapping(cfg.final_softcap or 0.0)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":
        from ...model.rope import rope_inv_freq

        _, attn_factor = rope_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, scaling,
                                       max_positions=cfg.max_position_embeddings)
        w.add_rope_scaling_attn_factors(attn_factor)
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))


def _plan_model(weights: MergedWeights, quant: str) -> list[_Planned]:
    cfg = weights.config
    tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights.shapes
    planned = []
    for hf in weights.names():
        name = gguf_name(hf, cfg)
        if name is None or (name == "output.weight" and cfg.tie_word_embeddings):
            continue
        shape = weights.shapes[hf]
        heads = rows_heads(cfg, name)

        def make(hf=hf, heads=heads, shift=norm_shift(cfg, name)):
            t = weights.tensor(hf, torch.float32)
            t = t + shift if shift else t
            return permute_rows(t, heads) if heads else t

        planned.append(_Planned(name, shape, tensor_type(name, shape, quant,
                                                         cfg.num_hidden_layers, tied), make))
    factors = rope_factors(cfg)
    if factors is not None:
        planned.append(_Planned("rope_freqs.weight", tuple(factors.shape), QUANT_TYPES["f32"],
                                lambda: factors))
    for name, t in longrope_factors(cfg).items():
        planned.append(_Planned(name, tuple(t.shape), QUANT_TYPES["f32"], lambda t=t: t))
    return sorted(planned, key=lambda p: _order(p.name))


# llama.cpp slides the window on layer il where il % n < n - 1 for these architectures (its
# interleaved-window builds); every other architecture, phi3 included (its window is switched
# off there), attends over the whole context.
LLAMA_CPP_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}


def window_warning(cfg, arch: str) -> str | None:
    """A warning where llama.cpp would attend differently from the model: a sliding window on
    an architecture whose llama.cpp build ignores it, or a pattern of windowed layers other than
    the one llama.cpp assumes for the architecture; None where they agree."""
    if not cfg.sliding_window or cfg.sliding_window >= cfg.max_position_embeddings:
        return None
    n = LLAMA_CPP_WINDOW_PATTERN.get(arch)
    if n is None:
        return (f"the model attends within a sliding window of {cfg.sliding_window} tokens; "
                f"llama.cpp's {arch} architecture attends over the whole context, so outputs "
                "differ past the window")
    ours = [cfg.window_for_layer(i) is not None for i in range(cfg.num_hidden_layers)]
    if ours == [i % n < n - 1 for i in range(cfg.num_hidden_layers)]:
        return None
    return (f"the model's sliding-window layers differ from llama.cpp's {arch} pattern (layer i "
            f"windowed where i % {n} < {n - 1}), so outputs differ past the window "
            f"({cfg.sliding_window} tokens)")


def export_gguf(model: str | os.PathLike, adapter_dir: str | os.PathLike | None,
                out_dir: str | os.PathLike, quant: str = "f16", overwrite: bool = False,
                progress: bool = False,
                merge_onto: str | os.PathLike | None = None, log=print) -> GGUFExport:
    """Merge `adapter_dir` (optional) into `model` and write OUT/model-<quant>.gguf plus an
    Ollama Modelfile.

    Args:
        quant: f32 | f16 | bf16 | q8_0 | q4_0 | q5_0 | q4_k_m | q6_k (see tensors.tensor_type).
        overwrite: allow a non-empty `out_dir` (its model-<quant>.gguf and Modelfile are
            replaced, other files kept).
        merge_onto: for a 4-bit (bnb-4bit) `model`, its 16-bit original to merge onto instead
            of the dequantised base (export/merge.py).
        log: where a note on leftovers beside the output that are not an export's goes.
    """
    _check_quant(quant, tuple(FILE_TYPES))
    _import_gguf()
    out = Path(out_dir)
    refuse_link_at(out, "output folder")  # never written through
    weights = MergedWeights(model, adapter_dir, merge_onto=merge_onto)
    check_output_folder(out, {"base model": weights.src, "adapter": weights.adapter_dir,
                              "original model": weights.onto})
    cfg = weights.config
    arch = architecture(cfg, str(weights.src / "config.json"))
    vocab = read_vocab(weights.src, cfg.vocab_size)
    warnings = list(vocab.warnings)
    window = window_warning(cfg, arch)
    if window:
        warnings.append(window)
    if cfg.attn_scale and abs(cfg.attn_scale * cfg.head_dim ** 0.5 - 1) > 1e-6:
        warnings.append(f"query_pre_attn_scalar {cfg.attn_scale ** -2:g} differs from head_dim "
                        f"{cfg.head_dim}; llama.cpp's {arch} derives the attention scale from "
                        "the model size, so a non-standard value is not carried over")
    if cfg.family.prefixes:
        warnings.append("the vision tower and projector are not written: the GGUF holds the "
                        "language model (llama.cpp reads the vision part from an mmproj file)")
    planned = _plan_model(weights, quant)
    model_name = Path(os.fspath(model)).name or weights.src.resolve().name  # hub id: its name
    file_name = f"model-{quant}.gguf"
    name = ollama_name(out.resolve().name)
    # the Modelfile first: a checkpoint string it cannot quote is refused before the GGUF
    text, more = modelfile_text(
        file_name, vocab.chat_template, vocab.stop_strings,
        eos=vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else None,
        system=default_system_prompt(load_tokenizer(weights.src),
                                     template_style(vocab.chat_template)))
    warnings += more
    # one export into `out` at a time, as the merged export (a second names its PID)
    with lock_beside(out):
        open_output(out, overwrite, log)  # first, what an export killed in `out` left
        with publishing(out, replaces=(file_name, "Modelfile")) as tmp:
            _write(tmp / file_name, arch,
                   lambda w: _model_metadata(w, cfg, arch, quant, model_name, vocab),
                   planned, progress)
            atomic_write_text(tmp / "Modelfile", text)
    return GGUFExport(gguf=out / file_name, modelfile=out / "Modelfile",
                      ollama_command=f"ollama create {name} -f "
                                     f"{shlex.quote(str(out / 'Modelfile'))}",
                      types={p.name: p.qtype.name for p in planned}, warnings=warnings)


def export_gguf_lora(model: str | os.PathLike, adapter_dir: str | os.PathLike,
                     out_dir: str | os.PathLike, quant: str = "f16",
                     overwrite: bool = False, log=print) -> GGUFExport:
    """Write the adapter alone as OUT/adapter-<quant>.gguf for llama.cpp's `--lora` (on a GGUF
    of `model` written by export_gguf).

    Tensors `<base GGUF name>.lora_a` [r, in] and `.lora_b` [out, r], B's rows reordered like
    the base weight's for llama's q/k. llama.cpp scales B @ A by adapter.lora.alpha / r, so the
    alpha written is scaling * r (rsLoRA's alpha / sqrt(r) scaling included).
    """
    _check_quant(quant, LORA_QUANTS)
    _import_gguf()
    if not adapter_dir:
        raise LeantuneError("--format gguf-lora needs --adapter")
    out = Path(out_dir)
    refuse_link_at(out, "output folder")  # never written through
    weights = MergedWeights(model, adapter_dir)  # checks the adapter fits this base
    check_output_folder(out, {"base model": weights.src, "adapter": weights.adapter_dir})
    cfg = weights.config
    arch = architecture(cfg, str(weights.src / "config.json"))
    planned = []
    for hf, (a, b) in weights.deltas.items():
        name = gguf_name(hf, cfg)
        heads = rows_heads(cfg, name)
        stem = name.removesuffix(".weight")
        b = permute_rows(b, heads) if heads else b
        for suffix, t in ((".weight.lora_a", a), (".weight.lora_b", b)):
            t = t.float().contiguous()
            planned.append(_Planned(stem + suffix, tuple(t.shape),
                                    tensor_type(stem, tuple(t.shape), quant, 0, False),
                                    lambda t=t: t))
    planned.sort(key=lambda p: _order(p.name))

    def metadata(w):
        w.add_type("adapter")
        w.add_name(Path(adapter_dir).resolve().name)
        w.add_string("adapter.type", "lora")
        w.add_float32("adapter.lora.alpha", float(weights.scaling * weights.rank))

    file_name = f"adapter-{quant}.gguf"
    with lock_beside(out):
        open_output(out, overwrite, log)  # first, what an export killed in `out` left
        with publishing(out, replaces=(file_name,)) as tmp:
            _write(tmp / file_name, arch, metadata, planned, progress=False)
    return GGUFExport(gguf=out / file_name, types={p.name: p.qtype.name for p in planned})
