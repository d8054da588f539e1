"""FP8 activation quantisation fused into the kernels that produce the activation (issue 23):
rms_norm_fwd and glu_fwd (and, for the q/k/v input-gradient GEMM, kernels/qkv_grad) write
their output's e4m3 codes and 1 x 128 block scales in quantize_rows' layout (equal to
quantize_rows and to its reference bit for bit, the 16-bit output unchanged), and the fused
layers hand them to the cuBLAS FP8 GEMMs (scaled mm emulated on the CPU) through
kernels/fp8_quant.QuantizedRows: with LEANTUNE_FP8_FUSED_QUANT (forward) and
EngineOptions.fuse_grad_quant (input gradients) on and off the loss and every LoRA gradient
are bit-identical, and on, fewer quantize_rows passes run."""

import pytest
import torch

from helpers import CONFIGS, model_for, one_torch_thread  # noqa: F401  (autouse)
from leantune import kernels
from leantune.kernels import fp8_gemm as gemm
from leantune.kernels.fp8_quant import (ROW_ALIGN, QuantizedRows, quantize_rows,
                                        quantize_rows_reference, transpose_codes_reference)
from leantune.kernels.rmsnorm import rms_norm_fwd
from leantune.kernels.swiglu import ACTS, glu_fwd

M = 21  # rows: not a multiple of ROW_ALIGN (padded codes)


def _bytes(t):
    return t.view(torch.uint8)


def _check_codes(q: QuantizedRows, y: torch.Tensor) -> None:
    """q's first M rows equal quantize_rows(y) and its reference; the padding rows zero codes,
    scale 1."""
    n = y.shape[0]
    codes, scale_t = q.targets
    with kernels.backend("triton"):
        ref_codes, ref_scale_t = quantize_rows(y)
    plain_codes, plain_scale_t = quantize_rows_reference(y)
    assert torch.equal(_bytes(codes), _bytes(ref_codes))
    assert torch.equal(_bytes(codes), _bytes(plain_codes))
    assert torch.equal(scale_t, ref_scale_t) and torch.equal(scale_t, plain_scale_t)
    assert q.codes.shape[0] % ROW_ALIGN == 0 and q.codes.shape[0] > n
    assert torch.all(_bytes(q.codes[n:]) == 0) and torch.all(q.scale_t[:, n:] == 1)


def _x(shape, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x[0, :2] = torch.tensor([200.0, -1e-4])  # an outlier, a tiny value
    return x.to(dtype)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [128, 384])
@pytest.mark.parametrize("offset", [0.0, 1.0])  # Llama's w * x_hat; Gemma's (1 + w)
def test_rms_norm_writes_the_codes_quantize_rows_would(H, dtype, offset, backend):
    x = _x((M, H + 5), dtype)[:, 2:H + 2]  # strided rows
    w = _x((1, H), dtype, seed=1, scale=0.5)[0]
    X = torch.zeros(M, H + 3, dtype=dtype)  # y into the left columns of a wider buffer
    with kernels.backend(backend):
        y_plain, rstd_plain = rms_norm_fwd(x, w, 1e-6, offset)
        q = QuantizedRows.empty(X[:, :H])
        y, rstd = rms_norm_fwd(x, w, 1e-6, offset, out=X[:, :H], quant=q.targets)
    assert y.data_ptr() == X.data_ptr() and torch.all(X[:, H:] == 0)
    assert torch.equal(y, y_plain) and torch.equal(rstd, rstd_plain)
    _check_codes(q, y)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [128, 384])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_glu_writes_the_codes_quantize_rows_would(inter, act, dtype, backend):
    gu = _x((M, 2 * inter), dtype, seed=2)  # gate | up, the column halves of one GEMM output
    gate, up = gu[:, :inter], gu[:, inter:]
    out = torch.zeros(M, inter + 4, dtype=dtype)
    with kernels.backend(backend):
        h_plain = glu_fwd(gate, up, ACTS[act])
        q = QuantizedRows.empty(out[:, :inter])
        h = glu_fwd(gate, up, ACTS[act], out=out[:, :inter], quant=q.targets)
    assert torch.equal(h, h_plain) and torch.all(out[:, inter:] == 0)
    if act != "silu":
        assert (_bytes(q.codes[:M]) == 0x80).any()  # gelu's -0: the sign kept, as torch's cast
    _check_codes(q, h)


def test_wrong_quant_buffers_are_one_clear_error():
    x = torch.randn(M, 128)
    q = QuantizedRows.empty(x)
    with pytest.raises(ValueError, match=r"rms_norm_fwd: quant must be .*QuantizedRows.empty"):
        rms_norm_fwd(x, torch.ones(128), 1e-6, quant=(q.codes, q.scale_t))  # padded rows
    with pytest.raises(ValueError, match="glu_fwd: quant must be"):
        glu_fwd(x, x, ACTS["silu"], quant=(q.targets[0], q.targets[1].t()))


