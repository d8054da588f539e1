"""The adapter's recorded base is checked: a fingerprint of the base weights recorded at
training (adapter metadata, run_config.json), compared at export, generate and chat; another
base is refused in one line, or warned about with --force-base."""

from __future__ import annotations

import builtins
import json
import shutil

import pytest
import torch
from helpers import (  # noqa: F401  (autouse; fixtures)
    FAST,
    alpaca_file,
    cli_error,
    make_tokenizer,
    one_torch_thread,
    run_cli,
    save_tiny_checkpoint,
    tiny_ckpt,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from leantune.lora.base_check import (FINGERPRINT_KEY, _same_name, check_base, fingerprint,
                                      recorded_base)

GEN = ["--device", "cpu", "--max-new-tokens", "3"]


@pytest.fixture(scope="module")
def run(tiny_ckpt, alpaca_file, tmp_path_factory):  # noqa: F811
    """A 1-step LoRA run on the tiny checkpoint."""
    import io
    from contextlib import redirect_stdout

    from leantune.cli import main

    out = tmp_path_factory.mktemp("run") / "run"
    with redirect_stdout(io.StringIO()):
        assert main(["train", "--model", str(tiny_ckpt), "--data", str(alpaca_file),
                     "--output", str(out), "--max-steps", "1", *FAST]) == 0
    return out


@pytest.fixture(scope="module")
def other_base(tiny_ckpt, tmp_path_factory):  # noqa: F811
    """A checkpoint of the same shapes (and tokenizer) as the tiny one, other weights."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("other") / "other", make_tokenizer(),
                                seed=7)


def test_fingerprint_is_of_the_weights_not_the_files(tiny_ckpt, tmp_path):  # noqa: F811
    fp = fingerprint(tiny_ckpt)
    assert fp.startswith("v1:") and len(fp) == 35 and fingerprint(tiny_ckpt) == fp
    # the same tensors in two shards, another folder: the same fingerprint
    tensors = load_file(str(tiny_ckpt / "model.safetensors"))
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}))
    assert fingerprint(sharded) == fp
    # one value changed, in the middle of one tensor: another fingerprint
    name = max(names, key=lambda k: tensors[k].numel())
    changed = dict(tensors)
    t = changed[name].clone().flatten()
    t[t.numel() // 2] += 1.0
    changed[name] = t.view(tensors[name].shape)
    other = tmp_path / "changed"
    other.mkdir()
    save_file(changed, str(other / "model.safetensors"))
    assert fingerprint(other) != fp
    # another dtype of the same values: other weights too
    half = tmp_path / "half"
    half.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(half / "model.safetensors"))
    assert fingerprint(half) != fp


def test_training_records_the_base(run, tiny_ckpt):  # noqa: F811
    with safe_open(str(run / "adapter_model.safetensors"), framework="pt") as sf:
        meta = sf.metadata()
    assert meta[FINGERPRINT_KEY] == fingerprint(tiny_ckpt)
    assert meta["leantune.base_model"] == str(tiny_ckpt)
    settings = json.loads((run / "run_config.json").read_text())
    assert settings["base_fingerprint"] == fingerprint(tiny_ckpt)
    ckpt = next((run / "checkpoints").iterdir())
    assert json.loads((ckpt / "state.json").read_text())["base_fingerprint"] == fingerprint(
        tiny_ckpt)
    assert recorded_base(ckpt / "trainable.safetensors") == (str(tiny_ckpt),
                                                             fingerprint(tiny_ckpt))


def test_another_base_is_refused_in_one_line(capsys, monkeypatch, run, other_base, tmp_path):
    out = tmp_path / "merged"
    for command in (["export", "--output", out], ["generate", "--prompt", "w5", *GEN],
                    ["chat", *GEN]):
        msg = cli_error(capsys, *command[:1], "--model", other_base, "--adapter", run,
                        *command[1:])
        assert msg.startswith(f"{run}: the adapter was trained on ") and "--force-base" in msg
        assert f"but --model {other_base} has other weights" in msg
    assert not out.exists()
    # a checkpoint of the run, too
    ckpt = next((run / "checkpoints").iterdir())
    assert "has other weights" in cli_error(capsys, "generate", "--model", other_base,
                                            "--adapter", ckpt, "--prompt", "w5", *GEN)
    # --force-base: a warning, and the command runs
    rc, _, err = run_cli(capsys, "export", "--model", other_base, "--adapter", run, "--output",
                         out, "--force-base")
    assert rc == 0 and (out / "config.json").exists(), err
    assert "leantune: warning: " in err and "going on (--force-base)" in err
    monkeypatch.setattr(builtins, "input", lambda _="": (_ for _ in ()).throw(EOFError))
    rc, _, err = run_cli(capsys, "chat", "--model", other_base, "--adapter", run, "--force-base",
                         *GEN)
    assert rc == 0 and "going on (--force-base)" in err


def test_a_copy_of_the_base_is_the_base(capsys, run, tiny_ckpt, tmp_path):  # noqa: F811
    copy = tmp_path / "copy"
    shutil.copytree(tiny_ckpt, copy)
    rc, _, err = run_cli(capsys, "generate", "--model", copy, "--adapter", run, "--prompt", "w5",
                         *GEN)
    assert rc == 0 and "warning" not in err, err


def test_without_a_fingerprint_the_name_is_checked(capsys, run, tiny_ckpt, other_base,  # noqa: F811
                                                   tmp_path):
    """A PEFT adapter from elsewhere records only adapter_config.json's base name."""
    peft = tmp_path / "peft"
    peft.mkdir()
    shutil.copy(run / "adapter_config.json", peft)
    save_file(load_file(str(run / "adapter_model.safetensors")),
              str(peft / "adapter_model.safetensors"))  # no metadata
    assert recorded_base(peft / "adapter_model.safetensors") == (str(tiny_ckpt), None)
    msg = cli_error(capsys, "generate", "--model", other_base, "--adapter", peft, "--prompt",
                    "w5", *GEN)
    assert msg == (f"{peft}: the adapter was trained on {tiny_ckpt} (adapter_config.json's "
                   f"base_model_name_or_path), not --model {other_base}; give the base it was "
                   "trained on, or --force-base to use this one anyway")
    rc, _, err = run_cli(capsys, "generate", "--model", tiny_ckpt, "--adapter", peft,
                         "--prompt", "w5", *GEN)
    assert rc == 0, err
    # nothing recorded at all: nothing to check
    config = json.loads((peft / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (peft / "adapter_config.json").write_text(json.dumps(config))
    check_base(peft / "adapter_model.safetensors", str(other_base), other_base)


def test_names_that_name_the_same_base(tmp_path):
    snap = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    assert _same_name("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B", snap)
    assert _same_name("Qwen/Qwen2.5-0.5B", str(snap), snap)  # its hub-cache snapshot
    assert not _same_name("Qwen/Qwen2.5-1.5B", str(snap), snap)
    assert _same_name(str(snap / ".." / "abc"), str(snap), snap)  # the same folder
    assert not _same_name(str(tmp_path), str(snap), snap)


def test_the_adapter_file_is_the_same_bytes_each_time(tiny_ckpt, tmp_path):  # noqa: F811
    """Two metadata keys or more: safetensors writes them in hash order, which changes from one
    write to the next; save_adapter sorts them, so a rewrite is bit for bit the same."""
    import leantune

    model = leantune.load_model(tiny_ckpt, device="cpu")
    leantune.apply_lora(model, leantune.LoRAConfig(r=4, alpha=8), seed=0)
    files = []
    for i in range(6):
        leantune.save_adapter(model, tmp_path / str(i), base_model_name=str(tiny_ckpt))
        files.append((tmp_path / str(i) / "adapter_model.safetensors").read_bytes())
    assert all(f == files[0] for f in files)
    with safe_open(str(tmp_path / "0" / "adapter_model.safetensors"), framework="pt") as sf:
        assert sf.metadata()[FINGERPRINT_KEY] == fingerprint(tiny_ckpt)
        assert sf.metadata()["format"] == "pt"
    assert load_file(str(tmp_path / "0" / "adapter_model.safetensors")).keys()
