"""GGUF block quantisers: our bytes decode with gguf-py's dequantisers (the layout reference) to
the input within each type's error; the K-quants beat the block quants of their size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

gguf = pytest.importorskip("gguf")

from leantune.export.gguf.quants import QUANT_TYPES, quantize  # noqa: E402


def _decode(raw: np.ndarray, name: str, shape) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType(QUANT_TYPES[name].ggml_type)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy()).reshape(shape).float()


def _rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).pow(2).mean().sqrt().item()


def _weights(kind: str, rows=64, cols=1024, seed=0) -> torch.Tensor:
    """Weight-like tensors: Gaussian, Laplace and heavy-tailed Student-t(4), std ~0.02."""
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return 0.02 * torch.randn(rows, cols, generator=g)
    u = torch.rand(rows, cols, generator=g).clamp(1e-6, 1 - 1e-6)
    if kind == "laplace":
        return -0.014 * torch.sign(u - 0.5) * torch.log1p(-2 * (u - 0.5).abs())
    z = torch.randn(rows, cols, generator=g)
    chi2 = torch.randn(4, rows, cols, generator=g).pow(2).sum(0)
    return 0.014 * z / (chi2 / 4).sqrt()


def test_block_sizes_are_ggmls():
    for q in QUANT_TYPES.values():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(q.ggml_type)] == (
            q.block, q.block_bytes), q.name


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q5_0", "q4_k", "q6_k"])
def test_blocks_decode_within_their_error(name):
    """Every block decodes (gguf-py) to its input within the type's rounding bound; an all-zero
    block stays zero; an outlier costs only its own block."""
    q = QUANT_TYPES[name]
    x = _weights("gauss", rows=8, cols=2 * 256)
    x[1] = 0.0
    x[2, 7] = 1.5  # an outlier
    raw = quantize(x, q)
    assert raw.dtype == np.uint8 and raw.shape == (8, q.row_bytes(512))
    y = _decode(raw, name, x.shape)
    assert torch.equal(y[1], torch.zeros(512))
    if q.block == 32:  # worst case per block: half a step of amax/127 (q8_0); one step where
        # the code clamps at the far end (q4_0: amax/8, q5_0: amax/16)
        blocks, ys = x.reshape(-1, 32), y.reshape(-1, 32)
        bound = blocks.abs().amax(-1) / {"q8_0": 254, "q4_0": 8, "q5_0": 16}[name]
        err = (blocks - ys).abs().amax(-1)
    else:  # the K-quant search may clip extremes: bound the RMS error per 256-element block
        blocks, ys = x.reshape(-1, 256), y.reshape(-1, 256)
        bound = blocks.abs().amax(-1) / {"q4_k": 15, "q6_k": 31}[name]
        err = (blocks - ys).pow(2).mean(-1).sqrt()
    assert (err <= bound * 1.001 + 1e-7).all(), (err / bound).max().item()
    far = slice(256, 512)  # the outlier's row, the other super-block: keeps its detail
    bits = {"q8_0": 50, "q4_0": 4, "q5_0": 8, "q4_k": 4, "q6_k": 12}[name]
    assert _rms(y[2, far], x[2, far]) < 0.02 / bits


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q5_0"])
def test_block_quants_as_good_as_gguf_py(name):
    """Our q8_0 / q4_0 / q5_0 lose no more than gguf-py's own quantisers (the reference code)."""
    x = _weights("laplace")
    qtype = gguf.GGMLQuantizationType(QUANT_TYPES[name].ggml_type)
    ref = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), qtype), qtype).reshape(x.shape)
    ours = _rms(_decode(quantize(x, QUANT_TYPES[name]), name, x.shape), x)
    assert ours <= 1.01 * _rms(torch.from_numpy(ref), x)


@pytest.mark.parametrize("kind", ["gauss", "laplace", "student"])
def test_k_quants_beat_block_quants(kind):
    """q4_k (4.5 bits) has a lower RMS error than q4_0 (4.5 bits), q6_k (6.56) than q5_0 (5.5)."""
    x = _weights(kind, seed=3)
    err = {n: _rms(_decode(quantize(x, QUANT_TYPES[n]), n, x.shape), x)
           for n in ["q4_0", "q5_0", "q4_k", "q6_k"]}
    assert err["q4_k"] < 0.9 * err["q4_0"], err
    assert err["q6_k"] < 0.6 * err["q5_0"], err


def test_float_types_are_plain_casts():
    x = _weights("gauss", rows=3, cols=40)
    assert np.array_equal(quantize(x, QUANT_TYPES["f32"]).view(np.float32), x.numpy())
    assert np.array_equal(quantize(x, QUANT_TYPES["f16"]).view(np.float16), x.half().numpy())
    assert torch.equal(_decode(quantize(x, QUANT_TYPES["bf16"]), "bf16", x.shape),
                       x.bfloat16().float())


def test_rows_must_split_into_blocks():
    with pytest.raises(ValueError, match="blocks of 256"):
        quantize(torch.zeros(2, 96), QUANT_TYPES["q4_k"])
    assert not QUANT_TYPES["q4_0"].fits(48) and QUANT_TYPES["q4_0"].fits(64)
