"""Gemma 2, Gemma 3 (text and the multimodal checkpoint's language model) and Phi-3 / Phi-4:
logits equal to transformers' on tiny odd configs that exercise every family feature (fp32,
sequences longer than the windows), greedy generation equal to transformers' generate, and the
roles each family's layers are built from."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import max_abs, one_torch_thread, randomize_, save_random_adapter  # noqa: F401

import leantune
from leantune.engine.executor import fused_unsupported, structure_unsupported
from leantune.errors import LeantuneError
from leantune.model.families import FAMILIES, GEMMA_NORMS, LLAMA_NORMS

TOL = 1e-4
WINDOW = 4
NEW_FAMILIES = ["gemma2", "gemma3_text", "gemma3_rope", "phi3", "phi3_longrope", "gemma3_mm"]


def new_family_config(name: str):
    """A tiny transformers config of a new family (fp32): every feature switched on with odd
    values (query_pre_attn_scalar != head_dim, soft-caps small enough to bite, windows of 4,
    per-layer-type RoPE with linear scaling on the full layers, partial rotary 0.75, LongRoPE
    whose original context is shorter than the test's sequences)."""
    from transformers import Gemma2Config, Gemma3Config, Gemma3TextConfig, Phi3Config

    base = {"vocab_size": 101, "hidden_size": 48, "intermediate_size": 80,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
            "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if name == "gemma2":  # alternating windows, both soft-caps
        return Gemma2Config(**base, query_pre_attn_scalar=12, sliding_window=WINDOW,
                            attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    text = dict(base, num_hidden_layers=4, query_pre_attn_scalar=20, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                             "sliding_attention"])
    if name == "gemma3_text":  # q/k norms; local 10k / global 1M bases
        return Gemma3TextConfig(**text)
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
    if name == "gemma3_rope":  # the global layers' scaled RoPE
        return Gemma3TextConfig(**text, rope_parameters=rope)
    if name == "gemma3_mm":  # the multimodal checkpoint: a vision tower + projector beside it
        vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 40,
                  "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
                  "patch_size": 14}
        return Gemma3Config(text_config=dict(text, rope_parameters=rope), vision_config=vision,
                            mm_tokens_per_image=4, image_token_index=100, boi_token_index=98,
                            eoi_token_index=99)
    phi = dict(base, hidden_size=64, head_dim=None)
    phi.pop("head_dim")
    if name == "phi3":  # fused qkv_proj / gate_up_proj, sliding window, partial rotary
        return Phi3Config(**phi, sliding_window=WINDOW, partial_rotary_factor=0.75)
    if name == "phi3_longrope":  # LongRoPE (Phi-3.5 / Phi-4-mini), partial rotary
        return Phi3Config(**dict(phi, max_position_embeddings=32), partial_rotary_factor=0.75,
                          original_max_position_embeddings=8,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0, 1.5, 2.0, 1.2, 3.0, 1.1],
                                           "long_factor": [2.0, 4.0, 1.5, 6.0, 3.0, 8.0],
                                           "original_max_position_embeddings": 8})
    raise ValueError(name)


def make_new_family(name: str, seed: int = 0):
    """A randomised transformers model of `name` (eager attention, fp32, eval)."""
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    cfg = new_family_config(name)
    if name == "gemma3_mm":
        hf = Gemma3ForConditionalGeneration(cfg)
        hf.config._attn_implementation = "eager"
    else:
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    hf = hf.float().eval()
    randomize_(hf, seed)
    return hf


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, name in enumerate(NEW_FAMILIES):
        folder = tmp_path_factory.mktemp(name)
        hf = make_new_family(name, seed=10 + i)
        hf.save_pretrained(folder)
        out[name] = (folder, hf, leantune.load_model(folder, device="cpu").eval())
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", NEW_FAMILIES)
@pytest.mark.parametrize("T", [6, 13])
def test_logits_match_transformers(checkpoints, name, T):
    """T = 13 is past every window (4) and past LongRoPE's original context (8): the long
    factors; T = 6 the short ones."""
    _, hf, model = checkpoints[name]
    ids = torch.randint(0, 98, (2, T), generator=torch.Generator().manual_seed(T))
    ref, got = _logits(hf, ids), _logits(model, ids)
    assert got.shape == ref.shape
    assert ref.abs().max() > 0.1
    assert max_abs(got, ref) < TOL


