"""Training mixture-of-experts models on the CPU: LoRA on attention and experts, the router's
load-balancing loss, full fine-tuning of an MXFP4 base, the layers' autograd fallback and the
planner's estimate, and `leantune train` from the command line."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    alpaca_file,  # noqa: F401  (fixture)
    capture_grads,
    load_hf,
    make_tokenizer,
    max_abs,
    one_torch_thread,  # noqa: F401  (autouse)
    quiet,
    read_metrics,
    run_cli,
    save_tiny_moe_checkpoint,
    tiny_ckpt,  # noqa: F401  (fixture)
    train_cfg,
)

import leantune
from leantune.errors import LeantuneError
from leantune.export import export_merged
from leantune.model.config import ModelConfig
from leantune.train.trainer import Trainer


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    tok = make_tokenizer()
    return {name: save_tiny_moe_checkpoint(root / name, tok, family, seed=3, mxfp4=mx)
            for name, family, mx in (("mixtral", "mixtral", False), ("gpt_oss", "gpt_oss", False),
                                     ("gpt_oss_mxfp4", "gpt_oss", True))}


def test_lora_on_experts_trains_and_exports(moe_ckpts, alpaca_file, tmp_path):  # noqa: F811
    logs = []
    cfg = train_cfg(moe_ckpts["gpt_oss"], alpaca_file, tmp_path / "run", max_steps=3,
                    lora_targets="q,v,experts", router_aux_loss_coef=0.01, save_every=2)
    trainer = Trainer(cfg, log=logs.append)
    assert any("load-balancing loss" in line and "--router-aux-loss-coef 0" in line
               for line in logs)
    result = trainer.train()
    metrics = [m for m in read_metrics(tmp_path / "run") if "loss" in m]
    assert len(metrics) == 3 and all(m["loss"] > 0 for m in metrics)
    assert all(0.5 < m["router_aux_loss"] < 2 * 2 for m in metrics)  # ~ top_k when balanced
    assert result.train_loss is not None
    adapter = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert adapter["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    # the experts' adapters learned something, and the export from the final adapter and from
    # the last training checkpoint (our own tensor names) give the same model
    ex = trainer.model.layers[0].mlp.experts
    assert ex.lora_B["down_proj"].abs().max() > 0
    a = export_merged(moe_ckpts["gpt_oss"], tmp_path / "run", tmp_path / "merged")
    ckpt = sorted((tmp_path / "run" / "checkpoints").iterdir())[-1]
    b = export_merged(moe_ckpts["gpt_oss"], ckpt, tmp_path / "merged_ckpt")
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    model = trainer.model.eval()
    with torch.no_grad():
        want = model(ids).logits
        for out in (a, b):
            assert max_abs(load_hf(out)(ids).logits, want) < 1e-4


def test_router_aux_loss_joins_the_gradient(moe_ckpts, alpaca_file, tmp_path,  # noqa: F811
                                            monkeypatch):
    """The step's gradient is that of loss / target tokens + coef * aux loss (the mean over the
    window's micro-batches)."""
    cfg = train_cfg(moe_ckpts["mixtral"], alpaca_file, tmp_path / "run", max_steps=1,
                    grad_accum=2, batch_size=1, max_grad_norm=0, router_aux_loss_coef=0.5,
                    lora_targets="q,experts")
    trainer = Trainer(cfg, log=quiet)
    grads = capture_grads(trainer, monkeypatch)
    batches = (batch for *_, batch in trainer.loader.iter_batches())
    window = [next(batches) for _ in range(2)]
    trainer.train_step(window)
    model = trainer.model
    n = sum(b.num_target_tokens for b in window)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    outs = [model(batch=b, loss_only=True) for b in window]
    ce = sum(o.loss_sum / n for o in outs)
    aux = sum(o.aux_loss / 2 for o in outs)
    ref = torch.autograd.grad(ce + 0.5 * aux, list(params.values()), retain_graph=True)
    for name, r in zip(params, ref):
        torch.testing.assert_close(grads[0][name], r, rtol=1e-4, atol=1e-7)
    ce_only = torch.autograd.grad(ce, list(params.values()))
    assert max(max_abs(a, b) for a, b in zip(ce_only, ref)) > 1e-6  # the aux loss matters


