"""Issue 20 §7: the DPO training step, leantune vs TRL DPOTrainer + PEFT in the same process.

Workload: the Llama-3.1-8B shape (random bf16 weights, normal(0, 0.02)), per step 4 pairs of a
512-token prompt with 512-token chosen and rejected completions (random ids), LoRA r=16 alpha=16
on q,k,v,o,gate,up,down (fp32 masters), AdamW on the LoRA parameters, the DPO sigmoid loss with
the reference (the base, adapter off) computed in every step. Tokens/s counts both sequences of
a pair: 2 x 4 x 1024 = 8192 tokens a step. Median of --steps steps after --warmup; peak =
torch.cuda.max_memory_allocated (weights included), reset before each tool.

    leantune            Trainer set-up as bench/speed.py (engine plan for --policy, input
                        embedding in host memory, packed weights); the step is
                        train/objectives/preference.py's DPOObjective.loss (a no-grad
                        adapter-off reference pass, then the policy's token_logps forward)
                        on the pairs packed as 8 documents, backward, clip, AdamW.
    leantune+precompute the same with --precompute-reference: prepare() computes the reference
                        log-probs once (its time is reported apart), the steps read them.
    ... 2-doc           --shared both|on|off (default both): leantune's pairs packed as one
                        shared document [prompt | chosen | rejected] each, the prompt run once
                        (the default layout: 4 rows of 1,536 tokens, 6,144 a pass), and/or as
                        two documents ("2-doc": 8,192 a pass); tokens/s counts 8,192 either
                        way; "pass" is the tokens a pass runs.
    trl                 (where `trl` imports) TRL's own DPOTrainer._compute_loss on its collator's
                        batch, over transformers + PEFT with non-reentrant gradient
                        checkpointing and TRL's fused log-prob head (add_fused_lm_head, as
                        DPOTrainer sets it up); the reference is the PEFT model with its adapter
                        disabled, each step; backward, clip, AdamW.

    # H200
    PYTHONPATH=src python bench/gpu_preference.py --precompute-reference --shared both
    # CPU, seconds (times meaningless): the whole path at a tiny shape
    PYTHONPATH=src python bench/gpu_preference.py --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (hf_peft_model, leantune_model, median, peak_gib, record,  # noqa: E402
                     reset_peak, step_times, sync, trainable)
from speed import make_trainer, random_batch  # noqa: E402

from leantune.data.preference import PreferencePair  # noqa: E402
from leantune.lora import LoRAConfig, apply_lora  # noqa: E402
from leantune.train.objectives.preference import DPOObjective  # noqa: E402


def random_pairs(vocab: int, pairs: int, prompt: int, completion: int, seed: int = 0):
    """`pairs` PreferencePairs of random ids (ids 3.. so none is a special token)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    return [PreferencePair(ids(prompt), ids(completion), ids(completion)) for _ in range(pairs)]


class Pairs:
    """A stand-in PreferenceDataset over pre-tokenised pairs."""

    kind, pad_id, source = "pairs", 0, "<random pairs>"

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def objective_cfg(seq: int, pairs: int, output: str, precompute: bool):
    obj = SimpleNamespace(name="dpo", beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
                          simpo_gamma=None, desirable_weight=1.0, undesirable_weight=1.0,
                          precompute_reference=precompute, max_prompt_len=None)
    return SimpleNamespace(objective=obj, max_seq_len=seq, batch_size=pairs, seed=0,
                           output=output, model="random", data=None)


