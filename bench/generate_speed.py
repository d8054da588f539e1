"""Issue 11: generation speed, leantune against transformers' `generate` in the same run.

Workload: a random-init model of the named shape (bf16 on CUDA), random prompts of 128 tokens,
greedy, 256 new tokens, every step run (EOS disabled), batch 1 and batch 16. Timed, each on the
same prompts: leantune.generate with CUDA graphs and without (eager decode steps), and
transformers' generate over the same weights (its default cache, SDPA, do_sample=False,
min_new_tokens = max_new_tokens). Median wall time of --runs calls after one warm-up call (which
captures leantune's graph); tok/s counts the new tokens of all rows, prefill included.

Bound: a decode step reads every weight at least once (the input embedding only in its B rows),
so one row gets at most bandwidth / weight bytes tokens/s (B rows share the reads: B times
that). Bandwidth: a device-to-device copy measured here, and the H200's 4.8 TB/s.

    python bench/generate_speed.py                                  # H200: Llama-3.1-8B shape
    OUT=/tmp/x python bench/generate_speed.py --shape tiny --device cpu  # dry run (no graphs)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import hf_config, leantune_model, median, record  # noqa: E402

import leantune  # noqa: E402

H200_BANDWIDTH = 4.8e12  # bytes/s, the spec sheet's HBM3e figure


def hf_model(shape: str, base, device):
    """transformers' model of `shape` (SDPA) over `base`'s weights (shared, not copied)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(shape)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa",
                                              dtype=base.model.embed_tokens.weight.dtype)
    state = dict(base.state_dict())
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, assign=True, strict=False)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg).to(device)  # was on meta
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.generation_config.eos_token_id = None  # every step runs
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), best of 5."""
    nbytes = 1 << 30 if device.type == "cuda" else 64 << 20
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def step_bytes(model) -> int:
    """Weight bytes a decode step reads: every parameter, less an untied input embedding (a step
    reads only its B rows)."""
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        w = model.model.embed_tokens.weight
        n -= w.numel() * w.element_size()
    return n


def timed(fn, runs: int, device) -> tuple[float, object]:
    """(median seconds of `runs` calls after one warm-up call, the last result)."""
    out = fn()
    times = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return median(times), out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256, help="new tokens per row")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = leantune_model(args.shape, device, dtype).eval()
    hf = hf_model(args.shape, model, device)
    nbytes = step_bytes(model)
    bandwidth = copy_bandwidth(device)
    print(f"{args.shape}: {nbytes / 1e9:.2f} GB of weights read per step; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s measured", flush=True)
    g = torch.Generator().manual_seed(0)
    table = []
    for B in args.batch:
        prompts = torch.randint(0, model.config.vocab_size, (B, args.prompt_len), generator=g)
        rows = prompts.tolist()
        runs = {}

        def ours(graphs: bool):
            return lambda: leantune.generate(model, None, rows, max_new_tokens=args.new,
                                             eos_token_ids=[], batch_size=B, cuda_graphs=graphs)

        if device.type == "cuda":
            runs["leantune (CUDA graphs)"] = ours(True)
        runs["leantune (eager)"] = ours(False)
        ids = prompts.to(device)
        with torch.no_grad():
            runs["transformers generate"] = lambda: hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new,
                min_new_tokens=args.new, do_sample=False)
        tokens = {}
        result = {}
        for name, fn in runs.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds, out = timed(fn, args.runs, device)
            tokens[name] = (out[0].token_ids if isinstance(out, list)
                            else out[0, args.prompt_len:].tolist())
            result[name] = B * args.new / seconds
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0
            record("generate", shape=args.shape, device=str(device), batch=B, impl=name,
                   prompt_len=args.prompt_len, new_tokens=args.new, seconds=seconds,
                   tok_s=result[name], ms_per_step=1e3 * seconds / args.new, peak_gib=peak)
        hf_tok_s = result["transformers generate"]
        bound = B * bandwidth / nbytes
        for name in runs:
            same = common_prefix(tokens[name], tokens["transformers generate"])
            table.append((B, name, result[name], result[name] / hf_tok_s, result[name] / bound,
                          result[name] / (B * H200_BANDWIDTH / nbytes), same))
        record("generate_bound", shape=args.shape, batch=B, bytes_per_step=nbytes,
               copy_bandwidth=bandwidth, bound_tok_s=bound,
               bound_tok_s_4_8tbs=B * H200_BANDWIDTH / nbytes)
    print(f"\n{args.shape}, {args.prompt_len}-token prompts, {args.new} new tokens, greedy; "
          f"bound = B x bandwidth / {nbytes / 1e9:.2f} GB")
    print(f"{'batch':>5}  {'implementation':<24}{'tok/s':>10}{'x HF':>7}{'of bound':>10}"
          f"{'of 4.8TB/s':>12}{'= HF for':>10}")
    for B, name, tok_s, ratio, frac, frac_spec, same in table:
        print(f"{B:>5}  {name:<24}{tok_s:>10.1f}{ratio:>7.2f}{100 * frac:>9.0f}%"
              f"{100 * frac_spec:>11.0f}%{same:>6} tok")


if __name__ == "__main__":
    main()
