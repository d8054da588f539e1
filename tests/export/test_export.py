"""Merged export: base + LoRA adapter -> a sharded HF checkpoint that transformers loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import (
    load_hf,
    max_abs,
    one_torch_thread,  # noqa: F401  (autouse)
    save_checkpoint,
    save_random_adapter,
    save_tiny_tokenizer,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import leantune
from leantune import LeantuneError, LoRAConfig, apply_lora, export_merged, save_adapter

TOL = 1e-4
SHARD_BYTES = 20_000


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def trained(request, tmp_path_factory):
    """(base folder, adapter folder, LoRA leantune model) for an untied and a tied family."""
    family = request.param
    root = tmp_path_factory.mktemp(f"export_{family}")
    base, adapter = root / "base", root / "adapter"
    save_checkpoint(family, base, seed=30)
    save_tiny_tokenizer(base, vocab_size=leantune.ModelConfig.from_file(
        base / "config.json").vocab_size)
    model = save_random_adapter(base, adapter, seed=31)
    return base, adapter, model


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(8))


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _tensors(folder) -> dict[str, tuple[str, object]]:
    """key -> (shard file name, safetensors dtype string) over every shard in folder."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                assert k not in out, f"{k} in two shards"
                out[k] = (f.name, sf.get_slice(k).get_dtype())
    return out


