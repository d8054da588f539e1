"""NF4 (4-bit NormalFloat) base weights in bitsandbytes' layout: the weight container, the
quantiser, dequantisation (a Triton kernel and its plain-PyTorch reference) and the linear
autograd Function of the plain path.

The layout is what bitsandbytes' Linear4bit saves (so `*-bnb-4bit` checkpoints load as they are,
without bitsandbytes). A weight W [out, in] is read row-major as n = out * in values in blocks of
64; each value becomes the index of the nearest of the 16 NF4 levels (NF4_LEVELS, in [-1, 1])
after dividing by its block's largest |w| (absmax):

    packed        uint8 [ceil(n / 2)]   two 4-bit indices a byte, the first value in the high
                                        nibble (an odd n pads with index 7, the level 0.0)
    quant_map     fp32 [16]             the NF4 levels
    absmax        per block; double-quantised (bitsandbytes' "nested" statistics):
      absmax            uint8 [ceil(n / 64)]    8-bit indices into nested_quant_map
      nested_quant_map  fp32 [256]              the signed 8-bit "dynamic" map (dynamic_map)
      nested_absmax     fp32 [ceil(n / 16384)]  per 256 blocks, the largest |absmax - offset|
      nested_offset     fp32 scalar             the mean of all absmax
    or stored as fp32 [ceil(n / 64)] without double quantisation.

Dequantisation, all in fp32, each product and sum rounded on its own (no fused multiply-add), so
it equals bitsandbytes' bit for bit:

    absmax_b = nested_quant_map[absmax[b]] * nested_absmax[b // 256] + nested_offset
    w_i      = quant_map[index_i] * absmax_(i // 64), rounded to the weight's dtype (the dtype
               it was quantised from, `weight_dtype`), then cast to the compute dtype

The Triton kernel writes into a given output, which may be a strided view (the left columns of
the engine's packed scratch buffer, engine/weights.py); the reference is the same math in
PyTorch ops (CPU, export).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import LeantuneError
from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None

BLOCKSIZE = 64          # values per absmax
NESTED_BLOCKSIZE = 256  # absmax values per nested_absmax
# The 16 NF4 levels: quantiles of the standard normal scaled to [-1, 1], with an exact zero
# (QLoRA, Dettmers et al. 2023, appendix E; bitsandbytes stores them as quant_map).
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
              0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
_ZERO_INDEX = 7
_BNB_PARTS = ("packed", "absmax", "quant_map", "nested_absmax", "nested_quant_map")
_QUANT_CHUNK = 1 << 24  # values quantised at a time (bounds the fp32 temporaries: 64 MiB)
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed 8-bit "dynamic" map: 256 sorted fp32 values in [-1, 1] (0 and 1
    included). For each decimal exponent e = 0..6 it holds 2^e linearly spaced magnitudes
    (midpoints of 2^e + 1 points from 0.1 to 1) times 10^(e - 6), with both signs."""
    values = [0.0, 1.0]
    for e in range(7):
        points = torch.linspace(0.1, 1.0, 2**e + 1, dtype=torch.float32)
        magnitudes = ((points[:-1] + points[1:]) / 2 * 10.0 ** (e - 6)).tolist()  # fp32 math
        values += magnitudes + [-m for m in magnitudes]
    return torch.tensor(sorted(values), dtype=torch.float32)


