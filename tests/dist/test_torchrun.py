"""`leantune train` under torchrun on the CPU (gloo, 2 processes, the tiny checkpoint): DDP and
FSDP2 give the losses, eval losses and final adapter of one process with the same global batch
(fp32, 1e-5 relative), with gradient accumulation, packing and an eval pass, on the autograd
path and on the fused layers (--activations recompute); a run resumes on another number of
processes; rank 0 alone writes; an error in any process ends every process with one line;
`accelerate launch --multi_gpu` (torchrun's launcher underneath, here with --device cpu) gives
torchrun's run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import alpaca_file, free_port, read_metrics, tiny_ckpt  # noqa: F401
from safetensors.torch import load_file

import leantune

SRC = Path(leantune.__file__).resolve().parents[1]
PROCS = 2
B = 2  # rows per process; the one-process reference takes PROCS * B
FLAGS = ["--max-seq-len", "128", "--lr", "1e-3", "--warmup-steps", "2",
         "--schedule", "constant", "--grad-accum", "2", "--max-steps", "4",
         "--eval-fraction", "0.1", "--eval-every", "2", "--device", "cpu", "--dtype", "float32",
         "--no-progress"]
# LoRA rank 4: at rank 16 on this 32-wide model one adapter direction of layer 1's down projection
# gets near-zero gradients, whose reduction-order noise AdamW turns into 1e-4 relative
# differences; two one-process runs that only split a window into other micro-batches differ
# as much (measured)
LORA = ["--lora-r", "4"]


def leantune_train(args, procs: int | None = None, accelerate: Path | None = None
                   ) -> subprocess.CompletedProcess:
    """`leantune train ARGS` in a process of its own, or under torchrun with `procs` processes,
    or with `accelerate` (a folder for its settings: none there, so only the flags count) under
    `accelerate launch --multi_gpu` with `procs` processes."""
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    if accelerate:
        env["HF_HOME"] = str(accelerate)  # (accelerate's default settings file lives there)
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                    "--num_processes", str(procs), "--num_machines", "1", "--mixed_precision",
                    "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m"]
    elif procs:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={procs}", "-m"]
    else:
        launcher = [sys.executable, "-m"]
    return subprocess.run([*launcher, "leantune", "train", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def run(tiny_ckpt, alpaca_file, tmp_path_factory):  # noqa: F811
    """run(name, procs, *flags) -> (output folder, stdout): a run of FLAGS on the tiny
    checkpoint, made once per module; with `procs`, under torchrun with --batch-size B, else
    in one process with --batch-size PROCS * B."""
    root = tmp_path_factory.mktemp("torchrun")
    done = {}

    def go(name: str, procs: int | None, *flags, accelerate: bool = False):
        if name not in done:
            out = root / name
            batch = B if procs else PROCS * B
            lora = [] if "--full" in flags else LORA
            res = leantune_train(["--model", tiny_ckpt, "--data", alpaca_file, "--output", out,
                                  *FLAGS, *lora, "--batch-size", batch, *flags], procs,
                                 accelerate=root / "hf" if accelerate else None)
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            done[name] = (out, res.stdout)
        return done[name]

    return go


def values(folder: Path) -> dict:
    """metrics.jsonl as {(step, key): value}."""
    return {(r["step"], k): v for r in read_metrics(folder) for k, v in r.items()
            if k in ("loss", "lr", "grad_norm", "tokens_seen", "eval_loss")}


def assert_same_run(got: Path, want: Path, records: bool = True) -> None:
    """Every loss, gradient norm and eval loss of `want` in `got` to 1e-5 (steps, learning rates
    and tokens exactly), and the same final adapter; with `records`, the same metrics.jsonl
    records too (a resumed run also has eval records where each part ended)."""
    a, b = values(got), values(want)
    assert b.keys() <= a.keys()
    for key, value in b.items():
        if key[1] in ("lr", "tokens_seen"):
            assert a[key] == value, key
        else:
            assert a[key] == pytest.approx(value, rel=1e-5), key
    if records:
        assert [sorted(r) for r in read_metrics(got)] == [sorted(r) for r in read_metrics(want)]
    ta = load_file(str(got / "adapter_model.safetensors"))
    tb = load_file(str(want / "adapter_model.safetensors"))
    assert ta.keys() == tb.keys()
    for k in tb:
        torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=1e-7, msg=k)


# (run name, flags, the parallel line): DDP and FSDP2, each with the layers under plain autograd
# (--activations auto on the CPU) and with leantune's fused layers (recompute; under FSDP2 they
# run between its unshard hooks)
RUNS = [("auto", [], "DDP over 2 processes (gloo; auto: the CPU has no memory budget)"),
        ("fsdp", ["--parallel", "fsdp"], "FSDP2 over 2 processes (gloo; --parallel fsdp)"),
        ("ddp-fused", ["--parallel", "ddp", "--activations", "recompute"],
         "DDP over 2 processes (gloo; --parallel ddp)"),
        ("fsdp-fused", ["--parallel", "fsdp", "--activations", "recompute"],
         "FSDP2 over 2 processes (gloo; --parallel fsdp)")]


@pytest.mark.parametrize("name,flags,line", RUNS, ids=[r[0] for r in RUNS])
def test_same_losses_and_adapter_as_one_process(run, name, flags, line):
    ref, _ = run("one", None)
    out, stdout = run(name, PROCS, *flags)
    assert f"parallel: {line}" in stdout
    assert_same_run(out, ref)


def test_one_process_under_torchrun_is_the_plain_run(run):
    """World size 1: no DDP wrap, and the plain run's losses, adapter and files."""
    ref, ref_stdout = run("one", None)
    out, stdout = run("torchrun-1", 1, "--batch-size", PROCS * B)
    assert "parallel: world size 1: no DDP wrap (nothing to all-reduce)" in stdout
    assert_same_run(out, ref)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert files == sorted(str(p.relative_to(ref)) for p in ref.rglob("*"))


