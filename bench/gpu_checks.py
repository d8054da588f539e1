"""GPU correctness checks that the CPU suite cannot run: the varlen flash-attention path on
packed rows against the mask path (bf16), the whole model on Triton kernels against reference
ops, the fused layers (flash / cuDNN attention ops, offload through pinned memory and a side
stream, Qwen3's q/k norm kernel) against autograd, the MoE layers (grouped GEMMs against the
per-expert loop, the fused MoE layer against autograd, gpt-oss's sinks on flash attention
against the mask path), and the environment facts.

    python bench/gpu_checks.py            # everything
    python bench/gpu_checks.py --moe      # the MoE checks only
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import hf_config, record  # noqa: E402

import leantune  # noqa: E402
from leantune import kernels  # noqa: E402
from leantune.batch import PackedBatch  # noqa: E402
from leantune.engine import EngineOptions, LayerPlan, attach, detach  # noqa: E402
from leantune.model import attention as attn  # noqa: E402
from leantune.model.config import ModelConfig  # noqa: E402
from leantune.model.loader import build_empty  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def small_config(window: int | None, layers: int, family: str = "llama") -> ModelConfig:
    """A small Llama-like config with GQA; Mistral with a sliding window when `window`; Qwen3
    (q/k norm) with family="qwen3"."""
    d = hf_config("tiny").to_dict()
    d.update(hidden_size=256, intermediate_size=512, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, vocab_size=1000, num_hidden_layers=layers)
    if window:
        d.update(model_type="mistral", sliding_window=window)
    if family == "qwen3":
        d.update(model_type="qwen3")
    cfg = ModelConfig.from_dict(d)
    return cfg


def packed_rows(lens: list[list[int]], dev, seed: int = 1) -> PackedBatch:
    """Rows of random documents of the given lengths (vocabulary 1000), next-token labels."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for r in lens:
        row = []
        for n in r:
            ids = torch.randint(0, 1000, (n,), generator=g).tolist()
            row.append((ids, ids[1:] + [-100]))
        rows.append(row)
    return PackedBatch.from_documents(rows).to(dev)


def randomize_norms(m, seed=0):
    """Norm weights (q/k norms too) away from 1, so that they carry signal."""
    g = torch.Generator(device=next(m.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype) * 0.2)


