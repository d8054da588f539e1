"""No writer follows a symbolic link: a link planted in a run, export or output folder (a shared
run folder, a downloaded model folder) never makes leantune write, or copy, outside it.

Each test plants links pointing outside the folder, runs one writer, and checks that the outside
targets are untouched (or never created) and that the writer either replaced the link by a file
of its own or refused in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, tiny_ckpt  # noqa: F401  (fixtures)
from helpers import make_tokenizer, quiet, save_random_adapter, save_tiny_checkpoint, train_cfg

from leantune.errors import LeantuneError

SECRET = "the outside file's own text\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder outside every output, with one file the links point at."""
    d = tmp_path / "outside"
    d.mkdir()
    (d / "secret.txt").write_text(SECRET)
    return d


def plant(link: Path, target: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)
    return link


def untouched(outside: Path, extra: tuple[str, ...] = ()) -> None:
    """The outside folder holds its one file, as it was, and nothing else."""
    assert sorted(p.name for p in outside.iterdir()) == sorted({"secret.txt", *extra})
    assert (outside / "secret.txt").read_text() == SECRET


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "symbolic link" in msg, msg
    return msg


# --- the trainer's writers ----------------------------------------------------------------------

def test_a_run_replaces_links_to_its_files_and_writes_nothing_outside(  # noqa: F811
        tiny_ckpt, alpaca_file, tmp_path, outside):
    """Links at the names of the tokenizer files, the chat template, loss.png (pointing at an
    existing file) and at run_config.json and the adapter files (pointing at files that do not
    exist yet) are replaced by the run's own files."""
    from leantune.train.trainer import Trainer

    run = tmp_path / "run"
    existing = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                "special_tokens_map.json", "loss.png"]
    dangling = ["run_config.json", "adapter_config.json", "adapter_model.safetensors"]
    for name in existing:
        plant(run / name, outside / "secret.txt")
    for name in dangling:
        plant(run / name, outside / name)
    Trainer(train_cfg(tiny_ckpt, alpaca_file, run, batch_size=4, max_steps=2), log=quiet).train()
    untouched(outside)
    # (transformers 5 writes no special_tokens_map.json: that link stays, its target unwritten)
    for name in [n for n in existing + dangling if n != "special_tokens_map.json"]:
        assert not (run / name).is_symlink() and (run / name).is_file(), name
    assert json.loads((run / "run_config.json").read_text())
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_linked_metrics_log_is_refused(tiny_ckpt, alpaca_file, tmp_path, outside):  # noqa: F811
    from leantune.train.trainer import Trainer

    run = tmp_path / "run"
    plant(run / "metrics.jsonl", outside / "metrics.jsonl")  # dangling: no "previous run" yet
    with pytest.raises(LeantuneError) as e:
        Trainer(train_cfg(tiny_ckpt, alpaca_file, run, batch_size=4, max_steps=2),
                log=quiet).train()
    assert str(run / "metrics.jsonl") in one_line(e)
    untouched(outside)


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl", "checkpoints",
                                  "checkpoints/step-2", "tensorboard"])
def test_a_link_the_run_would_write_into_is_refused_before_the_weights_load(  # noqa: F811
        tiny_ckpt, alpaca_file, tmp_path, outside, monkeypatch, name):
    import leantune.train.trainer as T

    def no_load(*a, **kw):
        raise AssertionError("the weights loaded before the link was refused")

    monkeypatch.setattr(T, "load_model", no_load)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    if name == "checkpoints":
        (run / "checkpoints").rmdir()
    plant(run / name, outside)
    with pytest.raises(LeantuneError) as e:
        T.Trainer(train_cfg(tiny_ckpt, alpaca_file, run, batch_size=4, max_steps=2),
                  log=quiet)
    assert one_line(e).startswith(f"{run / name}: the run folder's {Path(name).name} is a "
                                  "symbolic link")
    untouched(outside)


