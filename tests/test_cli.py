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

SMALL = ["--max-seq-len", "128", "--batch-size", "4", "--no-progress", "--device", "cpu"]
FAST = [*SMALL, "--lora-r", "4"]


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
    # no --save-every: only the last step is checkpointed (a finished run can be extended)
    assert [p.name for p in (out_dir / "checkpoints").iterdir()] == ["step-00000002"]


def test_full_finetune_writes_a_transformers_checkpoint(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                        capsys):
    from transformers import AutoModelForCausalLM

    out_dir = tmp_path / "full"
    rc, _, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output", out_dir,
                       "--max-steps", 2, *SMALL, "--full", "--lr", "1e-3")
    assert rc == 0, err
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

    # --resume needs a checkpoint
    folder = tmp_path / "fresh"
    line = one_line_error(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                          folder, "--max-steps", 2, "--resume", *FAST)
    assert "no checkpoint found" in line and str(folder) in line and "without --resume" in line


def test_a_finished_run_resumes_to_nothing_and_extends(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                         capsys):
    out_dir = tmp_path / "run"
    args = ["--model", tiny_ckpt, "--data", alpaca_file, "--output", out_dir, *FAST]
    assert train(capsys, *args, "--max-steps", 2)[0] == 0
    adapter = (out_dir / "adapter_model.safetensors").read_bytes()

    rc, out, err = train(capsys, *args, "--max-steps", 2, "--resume")
    assert rc == 0 and err == "", err
    assert f"{out_dir}: the run already finished at step 2; nothing to do" in out
    assert "a larger --max-steps or --epochs" in out and "done:" not in out
    assert [r["step"] for r in read_metrics(out_dir)] == [1, 2]
    assert (out_dir / "adapter_model.safetensors").read_bytes() == adapter

    rc, out, err = train(capsys, *args, "--max-steps", 4, "--resume")
    assert rc == 0, err
    assert "resumed from" in out and "step-00000002" in out
    # (step 3 is still in the warmup of both schedules: the same learning rate, said so)
    assert ("the run now has 4 optimizer steps (it was started with 2): the cosine schedule "
            "runs over 4 steps, so step 3 keeps learning rate") in out
    assert [r["step"] for r in read_metrics(out_dir)] == [1, 2, 3, 4]
    assert (out_dir / "checkpoints" / "step-00000004").is_dir()
    assert (out_dir / "adapter_model.safetensors").read_bytes() != adapter

    line = one_line_error(capsys, *args, "--max-steps", 3, "--resume")
    assert "the run is at step 4, past the 3 steps this command asks for" in line
    assert "--max-steps 4 or more" in line


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
    shutil.copytree(tiny_ckpt, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
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
    (["--device", "cpu", "--activations", "offload"], "offload needs a CUDA device"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--epochs", "nan"], "--epochs must be a finite number, got nan"),
    (["--eval-data", "x.jsonl", "--eval-fraction", "0.1"],
     "--eval-data and --eval-fraction both give an evaluation set; keep one of them"),
    (["--full", "--lora-r", "8"], "--lora-r is a LoRA setting, and --full trains every weight "
                                  "without an adapter; drop --lora-r or --full"),
    (["--full", "--lora-targets", "q,v"], "drop --lora-targets or --full"),
    (["--lora-alpha", "-16"], "--lora-alpha must be a positive number, got -16.0 (the adapter is "
                              "scaled by alpha / r; alpha = r is a common choice)"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be 0 or more, got -1.0; 0 turns clipping "
                                "off"),
    (["--weight-decay", "-0.1"], "--weight-decay must be 0 or more, got -0.1"),
    (["--save-every", "0"], "--save-every must be a positive number of steps, got 0; leave it "
                            "out to checkpoint only at the end"),
    (["--resume", "--overwrite"], "--resume continues the run in --output and --overwrite "
                                  "replaces it; give one of them"),
])
def test_flag_errors(tiny_ckpt, alpaca_file, tmp_path, capsys, extra, expect):  # noqa: F811
    line = one_line_error(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                          tmp_path / "out", *(SMALL if "--full" in extra else FAST), *extra)
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


