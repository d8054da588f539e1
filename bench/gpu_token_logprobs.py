"""GPU check of `kernels.token_logprobs`: the chunked Triton op against the plain full-logits
log_softmax reference, at Llama-3 sizes (8192 tokens x 4096 hidden x 128256 vocabulary, bf16,
frozen lm_head as under LoRA), with entropy, soft-capping and a temperature. Forward and backward
(random per-token upstream gradients for logp and entropy): max error, median time and the peak
memory above the inputs, printed as a short table, plus one JSON line (bench/harness.record).

    python bench/gpu_token_logprobs.py                 # the CUDA check
    python bench/gpu_token_logprobs.py --full-ft       # W trainable too (its gradient is formed)
    python bench/gpu_token_logprobs.py --dry-run       # tiny shapes on CPU (Triton interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        allow_abbrev=False, description="token_logprobs: Triton vs full-logits reference")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU through the Triton interpreter")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--softcap", type=float, default=30.0, help="0 for none")
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--full-ft", action="store_true", help="the lm_head weight requires grad")
    args = ap.parse_args(argv)
    if args.dry_run:  # odd sizes: a masked last vocabulary step, several chunks
        args.tokens, args.hidden, args.vocab = 37, 48, 515
    return args


ARGS = parse_args()
if ARGS.dry_run:  # triton.jit reads this when the kernel modules are imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import record  # noqa: E402

from leantune import kernels  # noqa: E402


def make_case(args, dev):
    """-> (hidden, weight, targets, dlogp, dent, trainable inputs); bf16 on CUDA, fp32 on CPU."""
    g = torch.Generator(device=dev).manual_seed(0)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    N, H, V = args.tokens, args.hidden, args.vocab
    hidden = torch.randn(N, H, device=dev, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dtype)
    weight.requires_grad_(args.full_ft)
    targets = torch.randint(0, V, (N,), device=dev, generator=g)
    targets[::7] = -100  # prompt tokens
    dlogp = torch.randn(N, device=dev, generator=g)
    dent = torch.randn(N, device=dev, generator=g) * 0.01
    inputs = [hidden, weight] if args.full_ft else [hidden]
    return hidden, weight, targets, dlogp, dent, inputs


def fwd_bwd_fn(case, args):
    hidden, weight, targets, dlogp, dent, inputs = case

    def fwd():
        return kernels.token_logprobs(hidden, weight, targets, args.softcap or None,
                                      args.temperature, return_entropy=True)

    def fwd_bwd():
        logp, ent = fwd()
        grads = torch.autograd.grad((logp * dlogp).sum() + (ent * dent).sum(), inputs)
        return (logp, ent), grads
    return fwd, fwd_bwd


def timed_ms(fn, dev) -> float:
    """Median milliseconds: triton.testing.do_bench on CUDA, one wall-clock run elsewhere."""
    if dev.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=5, rep=30, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run_backend(name, case, args, dev, chunk_bytes=None):
    """-> (outputs, grads, fwd_ms, fwd_bwd_ms, extra peak GiB) for one backend."""
    fwd, fwd_bwd = fwd_bwd_fn(case, args)
    with kernels.backend(name):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        outs, grads = fwd_bwd()
        peak = float("nan")
        if dev.type == "cuda":
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        outs = [o.detach().float() for o in outs]
        grads = [gr.float() for gr in grads]
        fwd_ms = timed_ms(lambda: fwd(), dev)
        tot_ms = timed_ms(fwd_bwd, dev)
    return outs, grads, fwd_ms, tot_ms, peak


def max_errors(a_list, b_list):
    """(max abs error, norm-relative error) over pairs of tensors."""
    abs_err = max((a - b).abs().max().item() for a, b in zip(a_list, b_list))
    rel_err = max(((a - b).norm() / b.norm().clamp_min(1e-12)).item()
                  for a, b in zip(a_list, b_list))
    return abs_err, rel_err


def main():
    args = ARGS
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if dev.type != "cuda" and not args.dry_run:
        sys.exit("gpu_token_logprobs.py: no CUDA device; run with --dry-run for the CPU check")
    case = make_case(args, dev)
    if args.dry_run:  # several chunks of logits even at tiny sizes
        from leantune.kernels import cross_entropy
        cross_entropy.CHUNK_BYTES["default"] = 8 * args.vocab * case[0].element_size()
    out_t, g_t, fwd_t, tot_t, peak_t = run_backend("triton", case, args, dev)
    out_r, g_r, fwd_r, tot_r, peak_r = run_backend("reference", case, args, dev)
    out_abs, out_rel = max_errors(out_t, out_r)
    grad_abs, grad_rel = max_errors(g_t, g_r)

    shape = f"{args.tokens} x {args.hidden} x {args.vocab} {str(case[0].dtype)[6:]}"
    print(f"token_logprobs  {shape}  softcap={args.softcap or None} T={args.temperature} "
          f"W {'trainable' if args.full_ft else 'frozen'}  ({dev.type})")
    print(f"{'path':<28}{'fwd ms':>10}{'fwd+bwd ms':>12}{'peak GiB':>10}")
    print(f"{'triton (chunked)':<28}{fwd_t:>10.2f}{tot_t:>12.2f}{peak_t:>10.2f}")
    print(f"{'reference (full log_softmax)':<28}{fwd_r:>10.2f}{tot_r:>12.2f}{peak_r:>10.2f}")
    print(f"max |err| logp/entropy {out_abs:.3e} (rel {out_rel:.2e}); "
          f"grads {grad_abs:.3e} (rel {grad_rel:.2e})")
    if not args.dry_run:
        record("token_logprobs", shape=shape, softcap=args.softcap, temperature=args.temperature,
               full_ft=args.full_ft, triton_fwd_ms=fwd_t, ref_fwd_ms=fwd_r,
               triton_fwd_bwd_ms=tot_t, ref_fwd_bwd_ms=tot_r, triton_peak_gib=peak_t,
               ref_peak_gib=peak_r, out_max_abs=out_abs, out_rel=out_rel,
               grad_max_abs=grad_abs, grad_rel=grad_rel)
    # The table is for reading; this is the check (loose: bf16 logits on both sides).
    ok = out_rel < 1e-3 and grad_rel < 3e-2
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
