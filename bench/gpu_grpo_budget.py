"""Issue 21 §3: GRPO's memory budget is a promise. The real Trainer (objective grpo, activations
auto, --max-memory-gib BUDGET) runs --steps steps (generation and training) over random-id
prompts on a random-weight model of --shape; the peak is torch.cuda.max_memory_allocated over
the whole run, the weights included, against the budget the planner was given.

bench/gpu_grpo.py times the step; it plans its trainer as an SFT step of the same tokens, so
its peak does not test the planner's generation phase (the KV cache of batch x G completions,
the prefill and the sampler): this script does.

    # H200
    PYTHONPATH=src python bench/gpu_grpo_budget.py --shape llama-3.2-1b --budget 4.4
    PYTHONPATH=src python bench/gpu_grpo_budget.py --shape qwen3-0.6b --budget 4
    # CPU, seconds: the same path at the tiny shape (no peak on the CPU)
    PYTHONPATH=src python bench/gpu_grpo_budget.py --tiny
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_grpo import Prompts  # noqa: E402
from harness import leantune_model, peak_gib, record, reset_peak  # noqa: E402
from shapes import SHAPES  # noqa: E402

from leantune.train.config import TrainConfig  # noqa: E402
from leantune.train.trainer import Trainer  # noqa: E402


class BudgetPrompts(Prompts):
    """The random-id prompts as the trainer reads a PromptDataset."""

    num_prompt_truncated = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def run(args, device) -> dict:
    reset_peak(device)
    model = leantune_model(args.shape, device, dtype=torch.bfloat16 if device.type == "cuda"
                           else torch.float32)
    logs = []
    with tempfile.TemporaryDirectory() as out:
        cfg = TrainConfig(objective="grpo", reward=["builtin:length-penalty"],
                          num_generations=args.generations,
                          max_completion_tokens=args.completion,
                          max_seq_len=args.prompt + args.completion, batch_size=args.prompts,
                          output=out, max_steps=args.steps, lr=1e-4, warmup_steps=0,
                          progress=False, eval_every=0, lora_r=16, lora_alpha=16,
                          lora_targets="q,k,v,o,gate,up,down", overwrite=True,
                          device=str(device), activations="auto",
                          max_memory_gib=args.budget if device.type == "cuda" else None)
        data = BudgetPrompts(SHAPES[args.shape]["vocab_size"], args.prompts * args.steps,
                             args.prompt)
        trainer = Trainer(cfg, model=model, train_data=data, log=logs.append)
        plan = trainer.activation_policy
        trainer.train()
        peak = peak_gib(device)
    del trainer, model
    return {"shape": args.shape, "budget_gib": args.budget, "peak_gib": peak, "plan": plan,
            "within": None if peak is None else peak <= args.budget,
            "steps": args.steps, "prompts": args.prompts, "generations": args.generations}


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--budget", type=float, default=4.4, help="--max-memory-gib")
    for flag, default in (("prompts", 2), ("generations", 8), ("prompt", 256),
                          ("completion", 256), ("steps", 3)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    ap.add_argument("--tiny", action="store_true", help="CPU dry run at the tiny shape")
    args = ap.parse_args()
    if args.tiny:
        args.shape, args.generations, args.prompt, args.completion, args.steps = \
            "tiny", 4, 16, 16, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    r = run(args, device)
    record("grpo_budget", **r)
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
    print(f"{'shape':14}{'budget GiB':>11}{'peak GiB':>10}  within  plan")
    print(f"{r['shape']:14}{r['budget_gib']:>11.2f}{peak:>10}  {str(r['within']):6}  {r['plan']}")


if __name__ == "__main__":
    main()
