"""`--merge-at-end`: a LoRA run also writes OUTPUT/merged, which transformers loads with the logits
of leantune's model plus the adapter; one-line refusals with --full, without a base model, and
where a merged folder is in the way."""

from __future__ import annotations

import pytest
import torch
from helpers import FAST, cli_error, load_hf, max_abs, run_cli
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, tiny_ckpt  # noqa: F401  (fixtures)

import leantune
from leantune.errors import LeantuneError
from leantune.train.config import TrainConfig
from leantune.train.trainer import Trainer


def train(capsys, *args):
    return run_cli(capsys, "train", *args)


def test_merged_model_matches_the_adapter(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    rc, stdout, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output", out,
                            "--max-steps", 3, "--lr", "1e-2", "--merge-at-end", *FAST)
    assert rc == 0, err
    merged = out / "merged"
    assert f"merged model: {merged}/" in stdout
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()

    tuned = leantune.load_model(tiny_ckpt, device="cpu", dtype=torch.float32)
    leantune.load_adapter(tuned, out)
    ids = torch.randint(0, tuned.config.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = tuned.eval()(ids).logits
        got = load_hf(merged)(ids).logits
        base = load_hf(tiny_ckpt)(ids).logits
    assert max_abs(want, base) > 1e-3  # training moved the adapter: the merge has work to show
    assert max_abs(got, want) < 1e-4


def test_merge_at_end_refusals(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    def one_line(*extra, flags=FAST):
        return cli_error(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                         tmp_path / "run", "--max-steps", 1, "--merge-at-end", *flags, *extra)

    i = FAST.index("--lora-r")
    no_lora_flags = FAST[:i] + FAST[i + 2:]  # (LoRA flags are refused with --full)
    assert one_line("--full", flags=no_lora_flags) == ("--merge-at-end merges a LoRA adapter into its "
                                  "base, but a --full run writes the whole model to --output "
                                  "already; drop --merge-at-end")
    assert not (tmp_path / "run").exists()  # refused before anything is written

    merged = tmp_path / "run" / "merged"
    merged.mkdir(parents=True)
    (merged / "notes.txt").write_text("mine")
    assert one_line() == (f"{merged}: already exists and --merge-at-end would "
                          "replace it; pass --overwrite, or choose another --output")
    assert (merged / "notes.txt").read_text() == "mine"
    rc, _, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                       tmp_path / "run", "--max-steps", 1, "--merge-at-end", "--overwrite", *FAST)
    assert rc == 0, err
    assert (merged / "model.safetensors.index.json").is_file()

    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "merged").write_text("a file")
    assert cli_error(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                     blocked, "--merge-at-end", "--overwrite", *FAST) == (
        f"{blocked / 'merged'}: is a file, where --merge-at-end writes the merged model; move it, "
        "or choose another --output")


def test_merge_at_end_needs_a_base_model(tmp_path):
    """Through the Python API a model object can be passed without --model: nothing to merge
    into, said before the model is used."""
    cfg = TrainConfig(data=None, output=str(tmp_path / "run"), merge_at_end=True, device="cpu")
    with pytest.raises(LeantuneError) as ei:
        Trainer(cfg, model=object(), train_data=[])
    assert str(ei.value) == ("--merge-at-end needs --model (the base checkpoint the adapter is "
                             "merged into)")
