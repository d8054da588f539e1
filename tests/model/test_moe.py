"""Mixture-of-experts: the MoE block's grouped routing against a per-expert-mask reference
(forward and gradients, the loop and the grouped GEMM), the families' flags and what makes them
differ from the dense ones (each shown to matter), checkpoints in every expert layout (per
expert, stacked, MXFP4), YaRN, and the load-balancing loss, all against transformers."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    MOE_FAMILIES,
    load_hf,
    logits_of,
    max_abs,
    one_torch_thread,  # noqa: F401  (autouse)
    quantize_mxfp4,
    save_checkpoint,
    save_mxfp4_gpt_oss,
    tiny_config,
)

import leantune
from leantune.errors import LeantuneError
from leantune.model.config import ModelConfig
from leantune.model.moe import Grouping, MoEBlock, gpt_oss_swiglu
from leantune.model.mxfp4 import dequantize_mxfp4

TOL = 1e-4



def _ids(seed=1, shape=(2, 13)):
    return torch.randint(0, 101, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (per-expert folder, stacked folder, transformers model)."""
    out = {}
    for i, fam in enumerate(MOE_FAMILIES):
        per_expert, stacked = (tmp_path_factory.mktemp(f"{fam}_{kind}")
                               for kind in ("per_expert", "stacked"))
        hf = save_checkpoint(fam, per_expert, seed=50 + i)
        hf.save_pretrained(stacked, save_original_format=False)
        out[fam] = (per_expert, stacked, hf)
    return out


def _keys(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


# --- checkpoints and parity -----------------------------------------------------------------------

@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("layout", ["per_expert", "stacked"])
def test_logits_match_transformers_from_either_expert_layout(checkpoints, family, layout):
    per_expert, stacked, hf = checkpoints[family]
    folder = per_expert if layout == "per_expert" else stacked
    keys = _keys(folder)
    has_stacked = any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
    # transformers 5.x writes per-expert tensors by default (gpt-oss has always been stacked)
    assert has_stacked == (layout == "stacked" or family == "gpt_oss")
    model = leantune.load_model(folder, device="cpu").eval()
    ids = _ids()
    ref = logits_of(hf, ids)
    assert ref.abs().max() > 0.1
    assert max_abs(logits_of(model, ids), ref) < TOL
    # and transformers reads the same checkpoint back to the same model
    assert max_abs(logits_of(load_hf(folder), ids), ref) < TOL


def test_family_flags_are_read(checkpoints):
    q = ModelConfig.from_file(checkpoints["qwen3_moe"][0] / "config.json")
    assert q.moe.num_experts == 6 and q.moe.top_k == 2 and q.moe.intermediate_size == 24
    assert q.moe.router == "softmax_topk" and not q.moe.norm_topk_prob and q.qk_norm
    assert q.moe.dense_layers == (1,) and [q.is_moe_layer(i) for i in range(3)] == [True, False,
                                                                                     True]
    qn = ModelConfig.from_file(checkpoints["qwen3_moe_norm"][0] / "config.json")
    assert qn.moe.norm_topk_prob and qn.moe.dense_layers == (0, 2)  # decoder_sparse_step 2
    m = ModelConfig.from_file(checkpoints["mixtral"][0] / "config.json")
    assert m.moe.num_experts == 5 and m.moe.norm_topk_prob and m.sliding_window == 4
    assert m.moe.intermediate_size == 40 and not m.attention_sinks
    g = ModelConfig.from_file(checkpoints["gpt_oss"][0] / "config.json")
    assert g.attention_sinks and g.attention_bias and g.o_bias and g.moe.bias
    assert g.moe.router == "topk_softmax" and g.moe.swiglu_limit == 0.5
    assert g.moe.swiglu_alpha == pytest.approx(1.702)
    assert [g.window_for_layer(i) for i in range(2)] == [4, None]
    assert g.rope_scaling["rope_type"] == "yarn" and g.rope_theta == 150000.0


def test_gpt_oss_release_config_names():
    """gpt-oss's own config.json: experts_per_token, rope_scaling (v4 names), no layer_types."""
    d = dict(model_type="gpt_oss", vocab_size=11, hidden_size=64, intermediate_size=32,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             num_local_experts=4, experts_per_token=2, sliding_window=128,
             rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                           "truncate": False})
    cfg = ModelConfig.from_dict(d)
    assert cfg.moe.top_k == 2 and cfg.moe.swiglu_limit == 7.0 and cfg.rope_theta == 150000.0
    assert [cfg.window_for_layer(i) for i in range(4)] == [128, None, 128, None]
    with pytest.raises(LeantuneError, match="invalid value"):
        ModelConfig.from_dict(dict(d, experts_per_token=5))  # more than the 4 experts