def bench_leantune(args, items, device, precompute: bool, shared: bool = True) -> dict:
    seq = args.prompt + args.completion
    vocab = leantune_model_vocab(args.shape)
    # the planner sees the packed step: 2 x pairs rows of prompt + completion tokens
    plan_batch = random_batch(vocab, 2 * args.pairs, seq)
    trainer = make_trainer(args.shape, plan_batch, args.policy, args.steps, device)
    model, params, opt = trainer.model, trainer.params, trainer.optimizer
    with tempfile.TemporaryDirectory() as out:
        obj = DPOObjective(objective_cfg(seq, args.pairs, out, precompute), log=lambda *a: None)
        # the training loader (shuffle=True: a training split, so the precomputed reference
        # is read; the batch below names its items explicitly, so the order does not matter)
        loader = obj.make_loader(Pairs(items), None, shuffle=True)
        obj.check_shared_prompt(model, [loader])  # (a model that can't: unshared, one line)
        loader.shared_prompt = loader.shared_prompt and shared
        prep_s = None
        if precompute:
            sync(device)
            t0 = time.perf_counter()
            obj.prepare(model, loader, SimpleNamespace(device=device, writer=True))
            sync(device)
            prep_s = time.perf_counter() - t0
        batch = loader.pack(list(range(len(items)))).to(device)
        n = obj.normaliser([batch])
        losses = []

        def step():
            out = obj.loss(model, batch)
            (out.loss_sum / n).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss_sum.detach() / n)

        reset_peak(device)
        times = step_times(step, args.warmup, args.steps, device)
        peak = peak_gib(device)
        if args.phases:  # where the step's time goes (median ms each)
            from leantune.train.objectives.preference import policy_logps, reference_logps

            def policy_only():
                policy_logps(model, batch)[0].sum().backward()
                opt.zero_grad(set_to_none=True)

            def sft_same_rows():
                model(batch=batch.batch, loss_only=True).loss_sum.backward()
                opt.zero_grad(set_to_none=True)

            print(f"phase  [{'precomputed reference' if precompute else 'reference each step'}]"
                  f" table {None if obj.reference_table is None else tuple(obj.reference_table.shape)}",
                  flush=True)
            for name, fn in (("objective.reference()", lambda: obj.reference(model, batch)),
                             ("reference pass (no grad)", lambda: reference_logps(model, batch)),
                             ("policy token_logps fwd+bwd", policy_only),
                             ("SFT loss fwd+bwd, same rows", sft_same_rows),
                             ("whole DPO step", step)):
                ms = 1e3 * median(step_times(fn, 1, args.steps, device))
                print(f"phase  {name:<30} {ms:8.1f} ms", flush=True)
            if args.profile:  # each phase's kernels, idle gaps and matmuls (profile_step's)
                from profile_step import kernel_profile

                def reference_pass():
                    with torch.no_grad():
                        reference_logps(model, batch)
                for name, fn in (("reference pass", reference_pass),
                                 ("policy fwd+bwd", policy_only)):
                    print(f"profile  {name}", flush=True)
                    kernel_profile(fn, args.shape, name, top=15)
            b = batch.batch
            print(f"phase  packed rows {tuple(b.input_ids.shape)}, documents "
                  f"{b.cu_seqlens.numel() - 1}, targets {int((b.labels != -100).sum())}",
                  flush=True)
    plan = getattr(trainer, "activation_policy", args.policy)
    del trainer, model, params, opt
    return {"step_s": median(times), "peak_gib": peak, "plan": str(plan),
            "loss0": float(losses[0]), "prepare_s": prep_s,
            "pass_tokens": batch.batch.input_ids.numel()}


def leantune_model_vocab(shape: str) -> int:
    from shapes import SHAPES

    return SHAPES[shape]["vocab_size"]


