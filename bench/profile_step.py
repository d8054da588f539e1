"""Where the time of one training step goes: kernel time by category (GEMM, attention, our Triton
kernels, other), GPU busy fraction, plus the ceilings that bound it: the bf16 GEMM rate on the
step's own shapes, and pinned host<->device copy bandwidth (for offloaded checkpointing).

    python bench/profile_step.py --shape llama-3.1-8b --policies recompute
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import hf_config, mean_ms, record  # noqa: E402
from speed import make_trainer, random_batch  # noqa: E402

from leantune.model.config import ModelConfig  # noqa: E402


WITH_STACK = False  # --stack: Python frames in the trace (the host causes name Python lines)


def category(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "nvjet", "sm90_xmma", "cublas", "splitk")):
        return "gemm"
    if any(s in n for s in ("_rms_norm", "_rope", "_glu", "_ce_", "cross_entropy", "_lce",
                            "_gather_rows")):
        return "triton"
    if "adam" in n or "foreach" in n or "multi_tensor" in n:
        return "optimizer"
    if "memcpy" in n or "memset" in n:
        return "copy"
    return "other"


def profile(shape, policy, tokens_rows, seq, device):
    mcfg = ModelConfig.from_dict(hf_config(shape).to_dict())
    batch = random_batch(mcfg.vocab_size, tokens_rows, seq)
    trainer = make_trainer(shape, batch, policy, 10, device)
    b = batch.to(device)
    for _ in range(3):
        trainer.train_step([b])
    torch.cuda.synchronize()
    # peak memory of the forward (+ loss) alone, and of the whole step
    torch.cuda.reset_peak_memory_stats()
    loss = trainer.model(batch=b, loss_only=True).loss_sum
    torch.cuda.synchronize()
    peak_fwd = torch.cuda.max_memory_allocated() / 2**30
    loss.backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    record("memory", shape=shape, policy=policy, peak_fwd_gib=round(peak_fwd, 3),
           peak_step_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3))
    kernel_profile(lambda: trainer.train_step([b]), shape, policy)
    trainer.engine.unstream(trainer.model)  # (streamed weights: the stream and the model refer
    del trainer                             # to each other until unstreamed)
    gc.collect()
    torch.cuda.empty_cache()


def kernel_profile(fn, shape, policy, steps: int = 2, top: int = 25):
    """Profile `steps` calls of `fn` (warmed up by the caller): kernel time by category and by
    kernel (the `top` largest), the compute stream's idle gaps and their causes, the matmuls by
    shape; one JSON line each (`shape`, `policy`: their labels)."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    with tprofile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU],
                  record_shapes=True, with_stack=WITH_STACK) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    by_cat, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    t_min, t_max = float("inf"), 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            dt = ev.time_range.elapsed_us() / 1e3 / steps
            by_cat[category(ev.name)] += dt
            by_name[ev.name[:90]] += dt
            count[ev.name[:90]] += 1
            t_min = min(t_min, ev.time_range.start)
            t_max = max(t_max, ev.time_range.end)
    wall = (t_max - t_min) / 1e3 / steps
    busy = sum(by_cat.values())
    record("profile", shape=shape, policy=policy, step_ms=round(wall, 2),
           kernel_ms=round(busy, 2), **{k: round(v, 2) for k, v in sorted(by_cat.items())},
           launches=sum(count.values()) // steps)
    for name, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {ms:8.2f} ms  x{count[name] // steps:4d}  {name}", flush=True)
    idle_gaps(prof, steps, shape, policy)
    gemm_table(prof, steps, shape, policy)


def idle_gaps(prof, steps, shape, policy, top=12):
    """Where the compute stream sits idle: gaps between consecutive kernels on the busiest
    stream (from the profiler's trace), summed by the kernel before and after each gap, and
    where in the step they fall (per tenth of the step)."""
    import json
    import os

    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    trace = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    events = [e for e in trace if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy = defaultdict(float)
    for e in events:
        busy[e["tid"]] += e["dur"]
    main = max(busy, key=busy.get)
    ks = sorted((e for e in events if e["tid"] == main), key=lambda e: e["ts"])
    t0, t1 = ks[0]["ts"], ks[-1]["ts"] + ks[-1]["dur"]
    by_pair, by_tenth = defaultdict(float), defaultdict(float)
    total = 0.0
    end = ks[0]["ts"] + ks[0]["dur"]
    prev = ks[0]
    for e in ks[1:]:
        gap = e["ts"] - end
        if gap > 5:  # us
            total += gap
            by_pair[(prev["name"][:45], e["name"][:45])] += gap
            by_tenth[int(10 * ((end - t0) % ((t1 - t0) / steps)) / ((t1 - t0) / steps))] += gap
        if e["ts"] + e["dur"] > end:
            end, prev = e["ts"] + e["dur"], e
    record("idle", shape=shape, policy=policy, idle_ms_per_step=round(total / 1e3 / steps, 2),
           by_tenth_ms={k: round(v / 1e3 / steps, 2) for k, v in sorted(by_tenth.items())})
    for (a, b), us in sorted(by_pair.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   idle {us / 1e3 / steps:7.2f} ms  after {a}  before {b}", flush=True)
    host_causes(trace, ks, steps, shape, policy, top)


def host_causes(trace, ks, steps, shape, policy, top=12, sample_us=10.0):
    """Why the compute stream idles: for each gap before a kernel, whether that kernel was
    launched late by the host (then: what the launching thread was doing while the stream sat
    idle, its innermost CPU op or CUDA runtime call, sampled every `sample_us`) or launched in
    time and held on the device (waiting on another stream's event, e.g. an offload copy)."""
    import bisect

    launches = {e["args"].get("correlation"): e for e in trace
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    host = defaultdict(list)  # tid -> its CPU ops and runtime calls
    for e in trace:
        if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation",
                            "python_function"):
            host[e["tid"]].append(e)
    starts = {}
    for tid, evs in host.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        starts[tid] = [e["ts"] for e in evs]

    def innermost(tid, t):
        evs, st = host[tid], starts[tid]
        i = bisect.bisect_right(st, t) - 1
        best = None
        # the latest-starting event that still covers t is the innermost (events nest)
        for j in range(i, max(-1, i - 400), -1):
            e = evs[j]
            if e["ts"] + e["dur"] >= t:
                best = e
                break
        return best["name"][:60] if best else "(no host event)"

    late, held = defaultdict(float), 0.0
    end = ks[0]["ts"] + ks[0]["dur"]
    for e in ks[1:]:
        gap = e["ts"] - end
        if gap > 5:
            lz = launches.get(e.get("args", {}).get("correlation"))
            if lz is None:
                late["(launch not traced)"] += gap
            else:
                issued = lz["ts"] + lz["dur"]
                if issued <= end:  # enqueued before the stream went idle: held on the device
                    held += gap
                else:
                    t = end
                    stop = min(issued, e["ts"])
                    while t < stop:
                        late[innermost(lz["tid"], t)] += min(sample_us, stop - t)
                        t += sample_us
                    held += max(0.0, e["ts"] - issued)
        end = max(end, e["ts"] + e["dur"])
    late_ms = sum(late.values()) / 1e3 / steps
    record("idle_causes", shape=shape, policy=policy, host_late_ms=round(late_ms, 2),
           device_held_ms=round(held / 1e3 / steps, 2),
           top={k: round(v / 1e3 / steps, 2) for k, v in
                sorted(late.items(), key=lambda kv: -kv[1])[:top]})
    print(f"   idle: host late {late_ms:.2f} ms/step, held on the device "
          f"{held / 1e3 / steps:.2f} ms/step; the host meanwhile:", flush=True)
    for name, us in sorted(late.items(), key=lambda kv: -kv[1])[:top]:
        print(f"   {us / 1e3 / steps:7.2f} ms  {name}", flush=True)


def gemm_table(prof, steps, shape, policy, top=16):
    """Matmuls of the step by shape: calls and GPU ms per step and TFLOP/s, from the profiler's
    ops grouped by input shape. Shows which products run below the GEMM ceiling."""
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key not in ("aten::mm", "aten::addmm", "aten::bmm"):
            continue
        shapes = [s for s in ev.input_shapes if s]
        a, b = shapes[1:3] if ev.key == "aten::addmm" else shapes[:2]
        if len(a) != 2 or len(b) != 2:
            continue
        (m, k), (_, n) = a, b
        ms = getattr(ev, "device_time_total", None) or ev.cuda_time_total
        ms = ms / 1e3 / steps
        rows.append((ms, ev.key, m, k, n, ev.count // steps))
    rows.sort(reverse=True)
    out = {}
    for ms, key, m, k, n, calls in rows[:top]:
        rate = 2 * m * k * n * calls / (ms / 1e3) / 1e12 if ms else 0.0
        print(f"   {ms:8.2f} ms  x{calls:4d}  {key:10s} [{m} x {k}] @ [{k} x {n}]  "
              f"{rate:6.1f} TFLOP/s", flush=True)
        out[f"{key} {m}x{k}x{n}"] = [calls, round(ms, 2), round(rate, 1)]
    record("gemm_shapes", shape=shape, policy=policy,
           total_ms=round(sum(r[0] for r in rows), 2), top=out)


def gemm_rates(shape, tokens, device):
    """TFLOP/s of x @ W^T for the layer's projection shapes (bf16, cuBLAS)."""
    c = ModelConfig.from_dict(hf_config(shape).to_dict())
    h, i, kv = c.hidden_size, c.intermediate_size, c.kv_size
    shapes = {"q/o": (h, h), "k/v": (kv, h), "qkv": (h + 2 * kv, h), "gate/up": (i, h),
              "gate+up": (2 * i, h), "down": (h, i), "lm_head": (c.vocab_size, h)}
    x = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
    xi = torch.randn(tokens, i, device=device, dtype=torch.bfloat16)
    out = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        inp = xi if k == i else x
        for _ in range(3):
            inp @ w.t()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            inp @ w.t()
        e.record()
        torch.cuda.synchronize()
        ms = s.elapsed_time(e) / 20
        out[name] = round(2 * tokens * n * k / ms / 1e9, 1)
        # backward-to-input shape: g [tokens, n] @ W [n, k]
        g = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
        for _ in range(3):
            g @ w
        torch.cuda.synchronize()
        s.record()
        for _ in range(20):
            g @ w
        e.record()
        torch.cuda.synchronize()
        out[name + " dX"] = round(2 * tokens * n * k / (s.elapsed_time(e) / 20) / 1e9, 1)
        del w, g
    record("gemm_tflops", shape=shape, tokens=tokens, **out)


def copy_bandwidth(device, mib=64):
    n = mib * 2**20 // 2
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty(n, dtype=torch.bfloat16, device=device)
    res = {}
    for name, fn in (("d2h", lambda: host.copy_(dev, non_blocking=True)),
                     ("h2d", lambda: dev.copy_(host, non_blocking=True))):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20):
            fn()
        e.record()
        torch.cuda.synchronize()
        res[name + "_gb_s"] = round(20 * n * 2 / (s.elapsed_time(e) / 1e3) / 1e9, 1)
    # both directions at once, on two side streams (an offloading forward with streamed weights:
    # activations go down the link while weights come up it)
    host2 = torch.empty_like(host).pin_memory()
    dev2 = torch.empty_like(dev)
    down, up = torch.cuda.Stream(device), torch.cuda.Stream(device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(down):
        for _ in range(20):
            host.copy_(dev, non_blocking=True)
    with torch.cuda.stream(up):
        for _ in range(20):
            dev2.copy_(host2, non_blocking=True)
    torch.cuda.synchronize()
    both = time.perf_counter() - t0
    res["both_each_gb_s"] = round(20 * n * 2 / both / 1e9, 1)
    record("copy_bandwidth", mib=mib, **res)


def attention_backends(device, B=4, T=2048, Hq=32, Hk=8, D=128):
    """fwd and fwd+bwd ms of causal attention at the 8B shape: the flash op we call, and SDPA's
    flash / cuDNN / efficient backends (k/v expanded to Hq heads where GQA is not native)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from leantune.engine import AttentionBackend, EngineOptions
    from leantune.model.attention import AttentionMeta

    q = torch.randn(B, T, Hq, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, T, Hk, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    meta = AttentionMeta.build((B, T), device, None, None, T, {None})
    res = {}

    def timed(fn, n=10):
        return round(mean_ms(fn, n), 3)

    for name, which in (("flash_op", "flash"), ("cudnn_op", "auto")):
        backend = AttentionBackend(EngineOptions(attention=which))
        out, state = backend.forward(q, k, v, meta, None, D ** -0.5)
        dout = torch.randn_like(out)
        res[f"{name} fwd"] = timed(lambda: backend.forward(q, k, v, meta, None, D ** -0.5))
        res[f"{name} bwd"] = timed(lambda: backend.backward(dout, q, k, v, out, state, meta,
                                                            None, D ** -0.5))
    qt = q.transpose(1, 2)
    kt = k.repeat_interleave(Hq // Hk, 2).transpose(1, 2)
    vt = v.repeat_interleave(Hq // Hk, 2).transpose(1, 2)
    for name, be in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                     ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(be):
                qq, kk, vv = (t.detach().requires_grad_() for t in (qt, kt, vt))
                res[name + " fwd"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                    qq, kk, vv, is_causal=True))
                o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
                g = torch.randn_like(o)
                res[name + " fwd+bwd"] = timed(lambda: torch.autograd.grad(
                    torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True),
                    (qq, kk, vv), g))
        except Exception as ex:  # backend not available for these inputs
            res[name] = f"{type(ex).__name__}: {str(ex)[:80]}"
    record("attention_backends", B=B, T=T, Hq=Hq, Hk=Hk, D=D, **res)


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--shape", nargs="+", default=["llama-3.1-8b"])
    ap.add_argument("--policies", nargs="+", default=["recompute"],
                    help="as bench/speed.py's (auto@GiB, offload:N, +keepall:M, ...)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--attention", action="store_true", help="time attention backends too")
    ap.add_argument("--stack", action="store_true",
                    help="record Python stacks (host causes name the Python function)")
    args = ap.parse_args()
    global WITH_STACK
    WITH_STACK = args.stack
    device = torch.device("cuda")
    if args.attention:
        attention_backends(device)
    if not args.no_ceilings:
        copy_bandwidth(device)
        for shape in args.shape:
            gemm_rates(shape, args.rows * args.seq, device)
    for shape in args.shape:
        for policy in args.policies:
            profile(shape, policy, args.rows, args.seq, device)


if __name__ == "__main__":
    main()