def main():
    import argparse

    import transformers
    import triton

    ap = argparse.ArgumentParser(
        allow_abbrev=False,
        description="GPU correctness checks (bf16/fp32): kernels vs reference ops, fused layer vs "
                    "autograd, host-memory embedding, MoE; one JSON line each")
    ap.add_argument("--moe", action="store_true", help="the MoE checks only")
    ap.add_argument("--fused", action="store_true", help="the fused layer checks only")
    args = ap.parse_args()

    record("env", torch=torch.__version__, triton=triton.__version__,
           transformers=transformers.__version__, gpu=torch.cuda.get_device_name(),
           capability=list(torch.cuda.get_device_capability()), has_varlen=attn.HAS_VARLEN,
           varlen_params=sorted(attn._VARLEN_PARAMS), leantune=leantune.__version__)
    dev = torch.device("cuda")
    if args.moe:
        moe_checks(dev)
        return
    if args.fused:
        fused_layer_checks(dev)
        return
    # a small Llama-like model with GQA and sliding window variants, fp32 and bf16
    for window in (None, 37):
        cfg = small_config(window, layers=2)
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            m = build_empty(cfg, dtype, dev)
            m.init_weights(seed=0)
            lens = [[100, 300, 57, 55], [512]]
            g = torch.Generator().manual_seed(0)
            rows = [[(torch.randint(0, 1000, (n,), generator=g).tolist(), [-100] * n) for n in r]
                    for r in lens]
            b = PackedBatch.from_documents(rows).to(dev)
            results = {}
            for path in ("varlen", "mask"):
                if path == "varlen" and (not attn.HAS_VARLEN or dtype == torch.float32):
                    continue
                m.attention_path = path
                with torch.no_grad():
                    results[path] = m(batch=b).logits
                m.attention_path = None
            with kernels.backend("reference"), torch.no_grad():
                m.attention_path = "mask"
                ref = m(batch=b).logits
                m.attention_path = None
            record("gpu_check", what="attention varlen vs mask", window=window, dtype=str(dtype),
                   rel_err=rel(results["varlen"], results["mask"]) if "varlen" in results else None)
            record("gpu_check", what="model triton kernels vs reference ops", window=window,
                   dtype=str(dtype), rel_err=rel(results["mask"], ref))
            # gradients through the packed varlen path vs reference ops + mask
            attach(m, [LayerPlan(0)] * 2, EngineOptions(fused_layers=False))
            leantune.apply_lora(m, leantune.LoRAConfig(r=8, alpha=16), dtype=torch.float32)
            for _, layer in leantune.lora.lora_layers(m):
                torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
            lab = b.input_ids.clone()
            lab[:, :-1] = b.input_ids[:, 1:]
            lab[:, -1] = -100
            bb = PackedBatch(**{**b.__dict__, "labels": lab})
            grads = {}
            for name, ctx in (("fast", kernels.backend("auto")), ("ref", kernels.backend("reference"))):
                with ctx:
                    m.attention_path = None if name == "fast" else "mask"
                    loss = m.loss_sum(bb)
                    gs = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])
                    m.attention_path = None
                grads[name] = (loss.detach(), torch.cat([x.flatten() for x in gs]))
            record("gpu_check", what="loss+LoRA grads fast path vs reference", window=window,
                   dtype=str(dtype), loss_rel=rel(grads["fast"][0], grads["ref"][0]),
                   grad_rel=rel(grads["fast"][1], grads["ref"][1]))
    fused_layer_checks(dev)
    qk_norm_rope_check(dev)
    embedding_check(dev)
    moe_checks(dev)


def qk_norm_rope_check(dev, B=4, T=2048, Hq=40, Hk=8, D=128):
    """The fused q/k norm + RoPE kernel on the GPU against the reference (RMSNorm then RoPE
    under autograd), forward and backward, bf16 at Qwen3-14B's head shapes; and its time."""
    from leantune.kernels.qk_norm_rope import (qk_norm_rope_bwd_, qk_norm_rope_fwd,
                                               qk_norm_rope_reference)
    from leantune.model.rope import rope_cos_sin, rope_inv_freq

    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(B, T, (Hq + 2 * Hk) * D, device=dev, generator=g).to(torch.bfloat16) * 3
    q = qkv[..., :Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D)
    wq = (1 + 0.3 * torch.randn(D, device=dev, generator=g)).to(torch.bfloat16)
    wk = (1 + 0.3 * torch.randn(D, device=dev, generator=g)).to(torch.bfloat16)
    pos = torch.arange(T, device=dev).expand(B, T)
    inv, scale = rope_inv_freq(D, 1e6, None, device=dev)
    cos, sin = rope_cos_sin(pos, inv, scale, torch.bfloat16)
    qo, ko = qk_norm_rope_fwd(q, k, wq, wk, 1e-6, 0.0, cos, sin)
    q0, k0 = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
    qr, kr = qk_norm_rope_reference(q0, k0, wq.float(), wk.float(), 1e-6, 0.0, cos.float(),
                                    sin.float())
    dq_out = torch.randn(q.shape, device=dev, generator=g).to(torch.bfloat16)
    dk_out = torch.randn(k.shape, device=dev, generator=g).to(torch.bfloat16)
    gq, gk = torch.autograd.grad((qr, kr), (q0, k0), (dq_out.float(), dk_out.float()))
    dq, dk = dq_out.clone(), dk_out.clone()
    qk_norm_rope_bwd_(dq, dk, q, k, wq, wk, 1e-6, 0.0, cos, sin)
    s_, e_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s_.record()
    for _ in range(10):
        qk_norm_rope_fwd(q, k, wq, wk, 1e-6, 0.0, cos, sin)
    e_.record()
    torch.cuda.synchronize()
    record("gpu_check", what="q/k norm + rope kernel vs fp32 reference (bf16, Qwen3-14B heads)",
           q_rel=rel(qo, qr), k_rel=rel(ko, kr), dq_rel=rel(dq, gq), dk_rel=rel(dk, gk),
           fwd_ms=round(s_.elapsed_time(e_) / 10, 3))


