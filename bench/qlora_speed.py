"""Issue 12: QLoRA. leantune's LoRA on an NF4 base vs leantune's bf16 LoRA in the same run, and
transformers + PEFT + bitsandbytes NF4 (when bitsandbytes imports); peak memory; the time to load
16-bit safetensors quantising on the fly.

Workload (as bench/speed.py): random weights of the named shape, LoRA r=16 alpha=16 on
q,k,v,o,gate,up,down (fp32 adapter masters), rows x seq tokens of random ids, fused AdamW on the
LoRA parameters; median of --steps steps after --warmup; peak = torch.cuda.max_memory_allocated
over the steps (weights included). Per shape, one random bf16 checkpoint is written to --scratch
(sharded safetensors; evicted from the page cache, so the first load reads the disk) and every
model is loaded from it: leantune NF4 (`load_model(..., load_in_4bit=True)`: the load time and
its GPU peak are reported, quantisation included), leantune bf16, and the baseline,
`AutoModelForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig(nf4, double
quantisation, bf16 compute))` + `prepare_model_for_kbit_training` + PEFT, non-reentrant gradient
checkpointing (the usual QLoRA recipe). Shapes too large for a checkpoint on this disk
(--no-checkpoint, default for llama-3.1-70b) are built NF4 in place from random bf16 weights
drawn on the GPU one projection at a time (the quantisation time is reported).

    python bench/qlora_speed.py --shape llama-3.1-8b          # NF4 auto@7.5, bf16 auto@17, bnb
    python bench/qlora_speed.py --shape llama-3.2-1b          # NF4 auto@2.5, bf16 auto@4, bnb
    python bench/qlora_speed.py --shape llama-3.1-70b --steps 3 --warmup 1
    python bench/qlora_speed.py --shape tiny --device cpu     # a dry run of the whole script

`--nf4` / `--bf16` take leantune activation policies (keep | recompute | offload | auto |
auto@GiB, several to time each; `--bf16 none` skips the bf16 run); `--no-baseline` skips
bitsandbytes.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (H200_BF16_FLOPS, flops_per_token, hf_config, median,  # noqa: E402
                     peak_gib, record, reset_peak, step_times, sync)
from shapes import LLAMA3_ROPE, SHAPES  # noqa: E402
from speed import random_batch  # noqa: E402

from leantune.model.config import ModelConfig  # noqa: E402

SHAPES.setdefault("llama-3.1-70b", dict(
    model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
    num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=8.0),
    max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_id=128001))

# (NF4 policies, bf16 policies) by shape: the budgets for NF4; bf16 at the budget of the
# speed issue (the same room for activations beside its 16-bit weights)
DEFAULTS = {"llama-3.1-8b": (["auto@7.5"], ["auto@17"]),
            "llama-3.2-1b": (["auto@2.5"], ["auto@4"]),
            "llama-3.1-70b": (["auto"], [])}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --- the weights -----------------------------------------------------------------------------
def write_random_checkpoint(shape: str, folder: Path, device, seed: int = 0) -> float:
    """A random bf16 checkpoint of `shape` (normal(0, 0.02), norms 1) in `folder`, sharded as
    transformers saves one, then evicted from the page cache. Returns the GiB written."""
    from leantune.export.shards import write_sharded
    from leantune.model.loader import build_empty

    cfg = hf_config(shape)
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in build_empty(
            ModelConfig.from_dict(cfg.to_dict()), torch.bfloat16, torch.device("meta"))
            .named_parameters()}
    g = torch.Generator(device=device).manual_seed(seed)

    def make(name, shape_):
        if name.endswith("norm.weight"):
            return torch.ones(shape_, dtype=torch.bfloat16)
        t = torch.empty(shape_, dtype=torch.bfloat16, device=device).normal_(0, 0.02,
                                                                             generator=g)
        return t.cpu()

    folder.mkdir(parents=True, exist_ok=True)
    entries = [(n, 2 * math.prod(s), lambda n=n, s=s: make(n, s)) for n, s in names.items()]
    write_sharded(entries, folder, max_shard_bytes=5 << 30)
    cfg.save_pretrained(folder)
    evict(folder)
    return sum(e[1] for e in entries) / 2**30


def evict(folder: Path) -> None:
    """Drop the checkpoint's pages from the page cache (written back first), so the next load
    reads the disk."""
    for f in folder.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def nf4_in_place(shape: str, device, seed: int = 0):
    """An NF4 model of `shape` without a checkpoint: every decoder projection quantised from
    random bf16 weights drawn on the device one at a time. Returns (model, quantise seconds)."""
    from leantune.model.loader import build_empty, nf4_projections
    from leantune.model.transformer import CausalLM

    cfg = ModelConfig.from_dict(hf_config(shape).to_dict())
    with torch.device("meta"):
        names = [n for n, _ in nf4_projections(CausalLM(cfg))]
    model = build_empty(cfg, torch.bfloat16, device, {n: None for n in names})
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=g)
        seconds = 0.0
        for _, mod in nf4_projections(model):
            w = torch.empty(mod.nf4.shape, dtype=torch.bfloat16, device=device)
            w.normal_(0, 0.02, generator=g)
            sync(device)
            t0 = time.perf_counter()
            mod.nf4.quantize_(w)
            sync(device)
            seconds += time.perf_counter() - t0
            del w
    return model, seconds


def dequant_rates(model, device) -> dict:
    """ms and GB/s (4-bit state read + bf16 written) of the Triton dequantisation of each of the
    first layer's NF4 weights into a bf16 buffer."""
    from harness import mean_ms

    from leantune.model.loader import nf4_projections

    out = {}
    for name, mod in nf4_projections(model):
        if not name.startswith("model.layers.0."):
            break
        q = mod.nf4
        buf = torch.empty(q.shape, dtype=torch.bfloat16, device=device)
        ms = mean_ms(lambda: q.dequantize(out=buf))
        moved = q.packed.numel() + q.absmax.numel() + 2 * buf.numel()
        out[name.rsplit(".", 1)[-1]] = {"ms": ms, "gb_s": moved / ms / 1e6}
    return out


