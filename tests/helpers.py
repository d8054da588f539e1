"""Shared test helpers: tiny Hugging Face configs for every supported family, randomised
transformers models saved as checkpoints, a tiny tokenizer, and the one-thread fixture.

Weights are re-randomised with a larger spread than transformers' init (std 0.02, norms 1, biases
0), so that norms, biases and q/k norms all carry signal and a 1e-4 logits tolerance means
something.
"""

from __future__ import annotations

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


FAMILIES = ["llama", "llama_tied", "llama_bias", "mistral", "qwen2", "qwen3"]
SLIDING_WINDOW = 4


def tiny_config(family: str):
    """A tiny transformers config for `family` (fp32, 2 layers, 4 heads, 2 kv heads)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

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


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def random_ids(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=g).tolist()
