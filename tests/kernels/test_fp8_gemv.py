"""The weight-only FP8 GEMV (kernels/fp8_gemv.py, interpreter): x W^T with x unquantised equals
the fp32 product with the dequantised weight (fp8_mm_reference's dequantisation), both inner
loops, split-K, a residual, strided outputs, odd shapes whose 128-blocks end part-way; fp8_mm
routes few-row forwards to it under LEANTUNE_FP8_GEMV and agrees with the GEMM path within the
GEMM's quantisation of x."""

import pytest
import torch

from helpers import one_torch_thread  # noqa: F401  (autouse)
from leantune import kernels
from leantune.kernels import fp8_gemm as gemm
from leantune.kernels import fp8_gemv as gemv
from leantune.kernels.fp8 import BLOCK, FP8View, FP8Weight, fp8_mm, fp8_mm_reference
from leantune.kernels.fp8_gemv import GemvConfig, fp8_gemv, fp8_gemv_reference

OUT_F, IN_F = 130, 200  # neither a multiple of 128

CONFIGS = {  # (the interpreter's default, config_for, is also run: config=None)
    "fma": GemvConfig("fma", 16, 64),
    "fma-split": GemvConfig("fma", 32, 128, split_k=2),
    "fma_rows-split": GemvConfig("fma_rows", 16, 128, split_k=2),
    "dot": GemvConfig("dot", 16, 128),
    "dot-split": GemvConfig("dot", 64, 64, split_k=2),
    "auto": None,
}


def _weight(shape=(OUT_F, IN_F), seed=0, dtype=torch.float32) -> FP8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, 0] = 0.9  # an outlier: its block's scale grows
    w[BLOCK:, :BLOCK] = 0  # an all-zero block
    return FP8Weight(shape, dtype).quantize_(w.to(dtype))


def _close(y, want, dtype):
    """fp32: the order of sums; bf16: one output rounding (the interpreter truncates)."""
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    assert (y.float() - want.float()).abs().max() <= tol * max(1.0, want.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("with_resid", [False, True])
def test_gemv_equals_dequantised_product(M, dtype, with_resid):
    q = _weight()
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, IN_F, generator=g).to(dtype)
    resid = torch.randn(M, OUT_F, generator=g).to(dtype) if with_resid else None
    # the reference is fp8_mm_reference's weight dequantisation, without x's quantisation
    want = x.float() @ q.dequantize(dtype=torch.float32).t()
    if resid is not None:
        want = want + resid.float()
    _close(fp8_gemv_reference(x, q, resid), want, dtype)
    for name, cfg in CONFIGS.items():
        if cfg is not None and cfg.loop != "dot" and M != 1:
            continue
        y = fp8_gemv(x, q, resid=resid, config=cfg)
        assert y.shape == (M, OUT_F) and y.dtype == dtype, name
        _close(y, want, dtype)


def test_strided_out_resid_in_place_and_packed_view():
    """The engine writes into column views and adds into the output itself; a packed group
    is an FP8View over stacked codes."""
    a, b = _weight((128, IN_F), 1), _weight((OUT_F, IN_F), 2)
    packed = FP8View(torch.cat([a.data, b.data]), torch.cat([a.scale, b.scale]), torch.float32)
    X = torch.randn(2, IN_F + 7)
    x = X[:, 3:3 + IN_F]  # strided rows
    want = x @ packed.dequantize(dtype=torch.float32).t()
    for cfg in (CONFIGS["dot"], CONFIGS["dot-split"]):
        Y = torch.zeros(2, 300)
        out = Y[:, 10:10 + 258]
        out.copy_(torch.ones(2, 258))
        fp8_gemv(x, packed, out=out, resid=out, config=cfg)
        torch.testing.assert_close(out, want + 1, rtol=1e-5, atol=1e-5)
        assert torch.all(Y[:, :10] == 0) and torch.all(Y[:, 268:] == 0)


def test_bad_input_is_one_line():
    q = _weight()
    with pytest.raises(ValueError, match=r"needs \[1..16, 200\]"):
        fp8_gemv(torch.randn(2, 199), q)
    with pytest.raises(ValueError, match="needs"):
        fp8_gemv(torch.randn(17, IN_F), q)