def embedding_check(dev, V=128256, H=4096, tokens=8192):
    """The input embedding read from pinned host memory (kernels/embedding.py) equals the table
    on the GPU, bit for bit; and how long the gather over the host link takes."""
    from leantune.kernels.embedding import embedding_lookup

    table = torch.randn(V, H, dtype=torch.bfloat16)
    host = table.pin_memory()
    ids = torch.randint(0, V, (4, tokens // 4), device=dev)
    on_gpu = torch.nn.functional.embedding(ids, table.to(dev))
    out = embedding_lookup(ids, host)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        embedding_lookup(ids, host)
    e.record()
    torch.cuda.synchronize()
    record("gpu_check", what="embedding gathered from pinned host memory vs on the GPU",
           equal=bool(torch.equal(out, on_gpu)), ms=round(s.elapsed_time(e) / 10, 3))


def fused_layer_checks(dev):
    """The hand-written layer backward (flash-attention ops called directly, offload through
    pinned memory and a side stream) against autograd on the same varlen path, bf16."""
    for family, window, lens in (
            ("llama", None, [[100, 300, 57, 55], [512]]), ("llama", 37, [[100, 300, 57, 55], [512]]),
            ("llama", None, [[512], [512]]),  # one document per row -> cuDNN
            ("qwen3", None, [[100, 300, 57, 55], [512]]), ("qwen3", None, [[512], [512]])):
        m = build_empty(small_config(window, layers=4, family=family), torch.bfloat16, dev)
        m.init_weights(seed=0)
        randomize_norms(m)
        leantune.apply_lora(m, leantune.LoRAConfig(r=8, alpha=16), dtype=torch.float32)
        for _, layer in leantune.lora.lora_layers(m):
            torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
        b = packed_rows(lens, dev)
        params = [p for p in m.parameters() if p.requires_grad]

        def run():
            loss = m.loss_sum(b)
            gs = torch.autograd.grad(loss, params)
            return loss.detach(), torch.cat([x.flatten() for x in gs])

        detach(m)
        ref = run()
        again = run()
        dense = len(lens[0]) == 1
        record("gpu_check", what="autograd (SDPA / varlen flash) twice", family=family,
               window=window, rows="one document each" if dense else "packed",
               loss_rel=rel(again[0], ref[0]), grad_rel=rel(again[1], ref[1]))
        plans = {"keep0": [LayerPlan(0)] * 4, "keep1": [LayerPlan(1)] * 4,
                 "keep2": [LayerPlan(2)] * 4,
                 "offload": [LayerPlan(1, True)] * 3 + [LayerPlan(1)],
                 # q/k/v projected again in backward (the planner's trim_for_link)
                 "offload without q/k/v": [LayerPlan(1, True, keep_qkv=False)] * 3
                 + [LayerPlan(2, keep_qkv=False)],
                 "mixed": [LayerPlan(0, True), LayerPlan(2), LayerPlan(1, True), LayerPlan(0)]}
        seen = {}
        for name, pl in plans.items():
            for attention in (("auto", "flash") if dense else ("auto",)):
                attach(m, pl, EngineOptions(attention=attention))
                first = run()
                again = run()  # pinned buffers reused
                seen[name, attention] = first, again
                if name == "offload without q/k/v":  # against keeping them: bit for bit where
                    # attention's backward is deterministic (cuDNN), else within its own
                    # run-to-run spread (flash's dq accumulates in any order)
                    kept, kept_again = seen["offload", attention]
                    record("gpu_check", what="fused layer offload without q/k/v vs with",
                           family=family, window=window, attention=attention,
                           rows="one document each" if dense else "packed",
                           bit_identical=bool(torch.equal(first[0], kept[0])
                                              and torch.equal(first[1], kept[1])),
                           grad_rel=rel(first[1], kept[1]),
                           kept_repeat_grad_rel=rel(kept_again[1], kept[1]))
                record("gpu_check", what=f"fused layer {name} vs autograd (bf16)", family=family,
                       window=window, rows="one document each" if dense else "packed",
                       attention=attention, loss_rel=rel(first[0], ref[0]),
                       grad_rel=rel(first[1], ref[1]), repeat_grad_rel=rel(again[1], first[1]))


MOE_CONFIGS = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=128, norm_topk_prob=True),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=128, sliding_window=37, attention_bias=True,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False,
                                  "original_max_position_embeddings": 256},
                    rope_theta=150000.0),
}


