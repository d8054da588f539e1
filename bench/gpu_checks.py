"""GPU correctness checks that the CPU suite cannot run: the varlen flash-attention path on
packed rows against the mask path and against transformers (bf16), the whole model on Triton
kernels against reference ops, and the environment facts.

    python bench/gpu_checks.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import hf_config, record  # noqa: E402

import leantune  # noqa: E402
from leantune import kernels  # noqa: E402
from leantune.batch import PackedBatch  # noqa: E402
from leantune.model import attention as attn  # noqa: E402
from leantune.model.config import ModelConfig  # noqa: E402
from leantune.model.loader import build_empty  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def small_config(window: int | None, layers: int) -> ModelConfig:
    """A small Llama-like config with GQA; Mistral with a sliding window when `window`."""
    d = hf_config("tiny").to_dict()
    d.update(hidden_size=256, intermediate_size=512, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, vocab_size=1000, num_hidden_layers=layers)
    if window:
        d.update(model_type="mistral", sliding_window=window)
    return ModelConfig.from_dict(d)


def main():
    import argparse

    import transformers
    import triton

    argparse.ArgumentParser(description="GPU correctness checks (bf16/fp32): kernels vs "
                            "reference ops, fused layer vs autograd, host-memory embedding; "
                            "one JSON line each").parse_args()

    record("env", torch=torch.__version__, triton=triton.__version__,
           transformers=transformers.__version__, gpu=torch.cuda.get_device_name(),
           capability=list(torch.cuda.get_device_capability()), has_varlen=attn.HAS_VARLEN,
           varlen_params=sorted(attn._VARLEN_PARAMS), leantune=leantune.__version__)
    dev = torch.device("cuda")
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
                attn.force_attention_path(path)
                with torch.no_grad():
                    results[path] = m(batch=b).logits
                attn.force_attention_path(None)
            with kernels.backend("reference"), torch.no_grad():
                attn.force_attention_path("mask")
                ref = m(batch=b).logits
                attn.force_attention_path(None)
            record("gpu_check", what="attention varlen vs mask", window=window, dtype=str(dtype),
                   rel_err=rel(results["varlen"], results["mask"]) if "varlen" in results else None)
            record("gpu_check", what="model triton kernels vs reference ops", window=window,
                   dtype=str(dtype), rel_err=rel(results["mask"], ref))
            # gradients through the packed varlen path vs reference ops + mask
            m.set_checkpointing(True)
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
                    attn.force_attention_path(None if name == "fast" else "mask")
                    loss = m.loss_sum(bb)
                    gs = torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])
                    attn.force_attention_path(None)
                grads[name] = (loss.detach(), torch.cat([x.flatten() for x in gs]))
            record("gpu_check", what="loss+LoRA grads fast path vs reference", window=window,
                   dtype=str(dtype), loss_rel=rel(grads["fast"][0], grads["ref"][0]),
                   grad_rel=rel(grads["fast"][1], grads["ref"][1]))
    fused_layer_checks(dev)
    embedding_check(dev)


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
    from leantune.model.fused_layer import LayerPlan

    for window, lens in ((None, [[100, 300, 57, 55], [512]]), (37, [[100, 300, 57, 55], [512]]),
                         (None, [[512], [512]])):  # the last: one document per row -> cuDNN
        m = build_empty(small_config(window, layers=4), torch.bfloat16, dev)
        m.init_weights(seed=0)
        leantune.apply_lora(m, leantune.LoRAConfig(r=8, alpha=16), dtype=torch.float32)
        for _, layer in leantune.lora.lora_layers(m):
            torch.nn.init.normal_(layer.lora_B.weight, std=0.02)
        g = torch.Generator().manual_seed(1)
        rows = []
        for r in lens:
            row = []
            for n in r:
                ids = torch.randint(0, 1000, (n,), generator=g).tolist()
                row.append((ids, ids[1:] + [-100]))
            rows.append(row)
        b = PackedBatch.from_documents(rows).to(dev)
        params = [p for p in m.parameters() if p.requires_grad]

        def run():
            loss = m.loss_sum(b)
            gs = torch.autograd.grad(loss, params)
            return loss.detach(), torch.cat([x.flatten() for x in gs])

        m.set_layer_plans([None] * 4)
        attn.set_cudnn_attention(False)
        flash = run()
        attn.set_cudnn_attention(True)
        ref = run()
        dense = len(lens[0]) == 1
        record("gpu_check", what="autograd, cuDNN vs flash attention" if dense else
               "autograd, flash attention twice", window=window, loss_rel=rel(ref[0], flash[0]),
               grad_rel=rel(ref[1], flash[1]))
        plans = {"keep0": [LayerPlan(0)] * 4, "keep1": [LayerPlan(1)] * 4,
                 "keep2": [LayerPlan(2)] * 4,
                 "offload": [LayerPlan(1, True)] * 3 + [LayerPlan(1)],
                 "mixed": [LayerPlan(0, True), LayerPlan(2), LayerPlan(1, True), LayerPlan(0)]}
        for name, pl in plans.items():
            m.set_layer_plans(pl)
            first = run()
            again = run()  # pinned buffers reused
            record("gpu_check", what=f"fused layer {name} vs autograd (bf16)",
                   window=window, rows="one document each" if dense else "packed", loss_rel=rel(first[0], ref[0]), grad_rel=rel(first[1], ref[1]),
                   repeat_grad_rel=rel(again[1], first[1]))


if __name__ == "__main__":
    main()
