"""4-bit bases: `load_model(..., load_in_4bit=True)` quantises the decoder's projections as they
load; pre-quantised bnb-4bit checkpoints (transformers + bitsandbytes' save, or the same layout
written here) load without bitsandbytes, with transformers' 4-bit logits; what leantune does not
read is a one-line error naming the tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import (bnb_tensors, max_abs, one_torch_thread,  # noqa: F401  (autouse)
                     randomize_, save_bnb_checkpoint, save_transformers_bnb_checkpoint,
                     tiny_config)
from leantune import load_model
from leantune.errors import LeantuneError
from leantune.kernels.nf4 import NF4Weight, dequantize_nf4_reference
from leantune.model.loader import nf4_projections, quantize_nf4_
from leantune.train.preflight import check_weights


@pytest.fixture(scope="module")
def base16(tmp_path_factory):
    """A tiny fp32 Llama checkpoint with input sizes of whole blocks of 64 (bitsandbytes' CPU
    kernels want them)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.hidden_size, cfg.intermediate_size = 64, 128
    hf = AutoModelForCausalLM.from_config(cfg).float()
    randomize_(hf, seed=3, std=0.05)
    folder = tmp_path_factory.mktemp("base16")
    hf.save_pretrained(folder)
    return folder


def _ids(vocab, seed=1):
    return torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_load_in_4bit_quantises_the_decoder_projections(base16):
    dense = load_model(base16, device="cpu")
    model = load_model(base16, device="cpu", load_in_4bit=True)
    projections = dict(nf4_projections(model))
    assert len(projections) == 7 * model.config.num_hidden_layers
    for name, mod in projections.items():
        assert mod.weight is None and mod.nf4 is not None and mod.nf4.weight_dtype == torch.float32
        assert f"{name}.weight" not in dict(model.named_parameters())
    # the embeddings and the LM head stay 16-bit (here fp32), as in bitsandbytes' QLoRA
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    # the same 4-bit weights as quantising the loaded 16-bit model in place
    quantize_nf4_(dense)
    ids = _ids(model.config.vocab_size)
    assert torch.equal(_logits(model, ids), _logits(dense, ids))
    q = projections["model.layers.1.mlp.down_proj"].nf4
    assert q.dequantize().shape == (64, 128)


@pytest.mark.parametrize("nested", [True, False])
def test_bnb_layout_checkpoint_loads_without_bitsandbytes(base16, tmp_path, nested):
    """A checkpoint in bitsandbytes' layout (written here with leantune's quantiser, the down
    projections kept 16-bit as llm_int8_skip_modules leaves them): the same 4-bit weights as
    quantising on load, the skipped modules 16-bit, the compute dtype from the config."""
    folder = save_bnb_checkpoint(base16, tmp_path / "bnb", nested=nested, skip=("down_proj",))
    assert check_weights(folder) is True and check_weights(base16) is False
    model = load_model(folder, device="cpu")
    assert next(model.parameters()).dtype == torch.float32  # bnb_4bit_compute_dtype
    for name, mod in nf4_projections(model):
        assert (mod.nf4 is None) == name.endswith("down_proj")
        if mod.nf4 is not None:
            assert mod.nf4.nested is nested
    dense = dict(nf4_projections(load_model(base16, device="cpu")))
    for name, mod in nf4_projections(model):
        w = dense[name].weight
        want = w if mod.nf4 is None else dequantize_nf4_reference(
            NF4Weight(w.shape, w.dtype, nested=nested).quantize_(w))
        assert torch.equal(mod.base_weight(), want)
    half = load_model(folder, device="cpu", dtype=torch.bfloat16)
    assert half.layers[0].self_attn.q_proj.nf4.dtype == torch.bfloat16


def test_transformers_bnb_checkpoint_logits_equal_transformers(base16, tmp_path):
    """Saved by transformers + bitsandbytes on the CPU; leantune loads it with its own code and
    gives transformers' 4-bit logits."""
    pytest.importorskip("bitsandbytes")
    hf4 = save_transformers_bnb_checkpoint(base16, tmp_path / "bnb", skip=["lm_head", "o_proj"])
    model = load_model(tmp_path / "bnb", device="cpu")
    assert model.layers[0].self_attn.o_proj.nf4 is None  # llm_int8_skip_modules: 16-bit
    assert model.layers[0].self_attn.q_proj.nf4 is not None
    ids = _ids(model.config.vocab_size)
    ref = _logits(hf4, ids)
    assert ref.abs().max() > 0.1
    assert max_abs(_logits(model, ids), ref) < 1e-5


def _rewrite(folder, out, edit_tensors=None, edit_config=None):
    """A copy of checkpoint `folder` with its tensors / config dict edited in place."""
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return out


QS = "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4"


def _state_edit(**kw):
    def edit(t):
        state = json.loads(bytes(t[QS].tolist()).decode())
        state.update(kw)
        key = QS if kw.get("quant_type", "nf4") == "nf4" else QS.replace("nf4", "fp4")
        del t[QS]
        t[key] = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    return edit


@pytest.mark.parametrize("edit,match", [
    (_state_edit(quant_type="fp4"), "fp4 4-bit weights are not supported"),
    (_state_edit(blocksize=128), "blocksize 128"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight":
                         t["model.layers.0.self_attn.q_proj.weight"].view(-1, 2)
                         .view(torch.bfloat16)}),  # bnb_4bit_quant_storage=bfloat16
     "stored as BF16"),
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight.absmax"),
     "missing from the checkpoint .e.g. model.layers.1.mlp.up_proj.weight.absmax"),
    (lambda t: t.update(bnb_tensors("lm_head.weight", t.pop("lm_head.weight"))),
     "lm_head.weight: a 4-bit weight where leantune reads a 16-bit one"),
])
def test_bnb_checkpoints_leantune_does_not_read_are_one_line_errors(base16, tmp_path, edit,
                                                                    match):
    folder = _rewrite(save_bnb_checkpoint(base16, tmp_path / "bnb"), tmp_path / "bad",
                      edit_tensors=edit)
    with pytest.raises(LeantuneError, match=match) as e:
        load_model(folder, device="cpu")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("quant,match", [
    ({"quant_method": "gptq", "bits": 4}, "'gptq' checkpoints are not supported"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8-bit bitsandbytes"),
])
def test_other_quantisations_are_one_line_errors(base16, tmp_path, quant, match):
    folder = _rewrite(base16, tmp_path / "q",
                      edit_config=lambda c: c.update(quantization_config=quant))
    for check in (lambda: load_model(folder, device="cpu"), lambda: check_weights(folder)):
        with pytest.raises(LeantuneError, match=match):
            check()


def test_preflight_checks_4bit_shapes(base16, tmp_path):
    """A 4-bit weight whose quant_state shape does not fit config.json fails before loading."""
    folder = _rewrite(save_bnb_checkpoint(base16, tmp_path / "bnb"), tmp_path / "bad",
                      edit_tensors=_state_edit(shape=[64, 96]))
    with pytest.raises(LeantuneError, match=r"q_proj.weight has shape \(64, 96\), config.json "
                                            r"implies \(64, 64\)"):
        check_weights(folder)
    with pytest.raises(LeantuneError, match=r"q_proj.weight: 4-bit weight of shape \(64, 96\) "
                                            r"\(its quant_state\), config.json implies"):
        load_model(folder, device="cpu")
