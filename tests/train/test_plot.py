"""The loss plot: `leantune plot RUN` and the end of a training run write loss.png from
metrics.jsonl; one-line errors for a missing run, no records, bad lines and no matplotlib."""

from __future__ import annotations

import json
import struct
import sys

from helpers import FAST, cli_error, run_cli
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, tiny_ckpt  # noqa: F401  (fixtures)

from leantune.train.plot import plot_metrics, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    blob = path.read_bytes()
    assert blob[:8] == PNG_SIGNATURE and blob[12:16] == b"IHDR"
    return struct.unpack(">II", blob[16:24])


def write_run(folder, n_steps=30, eval_every=10, tail=""):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "eval_loss": 3.0}]
    for s in range(1, n_steps + 1):
        lines.append({"step": s, "loss": 3.0 / (1 + 0.1 * s), "lr": 2e-4 * min(1, s / 5),
                      "grad_norm": 1.0})
        if s % eval_every == 0:
            lines.append({"step": s, "eval_loss": 3.2 / (1 + 0.08 * s)})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + tail)
    return folder


def test_plot_writes_a_png(tmp_path, capsys):
    import matplotlib.image

    run = write_run(tmp_path / "run")
    rc, out, err = run_cli(capsys, "plot", run)
    assert rc == 0, err
    png = run / "loss.png"
    assert out.strip() == f"loss plot written to {png}"
    assert png_size(png) == (960, 540)  # 8 x 4.5 inches at 120 dpi
    pixels = matplotlib.image.imread(str(png))
    assert pixels.shape[:2] == (540, 960) and pixels.std() > 0.05  # something is drawn
    assert not list(run.glob(".loss.png.tmp*"))  # written atomically

    other = tmp_path / "elsewhere.png"
    rc, out, err = run_cli(capsys, "plot", run / "metrics.jsonl", "--output", other)
    assert rc == 0, err
    assert png_size(other) == (960, 540)


def test_plot_of_a_run_still_writing_its_last_line(tmp_path):
    run = write_run(tmp_path / "run", tail='{"step": 31, "lo')
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == 30
    assert png_size(plot_metrics(run)) == (960, 540)


def test_plot_eval_only_or_train_only(tmp_path):
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 2.5}\n')
    assert png_size(plot_metrics(evals)) == (960, 540)
    train = tmp_path / "train"
    train.mkdir()
    (train / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n')
    assert png_size(plot_metrics(train)) == (960, 540)


def one_line_error(capsys, *args) -> str:
    return cli_error(capsys, "plot", *args)


def test_plot_errors(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "missing"
    assert one_line_error(capsys, missing) == (
        f"{missing}: not found; give the --output folder of a `leantune train` run (it writes "
        "metrics.jsonl from the first logged step)")
    empty_run = tmp_path / "empty"
    empty_run.mkdir()
    assert one_line_error(capsys, empty_run).startswith(f"{empty_run / 'metrics.jsonl'}: not found")

    (empty_run / "metrics.jsonl").write_text("")
    assert one_line_error(capsys, empty_run) == (
        f"{empty_run / 'metrics.jsonl'}: no loss recorded yet; plot again after the first logged "
        "step")

    bad = write_run(tmp_path / "bad")
    lines = (bad / "metrics.jsonl").read_text().splitlines()
    lines[3] = lines[3][:-5]
    (bad / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert one_line_error(capsys, bad) == (
        f"{bad / 'metrics.jsonl'}:4: malformed JSON; metrics.jsonl holds one JSON record per line, "
        "as `leantune train` writes it")
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 2}\n[1, 2]\n{"step": 3}\n')
    assert one_line_error(capsys, bad) == (
        f"{bad / 'metrics.jsonl'}:2: expected a record with an integer \"step\", as `leantune "
        "train` writes it")

    run = write_run(tmp_path / "run")
    assert one_line_error(capsys, run, "--output", tmp_path / "no" / "loss.png") == (
        f"{tmp_path / 'no'}: folder does not exist; create it or choose another --output")

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    assert one_line_error(capsys, run) == (
        "plotting needs matplotlib; run `pip install 'leantune[plot]'`")
    assert not (run / "loss.png").exists()


def test_training_writes_loss_png(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file,
                              "--output", out, "--max-steps", 2, *FAST)
    assert rc == 0, err
    assert png_size(out / "loss.png") == (960, 540)
    assert f"loss plot: {out / 'loss.png'}" in stdout


def test_training_without_matplotlib_says_so_once(tiny_ckpt, alpaca_file, tmp_path, capsys,  # noqa: F811
                                                  monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file,
                              "--output", out, "--max-steps", 2, *FAST)
    assert rc == 0, err
    assert not (out / "loss.png").exists() and (out / "adapter_model.safetensors").exists()
    notes = [line for line in stdout.splitlines() if "loss.png" in line]
    assert notes == ["note: no loss.png (it needs matplotlib: pip install 'leantune[plot]')"]


def test_a_failing_plot_does_not_fail_the_run(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from leantune.train.plot import plot_after_training

    run = write_run(tmp_path / "run")
    notes = []

    def broken(*args, **kwargs):
        raise RuntimeError("no fonts\nfound")

    monkeypatch.setattr(Figure, "savefig", broken)
    assert plot_after_training(run, notes.append) is None
    assert notes == [f"note: no loss.png (RuntimeError: no fonts found); `leantune plot {run}` "
                     "draws it later"]
    assert not list(run.glob("*.png")) and not list(run.glob(".loss.png*"))
    monkeypatch.undo()
    assert plot_after_training(run, notes.append) == run / "loss.png"
    assert notes[-1] == f"loss plot: {run / 'loss.png'}"
