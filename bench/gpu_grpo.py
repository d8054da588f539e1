"""Issue 21 §5: the GRPO step (generation + training), leantune vs TRL's GRPOTrainer pieces in
the same process.

Workload: the Llama-3.2-1B shape (random bf16 weights, normal(0, 0.02)), per step 2 prompts x
8 completions, 256-token prompts (random ids) and 256 new tokens (EOS never stops a row, so
every completion runs to the limit), LoRA r=16 alpha=16 on q,k,v,o,gate,up,down (fp32 masters),
AdamW on the LoRA parameters, beta 0, loss dapo, one iteration. The reward is a fixed
pseudo-random function of the completion's ids (so groups have non-zero advantages). Step time
= generation + training, each timed apart (device synced); median of --steps after --warmup;
peak = torch.cuda.max_memory_allocated over the whole step (weights included).

    leantune  the Trainer set up as bench/speed.py (engine plan for --policy, packed weights);
              train/objectives/grpo.py's generate_window (leantune's decode: static KV cache,
              CUDA-graph decode step captured once, the adapter live) then the step runner's
              train_step over the rollouts (fused token_logprobs head, exact accumulation).
    trl       (where `trl` imports) what TRL's GRPOTrainer runs without vLLM: transformers'
              generate (sampling, 256 new tokens) on transformers + PEFT with the same weights,
              then GRPOTrainer._compute_loss on its batch (its fused log-prob head, non-reentrant
              gradient checkpointing), backward, clip, AdamW. (The Trainer loop around them is
              left out: a lower bound on TRL's step.)

    After the table: the drift of the prefill and of the kept CUDA-graph decode step from the
    forward after training, beside the forward-vs-forward noise floor of the dtype; the decode
    steps made / graphs captured during the timed steps (0 / 0 expected); leantune's generation
    seconds under each decode-projections mode (generate/projections.py) and without the shared
    prefill (--no-modes skips that).

    # H200
    PYTHONPATH=src python bench/gpu_grpo.py
    PYTHONPATH=src python bench/gpu_grpo.py --shape qwen3-0.6b
    PYTHONPATH=src python bench/gpu_grpo.py --shape llama-3.1-8b --prompts 4 --policy auto@20
    # CPU, seconds (times meaningless): the whole path at a tiny shape
    PYTHONPATH=src python bench/gpu_grpo.py --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (hf_peft_model, leantune_model, median, peak_gib, record,  # noqa: E402
                     reset_peak, sync, trainable)
from shapes import SHAPES  # noqa: E402
from speed import make_trainer, random_batch  # noqa: E402

from leantune.data.prompts_data import PromptBatch, PromptItem  # noqa: E402
from leantune.lora import LoRAConfig, apply_lora  # noqa: E402
from leantune.train.config import TrainConfig  # noqa: E402
from leantune.train.objectives.grpo import GRPOObjective  # noqa: E402
from leantune.train.rewards import RewardFunction  # noqa: E402


def hashed_reward(completion_ids, **kw) -> list[float]:
    """A fixed pseudo-random reward in [0, 1) of each completion's ids."""
    return [((sum(ids) * 2654435761) % 1000) / 1000 for ids in completion_ids]