def test_features_are_read(checkpoints):
    g2 = checkpoints["gemma2"][2].config
    assert g2.norms == GEMMA_NORMS and g2.norm_offset == 1.0 and g2.tie_word_embeddings
    assert g2.attn_softcap == 5.0 and g2.final_softcap == 3.0
    assert g2.attn_scale == pytest.approx(12 ** -0.5) and g2.embed_scale == pytest.approx(48 ** .5)
    assert [g2.window_for_layer(i) for i in range(3)] == [WINDOW, None, WINDOW]
    g3 = checkpoints["gemma3_rope"][2].config
    assert g3.qk_norm and g3.attn_softcap is None
    assert g3.layer_rope["sliding_attention"] == (10000.0, None)
    assert g3.layer_rope["full_attention"][0] == 1e6
    assert g3.layer_rope["full_attention"][1]["rope_type"] == "linear"
    phi = checkpoints["phi3_longrope"][2].config
    assert phi.norms == LLAMA_NORMS and phi.rotary_dim == 12 and phi.head_dim == 16
    assert phi.rope_scaling["rope_type"] == "longrope"
    assert phi.rope_scaling["original_max_position_embeddings"] == 8
    mm = checkpoints["gemma3_mm"][2].config
    assert mm.model_type == "gemma3" and mm.num_hidden_layers == 4
    assert "vision_config" in mm.raw


def test_longrope_in_the_hub_v4_layout(checkpoints, tmp_path):
    """Phi-3 128k / Phi-3.5-mini / Phi-4-mini on the hub: `rope_scaling` holds only the type
    and factors, original_max_position_embeddings sits at the top level. The same weights give
    the same logits as the transformers 5 layout, past the original context too."""
    import shutil

    folder, hf, _ = checkpoints["phi3_longrope"]
    v4 = tmp_path / "v4"
    shutil.copytree(folder, v4)
    d = json.loads((v4 / "config.json").read_text())
    params = d.pop("rope_parameters")
    d.pop("original_max_position_embeddings", None)
    d.update(rope_theta=params["rope_theta"], original_max_position_embeddings=8,
             rope_scaling={"type": "longrope", "short_factor": params["short_factor"],
                           "long_factor": params["long_factor"]})
    (v4 / "config.json").write_text(json.dumps(d))
    model = leantune.load_model(v4, device="cpu").eval()
    assert model.config.rope_scaling["original_max_position_embeddings"] == 8
    ids = torch.randint(0, 98, (2, 13), generator=torch.Generator().manual_seed(3))
    assert max_abs(_logits(model, ids), _logits(hf, ids)) < TOL
    del d["original_max_position_embeddings"]  # nowhere: max_position_embeddings stands in
    (v4 / "config.json").write_text(json.dumps(d))
    scaling = leantune.load_model(v4, device="cpu").config.rope_scaling
    assert scaling["original_max_position_embeddings"] == d["max_position_embeddings"]
    del d["max_position_embeddings"]
    (v4 / "config.json").write_text(json.dumps(d))
    with pytest.raises(LeantuneError, match="original_max_position_embeddings"):
        leantune.load_model(v4, device="cpu")