def test_export_sharded_loads_in_transformers(trained, ids, tmp_path):
    base, adapter, model = trained
    out = export_merged(base, adapter, tmp_path / "merged", max_shard_bytes=SHARD_BYTES)
    assert out == tmp_path / "merged"
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1
    assert [s.name for s in shards] == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = _tensors(out)
    assert index["weight_map"] == {k: shard for k, (shard, _) in tensors.items()}
    total = 0
    for s in shards:
        with safe_open(str(s), "pt") as sf:
            size = sum(sf.get_tensor(k).nbytes for k in sf.keys())  # noqa: SIM118
            n = len(list(sf.keys()))
        assert size <= SHARD_BYTES or n == 1  # a shard exceeds the limit only for one big tensor
        total += size
    assert index["metadata"]["total_size"] == total
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (base / "config.json").read_text())
    # Side files come along: generation config and the tokenizer.
    for side in ["tokenizer.json", "tokenizer_config.json"]:
        assert (base / side).exists()
        assert (out / side).read_bytes() == (base / side).read_bytes(), side
    # generation_config.json: the base's, its eos_token_id completed with the tokenizer's EOS
    base_gen = json.loads((base / "generation_config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    eos = base_gen.get("eos_token_id")
    assert gen == {**base_gen, "eos_token_id": gen["eos_token_id"]}
    assert gen["eos_token_id"] == (2 if eos == 2 else [2])  # llama's is w2 already; qwen2 has none
    assert not list(out.glob(".*tmp*"))  # no temporary files left behind

    lora_logits = _logits(model, ids)
    base_logits = _logits(load_hf(base), ids)
    assert max_abs(lora_logits, base_logits) > 1e-2  # the merge has something to show
    assert max_abs(_logits(load_hf(out), ids), lora_logits) < TOL
    # The merged checkpoint also loads back into leantune, without LoRA.
    merged = leantune.load_model(out, device="cpu").eval()
    assert max_abs(_logits(merged, ids), lora_logits) < TOL

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    assert PreTrainedTokenizerFast.from_pretrained(out)("w3 w4 w5").input_ids == [3, 4, 5]
    text = "w3 w4 w5 w2"
    assert (AutoTokenizer.from_pretrained(out)(text).input_ids
            == AutoTokenizer.from_pretrained(base)(text).input_ids)


def test_export_without_adapter_copies_base(trained, ids, tmp_path):
    base, _, _ = trained
    out = export_merged(base, None, tmp_path / "copy", max_shard_bytes=SHARD_BYTES)
    assert max_abs(_logits(load_hf(out), ids), _logits(load_hf(base), ids)) == 0.0


def test_non_empty_output_without_overwrite_raises(trained, tmp_path):
    base, adapter, _ = trained
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(LeantuneError) as e:
        export_merged(base, adapter, out)
    assert str(out) in str(e.value) and "not empty" in str(e.value)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # nothing written
    export_merged(base, adapter, out, overwrite=True, max_shard_bytes=SHARD_BYTES)
    assert (out / "model.safetensors.index.json").exists()
    assert (out / "keep.txt").read_text() == "mine"


def test_empty_existing_output_is_fine(trained, tmp_path):
    base, adapter, _ = trained
    (tmp_path / "empty").mkdir()
    export_merged(base, adapter, tmp_path / "empty")
    assert (tmp_path / "empty" / "config.json").exists()


def test_bfloat16_export(trained, ids, tmp_path):
    base, adapter, model = trained
    fp32 = export_merged(base, adapter, tmp_path / "fp32", max_shard_bytes=SHARD_BYTES)
    bf16 = export_merged(base, adapter, tmp_path / "bf16", dtype="bfloat16",
                         max_shard_bytes=SHARD_BYTES)
    tensors = _tensors(bf16)
    assert tensors and {dt for _, dt in tensors.values()} == {"BF16"}
    assert {dt for _, dt in _tensors(fp32).values()} == {"F32"}
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    index = json.loads((bf16 / "model.safetensors.index.json").read_text())
    assert index["weight_map"].keys() == tensors.keys()
    # Each bf16 tensor is the fp32 merge rounded to bf16 (merged in fp32, cast once).
    for key in tensors:
        with safe_open(str(fp32 / _tensors(fp32)[key][0]), "pt") as a, \
                safe_open(str(bf16 / tensors[key][0]), "pt") as b:
            assert torch.equal(a.get_tensor(key).to(torch.bfloat16), b.get_tensor(key)), key
    hf = load_hf(bf16)  # loads; bf16 weights run in fp32
    assert max_abs(_logits(hf, ids), _logits(model, ids)) < 0.1


def test_export_validates_inputs(trained, tmp_path):
    base, adapter, _ = trained
    with pytest.raises(LeantuneError, match="adapter_config.json"):
        export_merged(base, tmp_path / "no_adapter", tmp_path / "o1")
    with pytest.raises(LeantuneError, match="does not exist"):
        export_merged(tmp_path / "no_model", adapter, tmp_path / "o2")


def test_rslora_export_matches(trained, ids, tmp_path):
    """rsLoRA scaling (alpha / sqrt(r)) is used by the merge too."""
    base, _, _ = trained
    model = leantune.load_model(base, device="cpu")
    apply_lora(model, LoRAConfig(r=4, alpha=6, targets="q,v,down", use_rslora=True))
    with torch.no_grad():
        g = torch.Generator().manual_seed(32)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    save_adapter(model, tmp_path / "adapter")
    out = export_merged(base, tmp_path / "adapter", tmp_path / "merged")
    assert max_abs(_logits(load_hf(out), ids), _logits(model.eval(), ids)) < TOL


def test_dtype_is_recorded_under_every_dtype_key(tmp_path):
    """transformers reads `dtype` before the legacy `torch_dtype`; a config carrying both (as the
    bundled demo model's does) must get the new dtype under both, or it loads in the old one."""
    from transformers import AutoConfig

    from leantune import assets

    base = assets.path("tiny-llama")
    src = json.loads((base / "config.json").read_text())
    assert src["dtype"] == src["torch_dtype"] == "bfloat16"
    out = export_merged(base, None, tmp_path / "fp32", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert AutoConfig.from_pretrained(out).dtype == torch.float32


def test_adapter_of_another_model_writes_nothing(trained, tmp_path):
    base, adapter, _ = trained
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    cases = {
        "renamed": ({k.replace("layers.0.", "layers.9."): v for k, v in tensors.items()},
                    "not found in the base model"),
        "reshaped": ({**tensors, key: tensors[key][:, :-1].contiguous()}, "do not fit"),
    }
    for name, (bad, expect) in cases.items():
        bad_dir = tmp_path / f"adapter_{name}"
        shutil.copytree(adapter, bad_dir)
        save_file(bad, str(bad_dir / "adapter_model.safetensors"))
        out = tmp_path / f"out_{name}"
        with pytest.raises(LeantuneError, match=expect) as e:
            export_merged(base, bad_dir, out)
        assert str(bad_dir) in str(e.value) and "\n" not in str(e.value)
        assert not out.exists()  # checked before anything is written


def test_overwrite_removes_stale_shards(trained, ids, tmp_path):
    base, adapter, model = trained
    out = tmp_path / "merged"
    export_merged(base, adapter, out, max_shard_bytes=SHARD_BYTES)  # many shards
    many = len(list(out.glob("model*.safetensors")))
    export_merged(base, adapter, out, overwrite=True)  # one shard
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert many > 1 and shards == ["model-00001-of-00001.safetensors"]


# --- nothing is lost: the inputs are never the output, a failed export changes nothing ----------

def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_output_overlapping_base_or_adapter_is_refused(trained, tmp_path):
    base, adapter, _ = trained
    before = _files(base), _files(adapter)
    cases = [(base, f"--output {base} is the base model folder {base}"),
             (base / "merged", f"--output {base / 'merged'} lies inside the base model folder"),
             (base.parent, f"--output {base.parent} contains the base model folder"),
             (adapter, f"--output {adapter} is the adapter folder {adapter}")]
    for out, expect in cases:
        with pytest.raises(LeantuneError) as e:
            export_merged(base, adapter, out, overwrite=True)
        assert str(e.value).startswith(expect)
        assert str(e.value).endswith("write to a folder of its own, outside it")
    assert (_files(base), _files(adapter)) == before
    assert not (base / "merged").exists()


def test_output_naming_a_file_is_refused(trained, tmp_path):
    base, adapter, _ = trained
    (tmp_path / "merged").write_text("mine")
    with pytest.raises(LeantuneError, match="is a file; give a folder"):
        export_merged(base, adapter, tmp_path / "merged", overwrite=True)
    assert (tmp_path / "merged").read_text() == "mine"


def test_a_failed_export_leaves_the_previous_one(trained, tmp_path, monkeypatch):
    import leantune.export.merge as merge_mod

    base, adapter, _ = trained
    out = export_merged(base, adapter, tmp_path / "merged", max_shard_bytes=SHARD_BYTES)
    before = _files(out)
    real = merge_mod.write_sharded

    def fail_midway(entries, folder, max_shard_bytes):
        real(entries[:3], folder, max_shard_bytes)  # some shards written, then the disk fills
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(merge_mod, "write_sharded", fail_midway)
    with pytest.raises(OSError):
        export_merged(base, adapter, out, overwrite=True, max_shard_bytes=SHARD_BYTES)
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]  # no temporary folder left


@pytest.fixture(scope="module")
def run_with_checkpoints(tmp_path_factory):
    """A LoRA run of the tiny model (3 steps, a checkpoint at each) and its base."""
    from helpers import alpaca_rows, make_tokenizer, save_tiny_checkpoint, write_jsonl

    from leantune.train import TrainConfig, Trainer

    root = tmp_path_factory.mktemp("ckpt_export")
    base = save_tiny_checkpoint(root / "base", make_tokenizer())
    data = write_jsonl(root / "train.jsonl", alpaca_rows(24))
    cfg = TrainConfig(model=str(base), data=str(data), output=str(root / "run"),
                      max_seq_len=128, batch_size=2, lr=1e-2, lora_r=4, lora_alpha=8,
                      max_steps=3, save_every=1, keep_checkpoints=0, device="cpu",
                      progress=False)
    Trainer(cfg, log=lambda *a: None).train()
    return base, root / "run"


def test_export_from_any_checkpoint_and_from_an_interrupted_run(run_with_checkpoints,
                                                                tmp_path):
    base, run = run_with_checkpoints
    final = _tensors_of(export_merged(base, run, tmp_path / "final"))
    last = _tensors_of(export_merged(base, run / "checkpoints" / "step-00000003",
                                     tmp_path / "step3"))
    first = _tensors_of(export_merged(base, run / "checkpoints" / "step-00000001",
                                      tmp_path / "step1"))
    assert final.keys() == last.keys() == first.keys()
    assert all(torch.equal(final[k], last[k]) for k in final)  # the last step is checkpointed
    assert any(not torch.equal(final[k], first[k]) for k in final)

    stopped = tmp_path / "stopped"  # a run stopped before its end: checkpoints, no adapter
    shutil.copytree(run, stopped, ignore=shutil.ignore_patterns("adapter_*"))
    notes = []
    got = _tensors_of(export_merged(base, stopped, tmp_path / "from_stopped", log=notes.append))
    assert all(torch.equal(got[k], final[k]) for k in final)
    assert notes == [f"{stopped} has no final adapter (the run was stopped before its end?): "
                     f"using its latest checkpoint, "
                     f"{stopped / 'checkpoints' / 'step-00000003'}"]


def test_export_of_a_full_checkpoint_says_what_to_do(run_with_checkpoints, tmp_path):
    import json as json_

    base, run = run_with_checkpoints
    ckpt = tmp_path / "step-00000001"
    shutil.copytree(run / "checkpoints" / "step-00000001", ckpt)
    state = json_.loads((ckpt / "state.json").read_text())
    state["config"]["full"] = True
    (ckpt / "state.json").write_text(json_.dumps(state))
    with pytest.raises(LeantuneError, match=r"a checkpoint of a full fine-tune \(--full\) holds "
                                            r"whole weights.*--resume"):
        export_merged(base, ckpt, tmp_path / "out")
    with pytest.raises(LeantuneError, match="adapter_config.json not found; --adapter must be an "
                                            "adapter folder .* or one checkpoint"):
        export_merged(base, tmp_path / "nothing", tmp_path / "out")
    (ckpt / "state.json").write_text("{}")
    with pytest.raises(LeantuneError, match=r"state.json: unreadable checkpoint state "
                                            r"\(KeyError: 'config'\); export another checkpoint"):
        export_merged(base, ckpt, tmp_path / "out")


def _tensors_of(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def test_cli_export_errors_are_one_line(trained, tmp_path, capsys):
    from leantune.cli import main

    base, adapter, _ = trained
    (tmp_path / "file").write_text("mine")
    for out, expect in ((tmp_path / "file", "is a file; give a folder"),
                        (base, "is the base model folder")):
        rc = main(["export", "--model", str(base), "--adapter", str(adapter), "--output",
                   str(out), "--overwrite"])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and expect in err, err


def test_cli_export_takes_the_base_from_the_adapter(trained, tmp_path, capsys):
    """Without --model, export merges onto the base the adapter names (as chat does); without
    either, one line."""
    from leantune.cli import main

    base, adapter, _ = trained
    rc = main(["export", "--adapter", str(adapter), "--output", str(tmp_path / "a")])
    out = capsys.readouterr().out
    assert rc == 0 and "the base model is" in out
    rc = main(["export", "--model", str(base), "--adapter", str(adapter), "--output",
               str(tmp_path / "b")])
    assert rc == 0
    a, b = _tensors_of(tmp_path / "a"), _tensors_of(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rc = main(["export", "--output", str(tmp_path / "c")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "give --model" in err