def bench_trl(args, items, device) -> dict:
    from trl.trainer.dpo_trainer import DataCollatorForPreference, DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = leantune_model(args.shape, device, dtype=dtype)
    apply_lora(base, LoRAConfig(r=16, alpha=16), dtype=torch.float32)
    pm = hf_peft_model(args.shape, base, device, gradient_checkpointing=True)
    del base
    add_fused_lm_head(pm.get_base_model(), outputs=("log_probs", "entropy", "mean_logits",
                                                    "is_top1"))  # as DPOTrainer.__init__
    pm.train()
    if device.type == "cuda":  # fp32 LoRA masters under a bf16 base, as transformers' Trainer
        autocast = lambda: torch.autocast("cuda", dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    accel = SimpleNamespace(device=device, gather=lambda x: x, gather_for_metrics=lambda x: x,
                            unwrap_model=lambda m: m, autocast=autocast)
    me = SimpleNamespace(accelerator=accel, aux_loss_enabled=False, precompute_ref_logps=False,
                         model=pm, ref_model=None, _metrics=defaultdict(lambda: defaultdict(list)),
                         _total_train_tokens=0, _tp_size=1, ld_alpha=None,
                         f_divergence_type="reverse_kl", loss_types=["sigmoid"],
                         loss_weights=[1.0], beta=0.1, label_smoothing=0.0, use_weighting=False,
                         args=SimpleNamespace(gradient_checkpointing_kwargs={"use_reentrant": False}))
    rows = [{"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected}
            for p in items]
    inputs = {k: v.to(device) for k, v in
              DataCollatorForPreference(pad_token_id=0).torch_call(rows).items()}
    params = trainable(pm)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    losses = []

    def step():
        with autocast():
            loss = DPOTrainer._compute_loss(me, pm, inputs, False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    reset_peak(device)
    times = step_times(step, args.warmup, args.steps, device)
    peak = peak_gib(device)
    del pm, params, opt, inputs
    return {"step_s": median(times), "peak_gib": peak, "plan": "gradient checkpointing",
            "loss0": float(losses[0]), "prepare_s": None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--policy", default="auto@17",
                    help="leantune's activation policy (bench/speed.py make_trainer): auto@GiB, "
                         "recompute, offload, keep")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--precompute-reference", action="store_true",
                    help="also time leantune with the reference log-probs precomputed")
    ap.add_argument("--shared", choices=["both", "on", "off"], default="both",
                    help="leantune's pairs as shared-prompt documents (on), two documents a "
                         "pair (off), or both, one after the other (default)")
    ap.add_argument("--no-baseline", action="store_true", help="skip TRL")
    ap.add_argument("--profile", action="store_true",
                    help="with --phases: profile the reference pass and the policy pass "
                         "(bench/profile_step.py's kernel, idle and matmul tables)")
    ap.add_argument("--phases", action="store_true",
                    help="also time the reference pass, the policy pass and an SFT step apart")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU dry run in seconds: the tiny shape, 2 pairs of 16 + 16 tokens")
    args = ap.parse_args(argv)
    if args.tiny:
        args.shape, args.pairs, args.prompt, args.completion = "tiny", 2, 16, 16
        args.device, args.policy, args.warmup, args.steps = "cpu", "keep", 0, 1
    device = torch.device(args.device)
    items = random_pairs(leantune_model_vocab(args.shape), args.pairs, args.prompt,
                         args.completion)
    tokens = 2 * args.pairs * (args.prompt + args.completion)
    layouts = {"both": [True, False], "on": [True], "off": [False]}[args.shared]
    runs = []
    for precompute in [False] + ([True] if args.precompute_reference else []):
        for shared in layouts:
            name = "leantune" + ("+precompute" if precompute else "") + ("" if shared else " 2-doc")
            runs.append((name, lambda p=precompute, s=shared: bench_leantune(args, items, device,
                                                                             p, s)))
    if not args.no_baseline:
        try:
            import trl  # noqa: F401
        except Exception as e:  # (absent, or too old / new for this transformers)
            print(f"trl does not import ({type(e).__name__}: {e}): no TRL baseline", flush=True)
        else:
            runs.append(("trl", lambda: bench_trl(args, items, device)))
    print(f"DPO step, {args.shape}, {args.pairs} pairs x ({args.prompt} prompt + "
          f"{args.completion} chosen/rejected) = {tokens} tokens/step, LoRA r16 on 7 "
          f"projections, reference each step", flush=True)
    results = {}
    for tool, fn in runs:
        try:
            r = fn()
        except torch.cuda.OutOfMemoryError as e:  # one line per failed tool; the run goes on
            r = {"error": f"out of memory: {str(e).splitlines()[0][:200]}"}
        reset_peak(device)
        r.update(tool=tool, shape=args.shape, tokens_per_step=tokens)
        if "step_s" in r:
            r["tokens_per_s"] = tokens / r["step_s"]
        results[tool] = r
        record("preference_dpo", **r)
    print(f"{'tool':<28}{'tokens/s':>10}{'pass':>7}{'peak GiB':>10}{'loss0':>10}  plan",
          flush=True)
    for tool, r in results.items():
        if "error" in r:
            print(f"{tool:<28}{r['error']}")
            continue
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        extra = f" (prepare {r['prepare_s']:.2f} s)" if r.get("prepare_s") is not None else ""
        print(f"{tool:<28}{r['tokens_per_s']:>10.0f}{r.get('pass_tokens', tokens):>7}{peak:>10}"
              f"{r['loss0']:>10.4f}  {r['plan']}{extra}", flush=True)
    rate = {t: r["tokens_per_s"] for t, r in results.items() if "tokens_per_s" in r}
    for a, b in (("leantune", "leantune 2-doc"), ("leantune", "trl")):
        if a in rate and b in rate:
            print(f"{a} / {b}: {rate[a] / rate[b]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