def test_fp8_mm_routes_few_rows_to_the_gemv_and_agrees_with_the_gemm(monkeypatch):
    """LEANTUNE_FP8_GEMV=1 (any Triton device): a forward of <= 16 rows takes the GEMV, more
    rows and dX the GEMM; =0 the GEMM always. On and off differ by the GEMM's quantisation
    of x to e4m3 (2^-4 relative per element), and the GEMV is the closer to the fp32 product."""
    calls = []
    real_gemv, real_gemm = gemv.fp8_gemv, gemm.fp8_gemm
    monkeypatch.setattr(gemv, "fp8_gemv", lambda *a, **k: calls.append("gemv") or
                        real_gemv(*a, **k))
    monkeypatch.setattr(gemm, "fp8_gemm", lambda *a, **k: calls.append("gemm") or
                        real_gemm(*a, **k))
    q = _weight()
    x = torch.randn(3, IN_F)
    exact = x @ q.dequantize(dtype=torch.float32).t()
    with kernels.backend("triton"):
        monkeypatch.setenv("LEANTUNE_FP8_GEMV", "1")
        y_on = fp8_mm(x, q)
        fp8_mm(torch.randn(17, IN_F), q)
        fp8_mm(torch.randn(3, OUT_F), q, transpose=True)
        assert calls == ["gemv", "gemm", "gemm"]
        monkeypatch.setenv("LEANTUNE_FP8_GEMV", "0")
        calls.clear()
        y_off = fp8_mm(x, q)
        assert calls == ["gemm"]
        monkeypatch.delenv("LEANTUNE_FP8_GEMV")  # default: CUDA tensors only
        calls.clear()
        fp8_mm(x, q)
        assert calls == ["gemm"]
    torch.testing.assert_close(y_off, fp8_mm_reference(x, q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_on, exact, rtol=1e-5, atol=1e-5)
    spread = exact.abs().max()
    gap = (y_on - y_off).abs().max()
    assert 0 < gap < 0.1 * spread
    assert (y_on - exact).abs().max() < (y_off - exact).abs().max()


def test_gpu_candidates_and_heuristic_fit_the_shapes():
    """Every timed config keeps BLOCK_N | 128 (one scale row a tile), "dot" tiles BLOCK_K | 128,
    the fma loops only for one row, splits of >= 512 inputs; the untuned config splits K where
    the output strips are too few for the GPU."""
    for M, N, K in ((1, 1024, 4096), (1, 4096, 14336), (8, 28672, 4096), (16, 130, 200)):
        cands = gemv.candidates(M, N, K, 132)
        assert cands and len(set(cands)) == len(cands)
        for c in cands:
            assert BLOCK % c.block_n == 0 and (c.loop != "dot" or BLOCK % c.block_k == 0)
            assert (c.loop != "dot") <= (M == 1)
            assert c.split_k == 1 or K >= 512 * c.split_k
        assert {c.loop for c in cands} == ({"fma", "fma_rows", "dot"} if M == 1 else {"dot"})
    assert gemv.heuristic(1, 1024, 4096, 132).split_k > 1
    assert gemv.heuristic(1, 28672, 4096, 132).split_k == 1
    assert gemv.heuristic(4, 4096, 4096, 132).loop == "dot"


def test_gemv_bench_tiny(tmp_path):
    """bench/gpu_fp8_gemv.py --tiny runs the GPU bench's code on the CPU: the GEMV, the GEMM
    and bf16 timed, the GEMV closer to the dequantised product than the GEMM; table last."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(root / "bench" / "gpu_fp8_gemv.py"), "--tiny",
                          "--shapes", "k/v"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert row["section"] == "fp8_gemv" and (row["M"], row["N"], row["K"]) == (1, 130, 200)
    assert all(row[f"{k}_us"] > 0 for k in ("gemv", "gemm", "bf16")), row
    assert row["gemv_err"] < 1e-2 and row["gemv_err"] < row["gemm_err"] < 0.06
    assert res.stdout.rstrip().splitlines()[-1].lstrip().startswith("k/v")


def test_decoding_through_the_gemv_equals_the_dequantised_model(monkeypatch):
    """leantune.generate on a tiny Llama with FP8 projections (prompt and steps <= 16 rows:
    every projection through the GEMV) picks the tokens the dense model holding the
    dequantised weights picks (greedy)."""
    import leantune
    from helpers import CONFIGS, model_for
    from leantune.lora.base_weight import quantize_fp8_
    from leantune.model.loader import nf4_projections

    fp8 = quantize_fp8_(model_for(CONFIGS["llama"]))
    dense = model_for(CONFIGS["llama"])
    with torch.no_grad():
        for (_, a), (_, b) in zip(nf4_projections(fp8), nf4_projections(dense)):
            b.weight.copy_(a.fp8.dequantize(dtype=torch.float32))
    calls = []
    real = gemv.fp8_gemv
    monkeypatch.setattr(gemv, "fp8_gemv", lambda *a, **k: calls.append(a[0].shape[0]) or
                        real(*a, **k))
    monkeypatch.setenv("LEANTUNE_FP8_GEMV", "1")
    monkeypatch.setenv("LEANTUNE_FP8_DECODE_HEAD", "0")  # (the 16-bit head in both)
    prompts = [[3, 17, 5, 60, 2], [9, 9, 41]]
    with kernels.backend("triton"):
        got = leantune.generate(fp8, None, prompts, max_new_tokens=3, eos_token_ids=[],
                                cuda_graphs=False)
    want = leantune.generate(dense, None, prompts, max_new_tokens=3, eos_token_ids=[],
                             cuda_graphs=False)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    n_proj = len(list(nf4_projections(fp8)))
    assert calls == [10] * n_proj + [2] * (2 * n_proj)  # the prefill (2 x 5), two steps


def test_tuning_times_the_configs_that_run_and_writes_nothing_of_the_callers():
    """tune() (the GPU's first-use pick; here on the host clock) returns one of the configs
    that ran, skips one that cannot (fma with 3 rows), and leaves resid as it was."""
    q = _weight()
    x, resid = torch.randn(3, IN_F), torch.randn(3, OUT_F)
    before = resid.clone()
    ok = [CONFIGS["dot"], CONFIGS["dot-split"]]
    assert gemv.tune(x, q, torch.float32, resid, [CONFIGS["fma"], *ok]) in ok
    assert torch.equal(resid, before)
    with pytest.raises(RuntimeError, match="no launch config ran"):
        gemv.tune(x, q, torch.float32, resid, [CONFIGS["fma"]])
