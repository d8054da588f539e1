"""The `leantune` command line: train, export, doctor.

Every user error ends as one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import LeantuneError

# The embedded default: a short real fine-tune of the bundled tiny model on the bundled data.
DEMO = dict(max_seq_len=256, batch_size=8, grad_accum=1, lr=2e-3, max_steps=120, warmup_steps=10,
            lora_r=16, lora_alpha=32, eval_every=40, output="leantune-demo")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a model on a dataset (LoRA by default)",
                       description="Fine-tune --model on --data. With neither, runs a short demo "
                                   "on a tiny model and dataset bundled with leantune.")
    a = p.add_argument
    a("--model", help="checkpoint folder (config.json + *.safetensors) or hub id")
    a("--data", help="training data: .jsonl, .json or .parquet")
    a("--output", help="output folder (adapter, metrics.jsonl, checkpoints)")
    a("--config", help="YAML file with the same keys as these flags (flags win)")
    a("--format", choices=["alpaca", "messages", "text"], help="data format (default: detect)")
    a("--max-seq-len", type=int, help="packed row length in tokens (default 2048)")
    a("--batch-size", type=int, help="packed rows per micro-batch (default 4)")
    a("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    a("--lr", type=float, help="peak learning rate (default 2e-4)")
    a("--weight-decay", type=float, help="AdamW weight decay (default 0)")
    a("--warmup-steps", type=int, help="linear warm-up steps (default 10)")
    a("--schedule", choices=["cosine", "linear", "constant"], help="decay after warm-up")
    a("--max-grad-norm", type=float, help="gradient clipping (default 1.0; 0 = off)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--epochs", type=float, help="passes over the data (default 1)")
    g.add_argument("--max-steps", type=int, help="optimizer steps (overrides --epochs)")
    a("--lora-r", type=int, help="LoRA rank (default 16)")
    a("--lora-alpha", type=float, help="LoRA alpha (default 16)")
    a("--lora-dropout", type=float, help="LoRA dropout (default 0)")
    a("--lora-targets", help="comma list of q,k,v,o,gate,up,down (default: all)")
    a("--use-rslora", action="store_true", default=None, help="scale by alpha/sqrt(r)")
    a("--full", action="store_true", default=None, help="full fine-tuning instead of LoRA")
    a("--train-on-inputs", action="store_true", default=None,
      help="also train on prompts (default: responses only)")
    a("--eval-data", help="evaluation data file")
    a("--eval-fraction", type=float, help="hold out this fraction of --data for evaluation")
    a("--eval-every", type=int, help="evaluate every N steps (default 50)")
    a("--save-every", type=int, help="checkpoint every N steps (default: only at the end)")
    a("--resume", action="store_true", default=None, help="continue from the last checkpoint")
    a("--overwrite", action="store_true", default=None, help="replace a previous run in --output")
    a("--seed", type=int, help="random seed (default 42)")
    a("--device", help="cuda, cuda:1, cpu (default: cuda if available)")
    a("--dtype", choices=["bfloat16", "float16", "float32"], help="default: by device")
    a("--checkpointing", choices=["auto", "none", "recompute", "offload"],
      help="what layers keep for backward; auto (default): on GPU, keep as many layers' "
           "activations as fit --max-memory-gib and offload the rest's attention state to host "
           "memory; none on CPU. recompute: keep layer inputs only; offload: attention state "
           "to host memory for every layer")
    a("--no-fused-layers", dest="fused_layers", action="store_false", default=None,
      help="use autograd (+ torch.utils.checkpoint) instead of the hand-written layer backward")
    a("--no-offload-embedding", dest="offload_embedding", action="store_false", default=None,
      help="keep a frozen input embedding on the GPU (by default it stays in pinned host "
           "memory and each step reads its tokens' rows over the host link)")
    a("--max-memory-gib", type=float, help="GPU memory the run may use (default: the GPU's)")
    a("--compile", action="store_true", default=None, help="torch.compile each decoder layer")
    a("--log-every", type=int, help="log every N steps (default 1)")
    a("--no-progress", dest="progress", action="store_false", default=None,
      help="no progress bar (plain log lines)")


def _config_from_args(args):
    from .train.config import TrainConfig, load_yaml_config

    values = load_yaml_config(args.config) if args.config else {}
    for k in TrainConfig.keys():
        v = getattr(args, k, None)
        if v is not None:
            values[k] = v
    demo = not values.get("model") and not values.get("data")
    if demo:
        from . import assets

        values = {**DEMO, **values}
        values["model"] = str(assets.path("tiny-llama"))
        values["data"] = str(assets.path("data/tiny_sft.jsonl"))
        values.setdefault("eval_data", str(assets.path("data/tiny_sft_eval.jsonl")))
        if not args.resume and not args.output and not args.config:
            values["overwrite"] = True  # the demo's own default folder may be rerun freely
    elif not values.get("model") or not values.get("data"):
        missing = "--model" if not values.get("model") else "--data"
        raise LeantuneError(f"{missing} is required when the other is given (give neither to "
                            "run the built-in demo)")
    return TrainConfig(**values), demo


def cmd_train(args) -> int:
    from .train.trainer import Trainer

    cfg, demo = _config_from_args(args)
    if demo:
        print("leantune demo: no --model/--data given, so fine-tuning the tiny Llama model bundled "
              "with leantune on its bundled instruction data (CPU-friendly: under a minute on 2 cores).")
    trainer = Trainer(cfg)
    result = trainer.train()
    out = Path(cfg.output)
    if result.first_eval_loss is not None and result.final_eval_loss is not None:
        print(f"eval loss: {result.first_eval_loss:.4f} -> {result.final_eval_loss:.4f}")
    what = "full model" if cfg.full else "LoRA adapter (PEFT format)"
    print(f"done: {result.steps} steps, {result.tokens_per_s:,.0f} tokens/s; {what} in {out}/, "
          f"metrics in {out / 'metrics.jsonl'}")
    if not cfg.full:
        from .export.serving import vllm_lora_lines

        for line in vllm_lora_lines(cfg.model, out, cfg.lora_r):
            print(line)
    if demo:
        print("\nNext, with your own model and data:\n"
              "  leantune train --model meta-llama/Llama-3.2-1B --data my_data.jsonl "
              "--output my-run\n"
              "  leantune export --model meta-llama/Llama-3.2-1B --adapter my-run "
              "--output my-run-merged")
    return 0


def cmd_export(args) -> int:
    if args.format == "merged":
        from .export import export_merged

        if args.quant:
            raise LeantuneError("--quant applies to --format gguf and gguf-lora; a merged "
                                "export takes --dtype")
        out = export_merged(args.model, args.adapter, args.output, dtype=args.dtype,
                            overwrite=args.overwrite)
        print(f"merged checkpoint written to {out}/ (loads with transformers "
              "AutoModelForCausalLM.from_pretrained; serve it with: vllm serve "
              f"{out})")
        return 0
    from .export import export_gguf, export_gguf_lora

    if args.dtype:
        raise LeantuneError("--dtype applies to --format merged; a GGUF export takes --quant")
    if args.format == "gguf-lora":
        res = export_gguf_lora(args.model, args.adapter, args.output, quant=args.quant or "f16",
                               overwrite=args.overwrite)
        print(f"LoRA adapter written to {res.gguf} (llama.cpp: llama-cli -m BASE.gguf "
              f"--lora {res.gguf})")
        return 0
    res = export_gguf(args.model, args.adapter, args.output, quant=args.quant or "f16",
                      overwrite=args.overwrite, progress=True)
    for w in res.warnings:
        print(f"leantune: warning: {w}", file=sys.stderr)
    print(f"GGUF written to {res.gguf}, Ollama Modelfile beside it; run it with Ollama: "
          f"{res.ollama_command}")
    return 0


def cmd_doctor(args) -> int:
    from .doctor import run_doctor

    return run_doctor()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leantune", description="Fast, memory-lean LLM fine-tuning.")
    sub = p.add_subparsers(dest="command", metavar="{train,export,doctor}")
    _train_parser(sub)
    e = sub.add_parser("export", help="merge a LoRA adapter into its base: HF safetensors or GGUF")
    e.add_argument("--model", required=True, help="base checkpoint folder or hub id")
    e.add_argument("--adapter", help="adapter folder written by `leantune train` (without it: "
                   "the base alone)")
    e.add_argument("--output", required=True, help="output folder")
    e.add_argument("--format", choices=["merged", "gguf", "gguf-lora"], default="merged",
                   help="merged: HF safetensors (default); gguf: one GGUF file + Ollama "
                        "Modelfile; gguf-lora: the adapter alone for llama.cpp's --lora")
    e.add_argument("--quant", help="GGUF tensor type: f32, f16 (default), bf16, q8_0, q4_0, "
                                   "q5_0, q4_k_m, q6_k (gguf-lora: f32, f16, bf16, q8_0)")
    e.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="output dtype (default: the base's)")
    e.add_argument("--overwrite", action="store_true")
    sub.add_parser("doctor", help="check the environment and what leantune will use")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 0
    handler = {"train": cmd_train, "export": cmd_export, "doctor": cmd_doctor}[args.command]
    try:
        return handler(args)
    except LeantuneError as e:
        print(f"leantune: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("leantune: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