def _nearest(scaled: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted `levels` for each value (a tie goes to the lower)."""
    return torch.bucketize(scaled, (levels[:-1] + levels[1:]) / 2, out_int32=True)


def _block_absmax(x: torch.Tensor, blocksize: int) -> torch.Tensor:
    """x: fp32 [m] -> the largest |x| of each block of `blocksize` [ceil(m / blocksize)]."""
    full = x.numel() // blocksize * blocksize
    out = x[:full].view(-1, blocksize).abs().amax(1)
    if full < x.numel():
        out = torch.cat([out, x[full:].abs().amax().view(1)])
    return out


def _scaled(x: torch.Tensor, absmax: torch.Tensor, blocksize: int) -> torch.Tensor:
    """x / its block's absmax, clamped to [-1, 1] (an all-zero block stays 0)."""
    inv = 1.0 / absmax.clamp(min=1e-38)
    per_value = inv.repeat_interleave(blocksize)[:x.numel()]
    return (x * per_value).clamp_(-1.0, 1.0)


# ------------------------------------------------------------------------------------------------
# the weight container
# ------------------------------------------------------------------------------------------------
class FormatBuffers(nn.Module):
    """A quantised weight's buffers (NF4 here, FP8 in kernels/fp8.py) plus its compute dtype,
    held as the dtype of an empty `compute` buffer: `.to(device)` moves every buffer, a dtype
    change (`.to(torch.bfloat16)`) reaches only `compute`, never the stored codes and scales
    (they are the format)."""

    def __init__(self, compute_dtype: torch.dtype, device=None):
        super().__init__()
        self.register_buffer("compute", torch.empty(0, dtype=compute_dtype, device=device),
                             persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: what `dequantize` returns by default."""
        return self.compute.dtype

    def _apply(self, fn, recurse=True):
        for name, t in self._buffers.items():
            if t is None:
                continue
            moved = fn(t)
            if name != "compute" and moved.dtype != t.dtype:
                moved = t.to(moved.device)
            self._buffers[name] = moved
        return self


class NF4Weight(FormatBuffers):
    """A frozen 4-bit base weight [out, in] (module docstring), its tensors registered as buffers
    (so `.to(device)` moves them) named as bitsandbytes names them, but for `packed` (its
    `weight`).

    weight_dtype: the dtype the weight was quantised from (bitsandbytes' quant_state "dtype"):
    dequantised values are rounded to it. The compute dtype (`dtype`, what `dequantize` returns
    by default) follows the model: `.to(torch.bfloat16)` changes it, never the stored codes,
    scales and maps (they are the format)."""

    def __init__(self, shape: tuple[int, int], weight_dtype: torch.dtype, nested: bool = True,
                 compute_dtype: torch.dtype | None = None, device=None):
        super().__init__(compute_dtype or weight_dtype, device)
        self.shape = tuple(int(s) for s in shape)
        self.weight_dtype = weight_dtype
        self.nested = nested
        n = self.numel
        blocks = -(-n // BLOCKSIZE)
        u8, f32 = dict(dtype=torch.uint8, device=device), dict(dtype=torch.float32, device=device)
        self.register_buffer("packed", torch.empty(-(-n // 2), **u8))
        self.register_buffer("quant_map", torch.empty(16, **f32))
        if nested:
            self.register_buffer("absmax", torch.empty(blocks, **u8))
            self.register_buffer("nested_absmax",
                                 torch.empty(-(-blocks // NESTED_BLOCKSIZE), **f32))
            self.register_buffer("nested_quant_map", torch.empty(256, **f32))
            self.register_buffer("nested_offset", torch.empty((), **f32))
        else:
            self.register_buffer("absmax", torch.empty(blocks, **f32))

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed codes, the absmax (and nested statistics), the maps."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values() if t is not None)

    def extra_repr(self) -> str:
        return (f"shape={self.shape}, weight_dtype={self.weight_dtype}, nested={self.nested}, "
                f"dtype={self.dtype}")

    # --- quantising ------------------------------------------------------------------------
    @torch.no_grad()
    def quantize_(self, w: torch.Tensor) -> "NF4Weight":
        """Fill from a dense weight w [out, in] (any float dtype), computed on this weight's
        device in chunks of 2^24 values (the fp32 temporaries stay near 64 MiB each)."""
        if tuple(w.shape) != self.shape:
            raise ValueError(f"quantize_: weight of shape {tuple(w.shape)}, expected {self.shape}")
        dev = self.device
        flat = w.reshape(-1).to(dev)  # (one tensor on the device at a time, never a model)
        chunks = range(0, self.numel, _QUANT_CHUNK)  # (a multiple of 64 and of 2)
        absmax = torch.cat([_block_absmax(flat[i:i + _QUANT_CHUNK].to(dev, torch.float32),
                                          BLOCKSIZE) for i in chunks])
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=dev)
        self.quant_map.copy_(levels)
        for i in chunks:
            x = flat[i:i + _QUANT_CHUNK].to(dev, torch.float32)
            block0 = i // BLOCKSIZE
            idx = _nearest(_scaled(x, absmax[block0:block0 + -(-x.numel() // BLOCKSIZE)],
                                   BLOCKSIZE), levels).to(torch.uint8)
            if idx.numel() % 2:
                idx = torch.cat([idx, idx.new_full((1,), _ZERO_INDEX)])
            self.packed[i // 2:i // 2 + idx.numel() // 2].copy_((idx[0::2] << 4) | idx[1::2])
        if not self.nested:
            self.absmax.copy_(absmax)
            return self
        offset = absmax.mean()
        centred = absmax - offset
        scale = _block_absmax(centred, NESTED_BLOCKSIZE)
        code = dynamic_map().to(dev)
        self.absmax.copy_(_nearest(_scaled(centred, scale, NESTED_BLOCKSIZE), code))
        self.nested_absmax.copy_(scale)
        self.nested_quant_map.copy_(code)
        self.nested_offset.copy_(offset)
        return self

    # --- dequantising ----------------------------------------------------------------------
    def dequantize(self, out: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight [out, in] in `dtype` (default: the compute dtype), written into `out`
        when given (a [out, in] tensor or strided view, whose dtype wins): the Triton kernel
        where the kernels run (CUDA), else the reference."""
        if out is None:
            out = torch.empty(self.shape, dtype=dtype or self.dtype, device=self.device)
        elif tuple(out.shape) != self.shape:
            raise ValueError(f"dequantize: out has shape {tuple(out.shape)}, expected {self.shape}")
        if use_triton(out):
            return dequantize_nf4(self, out)
        return out.copy_(dequantize_nf4_reference(self, out.dtype))

    def absmax_fp32(self) -> torch.Tensor:
        """Each block's absmax, fp32 [ceil(n / 64)] (undoing the double quantisation)."""
        if not self.nested:
            return self.absmax
        scale = self.nested_absmax.repeat_interleave(NESTED_BLOCKSIZE)[:self.absmax.numel()]
        return self.nested_quant_map[self.absmax.long()] * scale + self.nested_offset

    # --- bitsandbytes' checkpoint tensors ----------------------------------------------------
    @torch.no_grad()
    def load_bnb_(self, part: str, t: torch.Tensor, name: str) -> None:
        """Copy one tensor of a bitsandbytes checkpoint in: `part` is the key's suffix after the
        weight's name ("" for the packed weight itself, "absmax", "quant_map", "nested_absmax",
        "nested_quant_map", or the quant_state JSON, whose nested_offset is taken); `name`,
        the tensor's full name, for errors."""
        if part.startswith("quant_state."):
            state = parse_bnb_state(t, name)
            if self.nested:
                self.nested_offset.fill_(float(state["nested_offset"]))
            return
        target = "packed" if part == "" else part
        buf = self._buffers.get(target) if target in _BNB_PARTS else None
        if buf is None:
            raise LeantuneError(f"{name}: unexpected tensor for a 4-bit weight "
                                f"{'with' if self.nested else 'without'} nested statistics")
        if t.dtype != buf.dtype or t.numel() != buf.numel():
            what = ("bnb_4bit_quant_storage other than uint8 is not supported"
                    if part == "" and t.dtype != torch.uint8 else
                    f"expected {buf.numel()} values of {buf.dtype} for shape {self.shape}")
            raise LeantuneError(f"{name}: {t.dtype} tensor of shape {tuple(t.shape)}: {what}")
        if part == "quant_map" and not torch.equal(
                t.float(), torch.tensor(NF4_LEVELS, dtype=torch.float32)):
            raise LeantuneError(f"{name}: not the NF4 levels; only NF4 4-bit weights are "
                                "supported")
        buf.copy_(t.reshape(buf.shape))

    def bnb_parts(self) -> list[str]:
        """The key suffixes a bitsandbytes checkpoint holds for this weight."""
        parts = ["", "absmax", "quant_map", "quant_state.bitsandbytes__nf4"]
        return parts + (["nested_absmax", "nested_quant_map"] if self.nested else [])


def parse_bnb_state(t: torch.Tensor, name: str) -> dict:
    """The quant_state JSON of a bitsandbytes 4-bit weight (a uint8 tensor of UTF-8 bytes),
    checked to be what leantune reads: NF4, blocks of 64, nested blocks of 256 (fp32), a 2-D
    shape; anything else is one line naming the tensor."""
    import json

    if not name.endswith("bitsandbytes__nf4"):
        kind = name.rpartition("__")[2]
        raise LeantuneError(f"{name}: {kind} 4-bit weights are not supported, only nf4 "
                            "(bnb_4bit_quant_type='nf4'); use the 16-bit checkpoint with "
                            "--load-in-4bit")
    try:
        state = json.loads(bytes(t.to(torch.uint8).tolist()).decode("utf-8"))
        shape = [int(s) for s in state["shape"]]
        ok = (state["quant_type"] == "nf4" and int(state["blocksize"]) == BLOCKSIZE
              and state["dtype"] in _DTYPE_NAMES and len(shape) == 2)
        if "nested_offset" in state:
            float(state["nested_offset"])
            ok = ok and int(state["nested_blocksize"]) == NESTED_BLOCKSIZE \
                and state.get("nested_dtype", "float32") == "float32"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise LeantuneError(f"{name}: unreadable bitsandbytes quant_state ({type(e).__name__}: "
                            f"{e}); the checkpoint is corrupt") from None
    if not ok:
        raise LeantuneError(f"{name}: quant_type {state.get('quant_type')}, blocksize "
                            f"{state.get('blocksize')}, nested_blocksize "
                            f"{state.get('nested_blocksize')}, dtype {state.get('dtype')}: "
                            "leantune reads NF4 with blocks of 64 (nested: 256), 2-D weights; "
                            "use the 16-bit checkpoint with --load-in-4bit")
    state["shape"] = shape
    return state


def nf4_from_bnb_state(state: dict, compute_dtype: torch.dtype | None = None,
                       device=None) -> NF4Weight:
    """An empty NF4Weight of the shape, dtype and nesting a parsed quant_state describes."""
    return NF4Weight(tuple(state["shape"]), _DTYPE_NAMES[state["dtype"]],
                     nested="nested_offset" in state, compute_dtype=compute_dtype, device=device)


# ------------------------------------------------------------------------------------------------
# dequantisation: reference and Triton kernel
# ------------------------------------------------------------------------------------------------
def dequantize_nf4_reference(w: NF4Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight [out, in] in `dtype` (default the compute dtype), in PyTorch ops."""
    idx = torch.stack([w.packed >> 4, w.packed & 15], dim=1).view(-1)[:w.numel]
    absmax = w.absmax_fp32().repeat_interleave(BLOCKSIZE)[:w.numel]
    values = w.quant_map[idx.long()] * absmax
    return values.to(w.weight_dtype).to(dtype or w.dtype).view(w.shape)


if triton is not None:

    @triton.jit
    def _round_to_bf16(v):
        """fp32 -> the nearest bf16 value (ties to even), still fp32. The cast after it is then
        exact on every backend (the Triton interpreter truncates fp32 -> bf16 casts)."""
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _dequantize_kernel(PACKED, ABSMAX, NESTED_ABSMAX, NESTED_MAP, NESTED_OFFSET, QUANT_MAP,
                           OUT, cols, stride_r, stride_c, NESTED: tl.constexpr,
                           W_KIND: tl.constexpr, OUT_BF16: tl.constexpr, BLOCK: tl.constexpr):
        """OUT[row, c] for one row and BLOCK columns a program (module docstring's math), rounded
        to the weight's dtype (W_KIND: 0 fp32, 1 bf16, 2 fp16) before the output's. Launch with
        enable_fp_fusion=False: the absmax's product and sum must round separately."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = c < cols
        i = row * cols + c  # the value's place in the row-major weight
        byte = tl.load(PACKED + i // 2, mask=mask, other=0).to(tl.int32)
        level = tl.load(QUANT_MAP + tl.where(i % 2 == 0, byte >> 4, byte & 15))
        block = i // 64
        if NESTED:
            code = tl.load(ABSMAX + block, mask=mask, other=0).to(tl.int32)
            absmax = tl.load(NESTED_MAP + code) * tl.load(NESTED_ABSMAX + block // 256,
                                                          mask=mask, other=0.0)
            absmax = absmax + tl.load(NESTED_OFFSET)
        else:
            absmax = tl.load(ABSMAX + block, mask=mask, other=0.0)
        v = level * absmax
        if W_KIND == 1:
            v = _round_to_bf16(v)
        elif W_KIND == 2:
            v = v.to(tl.float16).to(tl.float32)
        if OUT_BF16:
            v = _round_to_bf16(v)
        tl.store(OUT + row * stride_r + c * stride_c, v.to(OUT.dtype.element_ty), mask=mask)


_W_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def dequantize_nf4(w: NF4Weight, out: torch.Tensor) -> torch.Tensor:
    """The Triton dequantisation of `w` into `out` ([out, in], any strides, fp32/bf16/fp16)."""
    rows, cols = w.shape
    block = min(1024, triton.next_power_of_2(cols))
    nested = w.nested
    _dequantize_kernel[(rows, triton.cdiv(cols, block))](
        w.packed, w.absmax, w.nested_absmax if nested else w.absmax,
        w.nested_quant_map if nested else w.quant_map,
        w.nested_offset if nested else w.quant_map, w.quant_map, out, cols,
        out.stride(0), out.stride(1), NESTED=nested, W_KIND=_W_KIND[w.weight_dtype],
        OUT_BF16=out.dtype == torch.bfloat16, BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out


# ------------------------------------------------------------------------------------------------
# the plain path's linear
# ------------------------------------------------------------------------------------------------
def nf4_linear(x: torch.Tensor, weight: NF4Weight) -> torch.Tensor:
    """x [..., in] -> x W^T [..., out] for the NF4 weight W [out, in]: forward dequantises W,
    backward dequantises it again for dx = dy W (lora/base_weight.base_linear)."""
    from ..lora.base_weight import NF4Base, base_linear

    return base_linear(x, NF4Base(weight))


__all__ = ["BLOCKSIZE", "NESTED_BLOCKSIZE", "NF4_LEVELS", "NF4Weight", "dequantize_nf4",
           "dequantize_nf4_reference", "dynamic_map", "nf4_from_bnb_state", "nf4_linear",
           "parse_bnb_state"]