def test_output_naming_a_file(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    (tmp_path / "run.txt").write_text("mine")
    line = one_line_error(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                          tmp_path / "run.txt", *FAST)
    assert line.endswith(f"--output {tmp_path / 'run.txt'} is a file; give a folder (it is "
                         "created if missing)")
    assert (tmp_path / "run.txt").read_text() == "mine"


def test_output_is_the_model_folder(tiny_ckpt, tmp_path, alpaca_file, capsys):  # noqa: F811
    """`train --output S` with S the model folder: refused, even with --overwrite, and the
    model's files stay as they are."""
    model = tmp_path / "model"
    shutil.copytree(tiny_ckpt, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    for extra in ([], ["--overwrite"]):
        line = one_line_error(capsys, "--model", model, "--data", alpaca_file, "--output", model,
                              *FAST, *extra)
        assert f"--output {model} is the model folder {model}; write to a folder of its own" in line
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


def test_empty_yaml_config_is_refused_not_the_demo(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("# nothing yet\n")
    line = one_line_error(capsys, "--config", cfg)
    assert line.endswith(f"{cfg}: the config file is empty; write the options as `key: value` "
                         "lines, e.g. `model: org/name` and `data: train.jsonl`")
    assert list(tmp_path.iterdir()) == [cfg]  # no demo ran


def test_no_progress_prints_a_line_per_step_and_all_on_stdout(tiny_ckpt, alpaca_file,  # noqa: F811
                                                               tmp_path, capsys):
    rc, out, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                         tmp_path / "run", "--max-steps", 3, *FAST)
    assert rc == 0 and err == "", err  # `> log` keeps the whole run
    lines = out.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/3", "2/3", "3/3"]
    assert all("loss" in ln and "tok/s" in ln for ln in steps)
    assert lines[0].startswith("data: ")
    assert any(ln.startswith("done: 3 steps") for ln in lines[-3:])  # (then the vLLM line)


def test_dropped_rows_are_reported_with_the_reason(tiny_ckpt, tmp_path, capsys):  # noqa: F811
    rows = alpaca_rows(20) + [{"instruction": "Paris " * 300, "output": "x"}]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = run_ok(capsys, tiny_ckpt, data, tmp_path / "run", "--max-seq-len", 64)
    assert ("note: training data: 1 of 21 rows dropped: 1 whose prompt fills --max-seq-len 64 "
            f"[{data}:21], leaving no response token (raise --max-seq-len)") in out


def test_ctrl_c_during_start_up_is_one_line(tiny_ckpt, alpaca_file, tmp_path, capsys,  # noqa: F811
                                            monkeypatch):
    import leantune.train.trainer as trainer_mod

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    out_dir = tmp_path / "run"
    run_ok(capsys, tiny_ckpt, alpaca_file, out_dir)
    before = (out_dir / "adapter_model.safetensors").read_bytes()
    monkeypatch.setattr(trainer_mod, "load_model", interrupted)
    rc, _, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output", out_dir,
                       "--max-steps", 2, "--overwrite", *FAST)
    assert rc == 130 and err == "leantune: interrupted (Ctrl-C); nothing was written\n"
    assert (out_dir / "adapter_model.safetensors").read_bytes() == before


def test_ctrl_c_after_the_run_finished_says_where_its_results_are(tiny_ckpt, alpaca_file,  # noqa: F811
                                                                   tmp_path, capsys, monkeypatch):
    """A Ctrl-C while the finished run's summary prints (its vLLM line, the demo's answer)
    cuts only the summary: one line that says the results are written, not "nothing"."""
    import leantune.export.serving as serving

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(serving, "vllm_lora_lines", interrupted)
    out_dir = tmp_path / "run"
    rc, _, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output", out_dir,
                       "--max-steps", 2, *FAST)
    assert rc == 130 and err == (f"leantune: interrupted (Ctrl-C) after the run finished; its "
                                 f"results are in {out_dir}/\n")
    assert (out_dir / "adapter_model.safetensors").is_file()


def test_an_error_after_a_signal_is_reported_as_the_interruption(tiny_ckpt, alpaca_file,  # noqa: F811
                                                                 tmp_path, capsys, monkeypatch):
    """A library that turns the KeyboardInterrupt into its own error (e.g. while it imports)
    must not make the user read about a broken tokenizer."""
    import os
    import signal

    import leantune.train.trainer as trainer_mod

    def swallowing(*a, **k):
        try:
            os.kill(os.getpid(), signal.SIGINT)
        except KeyboardInterrupt:
            raise ModuleNotFoundError("No module named 'half_imported'") from None

    monkeypatch.setattr(trainer_mod, "load_tokenizer", swallowing)
    rc, _, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                       tmp_path / "run", *FAST)
    assert rc == 130 and err == "leantune: interrupted (Ctrl-C); nothing was written\n"