# --- the runs --------------------------------------------------------------------------------
def leantune_step(model, batch, policy: str, steps: int, device):
    """A Trainer over `model` under `policy` (keep | recompute | offload | auto | auto@GiB) and
    its step on `batch`."""
    from leantune.train.config import TrainConfig
    from leantune.train.trainer import Trainer

    activations, _, budget = policy.partition("@")
    cfg = TrainConfig(output=tempfile.mkdtemp(), max_seq_len=batch.input_ids.shape[1],
                      batch_size=batch.input_ids.shape[0], lr=1e-4, warmup_steps=0,
                      max_steps=steps, progress=False, eval_every=0, lora_r=16, lora_alpha=16,
                      overwrite=True, device=str(device), dtype="bfloat16",
                      activations=activations, max_memory_gib=float(budget) if budget else None)
    docs = [(batch.input_ids[0].tolist(), batch.labels[0].tolist())]
    trainer = Trainer(cfg, model=model, train_data=docs, log=lambda *a: None)
    on_device = batch.to(device)
    return trainer, lambda: trainer.train_step([on_device])


def run_leantune(impl, model, batch, policies, args, device, extra):
    """Time each policy on `model`; one record each. Returns {policy: tokens/s}."""
    from leantune.engine import detach

    tokens = batch.input_ids.numel()
    fpt = flops_per_token(model.config, batch.input_ids.shape[1])
    out = {}
    for policy in policies:
        try:
            trainer, step = leantune_step(model, batch, policy, args.steps, device)
            reset_peak(device)
            t = median(step_times(step, args.warmup, args.steps, device))
        except Exception as e:  # OOM or a budget no plan fits: record it and go on
            record("qlora", shape=args.shape_now, impl=impl, policy=policy,
                   error=f"{type(e).__name__}: {str(e)[:300]}")
            detach(model)
            reset_peak(device)
            continue
        out[policy] = tokens / t
        record("qlora", shape=args.shape_now, impl=impl, policy=policy,
               plan=trainer.activation_policy, tok_s=tokens / t, step_s=t,
               peak_gib=peak_gib(device), mfu=fpt * tokens / t / H200_BF16_FLOPS, **extra)
        del trainer, step
        detach(model)  # (the executors hold the engine's scratch buffers)
        reset_peak(device)
    return out


