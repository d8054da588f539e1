"""The `leantune` command line: train, export, generate, chat, plot, inspect-data, doctor.

Every user error ends as one line on stderr and exit code 2, never a traceback. A run's log,
progress and summary go to stdout. Ctrl-C and SIGTERM end the command with one line and exit
code 130 or 143 (a run checkpoints first).
"""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import sys
from pathlib import Path

from . import __version__
from .dist import env_rank
from .errors import LeantuneError
from .utils import signals

# The demo's suggestion for a first run on real data: an open model (no licence to accept).
OPEN_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"

# The embedded default: a short real fine-tune of the bundled tiny model on the bundled data.
DEMO = dict(max_seq_len=256, batch_size=8, grad_accum=1, lr=2e-3, max_steps=120, warmup_steps=10,
            lora_r=16, lora_alpha=32, eval_every=40, output="leantune-demo")


DATA_HELP = ("a .jsonl, .json, .csv or .parquet file, a dataset folder, or a Hugging Face hub "
             "dataset (org/name)")


def _data_source_flags(a) -> None:
    """The flags that pick the rows of a hub dataset or dataset folder (train, inspect-data)."""
    a("--data-split", help="split of a hub dataset or dataset folder (default train)")
    a("--data-subset", help="subset (config name) of a hub dataset")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a model on a dataset (LoRA by default)",
                       description="Fine-tune --model on --data. With neither, runs a short demo "
                                   "on a tiny model and dataset bundled with leantune.")
    a = p.add_argument
    a("--model", help="checkpoint folder (config.json + *.safetensors) or hub id")
    a("--data", help=f"training data: {DATA_HELP}")
    _data_source_flags(a)
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
    a("--lora-targets", help="comma list of q,k,v,o,gate,up,down (default: all), and experts "
                             "(MoE models: the expert weights)")
    a("--use-rslora", action="store_true", default=None, help="scale by alpha/sqrt(r)")
    a("--full", action="store_true", default=None, help="full fine-tuning instead of LoRA")
    a("--adapter", help="continue from this adapter (e.g. an SFT run's folder): folded into the "
                        "16-bit base weights, so base + adapter is the starting point and a "
                        "preference objective's reference; --model defaults to its base")
    a("--router-aux-loss-coef", type=float,
      help="MoE models: add this times the router's load-balancing loss (default 0 = off)")
    o = p.add_argument_group("objective", "what the run optimises (default sft: next-token "
                                          "cross-entropy); the rest are preference settings")
    o.add_argument("--objective", help="sft (default), dpo, orpo, simpo, kto or grpo")
    o.add_argument("--beta", type=float, help="preference: the KL / odds-ratio weight (0.1)")
    o.add_argument("--loss-type", help="DPO family: sigmoid (default), ipo or hinge")
    o.add_argument("--label-smoothing", type=float, help="DPO sigmoid: label smoothing (0)")
    o.add_argument("--simpo-gamma", type=float, help="SimPO: the target reward margin (0.5)")
    o.add_argument("--desirable-weight", type=float, help="KTO: desirable rows' weight (1)")
    o.add_argument("--undesirable-weight", type=float, help="KTO: undesirable rows' weight (1)")
    o.add_argument("--precompute-reference", action="store_true", default=None,
                   help="compute the reference log-probs once, before training")
    o.add_argument("--max-prompt-len", type=int,
                   help="preference: prompt tokens kept, cut from the left (default: no cap)")
    o.add_argument("--no-shared-prompt", dest="shared_prompt", action="store_false",
                   default=None, help="DPO, ORPO, SimPO: pack each pair as two documents, the "
                                      "prompt run twice (default: once, in one shared document)")
    r = p.add_argument_group("GRPO", "--objective grpo: online RL on prompt-only rows "
                                     "{\"prompt\": ...}; --beta (default 0) and --loss-type "
                                     "(dapo, grpo, dr_grpo, bnpo, gspo) apply too")
    r.add_argument("--reward", action="append",
                   help="a reward function: FILE.py:FUNCTION (called as TRL's GRPOTrainer calls "
                        "it) or builtin:exact-answer, builtin:format[=REGEX], "
                        "builtin:length-penalty; repeat for several")
    r.add_argument("--reward-weights", type=float, nargs="+",
                   help="one weight per --reward, in order (default 1 each)")
    r.add_argument("--num-generations", type=int, help="completions per prompt (default 8)")
    r.add_argument("--max-completion-tokens", type=int,
                   help="tokens sampled per completion at most (default 256)")
    r.add_argument("--temperature", type=float, help="sampling temperature (default 1.0)")
    r.add_argument("--top-p", type=float, help="nucleus sampling (default 1.0: off)")
    r.add_argument("--epsilon", type=float, help="clip range of the ratio (default 0.2)")
    r.add_argument("--epsilon-high", type=float,
                   help="upper clip range (default: --epsilon; DAPO uses 0.28)")
    r.add_argument("--num-iterations", type=int,
                   help="updates per generation batch, the old log-probs kept (default 1)")
    r.add_argument("--scale-rewards", choices=["group", "batch", "none"],
                   help="advantages divided by the group's reward std (default), the batch's, "
                        "or not at all (Dr. GRPO)")
    r.add_argument("--mask-truncated-completions", action="store_true", default=None,
                   help="completions cut at --max-completion-tokens train nothing")
    r.add_argument("--log-completions-every", type=int,
                   help="every N steps write the first prompt's completions and rewards to "
                        "OUTPUT/samples.jsonl (default 0: off)")
    a("--load-in-4bit", action="store_true", default=None,
      help="QLoRA: quantise the decoder's linear weights to NF4 while loading (a *-bnb-4bit "
           "checkpoint is 4-bit without it)")
    a("--precision", choices=["bf16", "fp8"],
      help="bf16 (default), or fp8: the frozen base's projections quantised to e4m3 (128 x 128 "
           "block scales) while loading, their GEMMs in FP8 (GPUs of sm_89+; the adapter, "
           "norms, attention and loss stay 16/32-bit)")
    a("--merge-at-end", action="store_true", default=None,
      help="LoRA: also write the base model with the adapter merged in to OUTPUT/merged")
    a("--train-on-inputs", action="store_true", default=None,
      help="also train on prompts (default: responses only)")
    a("--eval-data", help="evaluation data, as --data")
    a("--eval-split", help="split of --eval-data when it is a hub dataset or dataset folder "
                           "(default test; the subset is --data-subset)")
    a("--eval-fraction", type=float, help="hold out this fraction of --data for evaluation")
    a("--eval-every", type=int, help="evaluate every N steps (default 50)")
    a("--save-every", type=int, help="checkpoint every N steps (default: only at the end; "
                                      "the last step is always checkpointed)")
    a("--sample-prompts", help="a .jsonl of prompts (as `leantune generate --prompts`): the "
                               "first 4 are completed before training, at each evaluation and "
                               "at the end, into OUTPUT/samples.jsonl")
    a("--sample-max-new-tokens", type=int, help="tokens per sample completion (default 64)")
    a("--resume", action="store_true", default=None,
      help="continue from the last checkpoint (with a larger --max-steps or --epochs: train on)")
    a("--overwrite", action="store_true", default=None, help="replace a previous run in --output")
    a("--seed", type=int, help="random seed (default 42)")
    a("--device", help="cuda, cuda:1, cpu (default: cuda if available)")
    a("--dtype", choices=["bfloat16", "float16", "float32"], help="default: by device")
    a("--activations", choices=["auto", "keep", "recompute", "offload"],
      help="what layers keep for backward; auto (default): on GPU, the fastest plan whose peak "
           "fits --max-memory-gib (layers keep everything, their attention state, or their "
           "input, on the GPU or offloaded to host memory); keep on CPU. keep: everything; "
           "recompute: layer inputs only; offload: attention state to host memory")
    a("--max-memory-gib", type=float,
      help="GPU memory the run may use (default: the GPU's); a promise: the step's peak stays "
           "under it, or the run stops at once saying the least that would do")
    a("--no-offload-embedding", dest="offload_embedding", action="store_false", default=None,
      help="keep a frozen input embedding on the GPU (by default it stays in pinned host "
           "memory and each step reads its tokens' rows over the host link)")
    a("--compile", action="store_true", default=None, help="torch.compile each decoder layer")
    a("--parallel", choices=["auto", "ddp", "fsdp"],
      help="under torchrun (one process per GPU): DDP, FSDP2 (the model sharded over the GPUs), "
           "or auto (default): DDP where the model, its trainable state and the leanest "
           "activation plan fit one GPU, else FSDP2; ignored in one process")
    e = p.add_argument_group("engine", "how the layers run (all saved with the run)")
    e.add_argument("--no-fused-layers", dest="fused_layers", action="store_false", default=None,
                   help="autograd (+ torch.utils.checkpoint) instead of the hand-written layer "
                        "backward")
    e.add_argument("--kernels", choices=["auto", "triton", "reference"],
                   help="auto (default): Triton kernels on CUDA; reference: plain PyTorch ops")
    e.add_argument("--attention", choices=["auto", "flash", "sdpa"],
                   help="attention backend of the fused layers: auto (default: cuDNN for rows "
                        "of one document, flash for packed rows), flash, sdpa (recomputed under "
                        "autograd)")
    e.add_argument("--no-pack-projections", dest="pack_projections", action="store_false",
                   default=None, help="separate GEMMs for q/k/v, gate/up, down instead of one "
                                      "packed GEMM each with the LoRA term folded in")
    e.add_argument("--mlp-chunk-mib", type=float,
                   help="row chunks of the fused MLP in backward (default 256 MiB)")
    e.add_argument("--link-gbs", type=float,
                   help="host link rate the memory planner assumes (default 50 GB/s)")
    e.add_argument("--link-duplex-gbs", type=float,
                   help="host link rate each way while both directions copy at once, which "
                        "the planner assumes for --stream-weights (default 33 GB/s)")
    e.add_argument("--no-trim-offload", dest="trim_offload", action="store_false", default=None,
                   help="offloaded layers always keep q/k/v (by default, where their copies "
                        "would outrun the forward, the fewest needed project q/k/v again in "
                        "backward instead of making the forward wait on the host link)")
    e.add_argument("--stream-weights", dest="stream_weights", action="store_true", default=None,
                   help="where the memory budget forces recompute, let the planner keep some "
                        "layers' frozen base weights in pinned host memory, copied to the GPU a "
                        "layer ahead of each use, so more layers keep their activations")
    e.add_argument("--prefetch-depth", type=int, choices=[0, 1, 2],
                   help="offloaded layers brought back at once in backward (default 0: 2 where "
                        "base weights stream, else 1)")
    e.add_argument("--stream-fill-ahead", dest="stream_fill_ahead", action="store_true",
                   default=None, help="with --stream-weights, a layer that does not stream starts "
                                      "the weight copy two streamed layers ahead (default: one "
                                      "ahead; experimental, not yet timed on a GPU)")
    e.add_argument("--stream-max-layers", type=int,
                   help="with --stream-weights, the most layers whose weights stream (default 0: "
                        "the planner's choice; it streams even counts)")
    a("--log-every", type=int, help="log every N steps (default 1)")
    a("--report-to", help="also send metrics to tensorboard (OUTPUT/tensorboard), wandb, or both "
                          "(comma list); default none")
    a("--no-progress", dest="progress", action="store_false", default=None,
      help="no progress bar: a plain line per logged step")