def test_accelerate_launch_is_torchrun(run):
    """`accelerate launch --multi_gpu --num_processes 2 -m leantune train ...` starts the
    processes as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT): the same run as torchrun's."""
    want, want_stdout = run(*RUNS[0][:2])
    out, stdout = run("accelerate", PROCS, accelerate=True)
    assert f"parallel: {RUNS[0][2]}" in stdout and stdout.count("step 4/4") == 1
    assert_same_run(out, want)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert files == sorted(str(p.relative_to(want)) for p in want.rglob("*"))


def test_full_fine_tuning_under_fsdp2(run):
    """--full: every weight sharded and trained, the final model gathered and written whole."""
    ref, _ = run("full-one", None, "--full", "--max-steps", "2")
    out, _ = run("full-fsdp", PROCS, "--full", "--max-steps", "2", "--parallel", "fsdp")
    a, b = values(out), values(ref)
    assert a.keys() == b.keys()
    for key, value in b.items():
        assert a[key] == pytest.approx(value, rel=1e-5), key
    files = sorted(p.name for p in ref.glob("model*.safetensors"))
    assert files and files == sorted(p.name for p in out.glob("model*.safetensors"))
    for name in files:
        ta, tb = load_file(str(out / name)), load_file(str(ref / name))
        assert ta.keys() == tb.keys()
        for k in tb:
            torch.testing.assert_close(ta[k], tb[k], rtol=1e-5, atol=1e-7, msg=k)


def test_rank0_alone_writes(run):
    ref, ref_stdout = run("one", None)
    name, flags, _ = RUNS[0]
    out, stdout = run(name, PROCS, *flags)  # (the run test_same_losses... made, or made here)
    assert ("global batch: 4 rows (2 per process x 2 processes), 2 micro-batch(es) a step: up "
            "to 1,024 tokens per step") in stdout
    # the files one process writes, each once: no second metrics line, log line or summary
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert files == sorted(str(p.relative_to(ref)) for p in ref.rglob("*"))
    for line in ("before training", "step 4/4", "done: 4 steps"):
        assert stdout.count(line) == ref_stdout.count(line) == 1, line
    assert json.loads((out / "run_config.json").read_text())["config"]["parallel"] == "auto"


def test_resume_on_another_number_of_processes(run, tiny_ckpt, alpaca_file):  # noqa: F811
    """FSDP2 on 2 processes to step 2, one process to step 3, FSDP2 on 2 processes again to
    step 4: the uninterrupted one-process run's losses and adapter (checkpoints hold whole
    tensors, and the data position in global batches)."""
    ref, _ = run("one", None)
    fsdp = ["--parallel", "fsdp", "--activations", "recompute"]
    out, _ = run("resumed", PROCS, *fsdp, "--max-steps", "2")
    for procs, steps, more in ((None, 3, ["--activations", "recompute"]), (PROCS, 4, fsdp)):
        batch = B if procs else PROCS * B
        res = leantune_train(["--model", tiny_ckpt, "--data", alpaca_file, "--output", out,
                              *FLAGS, *LORA, "--batch-size", batch, "--resume",
                              "--max-steps", steps, *more], procs)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert f"at step {steps - 1}" in res.stdout and f"step {steps}/{steps}" in res.stdout
    assert_same_run(out, ref, records=False)


def test_an_error_ends_every_process_with_one_line(tiny_ckpt, tmp_path):  # noqa: F811
    res = leantune_train(["--model", tiny_ckpt, "--data", tmp_path / "missing.jsonl",
                          "--output", tmp_path / "out", *FLAGS], PROCS)
    assert res.returncode != 0
    lines = [line for line in (res.stdout + res.stderr).splitlines()
             if line.startswith("leantune: ")]
    assert lines == [f"leantune: error: {tmp_path / 'missing.jsonl'}: data file not found; "
                     "check the --data path"], res.stderr[-2000:]
    assert not (tmp_path / "out").exists()


AGREE = """
import torch
from leantune.dist import setup
from leantune.errors import LeantuneError

ranks = setup.ranks_from_env()
cpu = torch.device("cpu")
setup.init_process_group(cpu)
setup.agree(None, cpu)  # no process brings an error: nothing happens
mine = LeantuneError(f"a problem only rank {ranks.rank} has") if ranks.rank else None
try:
    setup.agree(mine, cpu)
except LeantuneError as e:
    print(f"rank {ranks.rank} stops with: {e}", flush=True)
setup.shutdown()
"""


def test_an_error_of_one_process_stops_them_all_with_its_line(tmp_path):
    """An error only rank 1 meets (its GPU, say) reaches rank 0, which prints it."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={PROCS}", str(script)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(SRC)))
    assert res.returncode == 0, res.stderr[-2000:]
    for rank in range(PROCS):
        assert f"rank {rank} stops with: rank 1: a problem only rank 1 has" in res.stdout