def _perturbed_logits(model, ids, setattrs):
    """Logits with attributes changed by `setattrs` (a list of (obj, name, value)), restored."""
    old = [(o, n, getattr(o, n)) for o, n, _ in setattrs]
    try:
        for o, n, v in setattrs:
            setattr(o, n, v)
        return logits_of(model, ids)
    finally:
        for o, n, v in old:
            setattr(o, n, v)


def test_gpt_oss_features_are_exercised(checkpoints):
    """The gpt-oss parity means something: without its sinks, its SwiGLU clamp, YaRN or its
    windows the logits differ."""
    folder, _, hf = checkpoints["gpt_oss"]
    model = leantune.load_model(folder, device="cpu").eval()
    ids = _ids(shape=(1, 13))
    ref = logits_of(hf, ids)
    assert max_abs(logits_of(model, ids), ref) < TOL
    layers = model.layers
    no_sinks = [(layer.self_attn.sinks, "data", torch.full((4,), -1e4)) for layer in layers]
    no_window = [(layer.self_attn, "window", None) for layer in layers]
    plain_rope = [(model, "config", replace(model.config, rope_scaling=None)),
                  (model, "_rope_cache", {})]
    unclamped = replace(model.config.moe, swiglu_limit=1e9)  # (the spec is frozen)
    no_clamp = [(layer.mlp.experts, "spec", unclamped) for layer in layers]
    for name, change in [("sinks", no_sinks), ("window", no_window), ("rope", plain_rope),
                         ("clamp", no_clamp)]:
        assert max_abs(_perturbed_logits(model, ids, change), ref) > 1e-3, name


def test_dense_layers_of_qwen3_moe(checkpoints):
    model = leantune.load_model(checkpoints["qwen3_moe"][0], device="cpu")
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["MoEBlock", "MLP", "MoEBlock"]
    assert model.layers[1].mlp.up_proj.out_features == 80  # the dense intermediate_size


def test_gpt_oss_swiglu_clamps():
    gu = torch.tensor([[10.0, 10.0, -10.0, -10.0, 0.3, -0.2]])  # [g0, u0, g1, u1, g2, u2]
    out = gpt_oss_swiglu(gu, alpha=1.702, limit=7.0)
    g = torch.tensor([7.0, -10.0, 0.3])
    u = torch.tensor([7.0, -7.0, -0.2])
    torch.testing.assert_close(out[0], (u + 1) * g * torch.sigmoid(1.702 * g))


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("extra", [{}, {"mscale": 1.0, "mscale_all_dim": 0.5},
                                   {"attention_factor": 1.2}])
def test_yarn_matches_transformers(truncate, extra):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from leantune.model.rope import rope_inv_freq

    params = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
              "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": truncate,
              **extra}
    cfg = GptOssConfig(head_dim=64, max_position_embeddings=131072, rope_parameters=params)
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    inv, scale = rope_inv_freq(64, 150000.0, params)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


# --- the MoE block: grouped routing against a per-expert-mask reference ---------------------------