def _config_from_args(args):
    from .train.config import TrainConfig, load_yaml_config

    values = load_yaml_config(args.config) if args.config else {}
    for k in TrainConfig.keys():
        v = getattr(args, k, None)
        if v is not None:
            values[k] = v
    if values.get("adapter") and not values.get("model") and values.get("data"):
        from .generate.load import adapter_base, check_adapter_path

        values["model"] = adapter_base(check_adapter_path(values["adapter"]))
        print(f"model: {values['model']} (the base named by --adapter)")
    demo = not values.get("model") and not values.get("data")
    if demo:
        from . import assets

        # with --full the demo's LoRA settings do not apply
        values = {**{k: v for k, v in DEMO.items()
                     if not (values.get("full") and k.startswith("lora_"))}, **values}
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
    from .dist.setup import shutdown
    from .train.trainer import Trainer

    cfg, demo = _config_from_args(args)
    cfg.validate()  # a bad flag fails before the demo's banner
    if demo:
        print("leantune demo: no --model/--data given, so fine-tuning the tiny Llama model bundled "
              "with leantune on its bundled instruction data (CPU-friendly: under a minute on 2 cores).")
    trainer = Trainer(cfg)
    result = trainer.train()
    try:  # (the run is written: a Ctrl-C from here cuts only its summary)
        writer = trainer.parallel.writer
        out = Path(cfg.output)
        answer = _demo_answer(trainer, out) if demo and writer and result.steps_run else None
        del trainer  # under torchrun: DDP and FSDP2 go before the process group they use
        shutdown()
        if result.steps_run == 0 or not writer:
            return 0  # a finished run resumed (the trainer said so), or not rank 0 of torchrun's
        if result.first_eval_loss is not None and result.final_eval_loss is not None:
            print(f"eval loss: {result.first_eval_loss:.4f} -> {result.final_eval_loss:.4f}")
        what = "full model" if cfg.full else "LoRA adapter (PEFT format)"
        from .utils.words import count

        print(f"done: {count(result.steps, 'step')}, {result.tokens_per_s:,.0f} tokens/s; "
              f"{what} in {out}/, metrics in {out / 'metrics.jsonl'}")
        if not cfg.full:
            from .export.serving import vllm_lora_lines

            rank = cfg.lora.r  # (--adapter: the written adapter stacks both ranks)
            if cfg.adapter:
                import json

                rank = json.loads((out / "adapter_config.json").read_text())["r"]
            from .lora.base_check import base_name_to_record

            for line in vllm_lora_lines(base_name_to_record(cfg.model), out, rank):
                print(line)
        if demo:
            print(answer)
            print(f"\nNext, with your own model and data ({OPEN_MODEL} downloads without a "
                  f"licence to accept):\n"
                  f"  leantune train --model {OPEN_MODEL} --data my_data.jsonl --output my-run\n"
                  f"  leantune export --model {OPEN_MODEL} --adapter my-run "
                  "--output my-run-merged\n"
                  "Gated models (e.g. meta-llama/Llama-3.2-1B): accept the licence on the model's "
                  "page at huggingface.co, then log in with `hf auth login` (or set HF_TOKEN).")
        return 0
    except KeyboardInterrupt as interrupt:
        if env_rank() == 0:
            print(f"leantune: {signals.describe(interrupt)} after the run finished; its "
                  f"results are in {cfg.output}/", file=sys.stderr)
        return signals.exit_code(interrupt)


