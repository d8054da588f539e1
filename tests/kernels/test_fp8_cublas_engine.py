"""The cuBLAS FP8 path's glue inside the fused layers (CPU): every FP8 GEMM the engine runs, with
the engine's own out / resid / accumulate / strided views and packed FP8 groups, goes through
fp8_gemm.cublas_gemm with the scaled mm emulated (the same tensors and layout checks cuBLAS
would get); loss and LoRA gradients equal those of the FP8 emulation path."""

import pytest
import torch

from helpers import CONFIGS, loss_and_grads, model_for, packed_batch
from leantune import kernels
from leantune.engine import Engine, EngineOptions, LayerPlan, detach
from leantune.kernels import fp8_gemm as gemm
from leantune.lora.base_weight import quantize_fp8_

# every projection's in and out a multiple of 128 (as the cuBLAS path takes), packable groups
SHAPE = dict(CONFIGS["llama"], hidden_size=128, intermediate_size=256, num_attention_heads=2,
             num_key_value_heads=2, head_dim=64, num_hidden_layers=2)


@pytest.mark.parametrize("fuse_lora_add", [True, False])
def test_engine_through_the_cublas_glue_equals_the_emulation(fuse_lora_add, monkeypatch):
    calls = []

    def via_cublas(x, w, transpose=False, out=None, resid=None, scratch=None):
        calls.append((transpose, out is not None, resid is not None))
        return gemm.cublas_gemm(x, w, transpose=transpose, out=out, resid=resid,
                                scratch=scratch, scaled_mm=gemm.emulate_scaled_mm)

    batch = packed_batch()
    plans = [LayerPlan(0), LayerPlan(2)]
    options = EngineOptions(fuse_lora_add=fuse_lora_add)
    with kernels.backend("reference"):
        model = quantize_fp8_(model_for(SHAPE))
        Engine(options).attach(model, plans)
        ref_loss, ref_grads = loss_and_grads(model, batch)
        detach(model)
        import leantune.engine.weights as weights
        import leantune.lora.base_weight as base_weight

        monkeypatch.setattr(weights, "fp8_mm", via_cublas)
        monkeypatch.setattr(base_weight, "fp8_mm", via_cublas)
        Engine(options).attach(model, plans)
        loss, grads = loss_and_grads(model, batch)
    # forward and dX, into the engine's buffers and not; with a residual where the GEMM adds
    # it (fuse_lora_add off: with it on, lora_add_ adds o's and down's residuals with their
    # LoRA terms after the GEMM)
    want = {(False, False, False), (True, False, False), (True, True, False)}
    want |= {(False, True, True)} if not fuse_lora_add else {(False, True, False)}
    assert want <= set(calls)
    assert fuse_lora_add == all(not resid for _, _, resid in calls)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-4, atol=1e-6)