def run_bnb(folder: Path, batch, args, device):
    """transformers + PEFT + bitsandbytes NF4 (the usual QLoRA recipe) -> tokens/s, or None."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as e:
        record("qlora", shape=args.shape_now, impl="hf+peft+bnb",
               error=f"bitsandbytes does not import ({type(e).__name__}); carry its wheel")
        return None
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16)
    reset_peak(device)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=torch.bfloat16,
                                              device_map={"": str(device)},
                                              attn_implementation="sdpa")
    load_s = time.perf_counter() - t0
    hf.config.use_cache = False
    hf = prepare_model_for_kbit_training(
        hf, use_gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(0)
    pm = get_peft_model(hf, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0,
                                       target_modules=TARGETS, task_type="CAUSAL_LM"))
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda" or None)
    ids = batch.input_ids.to(device)

    def step():
        pm(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_peak(device)
    t = median(step_times(step, args.warmup, args.steps, device))
    tokens = batch.input_ids.numel()
    cfg = ModelConfig.from_dict(hf_config(args.shape_now).to_dict())
    record("qlora", shape=args.shape_now, impl="hf+peft+bnb", policy="recompute",
           tok_s=tokens / t, step_s=t, peak_gib=peak_gib(device), load_s=load_s,
           mfu=flops_per_token(cfg, batch.input_ids.shape[1]) * tokens / t / H200_BF16_FLOPS)
    del pm, hf, opt, params
    reset_peak(device)
    return tokens / t


def bench_shape(shape: str, args, device) -> None:
    from leantune.model.loader import load_model

    args.shape_now = shape
    nf4_policies, bf16_policies = DEFAULTS.get(shape, (["keep"], ["keep"]))
    nf4_policies = args.nf4 or nf4_policies
    bf16_policies = [] if args.bf16 == ["none"] else (args.bf16 or bf16_policies)
    cfg = ModelConfig.from_dict(hf_config(shape).to_dict())
    batch = random_batch(cfg.vocab_size, args.rows, args.seq)
    in_place = args.no_checkpoint or shape == "llama-3.1-70b"
    scratch = Path(tempfile.mkdtemp(dir=args.scratch, prefix=f"qlora-{shape}-"))
    try:
        if in_place:
            reset_peak(device)
            model, quant_s = nf4_in_place(shape, device)
            extra = dict(quantize_s=quant_s, built_peak_gib=peak_gib(device))
        else:
            t0 = time.perf_counter()
            gib = write_random_checkpoint(shape, scratch, device)
            record("qlora", shape=shape, impl="checkpoint", written_gib=gib,
                   write_s=time.perf_counter() - t0)
            reset_peak(device)
            t0 = time.perf_counter()
            model = load_model(scratch, dtype=torch.bfloat16, device=device, load_in_4bit=True)
            sync(device)
            extra = dict(load_s=time.perf_counter() - t0, load_peak_gib=peak_gib(device),
                         cold=True)
        record("qlora", shape=shape, impl="leantune-nf4", step="load", **extra)
        if device.type == "cuda":
            record("qlora", shape=shape, impl="leantune-nf4", step="dequantize",
                   per_weight=dequant_rates(model, device))
        nf4 = run_leantune("leantune-nf4", model, batch, nf4_policies, args, device, {})
        del model
        reset_peak(device)
        bf16 = {}
        if bf16_policies and not in_place:
            model = load_model(scratch, dtype=torch.bfloat16, device=device)
            bf16 = run_leantune("leantune-bf16", model, batch, bf16_policies, args, device, {})
            del model
            reset_peak(device)
        bnb = None if args.no_baseline or in_place else run_bnb(scratch, batch, args, device)
        for p, tok_s in nf4.items() if bf16 or bnb else ():
            record("qlora", shape=shape, impl="ratio", policy=p,
                   vs_own_bf16={b: tok_s / v for b, v in bf16.items()},
                   vs_bnb=(tok_s / bnb) if bnb else None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", nargs="+", default=["llama-3.1-8b"])
    ap.add_argument("--nf4", nargs="+", help="leantune NF4 policies (default: by shape)")
    ap.add_argument("--bf16", nargs="+", help="leantune bf16 policies (default: by shape; none)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-baseline", action="store_true", help="skip bitsandbytes")
    ap.add_argument("--no-checkpoint", action="store_true",
                    help="build the NF4 model in place (no checkpoint, no bf16 or bnb run)")
    ap.add_argument("--scratch", default=None, help="folder for the random checkpoint")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and args.seq == 2048:  # a dry run: small and quick
        args.rows, args.seq, args.warmup, args.steps = 2, 64, 1, 2
    for shape in args.shape:
        bench_shape(shape, args, device)


if __name__ == "__main__":
    main()
