"""GGUF export: base + LoRA adapter -> one .gguf (+ Ollama Modelfile), and the adapter alone.

Checked on tiny random checkpoints of every family: the file reads back with gguf-py's reader and
every tensor dequantises to the merged weights within its type's error; transformers loads the
f16 / q8_0 files with the merged model's logits; the K-quant tensors of q4_k_m / q6_k files beat
q4_0 / q5_0 on the same tensors; tokenizer metadata, Modelfile, LoRA GGUF and the errors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    CHATML_SPECIALS,
    CHATML_TEMPLATE,
    EOS_TEMPLATE,
    load_hf,
    make_spm_tokenizer,
    make_tokenizer,
    one_torch_thread,  # noqa: F401  (autouse)
    randomize_,
    save_random_adapter,
    save_tiny_tokenizer,
    tiny_config,
)

gguf = pytest.importorskip("gguf")

import leantune  # noqa: E402
from leantune import LeantuneError, export_merged  # noqa: E402
from leantune.cli import main  # noqa: E402
from leantune.export import export_gguf, export_gguf_lora  # noqa: E402
from leantune.export.gguf.modelfile import modelfile_text, template_style  # noqa: E402
from leantune.export.gguf.quants import QUANT_TYPES, quantize  # noqa: E402
from leantune.export.gguf.tensors import architecture, permute_rows, tensor_type  # noqa: E402
from leantune.export.gguf.vocab import CONTROL, NORMAL, UNUSED, pre_tokenizer_name  # noqa: E402
from leantune.export.merge import MergedWeights  # noqa: E402

QUANTS = ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k_m", "q6_k"]
# Sizes whose rows split into 32-blocks; llama's also into 256-blocks (K-quants apply). qwen3:
# transformers' GGUF loader takes head_dim 128 for qwen3 whatever the file says.
SIZES = {"llama": dict(hidden_size=256, intermediate_size=512, head_dim=64),
         "qwen3": dict(hidden_size=64, intermediate_size=96, head_dim=128,
                       num_attention_heads=2, num_key_value_heads=1),
         "mistral": dict(hidden_size=64, intermediate_size=96, head_dim=16, sliding_window=None)}
CHATML_FAMILIES = ("llama", "qwen2", "qwen3")
# relative RMS error of a dequantised tensor, by type
REL_ERR = {"f32": 0.0, "f16": 1e-3, "bf16": 8e-3, "q8_0": 1e-2, "q6_k": 3e-2, "q5_0": 6e-2,
           "q4_0": 0.12, "q4_k": 0.12}


def _tokenizer(family):
    if family in CHATML_FAMILIES:
        return make_tokenizer(CHATML_TEMPLATE, extra_specials=CHATML_SPECIALS)
    return make_tokenizer(EOS_TEMPLATE)


def _save_base(family: str, folder: Path, seed: int = 0, tok=None, **overrides) -> Path:
    """A randomised tiny checkpoint of `family` with `tok` (default: a byte-level BPE); its vocab
    has 5 padding rows beyond the tokenizer (as real checkpoints often do)."""
    from transformers import AutoModelForCausalLM

    tok = tok or _tokenizer(family)
    cfg = tiny_config(family)
    for k, v in {**dict(hidden_size=64, intermediate_size=96, head_dim=16),
                 **SIZES.get(family, {}), "vocab_size": len(tok) + 5, **overrides}.items():
        setattr(cfg, k, v)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomize_(hf, seed)
    hf.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


_CACHE: dict = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    _CACHE.clear()
    yield tmp_path_factory.mktemp("gguf")
    _CACHE.clear()


def ckpt(root: Path, family: str) -> tuple[Path, Path, Path]:
    """(base, adapter, merged HF checkpoint) of `family`, built once per module."""
    if family not in _CACHE:
        base = _save_base(family, root / family / "base", seed=40)
        save_random_adapter(base, root / family / "adapter", seed=41)
        merged = export_merged(base, root / family / "adapter", root / family / "merged")
        _CACHE[family] = (base, root / family / "adapter", merged)
    return _CACHE[family]


def exported(root: Path, family: str, quant: str):
    key = (family, quant)
    if key not in _CACHE:
        base, adapter, _ = ckpt(root, family)
        _CACHE[key] = export_gguf(base, adapter, root / family / f"gguf-{quant}", quant=quant)
    return _CACHE[key]


def _field(reader, key):
    return reader.fields[key].contents()


def _dequantised(reader) -> dict[str, tuple[str, torch.Tensor]]:
    """GGUF tensor name -> (type name, fp32 tensor in numpy order)."""
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        out[t.name] = (t.tensor_type.name.lower(), torch.from_numpy(np.array(data, np.float32)))
    return out


def _rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp(min=1e-12)).item()


def _expected(base, adapter) -> dict[str, torch.Tensor]:
    """The merged weights under their GGUF names, q/k rows reordered for llama's layout."""
    from leantune.export.gguf.tensors import gguf_name, rows_heads

    w = MergedWeights(base, adapter)
    out = {}
    for hf in w.names():
        name = gguf_name(hf)
        t = w.tensor(hf, torch.float32)
        heads = rows_heads(w.config, name)
        out[name] = permute_rows(t, heads) if heads else t
    return out


