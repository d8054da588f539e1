"""--sample-prompts against the model's context, checked when the run sets up (before the
weights load): a prompt that leaves no room is one line in train's words; one that leaves less
than --sample-max-new-tokens is said once and its samples stop at the context."""

from __future__ import annotations

import json

import pytest
from helpers import make_tokenizer, tiny_config

from leantune.errors import LeantuneError
from leantune.model.config import ModelConfig
from leantune.train.samples import SampleWriter


def _prompts(tmp_path, words: int):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hello"}) + "\n"
                    + json.dumps({"prompt": " ".join(["hello"] * words)}) + "\n")
    return path


def test_a_sample_prompt_past_the_context_is_refused_at_set_up(tmp_path):
    cfg = ModelConfig.from_dict(tiny_config("llama").to_dict())  # 256 positions
    tok = make_tokenizer()
    with pytest.raises(LeantuneError, match=r"--sample-prompts .*prompts\.jsonl: a prompt of "
                                            r"[\d,]+ tokens (through the chat template )?"
                                            r"leaves no room in the model's "
                                            r"256-token context"):
        SampleWriter(str(_prompts(tmp_path, 600)), tok, tmp_path, 8, cfg)


def test_a_sample_prompt_near_the_context_is_said_once_in_trains_words(tmp_path):
    cfg = ModelConfig.from_dict(tiny_config("llama").to_dict())
    tok = make_tokenizer()
    path = _prompts(tmp_path, 10)
    n = len(SampleWriter(str(path), tok, tmp_path, 8).ids[1])
    lines = []
    SampleWriter(str(path), tok, tmp_path, 256 - n + 4, cfg, log=lines.append)
    assert len(lines) == 1 and "--sample-max-new-tokens" in lines[0], lines
    assert "prompts.jsonl:2" in lines[0] and "leantune: note" not in lines[0], lines
    lines.clear()
    SampleWriter(str(path), tok, tmp_path, 8, cfg, log=lines.append)  # room enough: quiet
    assert lines == []
