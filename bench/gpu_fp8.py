"""Issue 23: FP8 for the frozen base. Two parts, one table last.

(a) GEMMs: M = --tokens (8192) rows against the Llama-3.1-8B projections (q/o 4096 x 4096, k/v
    1024 x 4096, gate/up 14336 x 4096, down 4096 x 14336): forward Y = X W^T and input gradient
    dX = dY W, in bf16 (cuBLAS) and in FP8 (kernels/fp8_gemm.py: e4m3 weights with 128 x 128
    block scales, the bf16 activation quantised per 1 x 128 block inside the kernel; dX with the
    codes transposed into a scratch buffer and read as stored). TFLOP/s, and the error against
    the fp32 product of the same bf16 operands: ||Y - Y_fp32|| / ||Y_fp32|| for bf16 and FP8.
    Beside the Triton kernel, the cuBLAS path (kernels/fp8_gemm.cublas_gemm: torch's blockwise
    1x128 x 128x128 scaled mm, the activation quantised by kernels/fp8_quant.py's Triton pass,
    dX through the transposed codes) with its error and its check against the emulation, and
    the quantisation and transpose alone (ms). Under --tiny the cuBLAS columns run the same
    glue with the scaled mm emulated (fp8_gemm.emulate_scaled_mm: the same tensors, torch's
    layout checks). The probe of torch's entry points is printed above the table.
    For reference, torch._scaled_mm (rowwise scales, where this torch has it) with the
    activation quantised by a separate PyTorch amax pass, the cost the issue measured.
(b) Steps: the Llama-3.1-8B shape, --rows x --seq tokens (4 x 2048), LoRA r16 alpha16 on every
    projection, random weights, fused AdamW; leantune bf16 and --precision fp8 under their
    activation policies (default bf16 auto@17, fp8 auto@12 and auto@17); tok/s (median of
    --steps after --warmup) and peak GiB (torch.cuda.max_memory_allocated over the steps).
(c) Loss (--parts loss): --loss-steps (100) at --lr (2e-4) on bench/loss_curve.py's documents,
    bf16 vs fp8 from one init, beside the bf16 noise floor (bf16 through the autograd layers
    against the fused ones): the issue's bar is a mean gap within 3x the floor.
(d) Decoding (--parts decode): batch-1 greedy tok/s, bf16 vs the same model's FP8 weights.
(e) Fused activation quantisation (--parts quant): ms of the RMSNorm (--tokens x 4096) and the
    GLU (--tokens x 14336) forward writing their output's e4m3 codes as they write it (the
    cuBLAS GEMM's input, kernels/fp8_quant.QuantizedRows) against the kernel alone and the
    kernel followed by the quantize_rows pass (LEANTUNE_FP8_FUSED_QUANT=0); codes checked equal.
    Likewise kernels/qkv_grad.py writing d q | d k | d v (the q/k/v input-gradient GEMM's input,
    EngineOptions.fuse_grad_quant) against the copies and RoPE pass it replaces.
    In (b), --fused-quant on off runs each fp8 policy both ways (LEANTUNE_FP8_FUSED_QUANT),
    --grad-quant on off with the q/k/v input gradient's codes written by qkv_grad or not
    (LEANTUNE_FUSE_GRAD_QUANT), and --trim on off each policy with offloaded layers trimmed of
    q/k/v or not (LEANTUNE_TRIM_OFFLOAD).
(f) gate/up's LoRA terms in the GLU kernels (--parts glu; EngineOptions.fuse_glu_lora): ms of the
    GLU forward (writing FP8 codes) and backward with the terms added in the kernel against two
    rank-16 addmm_ passes over gate | up before it (LEANTUNE_FUSE_GLU_LORA=0 in a step).
(g) The LoRA term and residual after the GEMM (--parts add): ms of lora_add_ against the passes
    it replaces, at o / down's and q | k | v's shapes.
    In (b), --lora-add on off runs each policy with q/k/v, o and down's LoRA terms (and o and
    down's residuals) added by one kernel after the GEMM or by a residual pass and addmm_ per
    projection (LEANTUNE_FUSE_LORA_ADD; kernels/lora_add.py).

    python bench/gpu_fp8.py                 # both parts on the GPU (~3 min on an H200)
    python bench/gpu_fp8.py --parts gemm    # (a) only
    LEANTUNE_FP8_GEMM=triton python bench/gpu_fp8.py --parts step   # steps on the Triton GEMM
    python bench/gpu_fp8.py --parts loss    # (c): 100 steps at lr 2e-4, Llama-3.2-1B shape
    python bench/gpu_fp8.py --parts decode  # (d): batch-1 decoding, bf16 vs FP8 weights
    python bench/gpu_fp8.py --parts quant step --bf16 --fp8 auto@17 --fused-quant on off
                                            # (e), and the 8B step with fused quantisation on/off
    python bench/gpu_fp8.py --tiny          # the same code paths on the CPU in seconds: the
                                            # Triton kernel in the interpreter, the step emulated
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if "--tiny" in sys.argv:  # the kernel in the interpreter, the step's FP8 GEMMs emulated
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("LEANTUNE_FP8_EMULATE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import (H200_BF16_FLOPS, flops_per_token, leantune_model, median,  # noqa: E402
                     peak_gib, record, reset_peak, step_times, sync)
from shapes import SHAPES  # noqa: E402
from speed import random_batch  # noqa: E402

from leantune import kernels  # noqa: E402
from leantune.kernels import fp8_gemm  # noqa: E402
from leantune.kernels.fp8 import (FP8_DTYPE, FP8_MAX, FP8Weight,  # noqa: E402
                                  fp8_mm_reference)

# decode --tiny: the tiny Llama with q/k/v and gate/up rows multiples of 128 (so its FP8 groups
# stack and the packed decode path runs, as at 8B)
SHAPES["tiny-fp8-decode"] = dict(SHAPES["tiny"], num_key_value_heads=4, head_dim=32,
                                 intermediate_size=128)

# Llama-3.1-8B's projections, (out, in)
PROJECTIONS = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (14336, 4096),
               "down": (4096, 14336)}
# (multiples of 128, as the cuBLAS path takes; K / 128 = 3 pads its weight scales)
TINY_PROJECTIONS = {"q/o": (128, 128), "k/v": (128, 256), "gate/up": (384, 128),
                    "down": (128, 384)}


def time_ms(fn, device, n: int = 20, warm: int = 3) -> float:
    """Mean ms of fn() (CUDA events on the GPU; the host clock on the CPU)."""
    if device.type == "cuda":
        from harness import mean_ms

        return mean_ms(fn, n, warm)
    return 1e3 * median(step_times(fn, 1, 2, device))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def rowwise_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes [N, K], scales [1, N] fp32): one scale per output row, the
    layout torch._scaled_mm's rowwise recipe takes for B = codes^T."""
    sw = (w.float().abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    w8 = (w.float() / sw[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w8, sw.view(1, -1).contiguous()


def scaled_mm_rowwise(x: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor):
    """torch._scaled_mm with rowwise scales, the activation quantised by plain PyTorch ops (the
    separate amax pass the issue measured): x [M, K] bf16, w8 [N, K] e4m3, sw [1, N] fp32."""
    amax = x.abs().amax(1, keepdim=True).float().clamp(min=1e-12)
    sx = amax / FP8_MAX
    x8 = (x / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)


def cublas_part(row, x, dy, q, scratch, y32, dx32, flops, device) -> None:
    """The cuBLAS path's columns into `row` (the scaled mm emulated on the CPU), and the
    quantisation and transpose alone."""
    from leantune.kernels.fp8_quant import quantize_rows

    emulate = device.type != "cuda"
    mm = fp8_gemm.emulate_scaled_mm if emulate else None
    row["cublas_mode"] = "emulated" if emulate else "cuBLAS"

    def fwd():
        return fp8_gemm.cublas_gemm(x, q, scaled_mm=mm)

    def dx():
        return fp8_gemm.cublas_gemm(dy, q, transpose=True, scratch=scratch, scaled_mm=mm)

    try:
        with kernels.backend("triton"):
            f_ms, b_ms = time_ms(fwd, device), time_ms(dx, device)
            row.update(cublas_fwd_tflops=flops / f_ms / 1e9, cublas_dx_tflops=flops / b_ms / 1e9,
                       cublas_fwd_err=rel_err(fwd(), y32), cublas_dx_err=rel_err(dx(), dx32),
                       cublas_vs_emulation=max(
                           rel_err(fwd(), fp8_mm_reference(x, q).float()),
                           rel_err(dx(), fp8_mm_reference(dy, q, transpose=True).float())),
                       quant_ms=time_ms(lambda: quantize_rows(x), device),
                       transpose_ms=time_ms(lambda: fp8_gemm.transpose_codes(q, scratch),
                                            device))
            row["cublas_fwd_plus_dx_ms"] = f_ms + b_ms
    except Exception as e:  # (no blockwise scaled mm in this torch / on this GPU: recorded)
        row["cublas_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"


def gemm_part(args, device) -> list[dict]:
    probe = fp8_gemm.probe_cublas(device)
    record("fp8_cublas_probe", path=fp8_gemm.gemm_path(), torch=torch.__version__,
           **{k: v or "ok" for k, v in probe.items()})
    print("cuBLAS blockwise probe (torch " + torch.__version__ + "): "
          + "; ".join(f"{k}: {v or 'ok'}" for k, v in probe.items()))
    rows = []
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    shapes = TINY_PROJECTIONS if args.tiny else PROJECTIONS
    M = args.tokens
    backend = "triton"  # (the interpreter on the CPU: TRITON_INTERPRET=1 under --tiny)
    for name, (N, K) in shapes.items():
        w = torch.empty(N, K, device=device, dtype=dtype).normal_(0, 0.02, generator=g)
        x = torch.empty(M, K, device=device, dtype=dtype).normal_(0, 1, generator=g)
        dy = torch.empty(M, N, device=device, dtype=dtype).normal_(0, 1e-3, generator=g)
        q = FP8Weight((N, K), dtype, device=device).quantize_(w)
        scratch = torch.empty(K, N, dtype=FP8_DTYPE, device=device)
        flops = 2 * M * N * K
        y32, dx32 = x.float() @ w.float().t(), dy.float() @ w.float()
        row = dict(shape=name, M=M, N=N, K=K)
        bf_f = time_ms(lambda: torch.mm(x, w.t()), device)
        bf_b = time_ms(lambda: torch.mm(dy, w), device)
        row.update(bf16_fwd_tflops=flops / bf_f / 1e9, bf16_dx_tflops=flops / bf_b / 1e9,
                   bf16_fwd_err=rel_err(x @ w.t(), y32), bf16_dx_err=rel_err(dy @ w, dx32))
        try:
            with fp8_gemm.using_gemm_path("triton"):  # (compiles: a kernel this GPU refuses
                fp8_gemm.fp8_gemm(x[:128], q)           # is one record)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            record("fp8_gemm", **row)
            rows.append(row)
            continue
        with kernels.backend(backend), fp8_gemm.using_gemm_path("triton"):
            f8_f = time_ms(lambda: fp8_gemm.fp8_gemm(x, q), device)
            row.update(fp8_fwd_tflops=flops / f8_f / 1e9,
                       fp8_fwd_err=rel_err(fp8_gemm.fp8_gemm(x, q), y32),
                       act_quant="pass" if fp8_gemm.prequantizes(M) else "kernel")
            fp8_gemm.set_act_quant("kernel")  # (the activation quantised per tile, inside)
            try:
                row["fp8_fwd_in_kernel_quant_tflops"] = flops / time_ms(
                    lambda: fp8_gemm.fp8_gemm(x, q), device) / 1e9
            finally:
                fp8_gemm.set_act_quant(os.environ.get("LEANTUNE_FP8_ACT_QUANT", "auto"))
            for layout in fp8_gemm.DX_LAYOUTS:
                fp8_gemm.set_dx_layout(layout)
                try:  # (a layout the compiler refuses on this GPU: recorded, the rest goes on)
                    ms = time_ms(lambda: fp8_gemm.fp8_gemm(dy, q, transpose=True,
                                                           scratch=scratch), device)
                    row[f"fp8_dx_{layout}_tflops"] = flops / ms / 1e9
                    row[f"fp8_dx_{layout}_err"] = rel_err(
                        fp8_gemm.fp8_gemm(dy, q, transpose=True, scratch=scratch), dx32)
                except Exception as e:
                    row[f"fp8_dx_{layout}_tflops"] = None
                    row[f"fp8_dx_{layout}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            fp8_gemm.set_dx_layout("transpose")
            # the kernel against the PyTorch emulation of the same quantisation (the CPU tests'
            # reference): equal up to fp32 summation order and the bf16 output's rounding
            row["kernel_vs_emulation"] = max(
                rel_err(fp8_gemm.fp8_gemm(x, q), fp8_mm_reference(x, q).float()),
                rel_err(fp8_gemm.fp8_gemm(dy, q, transpose=True, scratch=scratch),
                        fp8_mm_reference(dy, q, transpose=True).float()))
        dx_best = max(row["fp8_dx_transpose_tflops"] or 0, row["fp8_dx_direct_tflops"] or 0)
        row["fwd_plus_dx_speedup"] = ((bf_f + bf_b) / (f8_f + flops / dx_best / 1e9)
                                      if dx_best else None)
        cublas_part(row, x, dy, q, scratch, y32, dx32, flops, device)
        if "cublas_fwd_plus_dx_ms" in row:
            row["cublas_speedup"] = (bf_f + bf_b) / row.pop("cublas_fwd_plus_dx_ms")
        if device.type == "cuda" and hasattr(torch, "_scaled_mm"):
            try:  # (the old probe passed 1 x 128 block scales as rowwise ones: always refused)
                w8, sw = rowwise_weight(w)
                ms = time_ms(lambda: scaled_mm_rowwise(x, w8, sw), device)
                row.update(scaled_mm_rowwise_plus_quant_tflops=flops / ms / 1e9,
                           scaled_mm_rowwise_err=rel_err(scaled_mm_rowwise(x, w8, sw), y32))
            except Exception as e:  # (a torch without rowwise _scaled_mm on this GPU)
                row["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:160]}"
        record("fp8_gemm", **row)
        rows.append(row)
        del w, x, dy, q, scratch, y32, dx32
        reset_peak(device)
    return rows


def trainer_step(model, batch, policy: str, precision: str, steps: int, device):
    """A Trainer over `model` (--precision `precision`, which quantises its projections to FP8
    in place) under `policy` (keep | recompute | offload | auto | auto@GiB) and its step."""
    from leantune.train.config import TrainConfig
    from leantune.train.trainer import Trainer

    activations, _, budget = policy.partition("@")
    cfg = TrainConfig(output=tempfile.mkdtemp(), max_seq_len=batch.input_ids.shape[1],
                      batch_size=batch.input_ids.shape[0], lr=1e-4, warmup_steps=0,
                      max_steps=steps, progress=False, eval_every=0, lora_r=16, lora_alpha=16,
                      overwrite=True, device=str(device),
                      dtype="bfloat16" if device.type == "cuda" else "float32",
                      activations=activations, max_memory_gib=float(budget) if budget else None,
                      precision=precision)
    docs = [(batch.input_ids[0].tolist(), batch.labels[0].tolist())]
    trainer = Trainer(cfg, model=model, train_data=docs, log=lambda *a: None)
    on_device = batch.to(device)
    return trainer, lambda: trainer.train_step([on_device])


def gemm_name(precision: str, device) -> str:
    """Which GEMM a step's base projections run: bf16 (cuBLAS), or for fp8 the emulation, the
    cuBLAS path or the Triton kernel (kernels/fp8_gemm.py; at the training shapes)."""
    from leantune.kernels.fp8 import emulating

    if precision != "fp8":
        return "bf16"
    if emulating():
        return "emulated"
    return "cublas" if fp8_gemm.cublas_reason(device) is None else "triton"


def step_part(args, device) -> list[dict]:
    from leantune.engine import detach

    shape = "tiny" if args.tiny else args.shape
    cfg_model = None
    batch = None
    rows = []
    # (--lora-add applies to bf16 too: its unpacked o projection takes the kernel)
    runs = ([("bf16", p, None, t, args.glu_lora[0], la, None) for p in args.bf16
             for t in args.trim for la in args.lora_add]
            + [("fp8", p, fq, t, gl, la, gq) for p in args.fp8 for fq in args.fused_quant
               for t in args.trim for gl in args.glu_lora for la in args.lora_add
               for gq in args.grad_quant])
    switches = {k: os.environ.get(k) for k in ("LEANTUNE_FP8_FUSED_QUANT",
                                                "LEANTUNE_TRIM_OFFLOAD",
                                                "LEANTUNE_FUSE_GLU_LORA",
                                                "LEANTUNE_FUSE_LORA_ADD",
                                                "LEANTUNE_FUSE_GRAD_QUANT")}
    for precision, policy, fused_quant, trim, glu_lora, lora_add, grad_quant in runs:
        if fused_quant is not None:  # (read at each GEMM: kernels/fp8_gemm.fused_quant)
            os.environ["LEANTUNE_FP8_FUSED_QUANT"] = "1" if fused_quant == "on" else "0"
        if grad_quant is not None:  # (EngineOptions.fuse_grad_quant)
            os.environ["LEANTUNE_FUSE_GRAD_QUANT"] = "1" if grad_quant == "on" else "0"
        # (read by the Trainer's engine options: the planner's trim_for_link, the GLU kernels'
        # LoRA terms)
        os.environ["LEANTUNE_TRIM_OFFLOAD"] = "1" if trim == "on" else "0"
        os.environ["LEANTUNE_FUSE_GLU_LORA"] = "1" if glu_lora == "on" else "0"
        os.environ["LEANTUNE_FUSE_LORA_ADD"] = "1" if lora_add == "on" else "0"
        model = leantune_model(shape, device,
                               torch.bfloat16 if device.type == "cuda" else torch.float32)
        cfg_model = model.config
        batch = batch or random_batch(cfg_model.vocab_size, args.rows, args.seq)
        tokens = batch.input_ids.numel()
        row = dict(shape=shape, precision=precision, policy=policy, gemm=gemm_name(
            precision, device), fused_quant=fused_quant, trim=trim, glu_lora=glu_lora,
            lora_add=lora_add, grad_quant=grad_quant)
        try:
            trainer, step = trainer_step(model, batch, policy, precision, args.steps, device)
            reset_peak(device)
            t = median(step_times(step, args.warmup, args.steps, device))
            row.update(plan=trainer.activation_policy, tok_s=tokens / t, step_s=t,
                       peak_gib=peak_gib(device),
                       mfu=flops_per_token(cfg_model, batch.input_ids.shape[1]) * tokens
                       / t / H200_BF16_FLOPS)
            del trainer, step
        except Exception as e:  # OOM or a budget no plan fits: record it and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record("fp8_step", **row)
        rows.append(row)
        detach(model)
        del model
        reset_peak(device)
    for k, v in switches.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    best = {p: max((r.get("tok_s", 0) for r in rows if r["precision"] == p), default=0)
            for p in ("bf16", "fp8")}
    if best["bf16"] and best["fp8"]:
        record("fp8_step", shape=shape, ratio_fp8_vs_bf16=best["fp8"] / best["bf16"])
    return rows


def loss_part(args, device) -> list[dict]:
    """(c) --loss-steps steps at lr --lr on bench/loss_curve.py's documents (packed rows of
    --seq, --rows a step), one base and one LoRA init: leantune bf16, bf16 through the autograd
    layers (another kernel order of the same math: the bf16 noise floor) and --precision fp8.
    Per step |loss - bf16 loss| / bf16 loss."""
    import json

    from loss_curve import make_documents

    shape = "tiny" if args.tiny else args.loss_shape
    tiny = args.tiny
    vocab = SHAPES[shape]["vocab_size"]
    docs = make_documents(40 if tiny else 600, vocab, seed=1, hi=min(args.seq, 1024),
                          lo=8 if tiny else 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    curves = {}
    for name, precision, fused in (("bf16", "bf16", True), ("bf16-autograd", "bf16", False),
                                   ("fp8", "fp8", True)):
        from leantune.train.config import TrainConfig
        from leantune.train.trainer import Trainer

        out = Path(tempfile.mkdtemp())
        cfg = TrainConfig(output=str(out), max_seq_len=args.seq, batch_size=args.rows,
                          lr=args.lr, warmup_steps=3, max_steps=args.loss_steps, seed=0,
                          progress=False, eval_every=0, lora_r=16, lora_alpha=16, overwrite=True,
                          device=str(device), fused_layers=fused, precision=precision,
                          activations="auto" if device.type == "cuda" else "keep",
                          dtype=str(dtype).replace("torch.", ""))
        model = leantune_model(shape, device, dtype=dtype)  # (the same weights each time)
        trainer = Trainer(cfg, model=model, train_data=docs, log=lambda *a: None)
        trainer.train()
        curves[name] = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")
                        if '"loss"' in line]
        del trainer, model
        reset_peak(device)
    ref = curves["bf16"]

    def gaps(other):
        return [abs(a - b) / abs(b) for a, b in zip(other, ref)]

    g8, floor = gaps(curves["fp8"]), gaps(curves["bf16-autograd"])
    row = dict(shape=shape, steps=len(ref), lr=args.lr, fp8_mean_rel_gap=sum(g8) / len(g8),
               fp8_max_rel_gap=max(g8), floor_mean_rel_gap=sum(floor) / len(floor),
               floor_max_rel_gap=max(floor), first_last={k: [v[0], v[-1]]
                                                        for k, v in curves.items()},
               curves=curves)
    row["within_3x_floor"] = row["fp8_mean_rel_gap"] <= 3 * row["floor_mean_rel_gap"]
    record("fp8_loss", **row)
    return [row]


def decode_part(args, device) -> list[dict]:
    """(d) Batch-1 greedy decoding (leantune.generate, CUDA graphs on the GPU): a random prompt
    of 128 tokens, --new-tokens new ones (EOS off), the --shape model in bf16, then with its
    projections quantised to FP8 (the same GEMM kernel: a decode step streams the e4m3 weights,
    half the bytes). "fp8": q/k/v and gate/up as one GEMV a group (generate/projections.py
    _PackedFP8) and an FP8 LM head (_FP8Head); "fp8-bf16-head": the same with the 16-bit head
    (LEANTUNE_FP8_DECODE_HEAD=0); "fp8-unpacked": one GEMV a projection and the 16-bit head
    (LEANTUNE_FP8_PACKED_DECODE=0 too: the path before both). tok/s of new tokens, median of
    3 calls after a warm-up (which tunes and captures)."""
    import time

    import leantune
    from leantune.lora.base_weight import quantize_fp8_

    from leantune.generate.projections import DecodeProjections

    shape = "tiny-fp8-decode" if args.tiny else args.shape
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = leantune_model(shape, device, dtype).eval()
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, model.config.vocab_size, (1, 128 if not args.tiny else 8),
                         generator=g).tolist()
    out = []
    switches = {"bf16": ("1", "1"), "fp8": ("1", "1"), "fp8-bf16-head": ("1", "0"),
                "fp8-unpacked": ("0", "0")}  # (LEANTUNE_FP8_PACKED_DECODE, _DECODE_HEAD)
    for precision, (packed, head) in switches.items():
        if precision == "fp8":
            quantize_fp8_(model)
        os.environ["LEANTUNE_FP8_PACKED_DECODE"], os.environ["LEANTUNE_FP8_DECODE_HEAD"] = (
            packed, head)

        def run():
            return leantune.generate(model, None, rows, max_new_tokens=args.new_tokens,
                                     eos_token_ids=[], cuda_graphs=device.type == "cuda")

        parts = DecodeProjections(model)
        row = dict(shape=shape, precision=precision, batch=1, new_tokens=args.new_tokens,
                   packed_groups=parts.packed_groups, fp8_head=parts.head is not None)
        try:
            run()
            times = []
            for _ in range(3):
                sync(device)
                t0 = time.perf_counter()
                run()
                sync(device)
                times.append(time.perf_counter() - t0)
            row["tok_s"] = args.new_tokens / median(times)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record("fp8_decode", **row)
        out.append(row)
    for name in ("LEANTUNE_FP8_PACKED_DECODE", "LEANTUNE_FP8_DECODE_HEAD"):
        os.environ.pop(name)
    del model
    reset_peak(device)
    return out


def quant_part(args, device) -> list[dict]:
    """(e) The norm and the GLU forward (the kernels whose outputs the q/k/v, gate/up and down
    GEMMs read) and qkv_grad (d q | d k | d v for the q/k/v input-gradient GEMM; "alone": the
    copies and RoPE pass it replaces) at --tokens rows: alone, followed by the quantize_rows
    pass (fused quantisation off), and writing the codes themselves (on; the carrier allocated
    in the timing, as in the layer); the fused codes and scales checked equal to
    quantize_rows'."""
    from leantune.kernels.fp8_quant import QuantizedRows, quantize_rows
    from leantune.kernels.rmsnorm import rms_norm_fwd
    from leantune.kernels.swiglu import ACTS, glu_fwd

    M = args.tokens
    H, inter = (128, 384) if args.tiny else (4096, 14336)  # (Llama-3.1-8B)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.empty(M, H, device=device, dtype=dtype).normal_(0, 1, generator=g)
    w = torch.empty(H, device=device, dtype=dtype).normal_(1, 0.1, generator=g)
    gu = torch.empty(M, 2 * inter, device=device, dtype=dtype).normal_(0, 1, generator=g)
    y, h = x.new_empty(M, H), x.new_empty(M, inter)

    def norm(quant):
        rms_norm_fwd(x, w, 1e-5, out=y, quant=quant)

    def glu(quant):
        glu_fwd(gu[:, :inter], gu[:, inter:], ACTS["silu"], out=h, quant=quant)

    # d q | d k | d v into the q/k/v gradient buffer through RoPE's backward (Llama-3.1-8B's 32
    # / 8 heads of 128): by hand (copies, RoPE in place) against kernels/qkv_grad.py
    from leantune.kernels.qkv_grad import qkv_grad
    from leantune.kernels.rope import rope_

    B, T = (2, M // 2)
    Hq, Hk, D = (2, 1, 128) if args.tiny else (32, 8, 128)
    dq, dk, dv = (torch.randn(B, T, n, D, device=device, dtype=dtype) for n in (Hq, Hk, Hk))
    ang = torch.randn(B, T, D, device=device)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    dqkv = x.new_empty(M, (Hq + 2 * Hk) * D)

    def qkv_by_hand():
        parts = dqkv.split([Hq * D, Hk * D, Hk * D], 1)
        for dst, src in zip(parts, (dq, dk, dv)):
            dst.view(B, T, -1, D).copy_(src)
        rope_(parts[0].view(B, T, Hq, D), parts[1].view(B, T, Hk, D), cos, sin, inverse=True)

    def qkv_fused(quant):
        if quant is None:
            return qkv_by_hand()
        qkv_grad(dq, dk, dv, cos, sin, dqkv, quant=None if quant == "none" else quant)

    rows = []
    with kernels.backend("triton"):
        for name, run, out in (("rmsnorm", norm, y), ("glu", glu, h),
                               ("qkv_grad", qkv_fused, dqkv)):
            row = dict(kernel=name, M=M, K=out.shape[1])
            row.update(alone_ms=time_ms(lambda: run(None), device),
                       then_quant_ms=time_ms(lambda: (run(None), quantize_rows(out)), device),
                       fused_ms=time_ms(lambda: run(QuantizedRows.empty(out).targets), device))
            q = QuantizedRows.empty(out)
            run(q.targets)
            codes, scale_t = quantize_rows(out)
            row["codes_equal"] = (torch.equal(codes.view(torch.uint8), q.targets[0].view(
                torch.uint8)) and torch.equal(scale_t, q.targets[1]))
            row["saved_ms"] = row["then_quant_ms"] - row["fused_ms"]
            if name == "qkv_grad":  # (16-bit: the one pass without codes against by hand)
                row["fused_no_codes_ms"] = time_ms(lambda: qkv_fused("none"), device)
            record("fp8_fused_quant", **row)
            rows.append(row)
    return rows


def glu_part(args, device) -> list[dict]:
    """(f) gate/up's LoRA terms on an FP8 base (R = 32: r16 on gate and on up) at --tokens rows
    of Llama-3.1-8B's MLP: added by two rank-16 addmm_ passes over gate | up and then the GLU
    (fuse_glu_lora off), or inside the GLU kernels (on); forward (with the fused FP8 codes) and
    backward (in place, writing h; with the down projection's dx term ga A, r16, a third pass
    off); the fused results against the unfused (max rel err)."""
    from leantune.kernels.fp8_quant import QuantizedRows
    from leantune.kernels.swiglu import ACTS, glu_bwd_, glu_fwd

    M = args.tokens
    inter, R = (384, 32) if args.tiny else (14336, 32)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, std=1.0):
        return torch.empty(*shape, device=device, dtype=dtype).normal_(0, std, generator=g)

    gu0, xa, dy0 = rnd(M, 2 * inter), rnd(M, R), rnd(M, inter)
    ga, a_down = rnd(M, 16), rnd(16, inter, std=0.05)  # down's LoRA: dx += ga A
    b_gate, b_up = rnd(inter, R // 2, std=0.05), rnd(inter, R // 2, std=0.05)
    bg = torch.zeros(inter, R, device=device, dtype=dtype)
    bu = torch.zeros_like(bg)
    bg[:, :R // 2], bu[:, R // 2:] = b_gate, b_up
    h = rnd(M, inter)
    silu = ACTS["silu"]

    def unfused_fwd(gu):
        gu[:, :inter].addmm_(xa[:, :R // 2], b_gate.t())
        gu[:, inter:].addmm_(xa[:, R // 2:], b_up.t())
        glu_fwd(gu[:, :inter], gu[:, inter:], silu, out=h, quant=QuantizedRows.empty(h).targets)

    def fused_fwd(gu):
        glu_fwd(gu[:, :inter], gu[:, inter:], silu, out=h, quant=QuantizedRows.empty(h).targets,
                lora=(xa, bg, bu))

    def unfused_bwd(gu, dy):
        gu[:, :inter].addmm_(xa[:, :R // 2], b_gate.t())
        gu[:, inter:].addmm_(xa[:, R // 2:], b_up.t())
        dy.addmm_(ga, a_down)
        glu_bwd_(dy, gu[:, :inter], gu[:, inter:], silu, h_out=dy)

    def fused_bwd(gu, dy):
        glu_bwd_(dy, gu[:, :inter], gu[:, inter:], silu, h_out=dy, lora=(xa, bg, bu),
                 dy_lora=(ga, a_down))

    rows = []
    with kernels.backend("triton"):
        gu, dy = gu0.clone(), dy0.clone()
        row = dict(M=M, I=inter, R=R,
                   fwd_unfused_ms=time_ms(lambda: unfused_fwd(gu0.clone()), device)
                   - time_ms(lambda: gu0.clone(), device),
                   fwd_fused_ms=time_ms(lambda: fused_fwd(gu0), device),
                   bwd_unfused_ms=time_ms(lambda: unfused_bwd(gu0.clone(), dy0.clone()), device)
                   - time_ms(lambda: (gu0.clone(), dy0.clone()), device),
                   bwd_fused_ms=time_ms(lambda: fused_bwd(gu0.clone(), dy0.clone()), device)
                   - time_ms(lambda: (gu0.clone(), dy0.clone()), device))
        # the results: fused against unfused (the unfused rounds gate / up to 16 bits first)
        a = gu0.clone()
        unfused_fwd(a)
        h_unfused = h.clone()
        fused_fwd(gu0)
        row["fwd_rel_err"] = rel_err(h, h_unfused)
        a, da = gu0.clone(), dy0.clone()
        unfused_bwd(a, da)
        fused_bwd(gu, dy)
        row["bwd_rel_err"] = max(rel_err(gu, a), rel_err(dy, da))
    row["saved_ms"] = (row["fwd_unfused_ms"] - row["fwd_fused_ms"]
                       + row["bwd_unfused_ms"] - row["bwd_fused_ms"])
    record("fp8_glu_lora", **row)
    rows.append(row)
    # the tile sweep (kernels/swiglu.LORA_TILES: BLOCK_M, BLOCK_N, num_warps)
    import importlib

    swiglu = importlib.import_module("leantune.kernels.swiglu")
    default = dict(swiglu.LORA_TILES)
    sweep = {}
    with kernels.backend("triton"):
        for tile in args.glu_tiles:  # (a trailing "t": tl.dot in TF32 over fp32 casts)
            bm, bn, warps = (int(v) for v in tile.rstrip("t").split("x"))
            swiglu.LORA_TILES = {"fwd": (bm, bn, warps), "bwd": (bm, bn, warps)}
            swiglu.DOT16 = not tile.endswith("t")
            sweep[tile] = dict(
                fwd_ms=time_ms(lambda: fused_fwd(gu0), device),
                bwd_ms=time_ms(lambda: fused_bwd(gu0.clone(), dy0.clone()), device)
                - time_ms(lambda: (gu0.clone(), dy0.clone()), device))
    swiglu.LORA_TILES, swiglu.DOT16 = default, True
    if sweep:
        record("fp8_glu_lora_tiles", M=M, I=inter, default=default, tiles=sweep)
        for tile, r in sweep.items():
            print(f"glu tile {tile:<10} fwd {r['fwd_ms']:.3f} ms  bwd {r['bwd_ms']:.3f} ms",
                  flush=True)
    return rows


def add_part(args, device) -> list[dict]:
    """(g) The LoRA term added after the GEMM at --tokens rows of Llama-3.1-8B's projections
    (r16 each): o and down (a residual, N 4096, R 16) and q | k | v (no residual, N 6144, R 48
    in one block matrix): a residual pass and one addmm_ per projection (fuse_lora_add off)
    against kernels/lora_add.lora_add_ (on); rel err of each against the formula in fp32."""
    from leantune.kernels.lora_add import lora_add_

    M = args.tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    shapes = ({"o/down": ([256], True), "qkv": ([256, 64, 64], False)} if args.tiny else
              {"o/down": ([4096], True), "qkv": ([4096, 1024, 1024], False)})
    rows = []
    for name, (outs, with_resid) in shapes.items():
        def rnd(*shape, std=1.0):
            return torch.empty(*shape, device=device, dtype=dtype).normal_(0, std, generator=g)

        N, R = sum(outs), 16 * len(outs)
        y0, xa, resid = rnd(M, N), rnd(M, R), rnd(M, N) if with_resid else None
        bs = [rnd(o, 16, std=0.05) for o in outs]
        b_cat = torch.zeros(N, R, device=device, dtype=dtype)
        r0 = 0
        for i, (o, b) in enumerate(zip(outs, bs)):
            b_cat[r0:r0 + o, 16 * i:16 * (i + 1)] = b
            r0 += o
        want = y0.float() + xa.float() @ b_cat.float().t()
        if resid is not None:
            want += resid.float()
        y = y0.clone()

        def passes():
            if resid is not None:
                y.add_(resid)
            r0 = 0
            for i, (o, b) in enumerate(zip(outs, bs)):
                y[:, r0:r0 + o].addmm_(xa[:, 16 * i:16 * (i + 1)], b.t())
                r0 += o

        def kernel():
            lora_add_(y, xa, b_cat, resid)

        errs = {}
        for label, fn in (("passes", passes), ("kernel", kernel)):
            y.copy_(y0)
            fn()
            errs[label] = rel_err(y, want)
        row = dict(name=name, M=M, N=N, R=R, resid=with_resid,
                   passes_ms=time_ms(passes, device), kernel_ms=time_ms(kernel, device),
                   passes_rel_err=errs["passes"], kernel_rel_err=errs["kernel"])
        record("lora_add", **row)
        rows.append(row)
    return rows


def _f(v, fmt="{:.4g}"):
    return "-" if v is None else fmt.format(v)


def print_table(gemms: list[dict], steps: list[dict], losses: list[dict] = (),
                decodes: list[dict] = (), quants: list[dict] = (),
                glus: list[dict] = (), adds: list[dict] = ()) -> None:
    if gemms:
        print("\nGEMM    M x N x K        TFLOP/s: bf16 fwd / dX | triton fp8 fwd / dX(T) / "
              "dX(direct) [fwd, quant in-kernel] | speedup | rel err bf16 / fp8 | kernel vs "
              "emul. | _scaled_mm+quant")
        for r in gemms:
            if "error" in r:
                print(f"{r['shape']:<7} error: {r['error'][:100]}")
                continue
            check = "ok" if r["kernel_vs_emulation"] < 1e-2 else "FAIL"
            print(f"{r['shape']:<7} {r['M']}x{r['N']}x{r['K']:<9} "
                  f"{_f(r['bf16_fwd_tflops']):>7} / {_f(r['bf16_dx_tflops']):<7} | "
                  f"{_f(r['fp8_fwd_tflops']):>7} / {_f(r['fp8_dx_transpose_tflops'])} / "
                  f"{_f(r['fp8_dx_direct_tflops'])} [{_f(r.get('fp8_fwd_in_kernel_quant_tflops'))}]"
                  f" | {_f(r['fwd_plus_dx_speedup'], '{:.2f}')}x | "
                  f"{r['bf16_fwd_err']:.1e} / {r['fp8_fwd_err']:.1e} | "
                  f"{r['kernel_vs_emulation']:.1e} {check} | "
                  f"{_f(r.get('scaled_mm_rowwise_plus_quant_tflops'))}"
                  + (f" ({r['scaled_mm_error'][:60]})" if "scaled_mm_error" in r else ""))
        print("\nGEMM    cublas path       TFLOP/s: fwd / dX | fwd+dX speedup vs bf16 | rel err "
              "fwd / dX | vs emul. | quant ms / transpose ms")
        for r in (r for r in gemms if "error" not in r):
            print(f"{r['shape']:<7} cublas error: {r['cublas_error'][:100]}"
                  if "cublas_error" in r else
                  f"{r['shape']:<7} {r['cublas_mode']:<17} {_f(r['cublas_fwd_tflops']):>7} / "
                  f"{_f(r['cublas_dx_tflops']):<7} | {_f(r.get('cublas_speedup'), '{:.2f}')}x | "
                  f"{r['cublas_fwd_err']:.1e} / {r['cublas_dx_err']:.1e} | "
                  f"{r['cublas_vs_emulation']:.1e} "
                  f"{'ok' if r['cublas_vs_emulation'] < 1e-2 else 'FAIL'} | "
                  f"{r['quant_ms']:.3f} / {r['transpose_ms']:.3f}")
    if quants:
        print("\nquant  kernel      M x K          ms: alone | then quantize_rows | fused (codes "
              "written) | saved | codes equal")
        for r in quants:
            print(f"       {r['kernel']:<11} {r['M']}x{r['K']:<10} {r['alone_ms']:8.3f} | "
                  f"{r['then_quant_ms']:8.3f} | {r['fused_ms']:8.3f} | {r['saved_ms']:7.3f} | "
                  f"{'yes' if r['codes_equal'] else 'NO'}"
                  + (f"  (no codes: {r['fused_no_codes_ms']:.3f})" if "fused_no_codes_ms" in r
                     else ""))
    for r in glus:
        print(f"\nglu+lora M {r['M']} I {r['I']} R {r['R']}: fwd unfused {r['fwd_unfused_ms']:.3f} "
              f"/ fused {r['fwd_fused_ms']:.3f} ms, bwd unfused {r['bwd_unfused_ms']:.3f} / fused "
              f"{r['bwd_fused_ms']:.3f} ms, saved {r['saved_ms']:.3f} ms a layer; rel err fwd "
              f"{r['fwd_rel_err']:.1e} bwd {r['bwd_rel_err']:.1e}")
    for r in adds:
        print(f"\nlora_add {r['name']} M {r['M']} N {r['N']} R {r['R']} resid {r['resid']}: "
              f"passes {r['passes_ms']:.3f} ms, kernel {r['kernel_ms']:.3f} ms; rel err "
              f"{r['passes_rel_err']:.1e} / {r['kernel_rel_err']:.1e}")
    if steps:
        print("\nstep  shape         precision  gemm      policy     fused-q  grad-q  trim  "
              "glu-lora  lora-add  tok/s     peak GiB   plan")
        for r in steps:
            head = (f"      {r['shape']:<13} {r['precision']:<10} {r['gemm']:<9} "
                    f"{r['policy']:<10} {r.get('fused_quant') or '-':<7}  "
                    f"{r.get('grad_quant') or '-':<6}  {r.get('trim', '-'):<4}  "
                    f"{r.get('glu_lora', '-'):<8}  {r.get('lora_add', '-'):<8} ")
            print(head + (f"error: {r['error'][:80]}" if "error" in r else
                          f"{r['tok_s']:>8.0f}  {_f(r['peak_gib'], '{:.2f}'):>9}   "
                          f"{r['plan'][:100]}"))
    for r in decodes:
        print(f"decode {r['shape']} batch 1 {r['precision']:<13} "
              + (f"{r['tok_s']:.1f} tok/s" if "tok_s" in r else f"error: {r['error'][:80]}")
              + f"  (packed groups {r['packed_groups']}, fp8 head {r['fp8_head']})")
    for r in losses:
        print(f"\nloss  {r['shape']} {r['steps']} steps lr {r['lr']:g}: fp8 vs bf16 mean "
              f"{r['fp8_mean_rel_gap']:.2e} (max {r['fp8_max_rel_gap']:.2e}); bf16 noise floor "
              f"mean {r['floor_mean_rel_gap']:.2e} (max {r['floor_max_rel_gap']:.2e}); within "
              f"3x floor: {'yes' if r['within_3x_floor'] else 'NO'}")


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["gemm", "step"],
                    choices=["gemm", "step", "loss", "decode", "quant", "glu", "add"])
    ap.add_argument("--fused-quant", nargs="+", default=["on"], choices=["on", "off"],
                    help="step: run each fp8 policy with LEANTUNE_FP8_FUSED_QUANT on / off")
    ap.add_argument("--glu-lora", nargs="+", default=["on"], choices=["on", "off"],
                    help="step: run each fp8 policy with LEANTUNE_FUSE_GLU_LORA on / off (gate/up's "
                         "LoRA terms in the GLU kernels); repeat values to interleave runs")
    ap.add_argument("--glu-tiles", nargs="*", default=[],
                    help="glu: also time the low-rank GLU kernels at these tiles, "
                         "BLOCK_MxBLOCK_Nxnum_warps (e.g. 32x128x4 64x256x8; a trailing t: "
                         "tl.dot in TF32 over fp32 casts instead of 16-bit operands)")
    ap.add_argument("--lora-add", nargs="+", default=["on"], choices=["on", "off"],
                    help="step: each policy with LEANTUNE_FUSE_LORA_ADD on / off (the LoRA "
                         "term and residual added in one kernel; bf16's o projection too)")
    ap.add_argument("--grad-quant", nargs="+", default=["on"], choices=["on", "off"],
                    help="step: run each fp8 policy with LEANTUNE_FUSE_GRAD_QUANT on / off (the "
                         "input gradients' codes written by the kernels that write them); "
                         "repeat values to interleave runs")
    ap.add_argument("--trim", nargs="+", default=["on"], choices=["on", "off"],
                    help="step: run each policy with LEANTUNE_TRIM_OFFLOAD on / off (offloaded "
                         "layers without q/k/v where the host link bounds the forward)")
    ap.add_argument("--new-tokens", type=int, default=256, help="decode: new tokens")
    ap.add_argument("--loss-shape", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--loss-steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--tiny", action="store_true",
                    help="CPU, tiny shapes: the kernel in the interpreter, the step emulated")
    ap.add_argument("--tokens", type=int, default=8192, help="GEMM rows M")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--bf16", nargs="*", default=["auto@17"], help="bf16 policies")
    ap.add_argument("--fp8", nargs="*", default=["auto@12", "auto@17"], help="fp8 policies")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if args.tiny:
        args.tokens, args.rows, args.seq, args.warmup, args.steps = 64, 2, 64, 1, 2
        args.loss_steps, args.new_tokens = min(args.loss_steps, 6), 8
        args.bf16 = [p.partition("@")[0] if p.startswith("auto") else p for p in args.bf16]
        args.fp8 = list(dict.fromkeys(p.partition("@")[0] if p.startswith("auto") else p
                                      for p in args.fp8))
    gemms = gemm_part(args, device) if "gemm" in args.parts else []
    sync(device)
    steps = step_part(args, device) if "step" in args.parts else []
    losses = loss_part(args, device) if "loss" in args.parts else []
    decodes = decode_part(args, device) if "decode" in args.parts else []
    quants = quant_part(args, device) if "quant" in args.parts else []
    glus = glu_part(args, device) if "glu" in args.parts else []
    adds = add_part(args, device) if "add" in args.parts else []
    print_table(gemms, steps, losses, decodes, quants, glus, adds)


if __name__ == "__main__":
    main()
