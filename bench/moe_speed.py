"""Issue 13: mixture-of-experts speed. Two parts, each chosen with --parts.

`routing`: one MoE layer alone at Qwen3-30B-A3B's sizes (N = 4 x 2048 tokens, hidden 2048, 128
experts, top-8, expert width 768, bf16; weights normal(0, 0.02), x normal(0, 1)), frozen weights
as in LoRA training. Times the forward (under no_grad) and forward + backward (the gradient
w.r.t. x, and the LoRA parameters where there are any; a fixed random upstream gradient) of
  leantune     model/moe.py MoEBlock: router, one argsort grouping, grouped GEMM experts
               (`--grouped auto`: grouped_mm where it fits, i.e. CUDA bf16), un-permute;
  loop         the classic per-expert loop written here over the same tensors: a one-hot expert
               mask, for each expert with tokens `torch.where` its (slot, token) pairs, gather,
               the expert's MLP, `index_add_` weighted;
  transformers Qwen3MoeSparseMoeBlock over the same tensors, experts_implementation
               "grouped_mm" (transformers 5's default for a model from from_pretrained);
and, with LoRA r=16 alpha=16 on both stacked expert projections (fp32 masters, B random so it
counts), leantune and loop again. CUDA events, --routing-iters calls after --routing-warmup.
Reported: ms, gain = (t_loop / t_leantune - 1) * 100 %, transformers / leantune, and the max
abs differences of the outputs and of dx against leantune, `agree` when both are within 2% of
the largest magnitude (the same math in bf16, summed in another order).

`e2e`: the LoRA training step, leantune vs transformers + PEFT in the same run, per shape in
bench/shapes.py (random bf16 weights, normal(0, 0.02)), --rows x --seq tokens of random ids,
LoRA r=16 alpha=16 (fp32 masters), AdamW on the LoRA parameters, median of --steps steps after
--warmup, peak = torch.cuda.max_memory_allocated (weights included). Rows: LoRA on q,k,v,o;
with --experts-row also on q,k,v,o + the experts (leantune's `experts` target; PEFT's
`target_parameters` on the stacked expert parameters, the same init copied over). leantune runs
through Trainer.train_step under --policy (as bench/speed.py); transformers runs SDPA attention
(eager for gpt-oss, which has no SDPA path for its sinks), its default experts implementation,
non-reentrant gradient checkpointing, loss from model(input_ids, labels=...). `loss0`, the
first step's loss, is the same for both tools (the same weights; LoRA B starts at 0). Each
(shape, row, tool) that fails (e.g. out of memory) is one line in the table; the run goes on;
none starts after --stop-after seconds. One model at a time is on the GPU (the 30B shape's
weights are 61 GB; transformers shares leantune's tensors, bench/harness.py hf_peft_model).

    # H200, one call, all parts (rows go to $OUT/results.jsonl as they come; a table at the end)
    PYTHONPATH=src python bench/moe_speed.py --parts routing e2e --experts-row \\
        --shapes qwen3-30b-a3b gpt-oss-20b mixtral-8x7b-8l --stop-after 420
    # CPU dry run of everything (times are meaningless; the agreement checks are not);
    # --grouped on runs leantune's grouped GEMM path (grouped_mm on the CPU) as on the GPU
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/moe_speed.py --device cpu --parts routing e2e \\
        --routing-shape tiny --grouped on --shapes tiny-qwen3-moe tiny-gpt-oss tiny-mixtral \\
        --rows 2 --seq 64 --experts-row
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from harness import (hf_config, hf_peft_model, leantune_model, mean_ms, median,  # noqa: E402
                     record, trainable)
from qlora_speed import peak_gib, reset_peak, step_times  # noqa: E402
from speed import make_trainer, random_batch  # noqa: E402

from leantune.lora import LoRAConfig, apply_lora  # noqa: E402
from leantune.model.config import ModelConfig  # noqa: E402
from leantune.model.moe import MoEBlock, grouped_mm_fits  # noqa: E402

# one MoE layer's sizes: tokens, hidden, experts, top-k, expert width
ROUTING = {"qwen3-30b-a3b": (4 * 2048, 2048, 128, 8, 768),
           "tiny": (96, 64, 8, 2, 32)}
LORA_R = 16
AGREE = 0.02  # the largest difference from leantune's output (and dx) that counts as agreement,
# relative to its largest magnitude
ATTENTION = "q,k,v,o"


# --- part 1: one MoE layer ------------------------------------------------------------------
def routing_config(tokens: int, hidden: int, experts: int, top_k: int, width: int) -> dict:
    """A one-layer qwen3_moe config.json of these MoE sizes (attention fields are unused)."""
    return dict(model_type="qwen3_moe", vocab_size=1, hidden_size=hidden,
                intermediate_size=width, moe_intermediate_size=width, num_experts=experts,
                num_experts_per_tok=top_k, norm_topk_prob=True, num_hidden_layers=1,
                num_attention_heads=1, num_key_value_heads=1, head_dim=hidden)


def routing_block(cfg: dict, device, seed: int = 0) -> MoEBlock:
    """leantune's MoE layer of `cfg`, bf16, weights normal(0, 0.02), frozen."""
    block = MoEBlock(ModelConfig.from_dict(cfg)).to(device, torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02, generator=g).requires_grad_(False)
    return block


