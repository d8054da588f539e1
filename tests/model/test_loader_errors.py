"""Every broken checkpoint is a LeantuneError whose one-line message names the culprit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    one_torch_thread,  # noqa: F401  (autouse)
    save_checkpoint,
)
from safetensors.torch import load_file, save_file

import leantune
from leantune import LeantuneError
from leantune.model.config import SUPPORTED_MODEL_TYPES, ModelConfig


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid single-file checkpoint, copied by tests that break it."""
    folder = tmp_path_factory.mktemp("good")
    save_checkpoint("qwen2", folder, seed=40)
    assert (folder / "model.safetensors").exists()
    return folder


@pytest.fixture(scope="module")
def good_sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good_sharded")
    save_checkpoint("llama", folder, seed=41, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    return folder


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _error(path) -> str:
    with pytest.raises(LeantuneError) as e:
        leantune.load_model(path, device="cpu")
    msg = str(e.value)
    assert "\n" not in msg  # one line
    return msg


def test_good_checkpoints_load(good, good_sharded):
    leantune.load_model(good, device="cpu")
    leantune.load_model(good_sharded, device="cpu")


def test_missing_path(tmp_path):
    path = tmp_path / "does" / "not" / "exist"
    msg = _error(path)
    assert str(path) in msg and "does not exist" in msg


def test_unknown_hub_id_offline():
    msg = _error("no-such-org/no-such-model-xyz")  # HF_HUB_OFFLINE=1 in conftest
    assert "no-such-org/no-such-model-xyz" in msg


def test_folder_without_config(tmp_path):
    msg = _error(tmp_path)
    assert str(tmp_path / "config.json") in msg and "not found" in msg


def test_invalid_json_config(good, tmp_path):
    ckpt = _copy(good, tmp_path)
    (ckpt / "config.json").write_text('{\n  "model_type": "qwen2",\n  oops\n}\n')
    msg = _error(ckpt)
    assert f"{ckpt / 'config.json'}:3" in msg and "invalid JSON" in msg


def test_unsupported_model_type(good, tmp_path):
    ckpt = _copy(good, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = _error(ckpt)
    assert "'gpt2'" in msg and str(ckpt / "config.json") in msg
    for supported in SUPPORTED_MODEL_TYPES:
        assert supported in msg
    assert set(SUPPORTED_MODEL_TYPES) == {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                          "mixtral", "gpt_oss", "gemma2", "gemma3_text",
                                          "gemma3", "phi3"}


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_attention_heads",
                                   "intermediate_size", "num_hidden_layers"])