class Prompts:
    """A stand-in PromptDataset over random-id prompts (no tokenizer: texts are "")."""

    fields: list = []
    source = "<random prompts>"

    def __init__(self, vocab: int, n: int, length: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = [PromptItem("", torch.randint(3, vocab, (length,), generator=g).tolist())
                      for _ in range(n)]
        self.longest = length

    def where(self, i):
        return f"prompt {i}"


def grpo_objective(args, out: str) -> GRPOObjective:
    cfg = TrainConfig(objective="grpo", reward=["builtin:length-penalty"],
                      num_generations=args.generations, max_completion_tokens=args.completion,
                      max_seq_len=args.prompt + args.completion, batch_size=args.prompts,
                      output=out, max_steps=100).validate()
    obj = GRPOObjective(cfg, log=lambda *a: None)
    obj.rewards = [RewardFunction("hashed", hashed_reward)]
    obj.eos_ids = []  # random weights: every completion runs to the token limit
    obj.dataset = Prompts(SHAPES[args.shape]["vocab_size"], args.prompts, args.prompt)
    return obj


def timed_steps(args, device, generate, train) -> tuple[list[float], list[float], list]:
    """Run warmup + steps steps of generate(i) -> rollouts, train(rollouts) -> loss; returns
    the timed steps' generation and training seconds (device synced) and their losses."""
    gen, trn, losses = [], [], []
    for i in range(args.warmup + args.steps):
        sync(device)
        t0 = time.perf_counter()
        rollouts = generate(i)
        sync(device)
        t1 = time.perf_counter()
        loss = train(rollouts)
        sync(device)
        if i >= args.warmup:
            gen.append(t1 - t0)
            trn.append(time.perf_counter() - t1)
            losses.append(float(loss.detach()))
    return gen, trn, losses


@torch.no_grad()
def drift(model, ids: list[int], device) -> dict:
    """After training, max |x - forward logits| / max |forward logits| of the last prompt token,
    for x = the prefill over a fresh KV cache ("decode_vs_forward"), the kept (CUDA-graph)
    decode step after a prefill of all but the last token ("step_vs_forward": the adapter as
    trained must reach the graph's buffers), and, as the noise floor of the dtype, the forward
    through the other attention kernels (mask path vs causal/varlen: "forward_vs_forward")."""
    from leantune.generate.decode import _step_for

    was = model.training
    model.eval()
    x = torch.tensor([ids], device=device)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    try:
        ref = model(x).logits[:, -1]
        step = _step_for(model, 1, len(ids), device, device.type == "cuda", None,
                         getattr(model, "_bench_projections", "packed"))
        step.proj.refresh()
        with step.proj.installed():
            cache = step.cache
            cache.pad.zero_()
            cache.start.fill_(0)
            positions, meta = cache.meta(len(ids))
            prefill = model.forward_cached(x, positions, meta)
            cache.start.fill_(0)
            positions, meta = cache.meta(len(ids) - 1)
            model.forward_cached(x[:, :-1], positions, meta)
            cache.start.fill_(len(ids) - 1)
            stepped = step(model, x[:, -1]).clone()
        path = model.attention_path
        model.attention_path = "mask"
        try:
            other = model(x).logits[:, -1]
        finally:
            model.attention_path = path
    finally:
        model.train(was)
    return {"decode_vs_forward": rel(prefill, ref), "step_vs_forward": rel(stepped, ref),
            "forward_vs_forward": rel(other, ref)}


def generation_by_mode(args, device, obj, model, prompts) -> dict:
    """Median generate_window seconds per decode-projections mode (after one untimed call that
    captures that mode's graph), the same rollouts: plain, precast, packed, and packed without
    the shared prefill of repeated prompts (packed-noshare)."""
    out = {}
    for mode in ("plain", "precast", "packed", "packed-noshare"):
        obj.decode_projections = mode.split("-")[0]
        obj.decode_share_prompts = not mode.endswith("noshare")
        times = []
        for i in range(1 + max(1, args.steps // 2)):
            sync(device)
            t0 = time.perf_counter()
            obj.generate_window(model, [prompts], 1000 + i)
            sync(device)
            times.append(time.perf_counter() - t0)
        out[mode] = median(times[1:])
    obj.decode_projections, obj.decode_share_prompts = args.projections, True
    return out


def bench_leantune(args, device) -> dict:
    rows, seq = args.prompts * args.generations, args.prompt + args.completion
    plan_batch = random_batch(SHAPES[args.shape]["vocab_size"], rows, seq)
    trainer = make_trainer(args.shape, plan_batch, args.policy, args.steps, device)
    with tempfile.TemporaryDirectory() as out:
        obj = grpo_objective(args, out)
        obj.decode_projections = args.projections
        trainer.objective = obj
        model = trainer.model
        prompts = PromptBatch(obj.dataset.items, list(range(args.prompts)))
        reset_peak(device)
        last = []  # the last window (its trained tokens)

        def train_step(window):
            last[:] = window
            return trainer.train_step(window)[0]

        from leantune.generate.decode import COUNTS

        def generate(i):
            if i == args.warmup:  # from the first timed step on, nothing is made again
                counts.update(COUNTS)
            return obj.generate_window(model, [prompts], i)

        counts = dict(COUNTS)
        gen, train, losses = timed_steps(args, device, generate, train_step)
        remade = {k: COUNTS[k] - counts[k] for k in COUNTS}
        peak, metrics = peak_gib(device), obj.rollout_metrics
        ntok = obj.tokens(last)
        lora_b = max(float(p.detach().abs().max()) for n, p in model.named_parameters() if "lora_B" in n)
        model._bench_projections = args.projections
        checks = drift(model, prompts.items[0].ids, device)
        modes = generation_by_mode(args, device, obj, model, prompts) if args.modes else {}
    plan = getattr(trainer, "activation_policy", args.policy)
    del trainer, model
    g, t = median(gen), median(train)
    return {"step_s": g + t, "generation_s": g, "training_s": t, "peak_gib": peak,
            "plan": str(plan), "loss0": losses[0], "completion_len": metrics["completion_len"],
            "gen_tokens_per_s": rows * args.completion / g, "train_tokens": ntok,
            "lora_b_max": lora_b, "projections": args.projections, **checks,
            "timed_steps_made": remade["steps"], "timed_captures": remade["captures"],
            **{f"gen_s_{m}": v for m, v in modes.items()}}


def bench_trl(args, device) -> dict:
    from trl.trainer.grpo_trainer import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    from leantune.train.losses.grpo import group_advantages

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = leantune_model(args.shape, device, dtype=dtype)
    apply_lora(base, LoRAConfig(r=16, alpha=16), dtype=torch.float32)
    pm = hf_peft_model(args.shape, base, device, gradient_checkpointing=True)
    del base
    add_fused_lm_head(pm.get_base_model(), outputs=("log_probs", "entropy"))
    autocast = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
                else contextlib.nullcontext)
    me = GRPOTrainer.__new__(GRPOTrainer)
    me.__dict__.update(
        loss_type="dapo", beta=0.0, epsilon_low=0.2, epsilon_high=0.2,
        importance_sampling_level="token", top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        aux_loss_enabled=False, _entropy_bonus_enabled=False,
        max_completion_length=args.completion, current_gradient_accumulation_steps=1,
        model=pm, args=SimpleNamespace(delta=None, use_bias_correction_kl=False,
                                       steps_per_generation=1),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x,
                                    reduce=lambda x, reduction="sum": x,
                                    gather_for_metrics=lambda x: x, autocast=autocast,
                                    is_main_process=True),
        _metrics={"train": __import__("collections").defaultdict(list)})
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = torch.stack([torch.tensor(it.ids) for it in Prompts(vocab, args.prompts,
                                                                   args.prompt).items])
    prompt_ids = prompts.repeat_interleave(args.generations, 0).to(device)
    params = trainable(pm)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")

    def generate(_):
        pm.eval()
        with torch.no_grad(), autocast():
            out = pm.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                              do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                              max_new_tokens=args.completion, min_new_tokens=args.completion,
                              pad_token_id=0)
        pm.train()
        return out[:, prompt_ids.shape[1]:]

    def train(comp):
        rewards = torch.tensor(hashed_reward([c.tolist() for c in comp]))
        adv = group_advantages(rewards, args.generations).advantages.to(device)
        mask = torch.ones_like(comp)
        inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids),
                  "completion_ids": comp, "completion_mask": mask, "advantages": adv,
                  "num_items_in_batch": mask.sum().float()}
        loss = GRPOTrainer._compute_loss(me, pm, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    reset_peak(device)
    gen, train, losses = timed_steps(args, device, generate, train)
    peak = peak_gib(device)
    del pm, params, opt
    g, t = median(gen), median(train)
    rows = args.prompts * args.generations
    return {"step_s": g + t, "generation_s": g, "training_s": t, "peak_gib": peak,
            "plan": "gradient checkpointing, transformers generate", "loss0": losses[0],
            "completion_len": float(args.completion),
            "gen_tokens_per_s": rows * args.completion / g}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    for flag, default, what in (("prompts", 2, "prompts per step"),
                                ("generations", 8, "completions per prompt"),
                                ("prompt", 256, "prompt tokens"), ("completion", 256, "new tokens"),
                                ("warmup", 2, "untimed steps"), ("steps", 5, "timed steps")):
        ap.add_argument(f"--{flag}", type=int, default=default, help=f"{what} ({default})")
    ap.add_argument("--policy", default="auto@4",
                    help="leantune's activation policy (bench/speed.py make_trainer): auto@GiB, "
                         "recompute, offload, keep")
    ap.add_argument("--no-baseline", action="store_true", help="skip TRL")
    ap.add_argument("--projections", default="packed", choices=("packed", "precast", "plain"),
                    help="how leantune's decode step runs the LoRA projections "
                         "(generate/projections.py; packed)")
    ap.add_argument("--no-modes", dest="modes", action="store_false",
                    help="skip timing the generation under each projections mode")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU dry run in seconds: the tiny shape, 2 prompts x 4 of 16 + 16 tokens")
    args = ap.parse_args(argv)
    if args.tiny:
        args.shape, args.prompt, args.completion, args.generations = "tiny", 16, 16, 4
        args.device, args.policy, args.warmup, args.steps = "cpu", "keep", 0, 2
    device = torch.device(args.device)
    runs = [("leantune", lambda: bench_leantune(args, device))]
    if not args.no_baseline:
        try:
            import trl  # noqa: F401
        except Exception as e:  # (absent, or too old / new for this transformers)
            print(f"trl does not import ({type(e).__name__}: {e}): no TRL baseline", flush=True)
        else:
            runs.append(("trl", lambda: bench_trl(args, device)))
    print(f"GRPO step, {args.shape}, {args.prompts} prompts x {args.generations} completions, "
          f"{args.prompt} prompt + {args.completion} new tokens, LoRA r16 on 7 projections, "
          "beta 0, dapo", flush=True)
    results = {}
    for tool, fn in runs:
        try:
            r = fn()
        except torch.cuda.OutOfMemoryError as e:  # one line per failed tool; the run goes on
            r = {"error": f"out of memory: {str(e).splitlines()[0][:200]}"}
        reset_peak(device)
        r.update(tool=tool, shape=args.shape, prompts=args.prompts, generations=args.generations)
        results[tool] = r
        record("grpo_step", **r)
    print(f"{'tool':<10}{'step s':>9}{'gen s':>9}{'train s':>9}{'gen tok/s':>11}"
          f"{'peak GiB':>10}{'loss0':>10}  plan", flush=True)
    for tool, r in results.items():
        if "error" in r:
            print(f"{tool:<10}{r['error']}")
            continue
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"{tool:<10}{r['step_s']:>9.3f}{r['generation_s']:>9.3f}{r['training_s']:>9.3f}"
              f"{r['gen_tokens_per_s']:>11.0f}{peak:>10}{r['loss0']:>10.4f}  {r['plan']}",
              flush=True)
    ours = results["leantune"]
    if "decode_vs_forward" in ours:  # the adapter as trained reaches generation
        print(f"after training (LoRA B max {ours['lora_b_max']:.2e}), relative to forward: "
              f"prefill {ours['decode_vs_forward']:.2e}, decode step "
              f"{ours['step_vs_forward']:.2e}; forward through other attention kernels "
              f"{ours['forward_vs_forward']:.2e} (the dtype's noise)", flush=True)
    if "timed_captures" in ours:
        print(f"leantune decode steps made / CUDA graphs captured during the timed steps: "
              f"{ours['timed_steps_made']} / {ours['timed_captures']} (graphs: expected 0)",
              flush=True)
    if "gen_s_plain" in ours:
        print("leantune gen s by decode projections: " + ", ".join(
            f"{m} {ours['gen_s_' + m]:.3f}" for m in ("plain", "precast", "packed", "packed-noshare")),
            flush=True)
    if "step_s" in results.get("trl", {}) and "step_s" in results["leantune"]:
        print(f"trl / leantune step time: {results['trl']['step_s'] / results['leantune']['step_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