def _demo_answer(trainer, out: Path) -> str:
    """The lines that show the fine-tuned demo model's answer to a held-out question (a
    capital: what the tiny model knows from pretraining), asked in the alpaca prompt it was
    trained on."""
    from . import assets
    from .generate import generate
    from .generate.prompts import read_prompt_file

    rows = read_prompt_file(assets.path("data/tiny_sft_eval.jsonl"))
    row, prompt, _ = next((r for r in rows if "capital" in r[0]["instruction"]), rows[0])
    answer = generate(trainer.model, trainer.tokenizer, prompt, max_new_tokens=32)[0].text
    return (f"\nthe fine-tuned model, asked a held-out question: {row['instruction']}\n"
            f"  {' '.join(answer.split()) or '(an empty answer)'}\n"
            f"chat with it: leantune chat --adapter {out}   (it knows capitals: ask for one)")


def cmd_generate(args) -> int:
    import json

    from .generate import generate
    from .generate.context import fit_to_context
    from .generate.load import locate
    from .generate.prompts import has_typed, in_format, prompt_ids, read_prompt_file, typed_prompt
    from .utils.io import atomic_path

    kw = _sampling_kw(args)
    if args.chat_template is not None and args.prompt_format:
        raise LeantuneError("give --prompt-format or --chat-template / --no-chat-template, not "
                            "both (--chat-template is --prompt-format chat)")
    out = Path(args.output) if args.output else None
    if out is not None and out.exists() and not args.overwrite:
        raise LeantuneError(f"{out}: output file exists; choose another --output or pass "
                            "--overwrite")
    if out is not None and args.prompts and out.resolve() == Path(args.prompts).resolve():
        raise LeantuneError(f"{out}: --output is the --prompts file; choose another file")
    rows = (read_prompt_file(args.prompts) if args.prompts
            else [({"prompt": args.prompt}, args.prompt, "--prompt")])
    asked = ({True: "chat", False: "text"}[args.chat_template]
             if args.chat_template is not None else args.prompt_format)
    if args.prompts and asked not in (None, "auto") and not has_typed(rows):
        flag = "--prompt-format" if args.prompt_format else "--chat-template / --no-chat-template"
        raise LeantuneError(f"{flag} applies to --prompt and to {{\"prompt\": text}} rows; "
                            f"{args.prompts} has none ('messages' rows use the chat template, "
                            "alpaca rows its prompt): leave it out")
    src = locate(args.model, args.adapter, args.device, args.dtype, log=_note,
                 force_base=args.force_base, precision=args.precision)
    tokenizer = src.tokenizer
    if not args.prompts:
        rows = [(rows[0][0], typed_prompt(args.prompt, src.prompt_format(asked, log=_note)),
                 "--prompt")]
    elif has_typed(rows):  # {"prompt": text} rows are asked as --prompt is
        rows = in_format(rows, src.prompt_format(asked, log=_note))
    ids = [prompt_ids(tokenizer, prompt, where) for _, prompt, where in rows]  # before weights
    # a prompt past the model's context is refused before the weights load too (config.json
    # has the context); a capped completion's note is generate's, once
    fit_to_context(ids, [p.where for p in ids], args.max_new_tokens, src.config(),
                   log=lambda _: None)
    done = generate(src.load(), tokenizer, ids, batch_size=args.batch_size,
                    cuda_graphs=args.cuda_graphs, log=_note, **kw)
    if out is None and not args.prompts:
        print(done[0].text)
        return 0
    lines = "".join(json.dumps({**row, "completion": g.text, "tokens": len(g.token_ids),
                                "stopped": g.stopped}, ensure_ascii=False) + "\n"
                    for (row, _, _), g in zip(rows, done))
    if out is None:
        sys.stdout.write(lines)
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_text(lines)
    _note(f"{len(done)} completions written to {out}")
    return 0