CASES = ([(f, "f16") for f in ["llama", "llama_tied", "llama_bias", "mistral", "qwen2", "qwen3"]]
         + [("llama", q) for q in QUANTS if q != "f16"] + [("qwen2", "q8_0"), ("qwen3", "q4_k_m"),
                                                          ("llama_bias", "q4_0")])


@pytest.mark.parametrize("family,quant", CASES)
def test_every_tensor_round_trips(root, family, quant):
    base, adapter, _ = ckpt(root, family)
    res = exported(root, family, quant)
    assert res.gguf == root / family / f"gguf-{quant}" / f"model-{quant}.gguf"
    reader = gguf.GGUFReader(str(res.gguf))
    cfg = leantune.ModelConfig.from_file(base / "config.json")
    arch = {"mistral": "llama"}.get(cfg.model_type, cfg.model_type)
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, "general.file_type") == {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7,
                                                   "q4_0": 2, "q5_0": 8, "q4_k_m": 15,
                                                   "q6_k": 18}[quant]
    for key, value in [("block_count", cfg.num_hidden_layers),
                       ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("attention.key_length", cfg.head_dim),
                       ("rope.dimension_count", cfg.head_dim),
                       ("context_length", cfg.max_position_embeddings),
                       ("vocab_size", cfg.vocab_size)]:
        assert _field(reader, f"{arch}.{key}") == value, key
    assert _field(reader, f"{arch}.rope.freq_base") == pytest.approx(cfg.rope_theta)
    assert _field(reader, f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(
        cfg.rms_norm_eps)

    expected = _expected(base, adapter)
    if cfg.tie_word_embeddings:
        expected.pop("output.weight", None)
    got = _dequantised(reader)
    assert set(got) == set(expected) | ({"rope_freqs.weight"} if family == "llama" else set())
    for name, ref in expected.items():
        kind, t = got[name]
        assert t.shape == ref.shape, name
        if ref.dim() == 1:
            assert kind == "f32" and torch.equal(t, ref), name  # norms and biases stay f32
            continue
        assert kind == res.types[name] == tensor_type(name, tuple(ref.shape), quant,
                                                      cfg.num_hidden_layers,
                                                      cfg.tie_word_embeddings).name
        assert _rel_rms(t, ref) <= REL_ERR[kind], (name, kind, _rel_rms(t, ref))
    if quant in ("q4_k_m", "q6_k") and family == "llama":  # rows of 256: K-quants do apply
        assert {"q4_k", "q6_k"} >= {k for n, k in res.types.items() if not n.endswith("norm.weight")
                                    and got[n][1].dim() == 2}


def _round_2d_to_f16(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    return model


@pytest.mark.parametrize("family", ["llama_tied", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_transformers_loads_the_gguf(root, family, quant):
    """transformers dequantises our file into a model with the merged model's logits (f16: the
    merged weights rounded to f16 exactly; q8_0: within its error)."""
    from transformers import AutoModelForCausalLM

    _, _, merged = ckpt(root, family)
    res = exported(root, family, quant)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(res.gguf.parent), gguf_file=res.gguf.name, dtype=torch.float32).eval()
    ref = load_hf(merged)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        exact = ref(ids).logits
        if quant == "f16":
            assert (loaded(ids).logits - _round_2d_to_f16(ref)(ids).logits).abs().max() < 1e-4
        else:
            got = loaded(ids).logits
            assert _rel_rms(got, exact) < 0.04  # measured 0.019-0.023 on these random models
            assert (got.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("family", ["llama", "llama_bias"])
def test_transformers_undoes_the_llama_row_order(root, family):
    """transformers' GGUF loader reorders llama's q/k rows back: its weights are the merged ones
    (it ignores rope_freqs and attention biases, so logits are not compared here)."""
    from transformers import AutoModelForCausalLM

    _, _, merged = ckpt(root, family)
    res = exported(root, family, "f16")
    loaded = AutoModelForCausalLM.from_pretrained(
        str(res.gguf.parent), gguf_file=res.gguf.name, dtype=torch.float32).state_dict()
    ref = load_hf(merged).state_dict()
    for k, v in loaded.items():
        if v.dim() == 2:
            assert torch.equal(v, ref[k].half().float()), k


def test_rope_freqs_are_the_llama3_factors(root):
    """llama3 rope scaling travels as rope_freqs: each rotary frequency's divisor, as
    transformers' own llama3 rope computes it."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base, _, _ = ckpt(root, "llama")
    reader = gguf.GGUFReader(str(exported(root, "llama", "f16").gguf))
    kind, factors = _dequantised(reader)["rope_freqs.weight"]
    cfg = AutoConfig.from_pretrained(base)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    head_dim = cfg.head_dim
    plain = 1.0 / (cfg.rope_parameters["rope_theta"] ** (
        torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    assert kind == "f32" and factors.shape == (head_dim // 2,)
    assert torch.allclose(factors, plain / scaled, rtol=1e-5)
    assert factors.max() > 7.9 and factors.min() == 1.0  # factor 8 at low frequencies


def test_q4_k_m_mix_and_k_quant_errors(root):
    """q4_k_m: q6_k for output and for attn_v / ffn_down of the layers llama.cpp gives more bits,
    q4_k elsewhere; every q4_k tensor beats q4_0 and every q6_k tensor q5_0 on the same
    weights (same for a q6_k file)."""
    base, adapter, _ = ckpt(root, "llama")
    expected = _expected(base, adapter)
    types = exported(root, "llama", "q4_k_m").types
    assert types["output.weight"] == "q6_k"
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "q6_k"  # 1 >= 7*2/8
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == "q4_k"
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "q4_k"
    for quant in ("q4_k_m", "q6_k"):
        got = _dequantised(gguf.GGUFReader(str(exported(root, "llama", quant).gguf)))
        for name, (kind, t) in got.items():
            if kind not in ("q4_k", "q6_k"):
                continue
            rival = {"q4_k": "q4_0", "q6_k": "q5_0"}[kind]
            ref = expected[name]
            raw = quantize(ref, QUANT_TYPES[rival])
            r = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(
                QUANT_TYPES[rival].ggml_type)).reshape(ref.shape)
            assert _rel_rms(t, ref) < _rel_rms(torch.from_numpy(r.copy()), ref), (quant, name)


def test_q4_k_m_layer_rule_and_fallbacks():
    """llama.cpp's rule at 32 layers: the first and last 4 layers and every third between."""
    more = [i for i in range(32)
            if tensor_type(f"blk.{i}.ffn_down.weight", (4096, 14336), "q4_k_m", 32, False).name
            == "q6_k"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert tensor_type("blk.5.attn_k.weight", (1024, 4096), "q4_k_m", 32, False).name == "q4_k"
    assert tensor_type("token_embd.weight", (1000, 4096), "q4_k_m", 32, True).name == "q6_k"
    assert tensor_type("token_embd.weight", (1000, 4096), "q4_k_m", 32, False).name == "q4_k"
    # rows that do not split into 256-blocks fall back like llama.cpp's; then to f16
    assert tensor_type("blk.0.attn_q.weight", (576, 576), "q4_k_m", 30, False).name == "q5_0"
    assert tensor_type("blk.0.attn_q.weight", (576, 576), "q6_k", 30, False).name == "q8_0"
    assert tensor_type("blk.0.attn_q.weight", (48, 48), "q8_0", 2, False).name == "f16"
    assert tensor_type("blk.0.attn_norm.weight", (4096,), "q4_0", 2, False).name == "f32"


def test_tokenizer_metadata(root):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    base, _, _ = ckpt(root, "qwen2")
    res = exported(root, "qwen2", "q8_0")
    tok = PreTrainedTokenizerFast.from_pretrained(base)  # the files as they are
    vocab_size = leantune.ModelConfig.from_file(base / "config.json").vocab_size
    reader = gguf.GGUFReader(str(res.gguf))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    n = len(tok)
    assert tokens[:n] == tok.convert_ids_to_tokens(list(range(n)))
    assert tokens[n:] == [f"[PAD{i}]" for i in range(n, vocab_size)]
    types = _field(reader, "tokenizer.ggml.token_type")
    special = set(tok.all_special_ids)
    assert types == [CONTROL if i in special else NORMAL if i < n else UNUSED
                     for i in range(vocab_size)]
    merges = json.loads((base / "tokenizer.json").read_text())["model"]["merges"]
    assert _field(reader, "tokenizer.ggml.merges") == [
        m if isinstance(m, str) else " ".join(m) for m in merges]
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "gpt-2"  # plain byte-level regex
    assert _field(reader, "tokenizer.ggml.bos_token_id") == tok.bos_token_id
    assert _field(reader, "tokenizer.ggml.eos_token_id") == tok.eos_token_id
    assert _field(reader, "tokenizer.ggml.padding_token_id") == tok.pad_token_id
    assert _field(reader, "tokenizer.ggml.eot_token_id") == tok.convert_tokens_to_ids("<|im_end|>")
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert _field(reader, "tokenizer.chat_template") == CHATML_TEMPLATE
    # transformers rebuilds the same tokenizer from the file
    back = AutoTokenizer.from_pretrained(str(res.gguf.parent), gguf_file=res.gguf.name)
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n hello  world 123"
    assert back(text).input_ids == tok(text).input_ids


def test_pre_tokenizer_names():
    from leantune.export.gguf.vocab import LLAMA3_SPLIT, QWEN2_SPLIT, TEKKEN_MARK

    def split(regex, use_regex=False):
        return {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated"},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": use_regex}]}}

    assert pre_tokenizer_name(split(LLAMA3_SPLIT)) == "llama-bpe"
    assert pre_tokenizer_name(split(QWEN2_SPLIT)) == "qwen2"
    assert pre_tokenizer_name(split(TEKKEN_MARK + r"|\p{N}|\s+")) == "tekken"
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "use_regex": True}]}}) == "smollm"
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "ByteLevel"}}) == "gpt-2"
    assert pre_tokenizer_name(split(r"\w+|\s+")) is None


