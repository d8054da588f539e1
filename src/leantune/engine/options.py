"""EngineOptions: every setting of how the engine executes a model, in one object.

Set from `leantune train`'s flags, the YAML config or TrainConfig (train/config.py), saved with
the run (run_config.json and each checkpoint's state.json). Environment variables
(LEANTUNE_<NAME>) override single options for benchmarks and debugging only
(`with_env_overrides`); the run's saved config records the options actually used.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace

from ..errors import LeantuneError

KERNELS = ("auto", "triton", "reference")
ATTENTION = ("auto", "flash", "sdpa")


_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _flag(raw: str) -> bool:
    """A boolean environment value: 1/true/on/yes or 0/false/off/no (any case); else
    ValueError (a typo must not switch an option on)."""
    v = raw.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ValueError(raw)


@dataclass(frozen=True)
class EngineOptions:
    """kernels: "auto" (Triton on CUDA tensors, PyTorch elsewhere), "triton" or "reference".
    fused_layers: hand-written layer backward (False: autograd + torch.utils.checkpoint).
    attention: backend of the hand-written layers: "auto" (cuDNN for rows of one document,
        flash varlen for packed rows; the softmax statistics are kept for backward), "flash"
        (flash everywhere), "sdpa" (attention re-run under autograd in backward: debugging).
    pack_projections: q/k/v, gate/up and down as one GEMM each over a packed weight.
    pack_lora: the LoRA term inside those GEMMs (extra K columns holding s * B).
    pack_align: the packed width is padded to a multiple of this many columns.
    mlp_chunk_mib: the fused MLP runs in row chunks whose [rows, intermediate] tensors stay under
        this size in backward, and mlp_forward_chunk_factor times that in forward.
    link_gbs: the host link rate (GB/s, each way) the planner assumes for offloading.
    link_duplex_gbs: the rate each way while both directions copy at once (streamed weights
        coming up while offloaded activations go down): 33.6 GB/s measured on an H100 host
        (55 one way), 50.8 on an H200's; the lower by default.
    trim_offload: where the offloaded layers' copies would outrun the forward, the planner has
        the fewest it needs keep no q/k/v (projected again in backward: engine/planner.
        trim_for_link) instead of letting the forward wait on the host link.
    fuse_glu_lora: where gate/up's LoRA is not inside their GEMM (an FP8 base, or unpacked),
        the GLU kernels add its low-rank terms (kernels/swiglu.py) instead of two passes over
        the [tokens, 2 x intermediate] outputs that add them.
    fuse_lora_add: where a projection's LoRA term is not inside its GEMM (an FP8 base, the
        unpacked o projection), one kernel adds it and the residual to the GEMM's output
        (kernels/lora_add.py) instead of a residual pass and one addmm_ per projection.
    fuse_grad_quant: where an FP8 base's q/k/v input-gradient GEMM runs on cuBLAS (which reads
        e4m3 codes), kernels/qkv_grad.py writes its input's codes too (with fuse_qkv_grad),
        instead of a quantisation pass of the GEMM's own over the gradient.
    fuse_qkv_grad: attention's d q, d k, d v go into the q/k/v group's gradient buffer through
        RoPE's backward in one pass (kernels/qkv_grad.py; with an FP8 base, writing the codes
        its input-gradient GEMM reads) instead of three copies and an in-place RoPE pass (full
        rotary, no q/k norm).
    gemm_residual: a 16-bit projection's residual (down's; o's without a LoRA term) added by its
        cuBLAS GEMM (addmm, beta = 1), which PyTorch first copies into the output buffer, instead
        of by one add pass after a plain GEMM. Alone the two run alike (bench/gpu_gemm_shapes.py);
        in issue 20's DPO step the add pass was 0.6% faster, in the 8B SFT step no different
        (H100, BENCHMARKS.md 2026-12-07): off by default. (FP8 GEMMs add it in their epilogue,
        and a GEMM writing over the residual adds it in place, either way.)
    stream_weights: where the memory budget forces recompute, the planner may move some layers'
        frozen 16-bit base weights to pinned host memory, copied back to the GPU one layer ahead
        of each use (engine/weight_stream.py; engine/planner.plan_streaming), so that more
        layers keep their activations.
    prefetch_depth: how many offloaded layers below the one in backward are being brought back
        at once (1: the next; 2: the next two, so a copy late behind a streamed layer's weights
        has two layers' time; the planner counts the extra layer's state in the peak). 0 (the
        default): 2 where base weights stream, else 1. Measured on an H100 (BENCHMARKS.md
        2026-12-07, seventeenth session): Phi-4 at 31 GiB streamed 7,897 -> 8,081 tok/s with 2,
        unstreamed the same (7,722 / 7,719); the DPO step unstreamed 13,370 -> 13,250 (the
        extra state cost a layer that kept everything).
    stream_fill_ahead: with streamed weights, a layer that does not stream starts the copy of the
        streamed layer two ahead, into the slot the last streamed layer freed, so each copy
        overlaps more compute (engine/weight_stream.py); the same two GPU slots. Off by default:
        not yet timed on a GPU (its copies queue behind the earlier ones on their own stream, but
        they take link time from the activations' copies sooner).
    stream_max_layers: with stream_weights, the most layers whose weights may stream (0: the
        planner's choice, up to half the layers; the planner streams even counts, so an odd cap
        rounds down and 1 streams none). A knob for measuring: Phi-4 at 31 GiB on an H100 ran
        as fast capped at 12 as with the planner's 18, and slower at 8 (BENCHMARKS.md
        2026-12-07, seventeenth session)."""

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

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise LeantuneError(f"--kernels must be one of {', '.join(KERNELS)}, got "
                                f"{self.kernels!r}")
        if self.attention not in ATTENTION:
            raise LeantuneError(f"--attention must be one of {', '.join(ATTENTION)}, got "
                                f"{self.attention!r}")
        if self.prefetch_depth not in (0, 1, 2):
            raise LeantuneError(f"--prefetch-depth must be 0 (auto), 1 or 2, got "
                                f"{self.prefetch_depth}")
        if self.stream_max_layers < 0:
            raise LeantuneError(f"--stream-max-layers must be 0 (no cap) or more, got "
                                f"{self.stream_max_layers}")
        if self.pack_align < 1:
            raise LeantuneError(f"pack_align must be 1 or more, got {self.pack_align}")
        for name in ("mlp_chunk_mib", "mlp_forward_chunk_factor", "link_gbs",
                     "link_duplex_gbs"):
            value = getattr(self, name)
            if not value > 0:  # (also refuses NaN)
                raise LeantuneError(f"--{name.replace('_', '-')} must be positive, got {value}")

    def prefetch_layers(self, streaming: bool) -> int:
        """The prefetch depth in effect: prefetch_depth, or where 0, 2 with streamed base
        weights and 1 without."""
        return self.prefetch_depth or (2 if streaming else 1)

    @property
    def mlp_chunk_bytes(self) -> int:
        return int(self.mlp_chunk_mib * 2**20)

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbs * 1e9

    @property
    def link_duplex_bytes_per_s(self) -> float:
        return min(self.link_gbs, self.link_duplex_gbs) * 1e9

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineOptions":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def with_env_overrides(self, environ=os.environ) -> tuple["EngineOptions", list[str]]:
        """These options with any LEANTUNE_<NAME> variable applied (benchmarks); returns the new
        options and the names overridden."""
        changes, names = {}, []
        for f in fields(self):
            raw = environ.get(f"LEANTUNE_{f.name.upper()}")
            if raw is None:
                continue
            kind = type(getattr(self, f.name))
            try:
                changes[f.name] = _flag(raw) if kind is bool else kind(raw)
            except ValueError:
                what = ("switch (1/true/on/yes or 0/false/off/no)" if kind is bool
                        else f"{kind.__name__}")
                raise LeantuneError(f"LEANTUNE_{f.name.upper()}={raw!r} is not a valid {what}; "
                                    "unset it or fix the value") from None
            names.append(f.name)
        return replace(self, **changes), names