def test_missing_required_field(good, tmp_path, field):
    ckpt = _copy(good, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg[field]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = _error(ckpt)
    assert repr(field) in msg and "missing" in msg and str(ckpt / "config.json") in msg


def test_invalid_field_value(good, tmp_path):
    ckpt = _copy(good, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hidden_size"] = "wide"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    msg = _error(ckpt)
    assert str(ckpt / "config.json") in msg and "invalid value" in msg


def test_missing_safetensors(good, tmp_path):
    ckpt = _copy(good, tmp_path)
    (ckpt / "model.safetensors").unlink()
    torch.save({}, ckpt / "pytorch_model.bin")
    msg = _error(ckpt)
    assert str(ckpt) in msg and "safetensors" in msg


@pytest.mark.parametrize("keep", ["half", "all_but_4", "header_only_8"])
def test_truncated_safetensors(good, tmp_path, keep):
    ckpt = _copy(good, tmp_path)
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    n = {"half": len(data) // 2, "all_but_4": len(data) - 4, "header_only_8": 8}[keep]
    f.write_bytes(data[:n])
    msg = _error(ckpt)
    assert str(f) in msg and "truncated or corrupt" in msg


def test_garbage_safetensors(good, tmp_path):
    ckpt = _copy(good, tmp_path)
    f = ckpt / "model.safetensors"
    f.write_bytes(b"<html>not a model</html>" * 10)
    msg = _error(ckpt)
    assert str(f) in msg


def test_index_names_missing_shard(good_sharded, tmp_path):
    ckpt = _copy(good_sharded, tmp_path)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (ckpt / shard).unlink()
    msg = _error(ckpt)
    assert str(ckpt / shard) in msg and "missing" in msg


def test_unreadable_index(good_sharded, tmp_path):
    ckpt = _copy(good_sharded, tmp_path)
    (ckpt / "model.safetensors.index.json").write_text('{"metadata": {}}')
    msg = _error(ckpt)
    assert str(ckpt / "model.safetensors.index.json") in msg


@pytest.mark.parametrize("weight", ["model.norm.weight", "model.layers.1.mlp.down_proj.weight",
                                    "model.layers.0.self_attn.q_proj.bias"])
def test_checkpoint_missing_a_weight(good, tmp_path, weight):
    ckpt = _copy(good, tmp_path)
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    del tensors[weight]
    save_file(tensors, str(f), metadata={"format": "pt"})
    msg = _error(ckpt)
    assert weight in msg and "1 weight missing" in msg and str(ckpt) in msg


def test_a_fused_checkpoint_tensor_missing_is_named_as_the_checkpoint_names_it(tmp_path):
    """Phi-3 keeps q/k/v in one qkv_proj tensor: its absence is that one tensor, not the three
    projections the model splits it into."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2)
    ckpt = tmp_path / "phi3"
    Phi3ForCausalLM(cfg).save_pretrained(ckpt)
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.0.self_attn.qkv_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    assert _error(ckpt) == (f"{ckpt}: 1 weight missing from the checkpoint (e.g. "
                            "model.layers.0.self_attn.qkv_proj.weight); the download is "
                            "incomplete: re-download the model")


def test_weight_with_wrong_shape(good, tmp_path):
    ckpt = _copy(good, tmp_path)
    f = ckpt / "model.safetensors"
    tensors = load_file(str(f))
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, str(f), metadata={"format": "pt"})
    msg = _error(ckpt)
    assert key in msg and "shape" in msg and str(f) in msg


def test_config_errors_from_dict():
    with pytest.raises(LeantuneError, match="model_type None"):
        ModelConfig.from_dict({}, source="x.json")
    with pytest.raises(LeantuneError, match="unsupported|not supported"):
        ModelConfig.from_dict({"model_type": "gemma"}, source="x.json")
    with pytest.raises(LeantuneError, match=r"^x\.json: model_type 'gemma3' \(a multimodal "
                       r"checkpoint\) needs a text_config object .*; a text-only checkpoint "
                       r"says model_type 'gemma3_text' with those fields at the top level$"):
        ModelConfig.from_dict({"model_type": "gemma3"}, source="x.json")


def test_file_instead_of_folder(good):
    msg = _error(good / "config.json")
    assert str(good / "config.json") in msg and "is a file" in msg and "folder" in msg


def test_config_that_is_not_an_object(good, tmp_path):
    ckpt = _copy(good, tmp_path)
    (ckpt / "config.json").write_text("[1, 2]")
    msg = _error(ckpt)
    assert str(ckpt / "config.json") in msg and "JSON object" in msg


def test_hub_id_downloads_only_the_weights_transformers_loads(good, monkeypatch):
    import fnmatch

    import huggingface_hub

    from leantune.model.loader import resolve_checkpoint

    seen = {}

    def fake_snapshot_download(repo_id, allow_patterns=None, **_kw):
        seen.update(repo=repo_id, patterns=allow_patterns)
        return str(good)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_checkpoint("some-org/some-model") == good
    assert seen["repo"] == "some-org/some-model"

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in seen["patterns"])

    for name in ("config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                 "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"):
        assert fetched(name), name
    assert not fetched("consolidated.safetensors")  # Mistral repos: the same weights again


def test_bare_hub_names_are_tried_on_the_hub(tmp_path, monkeypatch):
    """A name without an org ("gpt2") that is no local folder goes to the hub (offline here)."""
    from leantune.model.loader import resolve_checkpoint

    monkeypatch.chdir(tmp_path)
    with pytest.raises(LeantuneError, match="no-such-model: no local folder of that name, and it "
                                            "could not be downloaded from the hub"):
        resolve_checkpoint("no-such-model")