def add_expert_lora(block: MoEBlock, seed: int = 1) -> list[torch.Tensor]:
    """LoRA r=16 alpha=16 on both stacked projections (fp32, as the trainer keeps them), B
    random so that the adapter changes the output. Returns the LoRA parameters."""
    ex = block.experts
    ex.add_lora(LORA_R, LORA_R, dtype=torch.float32)
    g = torch.Generator(device=ex.gate_up_proj.device).manual_seed(seed)
    with torch.no_grad():
        for b in ex.lora_B.values():
            b.normal_(0.0, 0.02, generator=g)
    return [*ex.lora_A.values(), *ex.lora_B.values()]


def loop_moe(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """The per-expert loop over `block`'s tensors (Qwen3-MoE routing, SiLU GLU): x [N, H] ->
    [N, H]. One host sync for the list of experts with tokens, one `torch.where` per expert."""
    spec, ex = block.spec, block.experts
    logits = F.linear(x, block.gate.weight)
    weights, idx = torch.softmax(logits.float(), dim=-1).topk(spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    hit = F.one_hot(idx, spec.num_experts).permute(2, 1, 0)  # [E, k, N]: token n's slot j is e
    out = torch.zeros_like(x)
    for e in hit.flatten(1).any(1).nonzero().flatten().tolist():
        slot, token = torch.where(hit[e])
        gate, up = expert_projection(ex, "gate_up_proj", e, x[token]).chunk(2, dim=-1)
        y = expert_projection(ex, "down_proj", e, F.silu(gate) * up)
        out.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    return out


def expert_projection(ex, name: str, e: int, h: torch.Tensor) -> torch.Tensor:
    """Expert e's projection `name` ([out, in] stacked weights) of rows h, plus its LoRA."""
    y = F.linear(h, getattr(ex, name)[e])
    if name in ex.lora_A:
        a, b = ex.lora_A[name][e].to(h.dtype), ex.lora_B[name][e].to(h.dtype)
        y = y + F.linear(F.linear(h, a), b) * ex.scaling
    return y


def transformers_block(cfg: dict, block: MoEBlock):
    """transformers' Qwen3MoeSparseMoeBlock sharing `block`'s tensors (same parameter names),
    experts_implementation grouped_mm: (a function x [N, H] -> [N, H], its implementation)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hcfg = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    hcfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        hf = Qwen3MoeSparseMoeBlock(hcfg)
    hf.load_state_dict(block.state_dict(), assign=True, strict=True)
    hf.requires_grad_(False)
    return (lambda x: hf(x[None])[0]), hf.experts.config._experts_implementation


def time_ms(fn, device, iters: int, warmup: int) -> float:
    """Mean ms of fn(): CUDA events on the GPU, wall clock elsewhere."""
    if device.type == "cuda":
        return mean_ms(fn, iters, warmup)
    return 1e3 * median(step_times(fn, warmup, iters, device))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_routing(size: str, grouped: str, iters: int, warmup: int, device) -> list[dict]:
    """The routing part's rows (module docstring)."""
    tokens, hidden, experts, top_k, width = ROUTING[size]
    cfg = routing_config(tokens, hidden, experts, top_k, width)
    block = routing_block(cfg, device)
    block.grouped_mm = {"auto": None, "on": True, "off": False}[grouped]
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)
    uses_grouped = block.grouped_mm if block.grouped_mm is not None else grouped_mm_fits(
        x, block.experts.gate_up_proj.transpose(1, 2))
    impls = {"leantune": block, "loop": lambda x_: loop_moe(block, x_)}
    paths = {"leantune": "grouped_mm" if uses_grouped else "loop", "loop": "torch.where loop"}
    try:
        impls["transformers"], paths["transformers"] = transformers_block(cfg, block)
    except Exception as e:  # an older transformers: the comparison with it is left out
        print(f"transformers' Qwen3MoeSparseMoeBlock: {type(e).__name__}: {e}", flush=True)
    rows = []
    for lora in (False, True):
        params = add_expert_lora(block) if lora else []
        ref = None
        for impl, f in impls.items():
            if lora and impl == "transformers":
                continue
            xg = x.detach().requires_grad_(True)
            y = f(xg)
            grads = torch.autograd.grad(y, [xg, *params], dy)
            row = dict(size=size, impl=impl, lora=lora, tokens=tokens, experts=experts,
                       top_k=top_k, path=paths[impl])
            if ref is None:
                ref = (y.detach(), grads)
            else:
                row.update(out_diff=max_diff(y, ref[0]), dx_diff=max_diff(grads[0], ref[1][0]),
                           lora_grad_diff=max((max_diff(a, b) for a, b in
                                               zip(grads[1:], ref[1][1:])), default=None),
                           out_max=ref[0].abs().max().item(),
                           dx_max=ref[1][0].abs().max().item())
                # bf16 sums in another order: a few units in the last place of the largest
                row["agree"] = (row["out_diff"] <= AGREE * row["out_max"]
                                and row["dx_diff"] <= AGREE * row["dx_max"])
            del y, grads

            def forward(f=f):
                with torch.no_grad():
                    f(x)

            def forward_backward(f=f):
                xg = x.detach().requires_grad_(True)
                torch.autograd.grad(f(xg), [xg, *params], dy)

            row.update(fwd_ms=time_ms(forward, device, iters, warmup),
                       fwd_bwd_ms=time_ms(forward_backward, device, iters, warmup))
            record("moe_routing", **row)
            rows.append(row)
    return rows


# --- part 2: the training step --------------------------------------------------------------
def bench_leantune(shape, batch, targets, policy, warmup, steps, device):
    """(median step seconds, peak GiB, plan, first step's loss) of leantune's
    Trainer.train_step."""
    trainer = make_trainer(shape, batch, policy, steps, device, lora_targets=targets)
    on_device = batch.to(device)
    losses = []

    def step():
        losses.append(trainer.train_step([on_device])[0])  # (the mean loss, as it returns it)

    reset_peak(device)
    try:
        times = step_times(step, warmup, steps, device)
    except BaseException:
        free_tensors(trainer.model)
        raise
    return median(times), peak_gib(device), trainer.activation_policy, losses[0].item()


def free_tensors(model) -> None:
    """Empty every parameter and buffer of `model` in place (on a failed run: an exception
    raised in backward on CUDA can keep the run's frames, and so the model, referenced)."""
    for t in [*model.parameters(), *model.buffers()]:
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    for m in model.modules():
        if getattr(m, "executor", None) is not None:
            m.executor = None


def bench_transformers(shape, batch, targets, warmup, steps, device):
    """(median step seconds, peak GiB, "attention / experts implementation", first step's
    loss) of transformers + PEFT over the same random weights and LoRA init."""
    base = leantune_model(shape, device)
    apply_lora(base, LoRAConfig(r=LORA_R, alpha=LORA_R, targets=targets), seed=42,
               dtype=torch.float32)
    pm = hf_peft_model(shape, base, device, gradient_checkpointing=True)
    del base  # (pm holds the base weights)
    pm.train()
    params = trainable(pm)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    ids = batch.input_ids.to(device)
    losses = []

    def step():
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak(device)
    try:
        times = step_times(step, warmup, steps, device)
    except BaseException:
        free_tensors(pm)
        raise
    c = pm.config
    return (median(times), peak_gib(device),
            f"{c._attn_implementation} / {getattr(c, '_experts_implementation', '?')}",
            losses[0].item())


def bench_e2e(shape, args, device, deadline: float) -> list[dict]:
    """The e2e rows of one shape: per LoRA row, transformers + PEFT then leantune; a run that
    would start after `deadline` (time.perf_counter()) is skipped."""
    cfg = ModelConfig.from_dict(hf_config(shape).to_dict())
    batch = random_batch(cfg.vocab_size, args.rows, args.seq)
    tokens = args.rows * args.seq
    lora_rows = ([] if args.experts_only else [ATTENTION]) + (
        [ATTENTION + ",experts"] if args.experts_row or args.experts_only else [])
    rows = []
    for targets in lora_rows:
        tok_s = {}
        # one leantune run per policy ("auto+nofused": the MoE layers under autograd instead of
        # the fused layer, the switch's benchmark)
        tools = ([] if args.no_baseline else ["transformers+peft"]) + [
            ("leantune", p) for p in args.policy]
        for tool in tools:
            tool, policy = tool if isinstance(tool, tuple) else (tool, None)
            if policy is not None and len(args.policy) > 1:
                tool = f"leantune {policy}"
            row = dict(shape=shape, lora=targets, tool=tool)
            if time.perf_counter() > deadline:
                row["skipped"] = "skipped: --stop-after reached"
                record("moe_e2e", **row)
                rows.append(row)
                continue
            try:
                if policy is not None:
                    t, peak, how, loss = bench_leantune(shape, batch, targets, policy,
                                                        args.warmup, args.steps, device)
                else:
                    t, peak, how, loss = bench_transformers(shape, batch, targets, args.warmup,
                                                      args.steps, device)
                tok_s[tool] = tokens / t
                row.update(tok_s=tok_s[tool], step_s=t, peak_gib=peak, loss0=loss, how=how)
            except Exception as e:  # out of memory, a missing feature: one line, and go on
                first = (str(e).strip().splitlines() or [""])[0]
                row.update(error=f"{type(e).__name__}: {first[:160]}")
            reset_peak(device)  # (after the except block: the traceback is gone, memory freed)
            if policy is not None and tool in tok_s and "transformers+peft" in tok_s:
                row["ratio"] = tok_s[tool] / tok_s["transformers+peft"]
            record("moe_e2e", **row)
            rows.append(row)
    return rows


# --- the table ------------------------------------------------------------------------------
def fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def print_routing(rows: list[dict]) -> None:
    print("\nMoE layer (ms; gain = leantune's speed-up over the loop; diffs vs leantune)")
    print(f"{'impl':<13}{'lora':<6}{'fwd':>9}{'fwd+bwd':>10}{'out diff':>10}{'dx diff':>10}"
          f"{'agree':>7}  path")
    by = {(r["impl"], r["lora"]): r for r in rows}
    for r in rows:
        print(f"{r['impl']:<13}{str(r['lora']):<6}{r['fwd_ms']:>9.3f}{r['fwd_bwd_ms']:>10.3f}"
              f"{fmt(r.get('out_diff'), '.2e'):>10}{fmt(r.get('dx_diff'), '.2e'):>10}"
              f"{str(r.get('agree', '-')):>7}  {r['path']}")
    for lora in (False, True):
        ours, loop, hf = (by.get((i, lora)) for i in ("leantune", "loop", "transformers"))
        if ours and loop:
            print(f"LoRA {lora}: gain over the loop: fwd {gain(loop, ours, 'fwd_ms'):+.0f}%, "
                  f"fwd+bwd {gain(loop, ours, 'fwd_bwd_ms'):+.0f}% (max |y| {loop['out_max']:.3g},"
                  f" max |dx| {loop['dx_max']:.3g})")
        if ours and hf:
            print(f"LoRA {lora}: transformers / leantune: fwd {hf['fwd_ms'] / ours['fwd_ms']:.2f}x,"
                  f" fwd+bwd {hf['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.2f}x")


def gain(slow: dict, fast: dict, key: str) -> float:
    """Time saved as a speed-up, in percent: (t_slow / t_fast - 1) * 100."""
    return (slow[key] / fast[key] - 1) * 100


def print_e2e(rows: list[dict]) -> None:
    print("\nLoRA training step (tok/s; ratio = leantune / transformers+peft; loss0: the first "
          "step's loss, the same weights: the same loss)")
    print(f"{'shape':<17}{'lora':<18}{'tool':<19}{'tok/s':>9}{'peak GiB':>10}{'ratio':>7}"
          f"{'loss0':>9}  how")
    for r in rows:
        if "error" in r or "skipped" in r:
            note = f"FAILED {r['error']}" if "error" in r else r["skipped"]
            print(f"{r['shape']:<17}{r['lora']:<18}{r['tool']:<19}  {note}")
            continue
        print(f"{r['shape']:<17}{r['lora']:<18}{r['tool']:<19}{r['tok_s']:>9.0f}"
              f"{fmt(r['peak_gib'], '.2f'):>10}{fmt(r.get('ratio'), '.2f'):>7}"
              f"{r['loss0']:>9.4f}  {r['how']}")


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--parts", nargs="+", choices=["routing", "e2e"], default=["routing", "e2e"])
    ap.add_argument("--routing-shape", choices=list(ROUTING), default="qwen3-30b-a3b")
    ap.add_argument("--routing-iters", type=int, default=10)
    ap.add_argument("--routing-warmup", type=int, default=3)
    ap.add_argument("--grouped", choices=["auto", "on", "off"], default="auto",
                    help="leantune's expert matmuls: grouped_mm where it fits / always / never")
    ap.add_argument("--shapes", nargs="+",
                    default=["qwen3-30b-a3b", "gpt-oss-20b", "mixtral-8x7b-8l"])
    ap.add_argument("--experts-row", action="store_true",
                    help="also time LoRA on attention + the experts")
    ap.add_argument("--no-baseline", action="store_true", help="leantune's runs only")
    ap.add_argument("--experts-only", action="store_true",
                    help="only the row with LoRA on the experts too")
    ap.add_argument("--policy", nargs="+", default=["auto"],
                    help="leantune activations (as bench/speed.py), one run each; "
                         "+nofused: the layers under autograd")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stop-after", type=float, default=float("inf"),
                    help="seconds from the start after which no further e2e run starts (those "
                         "left are listed as skipped), so that the table prints within a limit")
    args = ap.parse_args()
    device = torch.device(args.device)
    t0 = time.perf_counter()
    routing, e2e = [], []
    if "routing" in args.parts:
        routing = bench_routing(args.routing_shape, args.grouped, args.routing_iters,
                                args.routing_warmup, device)
        reset_peak(device)
    if "e2e" in args.parts:
        for shape in args.shapes:
            e2e += bench_e2e(shape, args, device, t0 + args.stop_after)
    if routing:
        print_routing(routing)
    if e2e:
        print_e2e(e2e)
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
