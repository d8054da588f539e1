"""`leantune train` end to end on a tiny model: outputs, metrics, eval, YAML configs, output
protection, and one-line errors (exit code 2, no traceback) for every bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, alpaca_rows, read_metrics, tiny_ckpt, write_jsonl  # noqa: F401

from leantune.cli import main

FAST = ["--max-seq-len", "128", "--batch-size", "4", "--lora-r", "4", "--no-progress",
        "--device", "cpu"]


def train(capsys, *args):
    rc = main(["train", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def run_ok(capsys, model, data, output, *extra):
    rc, out, err = train(capsys, "--model", model, "--data", data, "--output", output,
                         "--max-steps", 2, *FAST, *extra)
    assert rc == 0, err
    return out


def one_line_error(capsys, *args) -> str:
    """Run `leantune train args`; it must fail with exit 2 and exactly one stderr line."""
    rc, _, err = train(capsys, *args)
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("leantune: error: ")
    return lines[0]


# --- outputs -------------------------------------------------------------------------------------

def test_lora_run_writes_adapter_and_metrics(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out_dir = tmp_path / "run"
    out = run_ok(capsys, tiny_ckpt, alpaca_file, out_dir, "--lora-alpha", 8)
    assert "done: 2 steps" in out
    # rank 4 is not one of vLLM's --max-lora-rank values: a warning, and the line that serves it
    assert "warning: vLLM accepts LoRA ranks 8, 16" in out
    assert (f"vllm serve {tiny_ckpt} --enable-lora --lora-modules run={out_dir} "
            "--max-lora-rank 8") in out
    for name in ("adapter_model.safetensors", "adapter_config.json", "metrics.jsonl",
                 "tokenizer.json"):
        assert (out_dir / name).is_file(), name
    acfg = json.loads((out_dir / "adapter_config.json").read_text())
    assert acfg["r"] == 4 and acfg["lora_alpha"] == 8
    recs = read_metrics(out_dir)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib"):
            assert isinstance(r[key], (int, float)), key
        assert r["loss"] > 0 and r["tokens_per_s"] > 0 and r["grad_norm"] >= 0
    assert not (out_dir / "checkpoints").exists()  # save_every 0: no intermediate checkpoints


def test_full_finetune_writes_a_transformers_checkpoint(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                        capsys):
    from transformers import AutoModelForCausalLM

    out_dir = tmp_path / "full"
    run_ok(capsys, tiny_ckpt, alpaca_file, out_dir, "--full", "--lr", "1e-3")
    assert (out_dir / "config.json").is_file()
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert all((out_dir / f).is_file() for f in set(index["weight_map"].values()))
    assert not (out_dir / "adapter_model.safetensors").exists()
    assert [r["step"] for r in read_metrics(out_dir)] == [1, 2]

    base = AutoModelForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32)
    tuned = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    sb, st = base.state_dict(), tuned.state_dict()
    assert sb.keys() == st.keys()
    assert any(not torch.equal(sb[k], st[k]) for k in sb)  # the weights were trained
    ids = torch.tensor([[1, 5, 9, 12]])
    assert torch.isfinite(tuned(ids).logits).all()


@pytest.mark.parametrize("source", ["fraction", "file"])
def test_eval_records_start_before_training(tiny_ckpt, alpaca_file, tmp_path, capsys,  # noqa: F811
                                            source):
    out_dir = tmp_path / "run"
    if source == "fraction":
        extra = ["--eval-fraction", "0.1"]
    else:
        extra = ["--eval-data", write_jsonl(tmp_path / "eval.jsonl", alpaca_rows(6, seed=1))]
    rc, out, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output", out_dir,
                         "--max-steps", 3, "--eval-every", 2, "--lr", "5e-3", *FAST, *extra)
    assert rc == 0, err
    recs = read_metrics(out_dir)
    evals = [r for r in recs if "eval_loss" in r]
    assert recs[0] == {"step": 0, "eval_loss": evals[0]["eval_loss"]}  # first record, before step 1
    assert [r["step"] for r in evals] == [0, 2, 3]  # before, every 2 steps, and at the end
    assert all(r["eval_loss"] > 0 for r in evals)
    assert "eval loss:" in out


# --- output protection ---------------------------------------------------------------------------

def test_output_folder_is_protected(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out_dir = tmp_path / "run"
    run_ok(capsys, tiny_ckpt, alpaca_file, out_dir)
    first = (out_dir / "adapter_model.safetensors").read_bytes()

    line = one_line_error(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                          out_dir, "--max-steps", 2, *FAST)
    assert str(out_dir) in line and "--overwrite" in line and "--resume" in line
    assert (out_dir / "adapter_model.safetensors").read_bytes() == first  # untouched

    run_ok(capsys, tiny_ckpt, alpaca_file, out_dir, "--overwrite", "--seed", 7)
    assert (out_dir / "adapter_model.safetensors").read_bytes() != first
    assert [r["step"] for r in read_metrics(out_dir)] == [1, 2]  # replaced, not appended

    # --resume needs a checkpoint: neither this finished run (no --save-every) nor a new folder
    for folder in (out_dir, tmp_path / "fresh"):
        line = one_line_error(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                              folder, "--max-steps", 2, "--resume", *FAST)
        assert "no checkpoint found" in line and str(folder) in line


def test_resume_from_the_cli(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out_dir = tmp_path / "run"
    args = ["--model", tiny_ckpt, "--data", alpaca_file, "--output", out_dir, "--max-steps", 4,
            "--save-every", 2, *FAST]
    assert train(capsys, *args)[0] == 0
    assert (out_dir / "checkpoints" / "step-00000002").is_dir()
    rc, out, err = train(capsys, *args, "--resume")
    assert rc == 0, err
    assert "resumed from" in out and "step-00000002" in out
    assert [r["step"] for r in read_metrics(out_dir)] == [1, 2, 3, 4]


# --- YAML config ---------------------------------------------------------------------------------

def test_yaml_config_and_flags_win(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out_dir = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    # `lr: 1e-3` (no dot) is a string to YAML 1.1; the config still reads it as a number
    cfg.write_text(f"model: {tiny_ckpt}\ndata: {alpaca_file}\noutput: {out_dir}\n"
                   "max_steps: 5\nlr: 1e-3\nwarmup-steps: 0\nschedule: constant\nlora_r: 2\n"
                   "max_seq_len: 128\nprogress: false\n")
    rc, _, err = train(capsys, "--config", cfg, "--max-steps", 2, "--lora-r", 3, "--device", "cpu")
    assert rc == 0, err
    recs = read_metrics(out_dir)
    assert [r["step"] for r in recs] == [1, 2]  # the flag's 2 steps, not the file's 5
    assert all(r["lr"] == pytest.approx(1e-3) for r in recs)  # constant lr from the file
    assert json.loads((out_dir / "adapter_config.json").read_text())["r"] == 3


def test_yaml_switch_off_flags_as_keys(tmp_path):
    """`no-fused-layers: true` (the flag's name) reads as `fused_layers: false`."""
    from leantune.train.config import load_yaml_config

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("no-offload-embedding: true\nno_fused_layers: false\nprogress: false\n")
    assert load_yaml_config(str(cfg)) == {"offload_embedding": False, "fused_layers": True,
                                          "progress": False}


@pytest.mark.parametrize("text, expect", [
    ("max_steps: 2\nlearning_rate: 1e-4\n", "unknown option 'learning_rate'"),
    ("no-lr: true\n", "option 'no-lr' must be a number"),
    ("max_steps: two\n", "option 'max_steps' must be an integer"),
    ("lr: fast\n", "option 'lr' must be a number"),
    ("full: 1\n", "option 'full' must be true or false"),
    ("max_steps: [\n", "invalid YAML"),
    ("- a\n- b\n", "must be a mapping"),
])
def test_yaml_config_errors(tiny_ckpt, alpaca_file, tmp_path, capsys, text, expect):  # noqa: F811
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    line = one_line_error(capsys, "--config", cfg, "--model", tiny_ckpt, "--data", alpaca_file,
                          "--output", tmp_path / "run")
    assert str(cfg) in line and expect in line


# --- one-line errors -----------------------------------------------------------------------------

def test_model_errors(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    def err(model):
        return one_line_error(capsys, "--model", model, "--data", alpaca_file, "--output",
                              tmp_path / "out", *FAST)

    missing = tmp_path / "no-such-model"
    assert str(missing) in err(missing) and "does not exist" in err(missing)

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    line = err(gpt2)
    assert "'gpt2' is not supported" in line
    assert all(t in line for t in ("llama", "mistral", "qwen2", "qwen3"))

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_ckpt / "config.json", no_weights)
    line = err(no_weights)
    assert str(no_weights) in line and "no *.safetensors" in line

    cut = tmp_path / "truncated"
    shutil.copytree(tiny_ckpt, cut)
    blob = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    line = err(cut)
    assert "model.safetensors" in line and "truncated or corrupt" in line


def test_data_errors(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    def err(data, *extra):
        return one_line_error(capsys, "--model", tiny_ckpt, "--data", data, "--output",
                              tmp_path / "out", *FAST, *extra)

    missing = tmp_path / "missing.jsonl"
    assert f"{missing}: data file not found" in err(missing)

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert f"{empty}: file is empty" in err(empty)

    rows = [json.dumps(r) for r in alpaca_rows(4)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows[:2] + ['{"instruction": "hi", "output": '] + rows[2:]) + "\n")
    assert f"{bad}:3: malformed JSON" in err(bad)

    lacking = write_jsonl(tmp_path / "lacking.jsonl",
                          alpaca_rows(2) + [{"instruction": "hi", "answer": "x"}])
    line = err(lacking)
    assert f"{lacking}:3" in line and "missing field 'output'" in line

    as_text = write_jsonl(tmp_path / "as_text.jsonl", alpaca_rows(2))
    line = err(as_text, "--format", "text")
    assert f"{as_text}:1" in line and "missing field 'text'" in line


@pytest.mark.parametrize("extra, expect", [
    (["--max-seq-len", "0"], "--max-seq-len must be a positive integer, got 0"),
    (["--lora-targets", "x"], "unknown LoRA target 'x'"),
    (["--log-every", "0"], "--log-every must be a positive integer"),
    (["--grad-accum", "0"], "--grad-accum must be a positive integer"),
    (["--eval-fraction", "1.5"], "--eval-fraction must be in [0, 1)"),
    (["--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--device", "cpu", "--checkpointing", "offload"], "offload needs a CUDA device"),
])
def test_flag_errors(tiny_ckpt, alpaca_file, tmp_path, capsys, extra, expect):  # noqa: F811
    line = one_line_error(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                          tmp_path / "out", *FAST, *extra)
    assert expect in line


def test_device_errors(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    def err(device):
        return one_line_error(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                              tmp_path / "out", "--max-steps", 1, "--no-progress",
                              "--device", device)

    assert "--device 'gpu0' is not a device" in err("gpu0")
    if not torch.cuda.is_available():
        assert "--device cuda:1: torch sees no CUDA GPU" in err("cuda:1")
    assert not (tmp_path / "out").exists()  # flags are checked before the output is touched


def test_model_and_data_go_together(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    line = one_line_error(capsys, "--model", tiny_ckpt, "--output", tmp_path / "out")
    assert "--data is required" in line
    line = one_line_error(capsys, "--data", alpaca_file, "--output", tmp_path / "out")
    assert "--model is required" in line


# --- help ----------------------------------------------------------------------------------------

def test_module_help_runs():
    res = subprocess.run([sys.executable, "-m", "leantune", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "train" in res.stdout and "export" in res.stdout


def test_train_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ["--model", "--data", "--output", "--format", "--max-seq-len", "--batch-size",
                 "--grad-accum", "--lr", "--epochs", "--max-steps", "--lora-r", "--lora-alpha",
                 "--lora-dropout", "--lora-targets", "--full", "--eval-data", "--eval-fraction",
                 "--save-every", "--resume", "--seed", "--config", "--overwrite",
                 "--checkpointing", "--max-memory-gib", "--no-fused-layers"]:
        assert flag in text, flag