def test_roles_change_the_output(checkpoints):
    """The parity tests mean something: Gemma 2 without its attention-out norm, soft-caps or
    attention scale, or Gemma 3 with one RoPE for all layers, gives other logits."""
    _, hf, model = checkpoints["gemma2"]
    ids = torch.randint(0, 98, (1, 11), generator=torch.Generator().manual_seed(3))
    ref = _logits(hf, ids)
    layer = model.layers[0]
    at = layer.self_attn
    for attr, off in (("softcap", None), ("scale", 16 ** -0.5)):
        on = getattr(at, attr)
        setattr(at, attr, off)
        try:
            assert max_abs(_logits(model, ids), ref) > 1e-3
        finally:
            setattr(at, attr, on)
    _, hf3, model3 = checkpoints["gemma3_rope"]
    ref3 = _logits(hf3, ids)
    keys = [layer.rope_key for layer in model3.layers]
    assert keys == ["sliding_attention", "full_attention", "sliding_attention",
                    "sliding_attention"]
    try:
        for layer in model3.layers:
            layer.rope_key = "sliding_attention"
        assert max_abs(_logits(model3, ids), ref3) > 1e-3
    finally:
        for layer, key in zip(model3.layers, keys):
            layer.rope_key = key
    assert max_abs(_logits(model, ids), ref) < TOL


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "gemma3_mm", "phi3", "phi3_longrope"])
def test_greedy_generation_matches_transformers(checkpoints, name):
    """Past the windows (4), and across LongRoPE's switch to its long factors (original
    context 8: the 5-token prompt grows past it), where transformers' Phi-3 drops its KV cache
    and recomputes every key with the long factors, as leantune's decode does."""
    from leantune.generate.decode import decode

    _, hf, model = checkpoints[name]
    new = 9
    prompt = torch.randint(0, 98, (1, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, 5:].tolist()
    got = decode(model, [prompt[0].tolist()], new)[0].token_ids
    assert got == ref


def test_registry_covers_every_family():
    for t, fam in FAMILIES.items():
        assert fam.model_type == t
    assert FAMILIES["gemma2"].norms.attn_out == "post_attention_layernorm"
    assert FAMILIES["llama"].norms.mlp_in == "post_attention_layernorm"


def test_fused_path_refuses_parts_it_does_not_run(checkpoints):
    """Every new family's layers take the fused path (Gemma 2's soft-capping, Gemma 3's output
    and q/k norms, Phi-3's partial rotary); a part it does not run keeps a layer off it, with
    one line saying why (soft-capping together with sinks, here put onto a Gemma 2 layer)."""
    _, _, gemma = checkpoints["gemma2"]
    layer = gemma.layers[0]
    assert structure_unsupported(layer) is None
    layer.self_attn.sinks = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    try:
        assert fused_unsupported(layer) == "attention soft-capping with sinks"
    finally:
        layer.self_attn.sinks = None
    _, _, gemma3 = checkpoints["gemma3_text"]
    assert structure_unsupported(gemma3.layers[0]) is None
    _, _, phi = checkpoints["phi3"]
    assert structure_unsupported(phi.layers[0]) is None


def test_an_unknown_norm_keeps_a_layer_off_the_fused_path(tmp_path):
    """A Llama layer the fused executor runs, until a norm it does not know joins it: then the
    engine gives the layer the autograd path and says why in one line."""
    from helpers import save_checkpoint

    from leantune.engine import Engine, LayerPlan
    from leantune.engine.executor import CheckpointExecutor, FusedExecutor
    from leantune.model.layers import RMSNorm

    save_checkpoint("llama", tmp_path, seed=3)
    model = leantune.load_model(tmp_path, device="cpu")
    leantune.apply_lora(model, leantune.LoRAConfig(r=2), seed=0)  # (freezes the base)
    layer = model.layers[0]
    engine = Engine()
    assert fused_unsupported(layer) is None
    assert isinstance(engine.executor(layer, LayerPlan()), FusedExecutor)
    layer.extra_layernorm = RMSNorm(model.config.hidden_size, 1e-6).requires_grad_(False)
    why = engine.fused_unsupported(model)
    assert why == "layer part 'extra_layernorm', which the fused executor does not run"
    assert isinstance(engine.executor(layer, LayerPlan()), CheckpointExecutor)


# --- adapters and exports ------------------------------------------------------------------------

def _hf_cls(name):
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration if name == "gemma3_mm" else AutoModelForCausalLM


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "phi3", "gemma3_mm"])
def test_adapter_loads_in_peft_and_merged_export_in_transformers(checkpoints, name, tmp_path):
    """Our adapter loads with PEFT onto the transformers model (Phi-3: as PEFT's fused
    qkv_proj / gate_up_proj), and the merged export loads in transformers (Gemma 3 multimodal:
    as Gemma3ForConditionalGeneration, its vision tower bit-identical), same logits."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file

    from leantune.export.merge import export_merged

    folder, _, _ = checkpoints[name]
    ours = save_random_adapter(folder, tmp_path / "adapter", seed=5, r=3, alpha=6)
    ids = torch.randint(0, 98, (2, 11), generator=torch.Generator().manual_seed(4))
    want = _logits(ours, ids)
    cls = _hf_cls(name)
    base = cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32).eval()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # every LoRA PEFT makes is one of ours (Gemma 3 multimodal: none in the vision tower)
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]
    assert max_abs(_logits(peft, ids), want) < TOL
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    if name == "gemma3_mm":
        assert not any("vision_tower" in n for n, _ in peft.named_modules() if "lora_A" in n)
    if name == "phi3":
        assert set(config["target_modules"]) == {"qkv_proj", "o_proj", "gate_up_proj",
                                                 "down_proj"}
    back = leantune.load_model(folder, device="cpu")
    leantune.load_adapter(back, tmp_path / "adapter")
    assert max_abs(_logits(back.eval(), ids), want) < TOL
    export_merged(folder, tmp_path / "adapter", tmp_path / "merged", log=lambda *a: None)
    merged = cls.from_pretrained(tmp_path / "merged", attn_implementation="eager",
                                 dtype=torch.float32).eval()
    assert type(merged).__name__ == type(base).__name__
    assert max_abs(_logits(merged, ids), want) < TOL
    if name == "gemma3_mm":
        src, out = ({k: v for f in sorted(d.glob("*.safetensors")) for k, v in
                     load_file(f).items()} for d in (folder, tmp_path / "merged"))
        vision = [k for k in src if "vision_tower" in k or "multi_modal_projector" in k]
        assert vision and all(torch.equal(src[k], out[k]) for k in vision)


def test_a_peft_trained_phi3_adapter_loads_exactly(checkpoints, tmp_path):
    """PEFT's own rank-r qkv_proj / gate_up_proj LoRA (one A shared by q, k, v) loads onto our
    separate projections exactly, and merges."""
    from peft import LoraConfig, get_peft_model

    from leantune.export.merge import export_merged

    folder, _, _ = checkpoints["phi3"]
    hf = _hf_cls("phi3").from_pretrained(folder, attn_implementation="eager",
                                         dtype=torch.float32)
    pm = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=[
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(tmp_path / "peft")
    ids = torch.randint(0, 98, (1, 9), generator=torch.Generator().manual_seed(1))
    want = _logits(pm.eval(), ids)
    ours = leantune.load_model(folder, device="cpu")
    leantune.load_adapter(ours, tmp_path / "peft")
    assert max_abs(_logits(ours.eval(), ids), want) < TOL
    export_merged(folder, tmp_path / "peft", tmp_path / "merged", log=lambda *a: None)
    merged = _hf_cls("phi3").from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert max_abs(_logits(merged, ids), want) < TOL


# --- QLoRA ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gemma2", "gemma3_mm", "phi3"])
def test_load_in_4bit(checkpoints, name):
    """--load-in-4bit quantises every decoder projection as it reads it (Phi-3: the rows of its
    fused qkv_proj / gate_up_proj; Gemma 3 multimodal: under its prefix): the same 4-bit model
    as quantising the loaded 16-bit one."""
    from leantune.model.loader import load_model, nf4_projections, quantize_nf4_

    folder, _, dense = checkpoints[name]
    model = load_model(folder, device="cpu", load_in_4bit=True)
    assert len(dict(nf4_projections(model))) == 7 * model.config.num_hidden_layers
    ref = quantize_nf4_(load_model(folder, device="cpu"))
    ids = torch.randint(0, 98, (1, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    assert max_abs(_logits(model, ids), _logits(dense, ids)) > 0  # (it is 4-bit)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_mm"])
def test_bnb_4bit_checkpoint(checkpoints, name, tmp_path):
    """A bnb-4bit upload of these families (bitsandbytes' layout) loads without bitsandbytes:
    the 4-bit weights of quantising on load."""
    from helpers import save_bnb_checkpoint

    from leantune.model.loader import load_model

    folder, _, _ = checkpoints[name]
    if not (folder / "model.safetensors").exists():
        pytest.skip("sharded")
    bnb = save_bnb_checkpoint(folder, tmp_path / "bnb")
    ids = torch.randint(0, 98, (1, 9), generator=torch.Generator().manual_seed(0))
    got = _logits(load_model(bnb, device="cpu"), ids)
    want = _logits(load_model(folder, device="cpu", load_in_4bit=True), ids)
    assert torch.equal(got, want)


def test_gemma2_logits_on_the_blocked_soft_cap_path(checkpoints):
    """The varlen path's soft-capped attention (query blocks, documents from cu_seqlens; what
    CUDA runs) gives transformers' logits too."""
    _, hf, model = checkpoints["gemma2"]
    ids = torch.randint(0, 98, (2, 13), generator=torch.Generator().manual_seed(5))
    model.attention_path = "varlen"
    try:
        got = _logits(model, ids)
    finally:
        model.attention_path = None
    assert max_abs(got, _logits(hf, ids)) < TOL