def test_resume_with_a_linked_metrics_log_is_refused(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                     outside):
    """--resume rewrites metrics.jsonl (drops the steps it redoes): a link there is refused,
    and its target is neither written nor copied into the run."""
    from leantune.train.trainer import Trainer

    run = tmp_path / "run"
    cfg = train_cfg(tiny_ckpt, alpaca_file, run, batch_size=4, max_steps=4, save_every=2)
    Trainer(dataclasses.replace(cfg, max_steps=2), log=quiet).train()
    (outside / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    (run / "metrics.jsonl").unlink()
    plant(run / "metrics.jsonl", outside / "metrics.jsonl")
    with pytest.raises(LeantuneError) as e:
        Trainer(dataclasses.replace(cfg, resume=True), log=quiet).train()
    one_line(e)
    assert (outside / "metrics.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    untouched(outside, ("metrics.jsonl",))


def test_metrics_writer_never_follows_a_link(tmp_path, outside):
    from leantune.train.metrics import MetricsWriter

    for append in (False, True):
        link = tmp_path / f"metrics-{append}.jsonl"
        plant(link, outside / "secret.txt")
        with pytest.raises(LeantuneError) as e:
            MetricsWriter(link, append=append)
        one_line(e)
    untouched(outside)


def test_samples_log_never_follows_a_link(tmp_path, outside, monkeypatch):
    """samples.jsonl is appended to at every evaluation: a link there is refused."""
    import leantune.generate as gen
    from leantune.train.samples import SAMPLES, SampleWriter

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    run = tmp_path / "run"
    run.mkdir()
    writer = SampleWriter(str(prompts), make_tokenizer(), run, max_new_tokens=2)

    @dataclasses.dataclass
    class Done:
        text: str

    monkeypatch.setattr(gen, "generate", lambda *a, **k: [Done("hi")])
    assert writer.write(None, 1) == "hi"  # (a plain file: written)
    assert json.loads((run / SAMPLES).read_text()) == {"step": 1, "prompt": "hello",
                                                       "completion": "hi"}
    (run / SAMPLES).unlink()
    plant(run / SAMPLES, outside / "secret.txt")
    with pytest.raises(LeantuneError) as e:
        writer.write(None, 2)
    one_line(e)
    untouched(outside)


def test_plot_replaces_a_link_at_loss_png(tmp_path, outside):
    from leantune.train.plot import plot_metrics

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
    plant(run / "loss.png", outside / "secret.txt")
    out = plot_metrics(run)
    assert not out.is_symlink() and out.read_bytes()[:4] == b"\x89PNG"
    untouched(outside)


def _tiny_model_and_optimizer():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/step-00000005"])
def test_checkpoints_are_never_written_through_a_linked_folder(tmp_path, outside, where):
    from leantune.train.checkpoint import save_checkpoint

    run = tmp_path / "run"
    plant(run / where, outside)
    model, opt = _tiny_model_and_optimizer()
    with pytest.raises(LeantuneError) as e:
        save_checkpoint(run, 5, model, opt, {"data": {}})
    assert str(run / where) in one_line(e)
    untouched(outside)


def test_tensorboard_folder_link_is_refused(tmp_path, outside):
    pytest.importorskip("tensorboard")
    from leantune.train.reporting import TENSORBOARD_DIR, TensorBoardReporter

    run = tmp_path / "run"
    plant(run / TENSORBOARD_DIR, outside)
    with pytest.raises(LeantuneError) as e:
        TensorBoardReporter(run, 0)
    one_line(e)
    untouched(outside)


def test_tokenizer_save_replaces_links(tmp_path, outside):
    """save_pretrained_safely: the tokenizer writes into a private folder, whose files are
    renamed over whatever stands at their names."""
    from leantune.utils.io import save_pretrained_safely

    out = tmp_path / "out"
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    for name in names:
        plant(out / name, outside / "secret.txt")
    save_pretrained_safely(make_tokenizer(), out)
    untouched(outside)
    for name in names:
        assert (out / name).is_file() and not (out / name).is_symlink()
    assert "messages" in (out / "chat_template.jinja").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_adapter_save_replaces_links(tmp_path, outside):
    from leantune.lora import LoRAConfig, apply_lora
    from leantune.lora.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_adapter
    from leantune.model.config import ModelConfig
    from leantune.model.transformer import CausalLM

    from helpers import tiny_config

    cfg = ModelConfig.from_dict(tiny_config("llama").to_dict())
    model = CausalLM(cfg)
    apply_lora(model, LoRAConfig(r=2, alpha=4))
    out = tmp_path / "adapter"
    plant(out / ADAPTER_WEIGHTS, outside / "secret.txt")
    plant(out / ADAPTER_CONFIG, outside / "adapter_config.json")  # dangling
    save_adapter(model, out)
    untouched(outside)
    assert not (out / ADAPTER_WEIGHTS).is_symlink() and not (out / ADAPTER_CONFIG).is_symlink()
    assert json.loads((out / ADAPTER_CONFIG).read_text())["r"] == 2


# --- exports --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    base = save_tiny_checkpoint(root / "base", make_tokenizer())
    save_random_adapter(base, root / "adapter", seed=1)
    return base, root / "adapter"


def _linked_base(base: Path, tmp_path: Path, name: str, target: Path) -> Path:
    """A copy of `base` whose side file `name` is a link to `target`."""
    copy = tmp_path / "linked-base"
    shutil.copytree(base, copy)
    (copy / name).unlink(missing_ok=True)
    plant(copy / name, target)
    return copy


@pytest.mark.parametrize("name", ["tokenizer.json", "special_tokens_map.json"])
def test_merged_export_refuses_a_side_file_linked_out_of_the_model(base_and_adapter, tmp_path,
                                                                   outside, name):
    """A base model folder whose side file links to a file elsewhere: refused before anything
    is copied, and the export folder is not made."""
    from leantune.export.merge import export_merged

    base, adapter = base_and_adapter
    linked = _linked_base(base, tmp_path, name, outside / "secret.txt")
    out = tmp_path / "merged"
    with pytest.raises(LeantuneError) as e:
        export_merged(linked, adapter, out)
    assert str(linked / name) in one_line(e)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    untouched(outside)


def test_side_files_linked_inside_a_hub_cache_snapshot_are_copied(base_and_adapter, tmp_path):
    """A Hugging Face hub cache snapshot's files are links into the repository's blobs/: those
    are copied (their contents), not refused."""
    from leantune.export.full import TOKENIZER_FILES, copy_side_files

    base, _ = base_and_adapter
    repo = tmp_path / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in base.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copyfile(f, blob)
        plant(snap / f.name, Path("../../blobs") / blob.name)
    out = tmp_path / "out"
    out.mkdir()
    copy_side_files(snap, out)
    copied = sorted(p.name for p in out.iterdir())
    assert copied == sorted(n for n in TOKENIZER_FILES if (base / n).exists())
    for name in copied:
        assert not (out / name).is_symlink()
        assert (out / name).read_bytes() == (base / name).read_bytes()


def test_side_file_copy_checks_every_link_before_copying_any(base_and_adapter, tmp_path,
                                                             outside):
    from leantune.export.full import copy_side_files

    base, _ = base_and_adapter
    linked = _linked_base(base, tmp_path, "vocab.json", outside / "secret.txt")  # late in order
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(LeantuneError) as e:
        copy_side_files(linked, out)
    one_line(e)
    assert list(out.iterdir()) == []  # not even generation_config.json, first in the list


def test_side_file_copy_replaces_a_link_at_the_destination(base_and_adapter, tmp_path, outside):
    from leantune.export.full import copy_side_files

    base, _ = base_and_adapter
    out = tmp_path / "out"
    plant(out / "tokenizer.json", outside / "secret.txt")
    copy_side_files(base, out)
    assert (out / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    assert not (out / "tokenizer.json").is_symlink()
    untouched(outside)


def test_merged_export_refuses_a_linked_output_folder(base_and_adapter, tmp_path, outside):
    """`--output RUN/merged` where a shared run folder's merged/ is a link elsewhere."""
    from leantune.export.merge import export_merged

    base, adapter = base_and_adapter
    out = plant(tmp_path / "run" / "merged", outside)
    for overwrite in (False, True):
        with pytest.raises(LeantuneError) as e:
            export_merged(base, adapter, out, overwrite=overwrite)
        assert str(out) in one_line(e)
    untouched(outside)


def test_merged_export_overwrite_replaces_links_inside_the_output(base_and_adapter, tmp_path,
                                                                  outside):
    from leantune.export.merge import export_merged

    base, adapter = base_and_adapter
    out = tmp_path / "merged"
    for name in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        plant(out / name, outside / "secret.txt")
    export_merged(base, adapter, out, overwrite=True)
    untouched(outside)
    for name in ("config.json", "tokenizer.json", "model.safetensors.index.json"):
        assert (out / name).is_file() and not (out / name).is_symlink()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"


def test_full_model_save_never_copies_a_linked_side_file(tmp_path, outside):
    from leantune.export.full import save_full_model
    from leantune.model.config import ModelConfig
    from leantune.model.transformer import CausalLM

    from helpers import tiny_config

    src = tmp_path / "src"
    src.mkdir()
    plant(src / "tokenizer.json", outside / "secret.txt")
    model = CausalLM(ModelConfig.from_dict(tiny_config("llama").to_dict()))
    out = tmp_path / "out"
    with pytest.raises(LeantuneError) as e:
        save_full_model(model, out, source=src)
    one_line(e)
    assert not (out / "tokenizer.json").exists()
    untouched(outside)


@pytest.fixture(scope="module")
def chatml_base(tmp_path_factory):
    pytest.importorskip("gguf")
    from helpers import CHATML_SPECIALS, CHATML_TEMPLATE

    root = tmp_path_factory.mktemp("gguf-links")
    return save_tiny_checkpoint(root / "base", make_tokenizer(CHATML_TEMPLATE,
                                                              extra_specials=CHATML_SPECIALS))


def test_gguf_export_refuses_a_linked_output_folder(chatml_base, tmp_path, outside):
    from leantune.export.gguf import export_gguf

    out = plant(tmp_path / "gguf", outside)
    with pytest.raises(LeantuneError) as e:
        export_gguf(chatml_base, None, out, quant="f32", overwrite=True)
    assert str(out) in one_line(e)
    untouched(outside)


def test_gguf_export_replaces_links_to_the_gguf_and_modelfile(chatml_base, tmp_path, outside):
    from leantune.export.gguf import export_gguf

    out = tmp_path / "gguf"
    plant(out / "model-f32.gguf", outside / "secret.txt")
    plant(out / "Modelfile", outside / "Modelfile")  # dangling
    res = export_gguf(chatml_base, None, out, quant="f32", overwrite=True)
    untouched(outside)
    assert not res.gguf.is_symlink() and res.gguf.read_bytes()[:4] == b"GGUF"
    assert not res.modelfile.is_symlink() and res.modelfile.read_text().startswith("FROM ")


def test_generate_output_file_link_is_replaced(tiny_ckpt, tmp_path, outside, capsys):  # noqa: F811
    """`generate --output FILE`: a link at FILE (dangling, or to a file with --overwrite) is
    replaced by the completions, its target never written."""
    from helpers import run_cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    for target, extra in ((outside / "out.jsonl", []), (outside / "secret.txt", ["--overwrite"])):
        out = tmp_path / "out.jsonl"
        out.unlink(missing_ok=True)
        plant(out, target)
        rc, _, err = run_cli(capsys, "generate", "--model", tiny_ckpt, "--prompts", prompts,
                             "--output", out, "--max-new-tokens", "2", "--device", "cpu", *extra)
        assert rc == 0, err
        untouched(outside)
        assert not out.is_symlink() and json.loads(out.read_text())["prompt"] == "hello"


def test_atomic_writes_replace_a_link_and_refuse_a_linked_parent(tmp_path, outside):
    from leantune.utils.io import atomic_write_json, atomic_write_text

    out = tmp_path / "out"
    plant(out / "a.txt", outside / "secret.txt")
    atomic_write_text(out / "a.txt", "mine\n", root=out)
    assert (out / "a.txt").read_text() == "mine\n" and not (out / "a.txt").is_symlink()
    plant(out / "sub", outside)
    with pytest.raises(LeantuneError) as e:
        atomic_write_json(out / "sub" / "b.json", {}, root=out)
    one_line(e)
    untouched(outside)
    assert sorted(os.listdir(out)) == ["a.txt", "sub"]  # (no temporary file left)