def test_row_slices_of_the_carrier():
    x = torch.randn(40, 256)
    q = QuantizedRows.empty(x)
    quantize_rows_reference(x, *q.targets)
    assert q.codes.shape == (48, 256) and q.rows(slice(0, 40)) is q
    part = q.rows(slice(16, 40))  # aligned start: its padded rows still inside the buffers
    assert part.x.shape == (24, 256) and part.codes.shape == (32, 256)
    assert part.scale_t.is_contiguous() and torch.equal(part.scale_t, q.scale_t[:, 16:48])
    assert q.rows(slice(5, 20)) is None  # unaligned: the GEMM quantises x[5:20] itself
    codes, scale_t = gemm.quantize_padded(part, triton_kernel=True)
    assert codes is part.codes and scale_t is part.scale_t  # no pass of its own
    y = gemm.cublas_gemm(part, _weight(), scaled_mm=gemm.emulate_scaled_mm)
    torch.testing.assert_close(y, gemm.cublas_gemm(x[16:40], _weight(),
                                                   scaled_mm=gemm.emulate_scaled_mm),
                               rtol=0, atol=0)


def test_triton_gemm_reads_the_carriers_codes(monkeypatch):
    """Where cuBLAS refuses a GEMM (its Triton kernel runs instead), the kernel reading
    prequantised codes takes the carrier's (padding rows masked off): the same result as
    quantising x itself, bit for bit."""
    monkeypatch.setattr(gemm, "_act_quant", "pass")
    x = _x((M, 256), torch.float32, seed=3)
    q = QuantizedRows.empty(x)
    with kernels.backend("triton"):
        quantize_rows(x, *q.targets)
        passes = []
        real = gemm.quantize_rows
        monkeypatch.setattr(gemm, "quantize_rows", lambda *a: passes.append(1) or real(*a))
        got = gemm.fp8_gemm(q, _weight())
        assert not passes
        assert torch.equal(got, gemm.fp8_gemm(x, _weight())) and passes == [1]


def _weight():
    from leantune.kernels.fp8 import FP8Weight

    g = torch.Generator().manual_seed(5)
    return FP8Weight((128, 256), torch.float32).quantize_(torch.randn(128, 256, generator=g))


# every projection's in and out a multiple of 128 (the cuBLAS path's shapes); K = 128 (q/k/v,
# gate/up, o) and 384 (down: 3 scale blocks, padded to 4)
SHAPE = dict(CONFIGS["llama"], hidden_size=128, intermediate_size=384, num_attention_heads=2,
             num_key_value_heads=2, head_dim=64, num_hidden_layers=2)


def _batch():
    """3 rows x 7 tokens: N = 21 rows a GEMM (padded to 32 for cuBLAS)."""
    from leantune.batch import PackedBatch

    g = torch.Generator().manual_seed(0)
    rows = []
    for lens in ([7], [4, 3], [5]):
        row = []
        for n in lens:
            ids = torch.randint(0, 97, (n,), generator=g).tolist()
            row.append((ids, ids[1:] + [-100]))
        rows.append(row)
    return PackedBatch.from_documents(rows, pad_to_multiple=1)


def _loss_and_lora_grads(model, batch):
    """(loss, LoRA gradients, every layer's output)."""
    outs = []
    hooks = [layer.register_forward_hook(lambda m, a, y: outs.append(y.detach().clone()))
             for layer in model.layers]
    loss = model.loss_sum(batch) / batch.num_target_tokens
    for h in hooks:
        h.remove()
    params = [p for p in model.parameters() if p.requires_grad]
    return loss.detach(), torch.autograd.grad(loss, params), outs


def _engine_runs(monkeypatch, family: str, settings: dict, **shape) -> dict:
    """Every FP8 GEMM through cublas_gemm (scaled mm emulated), the norm / GLU / quantisation
    kernels in the interpreter, a layer recomputing everything below one keeping its
    attention state (MLP recomputed), for each of `settings` (name -> (EngineOptions, env)):
    name -> ((loss, LoRA gradients, layer outputs), quantize_rows passes, carriers handed to
    forward GEMMs, carriers handed to input-gradient GEMMs). `shape`: SHAPE's fields changed."""
    import leantune.engine.weights as weights
    import leantune.lora.base_weight as base_weight
    from leantune.engine import Engine, LayerPlan, detach
    from leantune.lora.base_weight import quantize_fp8_

    passes, handed = [], []
    real_quantize_rows = gemm.quantize_rows

    def counting_quantize_rows(x, *a, **k):
        passes.append(tuple(x.shape))
        return real_quantize_rows(x, *a, **k)

    def via_cublas(x, w, transpose=False, out=None, resid=None, scratch=None):
        handed.append((isinstance(x, QuantizedRows), transpose))
        return gemm.cublas_gemm(x, w, transpose=transpose, out=out, resid=resid,
                                scratch=scratch, scaled_mm=gemm.emulate_scaled_mm)

    monkeypatch.setattr(gemm, "quantize_rows", counting_quantize_rows)
    # (dX's code transpose by torch's copy: the interpreter's tiled one is slow, and untouched)
    monkeypatch.setattr(gemm, "transpose_codes",
                        lambda w, out=None: transpose_codes_reference(w.data, out))
    monkeypatch.setattr(gemm, "uses_cublas", lambda x, M, N, K: N % 128 == 0 and K % 128 == 0)
    monkeypatch.setattr(weights, "fp8_mm", via_cublas)
    monkeypatch.setattr(base_weight, "fp8_mm", via_cublas)
    batch = _batch()
    results = {}
    with kernels.backend("triton"):
        model = quantize_fp8_(model_for(dict(SHAPE, hidden_act=CONFIGS[family].get(
            "hidden_act", "silu"), **shape)))
        for name, (opts, env) in settings.items():
            for k, v in env.items():
                monkeypatch.setenv(k, v)
            passes.clear()
            handed.clear()
            Engine(opts).attach(model, [LayerPlan(0), LayerPlan(1)])
            results[name] = (_loss_and_lora_grads(model, batch), len(passes),
                             sum(q for q, t in handed if not t), sum(q for q, t in handed if t))
            detach(model)
    return results