def moe_checks(dev):
    """MoE on the GPU, bf16, packed rows, LoRA on attention and experts (random B): autograd
    with grouped GEMMs vs the per-expert loop; the fused MoE layer at each keep level and
    offloaded vs autograd; for gpt-oss, sinks on flash attention (varlen) vs the mask path."""
    from leantune.engine import Engine
    from leantune.model.moe import MoEBlock

    for family, extra in MOE_CONFIGS.items():
        d = hf_config("tiny").to_dict()
        d.update(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, vocab_size=1000, num_hidden_layers=4)
        d.update(extra)
        m = build_empty(ModelConfig.from_dict(d), torch.bfloat16, dev)
        m.init_weights(seed=0)
        randomize_norms(m)
        leantune.apply_lora(m, leantune.LoRAConfig(r=8, alpha=16, targets=[
            "q_proj", "k_proj", "v_proj", "o_proj", "experts"]), dtype=torch.float32)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
        b = packed_rows([[100, 300, 57, 55], [512]], dev)
        blocks = [layer.mlp for layer in m.layers if isinstance(layer.mlp, MoEBlock)]

        def run(model=m):
            loss = model.loss_sum(b)
            gs = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
            return loss.detach(), torch.cat([x.flatten() for x in gs])

        detach(m)
        ref = run()
        again = run()
        # the noise floor of bf16: the same model in fp32 (autograd)
        fp32 = run(copy.deepcopy(m).float())
        record("gpu_check", what="MoE autograd twice (grouped GEMMs)", family=family,
               loss_rel=rel(again[0], ref[0]), grad_rel=rel(again[1], ref[1]))
        record("gpu_check", what="MoE autograd bf16 vs fp32 (the noise floor)", family=family,
               loss_rel=rel(ref[0], fp32[0]), grad_rel=rel(ref[1], fp32[1]))
        for blk in blocks:
            blk.grouped_mm = False
        loop = run()
        for blk in blocks:
            blk.grouped_mm = None
        record("gpu_check", what="MoE grouped GEMMs vs per-expert loop (autograd)",
               family=family, loss_rel=rel(ref[0], loop[0]), grad_rel=rel(ref[1], loop[1]))
        if m.config.attention_sinks:
            m.attention_path = "mask"
            mask = run()
            m.attention_path = None
            record("gpu_check", what="sinks: flash varlen vs mask path (autograd)",
                   family=family, loss_rel=rel(ref[0], mask[0]), grad_rel=rel(ref[1], mask[1]))
        plans = {"keep0": [LayerPlan(0)] * 4, "keep1": [LayerPlan(1)] * 4,
                 "keep2": [LayerPlan(2)] * 4,
                 "mixed offload": [LayerPlan(0, True), LayerPlan(2), LayerPlan(1, True),
                                   LayerPlan(2, True)]}
        for name, pl in plans.items():
            engine = Engine()
            engine.attach(m, pl)
            kinds = {layer.executor.kind for layer in m.layers}
            first = run()
            second = run()
            record("gpu_check", what=f"fused MoE layer {name} vs autograd (bf16)", family=family,
                   executors=sorted(kinds), loss_rel=rel(first[0], ref[0]),
                   grad_rel=rel(first[1], ref[1]), repeat_grad_rel=rel(second[1], first[1]),
                   vs_fp32_grad_rel=rel(first[1], fp32[1]))
        detach(m)


if __name__ == "__main__":
    main()