def test_router_aux_loss_needs_a_moe_model(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    with pytest.raises(LeantuneError, match="--router-aux-loss-coef: .* is not a mixture-of-"):
        Trainer(train_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", router_aux_loss_coef=0.1),
                log=quiet)
    with pytest.raises(LeantuneError, match="--router-aux-loss-coef must be 0 or more"):
        train_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", router_aux_loss_coef=-1).validate()


def test_full_finetune_of_an_mxfp4_base_writes_a_dense_checkpoint(  # noqa: F811
        moe_ckpts, alpaca_file, tmp_path):
    cfg = train_cfg(moe_ckpts["gpt_oss_mxfp4"], alpaca_file, tmp_path / "run", max_steps=1,
                    full=True, lora_r=16)
    trainer = Trainer(cfg, log=quiet)
    trainer.train()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert "quantization_config" not in config  # the experts are written dequantised
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert max_abs(load_hf(tmp_path / "run")(ids).logits,
                       trainer.model.eval()(ids).logits) < 1e-4


def test_planner_estimate_for_moe_layers():
    """The autograd path's estimate counts the top-k experts' width and the routed copies."""
    from leantune.engine.executor import Keep
    from leantune.engine.planner import Workload, kept_bytes, plan_memory

    d = dict(model_type="mixtral", vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             num_local_experts=8, num_experts_per_tok=2)
    moe = ModelConfig.from_dict(d)
    dense = ModelConfig.from_dict(dict(d, model_type="mistral"))
    assert moe.mlp_width == 2 * 512 and dense.mlp_width == 512
    w_moe, w_dense = (Workload(c, 4096, autograd=True) for c in (moe, dense))
    extra = kept_bytes(w_moe, Keep.ALL) - kept_bytes(w_dense, Keep.ALL)
    assert extra == int(0.8 * 2 * 4096 * (3 * 512 + 2 * 2 * 256))
    plan = plan_memory(w_moe, 64 << 30, 1 << 30)
    assert len(plan.layers) == 4
    assert moe.num_params() > dense.num_params()


def test_cli_trains_a_moe_checkpoint(moe_ckpts, alpaca_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "--model", moe_ckpts["mixtral"], "--data",
                              alpaca_file, "--output", out, "--max-steps", 2, "--max-seq-len",
                              128, "--batch-size", 2, "--lora-r", 4, "--lora-targets",
                              "q,k,v,o,experts", "--router-aux-loss-coef", "0.02",
                              "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert "note: on a GPU the layers would run (on the CPU every run's do) under autograd" \
        in stdout and "load-balancing loss" in stdout
    assert (out / "adapter_model.safetensors").exists()
    assert "router_aux_loss" in read_metrics(out)[-1]
    model = leantune.load_model(moe_ckpts["mixtral"], device="cpu")
    leantune.load_adapter(model, out)  # the adapter loads back, experts included
    assert model.layers[1].mlp.experts.has_lora


def test_cli_moe_takes_the_fused_layers(moe_ckpts, alpaca_file, tmp_path, capsys):  # noqa: F811
    """Without the router's loss a MoE model (LoRA on the experts too) takes the fused layers."""
    rc, stdout, err = run_cli(capsys, "train", "--model", moe_ckpts["mixtral"], "--data",
                              alpaca_file, "--output", tmp_path / "run", "--max-steps", 1,
                              "--max-seq-len", 128, "--batch-size", 2, "--lora-r", 4,
                              "--lora-targets", "q,v,experts", "--activations", "recompute",
                              "--no-progress", "--device", "cpu")
    assert rc == 0, err
    assert "under autograd" not in stdout
    assert "recompute" in stdout
