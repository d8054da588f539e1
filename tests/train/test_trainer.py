"""The training loop: token-normalised gradient accumulation, exact resume, atomic checkpoints,
the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from safetensors.torch import load_file
from helpers import alpaca_file, read_metrics, tiny_ckpt  # noqa: F401  (fixtures)
from helpers import capture_grads

from leantune.batch import PackedBatch
from leantune.data import PackedLoader
from leantune.errors import LeantuneError
from leantune.train.checkpoint import CKPT_DIR, latest_checkpoint, load_checkpoint, save_checkpoint
from leantune.train.config import TrainConfig
from leantune.train.schedule import lr_factor
from leantune.train.trainer import Trainer


def quiet(*_args, **_kw):
    pass


def make_cfg(model, data, output, **kw) -> TrainConfig:
    base = dict(model=str(model), data=str(data), output=str(output), max_seq_len=128,
                batch_size=2, lr=1e-3, warmup_steps=2, device="cpu", dtype="float32",
                progress=False)
    if not kw.get("full"):
        base.update(lora_r=4, lora_alpha=8.0)
    return TrainConfig(**{**base, **kw})


# --- gradient accumulation ---------------------------------------------------------------------

def _max_rel(a: dict, b: dict) -> float:
    """Largest difference over all gradients, relative to the largest gradient entry."""
    scale = max(g.abs().max().item() for g in b.values())
    return max((a[n] - b[n]).abs().max().item() for n in b) / scale


def test_grad_accum_equals_one_batch_of_the_same_rows(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                      monkeypatch):
    # full fine-tuning (every weight gets a gradient), no clipping, one packed row per micro-batch
    cfg = make_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", full=True, batch_size=1,
                   grad_accum=4, max_grad_norm=0.0, max_seq_len=64, max_steps=2)
    tr = Trainer(cfg, log=quiet)
    grads = capture_grads(tr, monkeypatch)

    micro = [tr.loader.get_batch(0, i) for i in range(4)]
    n_target = [b.num_target_tokens for b in micro]
    assert len(set(n_target)) > 1, "the micro-batches must differ in target tokens"
    # the same 4 packed rows as a single batch (the epoch's row plan does not depend on batch size)
    big = PackedLoader(tr.train_data, 4, 64, seed=cfg.seed).get_batch(0, 0)
    assert big.input_ids.shape[0] == 4 and big.num_target_tokens == sum(n_target)

    loss_acc, norm_acc, tok_acc = tr.train_step(micro)
    loss_big, norm_big, tok_big = tr.train_step([big])
    g_acc, g_big = grads
    assert g_acc.keys() == g_big.keys() and len(g_big) == len(tr.params)
    assert _max_rel(g_acc, g_big) < 1e-6
    torch.testing.assert_close(loss_acc, loss_big, rtol=1e-6, atol=0)
    torch.testing.assert_close(norm_acc, norm_big, rtol=1e-5, atol=0)
    assert tok_acc == tok_big == big.num_real_tokens

    # teeth: averaging per-micro-batch means weights the tokens differently and is measurably off
    tr.optimizer.zero_grad(set_to_none=True)
    for b in micro:
        (tr.model.loss_sum(b) / b.num_target_tokens / len(micro)).backward()
    naive = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()
             if p.grad is not None}
    assert _max_rel(naive, g_big) > 1e-3


def test_each_step_takes_grad_accum_consecutive_micro_batches(tiny_ckpt, alpaca_file,  # noqa: F811
                                                             tmp_path, monkeypatch):
    cfg = make_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", grad_accum=3, max_steps=2)
    tr = Trainer(cfg, log=quiet)
    windows = []
    real_step = tr.train_step
    monkeypatch.setattr(tr, "train_step", lambda w: windows.append(w) or real_step(w))
    tr.train()
    expect = [tr.loader.get_batch(0, i) for i in range(6)]
    assert [len(w) for w in windows] == [3, 3]
    for got, want in zip([b for w in windows for b in w], expect):
        assert torch.equal(got.input_ids, want.input_ids)
    recs = [r for r in read_metrics(cfg.output) if "loss" in r]
    assert recs[-1]["tokens_seen"] == sum(b.num_real_tokens for b in expect)


# --- resume --------------------------------------------------------------------------------------

def resume_cfg(model, data, output, **kw) -> TrainConfig:
    # dropout in the adapters makes every step consume the torch RNG; 8 steps x 2 micro-batches
    # cross an epoch boundary of the loader; an eval every 2 steps is interleaved
    return make_cfg(model, data, output, lora_dropout=0.2, grad_accum=2, max_steps=8,
                    save_every=4, eval_fraction=0.1, eval_every=2, warmup_steps=2, **kw)


@pytest.fixture(scope="module")
def run_a(tiny_ckpt, alpaca_file, tmp_path_factory):  # noqa: F811
    """8 uninterrupted steps."""
    cfg = resume_cfg(tiny_ckpt, alpaca_file, tmp_path_factory.mktemp("resume") / "a")
    tr = Trainer(cfg, log=quiet)
    assert tr.total_steps == 8 and len(tr.loader) < 16  # the run crosses an epoch
    tr.train()
    return cfg


COMPARED = ("step", "loss", "lr", "grad_norm", "tokens_seen", "eval_loss")


def comparable(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in COMPARED if k in r} for r in records]


def _interrupted_run(cfg: TrainConfig, how: str, monkeypatch) -> None:
    """Run cfg and stop it during step 5: a Ctrl-C after that step's batches were drawn and its
    first forward used the RNG ("interrupt"), or a crash during step 7, with the last checkpoint
    at step 4 and steps 5-6 already in metrics.jsonl ("crash")."""
    tr = Trainer(cfg, log=quiet)
    real_step = tr.train_step
    calls = []

    def flaky(window):
        calls.append(1)
        if how == "interrupt" and len(calls) == 5:
            tr.model.loss_sum(window[0])
            raise KeyboardInterrupt
        if how == "crash" and len(calls) == 7:
            raise RuntimeError("simulated crash")
        return real_step(window)

    monkeypatch.setattr(tr, "train_step", flaky)
    if how == "interrupt":
        with pytest.raises(LeantuneError, match=r"interrupted \(Ctrl-C\) at step 4; checkpoint saved to .*step-00000004; "
                                       "continue with the same command plus --resume"):
            tr.train()
    else:
        with pytest.raises(RuntimeError, match="simulated crash"):
            tr.train()
        steps = [r["step"] for r in read_metrics(cfg.output) if "loss" in r]
        assert steps == [1, 2, 3, 4, 5, 6]
    assert latest_checkpoint(tr.output).name == "step-00000004"


@pytest.mark.parametrize("how", ["interrupt", "crash"])
def test_resume_continues_exactly(run_a, tmp_path, monkeypatch, how):
    cfg_b = dataclasses.replace(run_a, output=str(tmp_path / "b"))
    with monkeypatch.context() as m:
        _interrupted_run(cfg_b, how, m)
    logs = []
    Trainer(dataclasses.replace(cfg_b, resume=True), log=logs.append).train()
    assert any("resumed from" in line and "step-00000004" in line for line in logs)

    rec_a, rec_b = read_metrics(run_a.output), read_metrics(cfg_b.output)
    assert [r["step"] for r in rec_b] == [r["step"] for r in rec_a]  # no duplicates, no gaps
    for ra, rb in zip(comparable(rec_a), comparable(rec_b)):
        assert rb == pytest.approx(ra, rel=1e-6, abs=1e-9), f"step {ra['step']}"
    assert [r["step"] for r in rec_a if "loss" in r] == list(range(1, 9))

    ad_a = load_file(f"{run_a.output}/adapter_model.safetensors")
    ad_b = load_file(f"{cfg_b.output}/adapter_model.safetensors")
    assert ad_a.keys() == ad_b.keys() and ad_a
    for k in ad_a:
        torch.testing.assert_close(ad_b[k], ad_a[k], rtol=0, atol=1e-6)


def test_resume_without_rng_restore_would_differ(run_a, tmp_path, monkeypatch):
    """Teeth for the resume test: the dropout RNG restored from the checkpoint matters."""
    import leantune.train.checkpoint as ckpt_mod

    cfg_b = dataclasses.replace(run_a, output=str(tmp_path / "b"))
    with monkeypatch.context() as m:
        _interrupted_run(cfg_b, "crash", m)
    monkeypatch.setattr(ckpt_mod, "_set_rng_state", lambda state: None)
    Trainer(dataclasses.replace(cfg_b, resume=True), log=quiet).train()
    loss_a = [r["loss"] for r in read_metrics(run_a.output) if "loss" in r]
    loss_b = [r["loss"] for r in read_metrics(cfg_b.output) if "loss" in r]
    assert loss_b[:4] == loss_a[:4]
    assert all(abs(a - b) > 1e-7 for a, b in zip(loss_a[4:], loss_b[4:]))


@pytest.mark.parametrize("change, expect", [
    ({"lora_r": 2}, "has shape"),  # a different rank
    ({"lora_targets": "q,v"}, "is not in the model"),  # fewer adapted layers
])
def test_resume_with_other_lora_settings_is_a_one_line_error(run_a, tmp_path, monkeypatch,
                                                             change, expect):
    cfg_b = dataclasses.replace(run_a, output=str(tmp_path / "b"))
    with monkeypatch.context() as m:
        _interrupted_run(cfg_b, "crash", m)
    with pytest.raises(LeantuneError, match=f"step-00000004: .*{expect}.*same model and LoRA"):
        Trainer(dataclasses.replace(cfg_b, resume=True, **change), log=quiet)


def test_resume_with_more_lora_targets_is_a_one_line_error(tiny_ckpt, alpaca_file,  # noqa: F811
                                                            tmp_path):
    cfg = make_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", lora_targets="q,v", max_steps=2,
                   save_every=1)
    Trainer(cfg, log=quiet).train()
    with pytest.raises(LeantuneError, match="trainable parameters are not in the checkpoint"):
        Trainer(dataclasses.replace(cfg, resume=True, lora_targets="q,k,v"), log=quiet)


def test_resume_restores_the_fp16_loss_scale(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    cfg = make_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", dtype="float16", max_steps=2,
                   save_every=1)
    tr = Trainer(cfg, log=quiet)
    # a scale that grows every step, so the checkpointed scale differs from a fresh scaler's
    tr.scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=1)
    tr.train()
    resumed = Trainer(dataclasses.replace(cfg, resume=True), log=quiet)
    assert resumed.step == 2
    assert resumed.scaler.get_scale() == 2048.0
    assert resumed.scaler.state_dict()["growth_interval"] == 1


def test_logged_lr_follows_the_schedule(run_a):
    recs = [r for r in read_metrics(run_a.output) if "loss" in r]
    for r in recs:
        want = run_a.lr * lr_factor(r["step"] - 1, run_a.warmup_steps, 8, "cosine")
        assert r["lr"] == pytest.approx(want, rel=1e-12)
    assert recs[0]["lr"] == pytest.approx(run_a.lr / 2)  # first of 2 warm-up steps
    assert recs[1]["lr"] == pytest.approx(run_a.lr)  # peak at the end of warm-up


# --- checkpoints ---------------------------------------------------------------------------------

def _tiny_module():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    model, opt = _tiny_module()
    root = tmp_path / CKPT_DIR
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, {"data": {}}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003"]

    # a half-written checkpoint of a later step (a crash before the rename) is never picked up
    half = root / ".tmp-step-00000009"
    half.mkdir()
    (half / "trainable.safetensors").write_bytes(b"\0" * 10)
    assert latest_checkpoint(tmp_path).name == "step-00000003"

    # a leftover temporary folder of the step being saved is replaced, and pruning ignores temps
    stale = root / ".tmp-step-00000004"
    stale.mkdir()
    (stale / "junk").write_text("x")
    path = save_checkpoint(tmp_path, 4, model, opt, {"data": {}}, keep=2)
    assert path == root / "step-00000004" == latest_checkpoint(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == [
        "optimizer.json", "optimizer.safetensors", "rng.safetensors", "state.json",
        "trainable.safetensors"]
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step-00000009", "step-00000003",
                                                     "step-00000004"]
    # keep=0 keeps everything
    save_checkpoint(tmp_path, 5, model, opt, {"data": {}}, keep=0)
    assert len(list(root.glob("step-*"))) == 3


def test_checkpoint_round_trip_and_unreadable(tmp_path):
    model, opt = _tiny_module()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    path = save_checkpoint(tmp_path, 7, model, opt, {"data": {"epoch": 1}, "tokens_seen": 99})
    after_save = torch.rand(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model2, opt2 = _tiny_module()
    with torch.no_grad():
        model2.weight.zero_()
    state = load_checkpoint(path, model2, opt2)
    assert state["step"] == 7 and state["tokens_seen"] == 99 and state["data"] == {"epoch": 1}
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], want_opt)
    assert torch.equal(torch.rand(5), after_save)  # the torch RNG continues where it was saved

    (path / "trainable.safetensors").write_bytes(b"garbage")
    with pytest.raises(LeantuneError, match="step-00000007: checkpoint is unreadable"):
        load_checkpoint(path, model2, opt2)


def test_checkpoint_holds_no_pickle_and_keys_state_by_name(tmp_path):
    """The optimizer state is stored under parameter names: a model whose parameters are
    registered in another order still gets each moment back on the right parameter."""
    model, opt = _tiny_module()
    path = save_checkpoint(tmp_path, 1, model, opt, {"data": {}})
    for f in path.iterdir():
        assert f.suffix in (".safetensors", ".json"), f.name

    model2, _ = _tiny_module()
    opt2 = torch.optim.AdamW([model2.bias, model2.weight], lr=0.1)  # reversed order
    load_checkpoint(path, model2, opt2)
    saved = opt.state_dict()["state"]
    assert torch.equal(opt2.state[model2.weight]["exp_avg"], saved[0]["exp_avg"])
    assert torch.equal(opt2.state[model2.bias]["exp_avg_sq"], saved[1]["exp_avg_sq"])
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)


def test_optimizer_state_of_other_parameters_is_one_line(tmp_path):
    model, opt = _tiny_module()
    path = save_checkpoint(tmp_path, 1, model, opt, {"data": {}})
    model2, _ = _tiny_module()
    model2.bias.requires_grad_(False)  # the same weights, but only one of them trained
    opt2 = torch.optim.AdamW([model2.weight], lr=0.1)
    with pytest.raises(LeantuneError, match=r"step-00000001: the optimizer state does not match "
                                            r"this run's parameters \(e.g. bias\); resume with "
                                            "the same model and LoRA settings"):
        load_checkpoint(path, model2, opt2)


class _Payload:
    """Unpickling this creates `marker` (a stand-in for arbitrary code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["optimizer.pt", "rng.pt"])
