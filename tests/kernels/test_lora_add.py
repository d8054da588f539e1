"""lora_add_: y <- y + resid + xa b^T in one pass (kernels/lora_add.py). The Triton kernel (the
interpreter) and the reference equal the formula in float64 on odd shapes (rows and columns not
multiples of the tile, R not a power of two, R = 1), with and without the residual, into a
column slice of a wider buffer (the columns beside it untouched), fp32 and bf16; a bad call is
one line."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels
from leantune.kernels.lora_add import MAX_RANK, lora_add_

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}


def _inputs(rows, cols, R, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(rows, cols, generator=g).to(dtype)
    xa = torch.randn(rows, R, generator=g).to(dtype)
    b = (torch.randn(cols, R, generator=g) * 0.3).to(dtype)
    resid = torch.randn(rows, cols, generator=g).to(dtype)
    return y, xa, b, resid


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_resid", [True, False])
@pytest.mark.parametrize("rows,cols,R", [(37, 200, 20), (1, 3, 1), (65, 129, 48), (5, 131, 64)])
def test_matches_the_formula(backend, dtype, with_resid, rows, cols, R):
    y0, xa, b, resid = _inputs(rows, cols, R, dtype, seed=rows + cols + R)
    want = y0.double() + xa.double() @ b.double().t()
    if with_resid:
        want += resid.double()
    wide = torch.full((rows, cols + 5), 7.0, dtype=dtype)
    wide[:, 2:2 + cols] = y0
    y = wide[:, 2:2 + cols]  # row-strided: a column slice of a wider buffer
    with kernels.backend(backend):
        out = lora_add_(y, xa, b, resid if with_resid else None)
    assert out.data_ptr() == y.data_ptr()  # in place
    assert (wide[:, :2] == 7).all() and (wide[:, 2 + cols:] == 7).all()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol)


def test_kernel_equals_reference_in_fp32():
    y0, xa, b, resid = _inputs(70, 257, 33, torch.float32, seed=1)
    outs = []
    for backend in ("triton", "reference"):
        y = y0.clone()
        with kernels.backend(backend):
            outs.append(lora_add_(y, xa, b, resid))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_block_matrix_adds_each_projection_in_its_columns():
    """b as ProjectionGroup.b_cat lays it out (each projection's s B_i in its rows and its own
    columns): one call adds q | k | v's terms as three addmm_ would."""
    g = torch.Generator().manual_seed(3)
    outs, ranks = [7, 3, 5], [2, 3, 4]
    n, R = 9, sum(ranks)
    x_a = torch.randn(n, R, generator=g)
    bs = [torch.randn(o, r, generator=g) for o, r in zip(outs, ranks)]
    y0 = torch.randn(n, sum(outs), generator=g)
    b_cat = torch.zeros(sum(outs), R)
    want = y0.clone()
    r0 = c0 = 0
    for o, r, b in zip(outs, ranks, bs):
        b_cat[r0:r0 + o, c0:c0 + r] = b * 2.0
        want[:, r0:r0 + o].addmm_(x_a[:, c0:c0 + r], b.t(), alpha=2.0)
        r0, c0 = r0 + o, c0 + r
    with kernels.backend("triton"):
        got = lora_add_(y0.clone(), x_a, b_cat)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_calls_are_one_line(backend):
    y, xa, b, resid = _inputs(4, 6, 3, torch.float32, seed=0)
    with kernels.backend(backend):
        for args in [(y, xa[:, :2], b), (y, xa, b.to(torch.bfloat16)), (y, xa, b, resid[:, :5]),
                     (y, xa[:3], b)]:
            with pytest.raises(ValueError, match="lora_add_") as e:
                lora_add_(*args)
            assert "\n" not in str(e.value)
        big = torch.zeros(4, MAX_RANK + 1)
        with pytest.raises(ValueError, match=f"at most {MAX_RANK}"):
            lora_add_(y, big, torch.zeros(6, MAX_RANK + 1))