def _assert_bit_identical(a, b) -> None:
    (loss_a, grads_a, outs_a), (loss_b, grads_b, outs_b) = a, b
    assert torch.equal(loss_a, loss_b) and len(outs_a) == 2
    assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_b))
    assert len(grads_a) == 7 * 2 * 2  # A and B of 7 projections, 2 layers
    assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b))


@pytest.mark.parametrize("family,chunk_rows", [("llama", None), ("gelu", 11)])
def test_fused_layers_bit_identical_with_fused_quant_on_and_off(family, chunk_rows,
                                                                monkeypatch):
    """The forward GEMMs' carriers (LEANTUNE_FP8_FUSED_QUANT); `chunk_rows`: MLP row chunks
    (the first a row slice of the norm's codes, the second unaligned: quantised by the
    GEMM)."""
    from helpers import chunk_options
    from leantune.engine import EngineOptions

    # (the input gradients' codes off: test_fused_grad_quant_bit_identical_on_and_off's)
    opts = (chunk_options(chunk_rows, intermediate=384, fuse_grad_quant=False) if chunk_rows
            else EngineOptions(fuse_grad_quant=False))
    runs = _engine_runs(monkeypatch, family, {
        on: (opts, {"LEANTUNE_FP8_FUSED_QUANT": on}) for on in ("1", "0")})
    result_on, passes_on, handed_on, grads_on = runs["1"]
    result_off, passes_off, handed_off, grads_off = runs["0"]
    _assert_bit_identical(result_on, result_off)
    assert grads_on == grads_off == 0
    assert handed_off == 0 and handed_on > 0 and passes_on == passes_off - handed_on
    # per layer q/k/v, gate/up and down in forward; recomputed in backward the first layer's
    # q/k/v and gate/up, the second's gate/up (chunked: their first chunks; the second chunks,
    # unaligned, quantised by the GEMM)
    assert handed_on == 3 * 2 + 2 + 1


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_grad_quant_bit_identical_on_and_off(head_dim, monkeypatch):
    """The q/k/v input-gradient GEMM's carrier (EngineOptions.fuse_grad_quant: kernels/qkv_grad
    writing d q | d k | d v's codes, heads of 128; none for heads of 64): loss and LoRA
    gradients bit-identical on and off, and on, that GEMM quantises nothing of its own."""
    from leantune.engine import EngineOptions

    heads = {} if head_dim == 64 else dict(head_dim=head_dim, num_attention_heads=1,
                                            num_key_value_heads=1)
    runs = _engine_runs(monkeypatch, "llama", {on: (EngineOptions(fuse_grad_quant=on), {})
                                               for on in (True, False)}, **heads)
    result_on, passes_on, fwd_on, grads_on = runs[True]
    result_off, passes_off, fwd_off, grads_off = runs[False]
    _assert_bit_identical(result_on, result_off)
    assert fwd_on == fwd_off > 0 and grads_off == 0
    assert passes_on == passes_off - grads_on
    # heads of 128: q/k/v's, in the top layer (the bottom one needs no input gradient)
    assert grads_on == (1 if head_dim == 128 else 0)


def test_switch_off_and_other_paths_hand_over_nothing(monkeypatch):
    """LEANTUNE_FP8_FUSED_QUANT=0, the reference kernels, the emulation: no carrier asked for."""
    from leantune.kernels.fp8 import FP8Weight, takes_quantized

    w = FP8Weight((128, 128), torch.float32)
    x = torch.randn(64, 128)
    monkeypatch.setattr(gemm, "uses_cublas", lambda x, M, N, K: True)
    with kernels.backend("triton"):
        assert takes_quantized(x, w)
        monkeypatch.setenv("LEANTUNE_FP8_FUSED_QUANT", "0")
        assert not takes_quantized(x, w)
        monkeypatch.delenv("LEANTUNE_FP8_FUSED_QUANT")
        monkeypatch.setenv("LEANTUNE_FP8_EMULATE", "1")
        assert not takes_quantized(x, w)
    with kernels.backend("reference"):
        assert not takes_quantized(x, w)