def cmd_chat(args) -> int:
    from .generate.chat import chat
    from .generate.load import locate
    from .generate.prompts import typed_prompt

    kw = _sampling_kw(args)
    src = locate(args.model, args.adapter, args.device, args.dtype, log=_note,
                 force_base=args.force_base, precision=args.precision)
    fmt = src.prompt_format(args.prompt_format, log=_note, untrained="chat")
    typed_prompt("", fmt, args.system)  # --system without a chat template: before the weights
    chat(src.load(), src.tokenizer, system=args.system, cuda_graphs=args.cuda_graphs, log=_note,
         prompt_format=fmt, **kw)
    return 0


def _note(line: str) -> None:
    """generate and chat: notes go to stderr (stdout holds the completions)."""
    print(line, file=sys.stderr)


def _sampling_kw(args) -> dict:
    """The sampling flags of generate and chat, checked before the model loads."""
    from .generate import Sampling

    if args.max_new_tokens < 1:
        raise LeantuneError(f"--max-new-tokens must be a positive integer, got "
                            f"{args.max_new_tokens}")
    if getattr(args, "batch_size", 1) < 1:
        raise LeantuneError(f"--batch-size must be a positive integer, got {args.batch_size}")
    Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed).check()
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                seed=args.seed, stop=getattr(args, "stop", None) or ())