def reference_moe(block: MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """The MoE block as plainly as it can be written: for each expert, the tokens that chose it
    (a mask), its MLP, weighted, added back. x [N, H] -> [N, H]."""
    ex, spec = block.experts, block.spec
    _, weights, idx = block.route(x)
    out = torch.zeros_like(x)

    def proj(name, e, h):
        w = getattr(ex, name)[e]
        y = h @ (w if ex.transposed else w.t())
        bias = getattr(ex, name + "_bias")
        if bias is not None:
            y = y + bias[e]
        if name in ex.lora_A:
            y = y + h @ ex.lora_A[name][e].t() @ ex.lora_B[name][e].t() * ex.scaling
        return y

    for e in range(spec.num_experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        h = proj("gate_up_proj", e, x[tok])
        if spec.swiglu_limit is not None:
            h = gpt_oss_swiglu(h, spec.swiglu_alpha, spec.swiglu_limit)
        else:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        y = proj("down_proj", e, h) * weights[tok, slot, None]
        out = out.index_add(0, tok, y)
    return out


def _block(family: str, lora: bool, seed: int = 0) -> MoEBlock:
    """The first MoE block of a random model of `family` (fp32), everything trainable, with
    random LoRA on its experts if `lora`."""
    cfg = ModelConfig.from_dict(tiny_config(family).to_dict())
    model = leantune.model.loader.build_empty(cfg, torch.float32, torch.device("cpu"))
    model.init_weights(std=0.2, seed=seed)
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        if lora:
            block.experts.add_lora(4, 8)
            for p in block.experts.lora_B.values():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return block


def _outputs_and_grads(fn, block, x):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    params = [p for p in block.parameters() if p.requires_grad]
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(),
                                [x, *params])
    return y.detach(), grads


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("grouped", [False, True])
def test_grouped_routing_matches_per_expert_masks(family, lora, grouped):
    """Forward and every gradient (input, router, experts, biases, LoRA) of the grouped block
    equal the per-expert-mask reference; `grouped`: the grouped GEMM (torch's grouped_mm, which
    this CPU build has for fp32) instead of the loop."""
    block = _block(family, lora)
    block.grouped_mm = grouped
    H = block.experts.down_proj.shape[-1 if block.experts.transposed else 1]
    x = torch.randn(37, H, generator=torch.Generator().manual_seed(3))
    ref, ref_grads = _outputs_and_grads(lambda t: reference_moe(block, t), block, x)
    got, grads = _outputs_and_grads(lambda t: block(t[None])[0], block, x)
    assert ref.abs().max() > 0.1
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert len(grads) == len(ref_grads) == 1 + len(list(block.parameters()))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_grouping_is_one_sort_and_every_expert_may_be_empty():
    idx = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 unused
    g = Grouping.build(idx, 4)
    assert g.counts.tolist() == [2, 0, 3, 1] and g.ends.tolist() == [2, 2, 5, 6]
    assert g.ends.dtype == torch.int32
    assert g.experts.tolist() == [0, 0, 2, 2, 2, 3]
    assert g.tokens.tolist() == [0, 2, 0, 1, 2, 1]  # stable: token order within an expert
    flat = idx.reshape(-1)
    assert torch.equal(flat[g.order], g.experts)
    assert torch.equal(g.order[g.inverse], torch.arange(6))
    assert g.host_counts == [2, 0, 3, 1]


# --- MXFP4 ----------------------------------------------------------------------------------------

def test_mxfp4_dequantisation_matches_transformers_and_the_packer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 64, generator=g) * torch.logspace(-3, 2, 5)[None, :, None]
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == w.shape
    # transformers' dequantiser returns the gpt-oss parameter layout [E, in, out]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(ours, theirs.transpose(1, 2), rtol=0, atol=0)
    # within the block's scale: half of E2M1's coarsest spacing (2), or what the clamp at 6 cuts
    # from the largest value (< 8) times the scale
    scale = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert ((ours - w).abs() <= 2 * scale).all()
    # values on the grid come back exactly; nibble order: element 0 in the low nibble
    exact = torch.tensor([0.5, -1.5, 6.0, 0.0] * 8)
    b, s = quantize_mxfp4(exact)
    assert b[0, 0] == 1 | (11 << 4) and s[0] == 127
    torch.testing.assert_close(dequantize_mxfp4(b, s), exact, rtol=0, atol=0)
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(b[..., :8], s)


