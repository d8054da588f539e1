"""Offline tokenizers for the data tests: a tiny byte-level BPE trained in milliseconds, wrapped
in a transformers fast tokenizer with BOS/EOS/PAD and a small Jinja chat template."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

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


def make_tokenizer(chat_template=EOS_TEMPLATE):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>",
                                 additional_special_tokens=SPECIALS[3:])
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer(EOS_TEMPLATE)


@pytest.fixture(scope="session")
def end_tokenizer():
    return make_tokenizer(END_TEMPLATE)


@pytest.fixture(scope="session")
def plain_tokenizer():
    """No chat template."""
    return make_tokenizer(None)