@pytest.mark.parametrize("extra", [[], ["--full"]])
def test_the_demo_suggests_an_open_model_next(tmp_path, capsys, extra):
    """The demo's hint names a model that downloads without a licence, and says how to log in
    for gated ones; with --full the demo's LoRA settings are not applied (they would be
    refused)."""
    from leantune.cli import OPEN_MODEL

    rc, out, err = train(capsys, "--max-steps", 1, "--output", tmp_path / "demo", "--device",
                         "cpu", "--no-progress", *extra)
    assert rc == 0, err
    assert f"leantune train --model {OPEN_MODEL} --data my_data.jsonl --output my-run" in out
    assert f"{OPEN_MODEL} downloads without a licence to accept" in out
    assert "accept the licence on the model's page" in out
    assert "`hf auth login` (or set HF_TOKEN)" in out
    # the fine-tuned model answers a held-out question, and the chat line names the run
    lines = out.splitlines()
    asked = lines.index("the fine-tuned model, asked a held-out question: Which city is the "
                        "capital of Canada?")
    assert lines[asked + 1].startswith("  ")
    assert lines[asked + 2].startswith(f"chat with it: leantune chat --adapter {tmp_path / 'demo'}")


# --- help ----------------------------------------------------------------------------------------


def test_version(capsys):
    import leantune

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"leantune {leantune.__version__}\n"


def test_import_leantune_does_not_wait_for_torch():
    """`leantune --version` and the start of every command come before torch loads (so a
    Ctrl-C while it loads reaches the command's handler); the API names load on use."""
    code = ("import sys, leantune; assert 'torch' not in sys.modules; "
            "leantune.LoRAConfig; assert 'torch' in sys.modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr

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
                 "--activations", "--max-memory-gib", "--no-fused-layers", "--attention", "--kernels"]:
        assert flag in text, flag


def test_argparse_mistakes_are_one_line(capsys):
    """A flag argparse refuses (a bad choice, an unknown or renamed flag) is one line, not the
    whole usage, and says where to look."""
    from leantune.cli import main

    for argv, expect in ((["train", "--attention", "cudnn"],
                          "argument --attention: invalid choice: 'cudnn'"),
                         (["train", "--checkpointing", "none"],
                          "--checkpointing is now --activations (its value none is now keep)"),
                         (["export", "--model", "m"], "the following arguments are required")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert expect in err and "see `leantune " in err and "--help`" in err


def test_yaml_key_renamed(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("checkpointing: none\n")
    from leantune.errors import LeantuneError
    from leantune.train.config import load_yaml_config

    with pytest.raises(LeantuneError, match="option 'checkpointing' is now 'activations'"):
        load_yaml_config(str(cfg))


def test_kernels_triton_off_cuda_is_one_line(tiny_ckpt, alpaca_file, tmp_path, capsys,  # noqa: F811
                                             monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the tests' interpreter is allowed)
    line = one_line_error(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                          tmp_path / "out", *FAST, "--max-steps", 1, "--kernels", "triton")
    assert "--kernels triton needs a CUDA GPU" in line and "--kernels auto" in line
    assert not (tmp_path / "out").exists()  # refused before the output is touched


def test_router_aux_loss_on_a_dense_model_is_refused_before_loading(tiny_ckpt, alpaca_file,  # noqa: F811
                                                                    tmp_path, capsys):
    rc, out, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                         tmp_path / "out", *FAST, "--max-steps", 1,
                         "--router-aux-loss-coef", "0.01")
    assert rc == 2 and "not a mixture-of-experts model" in err
    assert "model: loading" not in out and not (tmp_path / "out").exists()


def test_attention_flash_on_the_cpu_is_noted(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out = run_ok(capsys, tiny_ckpt, alpaca_file, tmp_path / "run", "--attention", "flash")
    assert "note: --attention flash is for CUDA" in out


def test_a_relative_model_path_is_recorded_absolute(tiny_ckpt, alpaca_file, tmp_path, capsys,  # noqa: F811
                                                    monkeypatch):
    """The adapter finds its base from any working directory: a local --model given relative
    is recorded (adapter_config.json, the vLLM line) as its absolute path."""
    monkeypatch.chdir(tiny_ckpt.parent)
    out = run_ok(capsys, tiny_ckpt.name, alpaca_file, tmp_path / "run")
    recorded = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == str(tiny_ckpt.resolve())
    assert f"vllm serve {tiny_ckpt.resolve()} " in out
    settings = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert settings["config"]["model"] == str(tiny_ckpt.resolve())
    monkeypatch.chdir(tmp_path)
    step = next((tmp_path / "run" / "checkpoints").iterdir())  # (its state.json names the base)
    for adapter in (tmp_path / "run", step):
        rc = main(["generate", "--adapter", str(adapter), "--prompt", "hi",
                   "--max-new-tokens", "2", "--device", "cpu"])
        assert rc == 0, capsys.readouterr().err