def test_mxfp4_checkpoint_loads_dequantised(tmp_path):
    hf = save_mxfp4_gpt_oss(tmp_path, seed=7)
    keys = _keys(tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    from leantune.train.preflight import check_weights

    check_weights(tmp_path)  # the pre-flight check reads the same plan
    for dtype, tol in ((torch.float32, TOL), (torch.bfloat16, None)):
        model = leantune.load_model(tmp_path, device="cpu", dtype=dtype).eval()
        w = model.layers[1].mlp.experts.down_proj
        ref_w = hf.model.layers[1].mlp.experts.down_proj
        assert w.dtype == dtype and torch.equal(w.float(), ref_w.to(dtype).float())
        if tol:
            ids = _ids()
            assert max_abs(logits_of(model, ids), logits_of(hf, ids)) < tol
    # transformers reads the packed checkpoint (dequantising on the CPU) to the same model
    from transformers import AutoModelForCausalLM, Mxfp4Config

    theirs = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager").eval()
    ids = _ids()
    assert max_abs(logits_of(theirs, ids), logits_of(hf, ids)) < TOL


def test_mxfp4_checkpoint_with_wrong_scales_is_a_one_line_error(tmp_path):
    from safetensors.torch import load_file, save_file

    save_mxfp4_gpt_oss(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(LeantuneError, match=f"{key} has shape .* config.json implies"):
        leantune.load_model(tmp_path, device="cpu")


def test_per_expert_checkpoint_missing_an_expert_is_a_one_line_error(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints["mixtral"][0], folder)
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    del tensors[key]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(LeantuneError, match=f"1 weight missing .*e.g. {key}"):
        leantune.load_model(folder, device="cpu")


# --- the load-balancing loss ----------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_router_aux_loss_matches_transformers(checkpoints, family):
    folder, _, hf = checkpoints[family]
    model = leantune.load_model(folder, device="cpu").eval()
    ids = _ids(seed=4, shape=(2, 11))
    with torch.no_grad():
        ref = hf(ids, output_router_logits=True).aux_loss
        assert model(ids).aux_loss is None  # off by default
        model.router_aux_loss = True
        got = model(ids).aux_loss
    assert ref > 0.5  # ~top_k for balanced routing
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-6)
    assert all(layer.mlp.router_stats is None for layer in model.layers
               if isinstance(layer.mlp, MoEBlock))


def test_router_aux_loss_gradient_through_recompute(checkpoints):
    """With the layers recomputed in backward (torch.utils.checkpoint), the aux loss still
    back-propagates into the router, as it does without recompute."""
    from leantune.engine import LayerPlan, attach, detach

    model = leantune.load_model(checkpoints["mixtral"][0], device="cpu")
    model.router_aux_loss = True
    ids = _ids(seed=5)
    routers = [layer.mlp.gate.weight for layer in model.layers]
    for p in routers:
        p.requires_grad_(True)

    def grads():
        out = model(ids)
        return torch.autograd.grad(out.aux_loss + out.logits.mean(), routers)

    ref = grads()
    attach(model, [LayerPlan()] * len(model.layers))  # the autograd path's recompute
    assert all(layer.executor.kind == "checkpoint" for layer in model.layers)
    got = grads()
    detach(model)
    for g, r in zip(got, ref):
        assert r.abs().max() > 0
        torch.testing.assert_close(g, r)


def test_config_json_of_a_saved_moe_checkpoint_has_the_fields_we_read(checkpoints):
    """transformers 5 writes num_local_experts for qwen3_moe too: both names are read."""
    d = json.loads((checkpoints["qwen3_moe"][0] / "config.json").read_text())
    d.pop("num_local_experts", None)
    d["num_experts"] = 6
    assert ModelConfig.from_dict(d).moe.num_experts == 6