def test_unknown_pre_tokenizer_warns_and_writes_default(root, tmp_path):
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = tmp_path / "base"
    shutil.copytree(ckpt(root, "qwen2")[0], base)
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\w+|\s+|[^\w\s]+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.save_pretrained(base)
    res = export_gguf(base, None, tmp_path / "out", quant="f16")
    assert any("pre-tokenizer" in w and "'default'" in w for w in res.warnings)
    assert _field(gguf.GGUFReader(str(res.gguf)), "tokenizer.ggml.pre") == "default"


def test_modelfile_and_ollama_command(root):
    res = exported(root, "qwen2", "q8_0")
    text = res.modelfile.read_text()
    assert res.modelfile == res.gguf.parent / "Modelfile"
    lines = text.splitlines()
    assert lines[0] == "FROM ./model-q8_0.gguf"
    assert 'TEMPLATE """{{- range .Messages }}<|im_start|>{{ .Role }}' in text
    assert "{{ .Content }}<|im_end|>" in text
    assert 'PARAMETER stop "</s>"' in lines and 'PARAMETER stop "<|im_end|>"' in lines
    assert res.ollama_command == f"ollama create gguf-q8_0 -f {res.gguf.parent / 'Modelfile'}"
    assert not res.warnings


def test_modelfile_styles_and_default_system():
    from leantune.export.gguf.modelfile import default_system_prompt

    llama3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
              "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}")
    mistral = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    assert template_style(CHATML_TEMPLATE) == "chatml"
    assert template_style(llama3) == "llama3"
    assert template_style(mistral) == "mistral"
    assert template_style(EOS_TEMPLATE) is None
    text, warnings = modelfile_text("m.gguf", llama3, ["<|eot_id|>", "<|end_of_text|>"])
    assert "<|start_header_id|>assistant<|end_header_id|>" in text and not warnings
    assert 'PARAMETER stop "<|eot_id|>"' in text and 'PARAMETER stop "<|end_of_text|>"' in text
    text, _ = modelfile_text("m.gguf", mistral, ["</s>"], eos="</s>")
    assert "[INST] " in text and 'PARAMETER stop "[INST]"' in text and "}}</s>" in text
    text, warnings = modelfile_text("m.gguf", EOS_TEMPLATE, ["</s>"])
    assert "TEMPLATE" not in text and "no TEMPLATE" in warnings[0]
    # a ChatML template that writes a default system prompt (SmolLM2, Qwen2.5 do): SYSTEM line
    with_system = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>"
                   "\n{% endif %}" + CHATML_TEMPLATE)
    tok = make_tokenizer(with_system, extra_specials=CHATML_SPECIALS)
    assert default_system_prompt(tok, "chatml") == "Be brief."
    text, _ = modelfile_text("m.gguf", with_system, ["<|im_end|>"], system="Be brief.")
    assert 'SYSTEM """Be brief."""' in text


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_lora_gguf_matches_the_merged_gguf(root, family):
    """base + alpha / r * B @ A, in GGUF space (llama's q/k rows reordered in B too), equals the
    merged model's GGUF tensor."""
    base, adapter, _ = ckpt(root, family)
    res = export_gguf_lora(base, adapter, root / family / "lora", quant="f32")
    assert res.gguf.name == "adapter-f32.gguf"
    reader = gguf.GGUFReader(str(res.gguf))
    assert _field(reader, "general.type") == "adapter"
    assert _field(reader, "adapter.type") == "lora"
    alpha = _field(reader, "adapter.lora.alpha")
    assert alpha == pytest.approx(8.0)  # r 4, alpha 8: llama.cpp's alpha / r is the scaling 2
    lora = _dequantised(reader)
    plain = _dequantised(gguf.GGUFReader(str(export_gguf(base, None, root / family / "b32",
                                                         quant="f32").gguf)))
    merged = _dequantised(gguf.GGUFReader(str(exported(root, family, "f32").gguf)))
    pairs = sorted(n.removesuffix(".lora_a") for n in lora if n.endswith(".lora_a"))
    assert len(pairs) == 7 * 2 and "blk.0.attn_q.weight" in pairs and "blk.1.attn_k.weight" in pairs
    for name in pairs:
        a, b = lora[name + ".lora_a"][1], lora[name + ".lora_b"][1]
        assert a.shape[0] == 4 and b.shape[1] == 4
        delta = b @ a * (alpha / 4)
        assert (plain[name][1] + delta - merged[name][1]).abs().max() < 1e-5, name
        assert delta.abs().max() > 1e-2  # the adapter does something
    f16 = export_gguf_lora(base, adapter, root / family / "lora16", quant="f16")
    assert set(f16.types.values()) == {"f16"}


