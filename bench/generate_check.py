"""GPU correctness of generation: the CUDA-graph decode step gives the eager step's tokens, and
in fp32 both give transformers' greedy `generate`, token for token (random-init model of the
named shape, prompts of different lengths decoded as one batch, EOS off).

    python bench/generate_check.py --shape llama-3.2-1b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from generate_speed import common_prefix, hf_model  # noqa: E402
from harness import leantune_model, record  # noqa: E402

import leantune  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--lengths", type=int, nargs="+", default=[17, 64, 40])
    args = p.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        model = leantune_model(args.shape, device, dtype).eval()
        prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
                   for n in args.lengths]

        def ours(graphs: bool):
            return leantune.generate(model, None, prompts, max_new_tokens=args.new,
                                     eos_token_ids=[], cuda_graphs=graphs and device.type == "cuda")

        graphs, eager = ours(True), ours(False)
        same = [common_prefix(a.token_ids, b.token_ids) for a, b in zip(graphs, eager)]
        hf_same = []
        if dtype == torch.float32:
            hf = hf_model(args.shape, model, device)
            for prompt, row in zip(prompts, eager):
                ids = torch.tensor([prompt], device=device)
                with torch.no_grad():
                    ref = hf.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=args.new, min_new_tokens=args.new,
                                      do_sample=False)[0, len(prompt):].tolist()
                hf_same.append(common_prefix(row.token_ids, ref))
            del hf
        record("generate_check", shape=args.shape, dtype=str(dtype), new_tokens=args.new,
               graphs_equal_eager=same, eager_equal_hf=hf_same or None)
        del model
        torch.cuda.empty_cache() if device.type == "cuda" else None


if __name__ == "__main__":
    main()