def test_a_pickled_checkpoint_is_refused_without_running_it(tmp_path, name):
    import pickle

    model, opt = _tiny_module()
    path = save_checkpoint(tmp_path, 3, model, opt, {"data": {}})
    # an old-format (or crafted) checkpoint: its state as pickles instead of safetensors
    for f in ("optimizer.safetensors", "optimizer.json", "rng.safetensors"):
        (path / f).unlink()
    marker = tmp_path / "code-ran"
    (path / name).write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(LeantuneError) as e:
        load_checkpoint(path, *_tiny_module())
    msg = str(e.value)
    assert f"{path}: {name} is a pickle" in msg and "--overwrite" in msg
    assert f"leantune export --adapter {path}" in msg and "\n" not in msg
    assert not marker.exists()
    pickle.loads((path / name).read_bytes())  # teeth: the payload is live
    assert marker.exists()


def test_a_tokenizer_with_custom_code_loads_without_running_it(tmp_path):
    """A checkpoint folder whose tokenizer_config.json points at its own Python file (auto_map):
    leantune loads the tokenizer from its data files and never imports that file."""
    import json
    import shutil

    from leantune import assets
    from leantune.train.trainer import load_tokenizer

    folder = tmp_path / "model"
    shutil.copytree(assets.path("tiny-llama"), folder)
    marker = tmp_path / "code-ran"
    (folder / "tokenization_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PreTrainedTokenizerFast as CustomTokenizer\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    assert tok("hello").input_ids and not marker.exists()


def test_a_folder_without_tokenizer_files_is_refused(tmp_path):
    """transformers builds a Gemma tokenizer of 5 tokens from config.json alone (training would
    then see only <unk>s): a folder with no vocabulary file is one line, before that."""
    from transformers import AutoTokenizer

    from leantune.train.trainer import load_tokenizer

    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gemma2", "vocab_size": 256}')
    try:  # (transformers 5.x: it loads, nearly empty; another version may refuse it itself)
        assert len(AutoTokenizer.from_pretrained(str(folder))) < 10
    except (OSError, ValueError, TypeError):
        pass
    with pytest.raises(LeantuneError) as e:
        load_tokenizer(str(folder))
    assert str(e.value).startswith(f"{folder}: no tokenizer files") and "\n" not in str(e.value)


def test_a_token_id_past_the_models_vocabulary_names_the_row(tmp_path, tiny_ckpt, alpaca_file):  # noqa: F811
    """A tokenizer bigger than the model's vocabulary: the first row holding such an id is
    named by file and line, before the weights load."""
    import json
    import shutil

    folder = tmp_path / "small-vocab"
    shutil.copytree(tiny_ckpt, folder)
    config = json.loads((folder / "config.json").read_text())
    config["vocab_size"] = 40
    (folder / "config.json").write_text(json.dumps(config))
    cfg = TrainConfig(model=str(folder), data=str(alpaca_file), output=str(tmp_path / "run"),
                      max_seq_len=64, device="cpu", dtype="float32", progress=False)
    with pytest.raises(LeantuneError, match=rf"^training data: {alpaca_file}:1 holds token id "
                                            r"\d+, outside the model's vocabulary \(0\.\.39\)"):
        Trainer(cfg, log=lambda *a, **k: None)


# --- schedule ------------------------------------------------------------------------------------

def test_schedule_values():
    # warm-up of 4 steps: 1/4, 2/4, 3/4, 1; then decay over the remaining 8 of 12 steps
    assert [lr_factor(s, 4, 12, "cosine") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [lr_factor(s, 4, 12, "linear") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 12, "cosine") == 1.0
    assert lr_factor(6, 4, 12, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_factor(8, 4, 12, "cosine") == pytest.approx(0.5)
    assert lr_factor(11, 4, 12, "cosine") == pytest.approx(0.5 * (1 + math.cos(7 * math.pi / 8)))
    assert lr_factor(12, 4, 12, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(50, 4, 12, "cosine") == pytest.approx(0.0, abs=1e-12)  # clamped, no rebound
    assert lr_factor(8, 4, 12, "linear") == 0.5
    assert lr_factor(10, 4, 12, "linear") == 0.25
    assert lr_factor(12, 4, 12, "linear") == 0.0
    assert lr_factor(0, 0, 10, "linear") == 1.0  # no warm-up: start at the peak
    assert lr_factor(5, 0, 10, "linear") == 0.5
    assert lr_factor(2, 4, 12, "constant") == 0.75
    assert lr_factor(9, 4, 12, "constant") == 1.0
    # monotone non-increasing after warm-up
    vals = [lr_factor(s, 4, 40, "cosine") for s in range(4, 41)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))


def test_validate_rejects_bad_counts():
    for kw, flag in [({"log_every": 0}, "--log-every"), ({"save_every": -1}, "--save-every"),
                     ({"grad_accum": 0}, "--grad-accum"), ({"max_steps": 0}, "--max-steps")]:
        with pytest.raises(LeantuneError, match=flag):
            TrainConfig(**kw).validate()


def test_packed_batch_rows_match_loader(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    """The grad-accum test builds its big batch from a second loader; check the premise that
    the row plan (and so each row's content) is independent of the batch size."""
    tr = Trainer(make_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_seq_len=64,
                          batch_size=1, max_steps=1), log=quiet)
    big = PackedLoader(tr.train_data, 3, 64, seed=tr.cfg.seed).get_batch(0, 0)
    for i in range(3):
        row = tr.loader.get_batch(0, i)
        assert isinstance(row, PackedBatch)
        n = row.input_ids.shape[1]
        assert torch.equal(big.input_ids[i, :n], row.input_ids[0])
        assert torch.equal(big.labels[i, :n], row.labels[0])


def test_fused_layers_on_and_off_train_the_same(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    """The Trainer's --activations recompute through the fused layer backward and through
    autograd + torch.utils.checkpoint: the same losses step by step (fp32, CPU)."""
    losses = {}
    for fused in (True, False):
        cfg = make_cfg(tiny_ckpt, alpaca_file, tmp_path / f"run-{fused}", max_steps=4,
                       activations="recompute", fused_layers=fused)
        trainer = Trainer(cfg, log=quiet)
        trainer.train()
        losses[fused] = [r["loss"] for r in read_metrics(cfg.output) if "loss" in r]
    assert len(losses[True]) == 4
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_offload_on_cpu_is_a_one_line_error(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    cfg = make_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=1, activations="offload")
    with pytest.raises(LeantuneError, match="offload needs a CUDA device"):
        Trainer(cfg, log=quiet)


@pytest.mark.parametrize("change", [{"lr": 5e-4}, {"grad_accum": 3}, {"schedule": "linear"},
                                    {"warmup_steps": 0}])
def test_resume_with_other_optimisation_settings_is_a_one_line_error(run_a, tmp_path,
                                                                     monkeypatch, change):
    cfg_b = dataclasses.replace(run_a, output=str(tmp_path / "b"))
    with monkeypatch.context() as m:
        _interrupted_run(cfg_b, "crash", m)
    key = next(iter(change))
    flag = "--" + key.replace("_", "-")
    with pytest.raises(LeantuneError, match=f"step-00000004: the run was started with {flag} "):
        Trainer(dataclasses.replace(cfg_b, resume=True, **change), log=quiet)


def test_token_ids_outside_the_vocabulary_are_a_one_line_error(tiny_ckpt, alpaca_file,  # noqa: F811
                                                               tmp_path):
    from leantune.model.loader import load_model

    model = load_model(str(tiny_ckpt), dtype=torch.float32)
    V = model.config.vocab_size
    docs = [([1, 2, 3], [2, 3, -100]), ([5, V + 7, 6], [V + 7, 6, -100])]
    cfg = make_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=1)
    with pytest.raises(LeantuneError, match=f"training data: document 1 holds token id {V + 7}"):
        Trainer(cfg, model=model, train_data=docs, log=quiet)


def test_tokens_per_s_counts_training_time_only(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                monkeypatch):
    """tokens_per_s (and the ETA) start when training starts: the evaluation before the first
    step (here made 1 s long) is not counted as training time."""
    import time

    from helpers import train_cfg

    cfg = train_cfg(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=2, eval_fraction=0.2)
    trainer = Trainer(cfg)
    real = trainer.evaluate_metrics

    def slow_eval():
        out = real()
        if trainer.step == 0:
            time.sleep(1.0)
        return out

    monkeypatch.setattr(trainer, "evaluate_metrics", slow_eval)
    trainer.train()
    first = next(r for r in read_metrics(tmp_path / "run") if "loss" in r)
    # one step's tokens over its own time (not over that time plus the second of evaluation)
    assert first["tokens_per_s"] > 0.5 * first["tokens_seen"] / first["step_time_s"]