def _generation_flags(p, stop: bool = True) -> None:
    """--model/--adapter, sampling and device flags of generate and chat (`stop`: --stop)."""
    a = p.add_argument
    a("--model", help="checkpoint folder or hub id (default: the base named by --adapter)")
    a("--adapter", help="LoRA adapter (attached unmerged): a folder written by `leantune "
                        "train` or PEFT, a run folder or one checkpoint (RUN/checkpoints/step-N)")
    a("--max-new-tokens", type=int, default=256, help="most tokens per completion (default 256)")
    a("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    a("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    a("--top-p", type=float, default=1.0,
      help="sample among the most likely tokens whose probabilities sum to p (1: off)")
    a("--repetition-penalty", type=float, default=1.0,
      help="> 1 makes tokens already in the text less likely (1: off)")
    a("--seed", type=int, help="seed of the sampling (same seed, same text)")
    if stop:
        a("--stop", action="append", metavar="STR",
          help="end a completion at this text (repeat for more); EOS ids always end it")
    a("--force-base", action="store_true",
      help="use --model even when it is not the base the adapter was trained on (a warning)")
    a("--prompt-format", choices=["auto", "chat", "alpaca", "text"],
      help="how a typed prompt (--prompt, a {\"prompt\": text} row, a chat line) is put to "
           "the model: auto (default): as the run was trained (its run_config.json), else the "
           "chat template when the tokenizer has one")
    a("--device", help="cuda, cuda:1, cpu (default: cuda if available)")
    a("--dtype", choices=["bfloat16", "float16", "float32"], help="default: by device")
    a("--precision", choices=["bf16", "fp8"], default="bf16",
      help="fp8: the base's projections in e4m3 (quantised as they load; half the weight "
           "bytes a token reads), on GPUs with FP8 units (sm_89+)")
    a("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
      help="run each decode step eagerly (CUDA graphs replay it by default on CUDA)")


def cmd_export(args) -> int:
    from .generate.load import check_adapter_path

    if args.adapter:
        check_adapter_path(args.adapter)
    if not args.model:
        if not args.adapter:
            raise LeantuneError("export: give --model (the base checkpoint) and --adapter (the "
                                "fine-tune to merge into it)")
        from .generate.load import adapter_base

        args.model = adapter_base(Path(args.adapter))
        print(f"export: the base model is {args.model} (named by --adapter; --model overrides)")
    if args.adapter:
        from .lora.base_check import check_adapter_base

        check_adapter_base(args.adapter, args.model, force=args.force_base,
                           log=lambda line: print(line, file=sys.stderr),
                           merge_onto=args.merge_onto)
    if args.format == "merged":
        from .export import export_merged

        if args.quant:
            raise LeantuneError("--quant applies to --format gguf and gguf-lora; a merged "
                                "export takes --dtype")
        out = export_merged(args.model, args.adapter, args.output, dtype=args.dtype,
                            overwrite=args.overwrite, log=print, merge_onto=args.merge_onto)
        print(f"merged checkpoint written to {out}/ (loads with transformers "
              "AutoModelForCausalLM.from_pretrained; serve it with: vllm serve "
              f"{out})")
        return 0
    from .export import export_gguf, export_gguf_lora

    if args.dtype:
        raise LeantuneError("--dtype applies to --format merged; a GGUF export takes --quant")
    if args.format == "gguf-lora":
        if args.merge_onto:
            raise LeantuneError("--merge-onto applies to --format merged and gguf; gguf-lora "
                                "writes the adapter alone")
        res = export_gguf_lora(args.model, args.adapter, args.output, quant=args.quant or "f16",
                               overwrite=args.overwrite)
        print(f"LoRA adapter written to {res.gguf} (llama.cpp: llama-cli -m BASE.gguf "
              f"--lora {res.gguf})")
        return 0
    res = export_gguf(args.model, args.adapter, args.output, quant=args.quant or "f16",
                      overwrite=args.overwrite, progress=True, merge_onto=args.merge_onto)
    for w in res.warnings:
        print(f"leantune: warning: {w}", file=sys.stderr)
    print(f"GGUF written to {res.gguf}, Ollama Modelfile beside it; run it with Ollama: "
          f"{res.ollama_command}")
    return 0


def cmd_plot(args) -> int:
    from .train.plot import plot_metrics

    print(f"loss plot written to {plot_metrics(args.run, args.output)}")
    return 0


def cmd_inspect_data(args) -> int:
    from .data.inspect import inspect_dataset, load_tokenizer_only, open_dataset, use_color

    tokenizer = load_tokenizer_only(args.model)
    dataset = open_dataset(args.data, tokenizer, args.max_seq_len, format=args.format,
                           train_on_inputs=args.train_on_inputs, split=args.data_split or "train",
                           subset=args.data_subset)  # (SFT rows, or preference pairs / KTO rows)
    print(inspect_dataset(dataset, args.rows, color=use_color(sys.stdout), tokens=args.tokens))
    return 0


def cmd_doctor(args) -> int:
    from .doctor import run_doctor

    return run_doctor()


# Flags renamed since earlier releases: their old name gets a pointer to the new one.
RENAMED_FLAGS = {"--checkpointing": "--activations (its value none is now keep)"}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where to look, not the whole usage. No
    abbreviations (`--max-seq 64` would silently set --max-seq-len, and a later flag starting
    the same way would change its meaning), and an unknown flag names the nearest one."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # (subparsers are made through this too)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        args, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._command_parser(getattr(args, "command", None))
            parser.error(unknown_arguments(extras, parser))
        return args

    def _command_parser(self, command: str | None) -> argparse.ArgumentParser:
        """The subcommand's parser (its flags are the ones to suggest), else this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and command in action.choices:
                return action.choices[command]
        return self

    def error(self, message: str):
        for old, new in RENAMED_FLAGS.items():
            if old in message:
                message += f"; {old} is now {new}"
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


def unknown_arguments(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" line, with the nearest flag of `parser` for each
    unknown one (abbreviations are refused: their full name is suggested)."""
    from .utils.suggest import did_you_mean

    flags = [o for o in parser._option_string_actions if o.startswith("--")]
    hints = [f"{e.split('=', 1)[0]}{did_you_mean(e.split('=', 1)[0], flags)}"
             for e in extras if e.startswith("--")]
    hints = [h.replace("; did you mean", ": did you mean") for h in hints if "did you mean" in h]
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints
                                                             else "")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="leantune", description="Fast, memory-lean LLM fine-tuning.")
    p.add_argument("--version", action="version", version=f"leantune {__version__}")
    sub = p.add_subparsers(dest="command",
                           metavar="{train,export,generate,chat,plot,inspect-data,doctor}")
    _train_parser(sub)
    e = sub.add_parser("export", help="merge a LoRA adapter into its base: HF safetensors or GGUF")
    e.add_argument("--model", help="base checkpoint folder or hub id (default: the base named "
                                    "by --adapter)")
    e.add_argument("--adapter",
                   help="adapter folder written by `leantune train` (or PEFT), a run folder "
                        "(its latest checkpoint when the run has no final adapter), or one "
                        "checkpoint: RUN/checkpoints/step-N (without it: the base alone)")
    e.add_argument("--output", required=True, help="output folder")
    e.add_argument("--format", choices=["merged", "gguf", "gguf-lora"], default="merged",
                   help="merged: HF safetensors (default); gguf: one GGUF file + Ollama "
                        "Modelfile; gguf-lora: the adapter alone for llama.cpp's --lora")
    e.add_argument("--quant", help="GGUF tensor type: f32, f16 (default), bf16, q8_0, q4_0, "
                                   "q5_0, q4_k_m, q6_k (gguf-lora: f32, f16, bf16, q8_0)")
    e.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                   help="output dtype (default: the base's)")
    e.add_argument("--merge-onto",
                   help="a 4-bit (bnb-4bit) --model's 16-bit original: merge the adapter onto "
                        "its weights instead of the dequantised 4-bit ones")
    e.add_argument("--overwrite", action="store_true",
                   help="replace a previous export in --output (other files there are kept)")
    e.add_argument("--force-base", action="store_true",
                   help="merge onto --model even when it is not the base the adapter was "
                        "trained on (a warning)")
    gp = sub.add_parser("generate", help="complete prompts with a model (+ adapter)",
                        description="Complete --prompt, or each row of --prompts, with --model "
                                    "and --adapter (unmerged), greedily by default.")
    src = gp.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt: printed completion (in the prompt format "
                                      "the run was trained with: --prompt-format)")
    src.add_argument("--prompts", help="a .jsonl (.json, .csv) of rows {\"prompt\": text} "
                                       "(asked as --prompt is), "
                                       "{\"messages\": [...]} (chat template) or alpaca "
                                       "{\"instruction\", \"input\"}: JSONL out, each row "
                                       "with completion, tokens, stopped")
    gp.add_argument("--output", help="write the JSONL rows to this file (default: stdout)")
    gp.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    gp.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                    help="--prompt (and {\"prompt\": text} rows) as a user turn through the "
                         "chat template: --prompt-format chat; --no-chat-template: text")
    gp.add_argument("--batch-size", type=int, default=16, help="prompts decoded together "
                                                              "(default 16)")
    _generation_flags(gp)
    ch = sub.add_parser("chat", help="chat with a model (+ adapter) in the terminal",
                        description="An interactive chat through the tokenizer's chat template, "
                                    "replies streamed as they are generated. /reset starts "
                                    "over, /exit or Ctrl-D ends.")
    ch.add_argument("--system", help="a system message that starts the conversation")
    _generation_flags(ch, stop=False)
    pl = sub.add_parser("plot", help="draw a run's train and eval loss and lr into loss.png")
    pl.add_argument("run", help="output folder of a `leantune train` run (or its metrics.jsonl)")
    pl.add_argument("--output", help="PNG file to write (default RUN/loss.png)")
    i = sub.add_parser("inspect-data", help="show rows as the model sees them, and how they pack",
                       description="Tokenize --data with --model's tokenizer (no weights are "
                                   "loaded) and show a few documents with their trained tokens "
                                   "marked, then lengths, packing, truncated and dropped rows.")
    i.add_argument("--data", required=True, help=DATA_HELP)
    i.add_argument("--model", required=True, help="checkpoint folder or hub id (its tokenizer)")
    _data_source_flags(i.add_argument)
    i.add_argument("--format", choices=["alpaca", "messages", "text"],
                   help="data format (default: detect)")
    i.add_argument("--max-seq-len", type=int, default=2048, help="packed row length (default 2048)")
    i.add_argument("--rows", type=int, default=3, help="documents to show (default 3)")
    i.add_argument("--train-on-inputs", action="store_true", help="also train on prompts")
    i.add_argument("--tokens", action="store_true",
                   help="show each token on its own, quoted, instead of the text")
    sub.add_parser("doctor", help="check the environment and what leantune will use")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (0 ok, 2 bad input, 130 / 143 interrupted)."""
    with signals.as_interrupts():
        try:
            args = build_parser().parse_args(argv)
            if args.command is None:
                build_parser().print_help()
                return 0
            handler = {"train": cmd_train, "export": cmd_export, "generate": cmd_generate,
                       "chat": cmd_chat, "plot": cmd_plot, "inspect-data": cmd_inspect_data,
                       "doctor": cmd_doctor}
            return handler[args.command](args)
        except LeantuneError as e:
            if e.exit_code == 2 and signals.received():  # a library turned Ctrl-C into an error
                return _interrupted(signals.received())
            if env_rank() == 0:  # under torchrun every process has the error: rank 0 says it
                print(f"leantune: error: {e}", file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt as e:  # before a run started, or in an export: nothing written
            return _interrupted(e)
        except RecursionError as e:  # a file read elsewhere than the readers that name it
            if signals.received():
                return _interrupted(signals.received())
            if not _in_a_parser(e):  # (a bug, or a user's reward function: its traceback)
                raise
            if env_rank() == 0:
                print("leantune: error: an input file nests its structure (JSON, YAML) too deeply "
                      "to read; check the files the command was given", file=sys.stderr)
            return 2
        except Exception as e:
            if signals.received():
                return _interrupted(signals.received())
            message = _disk_fault(e)
            if message is None:
                raise
            if env_rank() == 0:
                try:
                    print(f"leantune: error: {message}", file=sys.stderr)
                except OSError:
                    pass  # stderr is gone too: the exit code says it
            return 2


def _in_a_parser(e: BaseException) -> bool:
    """Whether a RecursionError was raised inside the json or yaml packages (a file nested too
    deeply), not elsewhere."""
    tb, last = e.__traceback__, None
    while tb is not None:
        last, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    parts = Path(last).parts if last else ()
    return any(p in ("json", "yaml") for p in parts[-3:-1])


# what a disk fault mid-command leaves: every write is a temporary file renamed into place
FAULT_NOTE = "the command stopped; the files it had written before are intact"


def _disk_fault(e: BaseException) -> str | None:
    """The one line for a disk fault (full, read-only, a file in the way, a closed stdout pipe)
    that reached the top of a command; None for any other error."""
    from .utils.paths import disk_error_message, os_error_of

    err = os_error_of(e)
    message = disk_error_message(err) if err is not None else None
    if message is None:
        return None
    if err.errno == errno.EPIPE:
        _silence_stdout()
    return f"{message}; {FAULT_NOTE}"


def _silence_stdout() -> None:
    """Point stdout at /dev/null: its reader is gone, and the interpreter's last flush must
    not fail again (a second 'Broken pipe' after the one line)."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass


def _interrupted(interrupt: KeyboardInterrupt) -> int:
    if env_rank() == 0:
        print(f"leantune: {signals.describe(interrupt)}; nothing was written", file=sys.stderr)
    return signals.exit_code(interrupt)


def run() -> None:
    """The `leantune` program (console script and `python -m leantune`)."""
    code = main()
    signals.exit_quietly_on_signal()  # one more Ctrl-C while the interpreter shuts down: no trace
    sys.exit(code)


if __name__ == "__main__":
    run()