# --- bad input: one-line errors, nothing written or overwritten ----------------------------------

def test_unknown_quant_and_family(root, tmp_path):
    base, adapter, _ = ckpt(root, "qwen2")
    with pytest.raises(LeantuneError, match="--quant 'q3_k'.*q4_k_m"):
        export_gguf(base, adapter, tmp_path / "o", quant="q3_k")
    with pytest.raises(LeantuneError, match="gguf-lora|f32, f16, bf16, q8_0"):
        export_gguf_lora(base, adapter, tmp_path / "o", quant="q4_k_m")
    assert not (tmp_path / "o").exists()
    cfg = leantune.ModelConfig.from_file(base / "config.json")
    cfg.model_type = "gemma"
    with pytest.raises(LeantuneError, match="GGUF export covers model types"):
        architecture(cfg)
    gemma = tmp_path / "gemma"
    shutil.copytree(base, gemma)
    config = json.loads((gemma / "config.json").read_text())
    (gemma / "config.json").write_text(json.dumps({**config, "model_type": "gemma"}))
    with pytest.raises(LeantuneError, match="model_type 'gemma' is not supported"):
        export_gguf(gemma, None, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_word_level_tokenizer_is_refused(root, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(ckpt(root, "qwen2")[0], base)
    for f in base.glob("tokenizer*"):
        f.unlink()
    save_tiny_tokenizer(base, vocab_size=50)
    with pytest.raises(LeantuneError, match="WordLevel tokenizer"):
        export_gguf(base, None, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_adapter_of_another_base_writes_nothing(root, tmp_path):
    base, _, _ = ckpt(root, "llama")
    _, other_adapter, _ = ckpt(root, "qwen2")
    for fn in (export_gguf, export_gguf_lora):
        with pytest.raises(LeantuneError, match="another model") as e:
            fn(base, other_adapter, tmp_path / "o")
        assert "\n" not in str(e.value)
        assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary folder left behind


def test_existing_output_is_not_overwritten(root, tmp_path):
    base, adapter, _ = ckpt(root, "qwen2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-f16.gguf").write_text("mine")
    (out / "notes.txt").write_text("mine too")
    with pytest.raises(LeantuneError, match="not empty.*--overwrite"):
        export_gguf(base, adapter, out)
    assert (out / "model-f16.gguf").read_text() == "mine"
    res = export_gguf(base, adapter, out, overwrite=True)
    assert gguf.GGUFReader(str(res.gguf)).tensors  # replaced by the export
    assert (out / "notes.txt").read_text() == "mine too"  # other files kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_cli_gguf_export(root, tmp_path, capsys):
    base, adapter, _ = ckpt(root, "qwen2")
    out = tmp_path / "cli-out"
    rc = main(["export", "--model", str(base), "--adapter", str(adapter), "--output", str(out),
               "--format", "gguf", "--quant", "q8_0"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    assert f"ollama create cli-out -f {out / 'Modelfile'}" in stdout
    assert (out / "model-q8_0.gguf").is_file() and (out / "Modelfile").is_file()
    rc = main(["export", "--model", str(base), "--adapter", str(adapter), "--output",
               str(tmp_path / "lora"), "--format", "gguf-lora"])
    stdout, err = capsys.readouterr()
    assert rc == 0 and "--lora" in stdout and (tmp_path / "lora" / "adapter-f16.gguf").is_file()
    for args, expect in [(["--format", "gguf", "--quant", "q9"], "--quant 'q9'"),
                         (["--format", "gguf-lora", "--adapter", ""], "needs --adapter"),
                         (["--format", "gguf", "--dtype", "float16"], "--dtype applies"),
                         (["--quant", "q8_0"], "--quant applies")]:
        rc = main(["export", "--model", str(base), "--output", str(tmp_path / "bad"), *args])
        _, err = capsys.readouterr()
        assert rc == 2 and len(err.strip().splitlines()) == 1 and expect in err, err
    assert not (tmp_path / "bad").exists()


def test_sliding_window_is_warned(tmp_path):
    base = _save_base("mistral", tmp_path / "base", sliding_window=8)
    res = export_gguf(base, None, tmp_path / "out")
    assert any("sliding window of 8 tokens" in w for w in res.warnings)


def test_sentencepiece_style_tokenizer(tmp_path):
    """Llama 2 / Mistral 7B tokenizers (BPE with byte fallback, "▁" for spaces) become
    llama.cpp's "llama" model: byte tokens typed BYTE, scores that replay the merge order, the
    space prefix; transformers rebuilds the same tokenizer from the file."""
    from transformers import AutoTokenizer

    tok = make_spm_tokenizer()
    base = _save_base("mistral", tmp_path / "base", tok=tok)
    res = export_gguf(base, None, tmp_path / "out", quant="q8_0")
    reader = gguf.GGUFReader(str(res.gguf))
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert _field(reader, "tokenizer.ggml.pre") == "default"
    assert _field(reader, "tokenizer.ggml.add_space_prefix") is True
    assert _field(reader, "tokenizer.ggml.add_bos_token") is True
    types = _field(reader, "tokenizer.ggml.token_type")
    assert types[:3] == [2, CONTROL, CONTROL] and set(types[3:259]) == {6}  # unk, specials, bytes
    assert set(types[259:len(tok)]) == {NORMAL}
    scores = _field(reader, "tokenizer.ggml.scores")
    merges = _field(reader, "tokenizer.ggml.merges")
    first = tok.convert_tokens_to_ids(merges[0].replace(" ", ""))
    assert scores[first] == 0.0 and min(scores) == -(len(merges) - 1)
    back = AutoTokenizer.from_pretrained(str(res.gguf.parent), gguf_file=res.gguf.name)
    # (not text with a leading space: transformers rebuilds the prefix with Metaspace, which adds
    # no "▁" before one, where this tokenizer's normalizer and llama.cpp always do)
    for text in ["What is the capital of France?", "héllo  wörld 42 ✓\nthe lazy dog."]:
        assert back(text).input_ids == tok(text).input_ids, text
    text = res.modelfile.read_text()
    assert "[INST] " in text and 'PARAMETER stop "</s>"' in text
