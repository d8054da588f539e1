"""--overwrite sets an objective's files in the run folder aside with the rest of the previous
run (a preference run's precomputed reference log-probs, GRPO's rollouts in progress): the new
run computes its own, and a new run stopped before its first checkpoint puts them back."""

from __future__ import annotations

from helpers import one_pair_changed
from helpers import one_torch_thread, run_cli  # noqa: F401  (autouse)

from leantune import assets
from leantune.train.objectives.grpo import ROLLOUTS_FILE
from leantune.train.objectives.preference import REFERENCE_FILE, load_reference
from leantune.train.output import SET_ASIDE, RunFolder, run_files

TINY = assets.path("tiny-llama")
PAIRS = assets.path("data/demo_preference.jsonl")
FAST = ["--max-seq-len", "64", "--batch-size", "4", "--no-progress", "--device", "cpu",
        "--dtype", "float32", "--warmup-steps", "0"]


def test_an_overwrite_sets_the_objective_files_aside_and_puts_them_back(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    old = {"adapter_config.json": b"{}", REFERENCE_FILE: b"old reference",
           ROLLOUTS_FILE: b"old rollouts"}
    for name, data in old.items():
        (out / name).write_bytes(data)
    assert {REFERENCE_FILE, ROLLOUTS_FILE} <= {p.name for p in run_files(out)}
    folder = RunFolder(out, log=lambda *_: None)
    folder.begin(overwrite=True)
    assert not (out / REFERENCE_FILE).exists() and not (out / ROLLOUTS_FILE).exists()
    assert (out / SET_ASIDE / REFERENCE_FILE).read_bytes() == b"old reference"
    (out / REFERENCE_FILE).write_bytes(b"new reference")  # the new run's, then it stops early
    (out / ROLLOUTS_FILE).write_bytes(b"new rollouts")
    folder.restore()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == old


def test_overwrite_of_a_precompute_reference_run_with_other_data(tmp_path, capsys):
    out = tmp_path / "dpo"
    common = ["train", "--model", TINY, "--objective", "dpo", "--output", out, "--max-steps", "1",
              "--precompute-reference", *FAST]
    rc, _, err = run_cli(capsys, *common, "--data", PAIRS)
    assert rc == 0, err
    _, before = load_reference(out / REFERENCE_FILE)
    changed = one_pair_changed(PAIRS, tmp_path / "changed.jsonl")
    rc, stdout, err = run_cli(capsys, *common, "--data", changed, "--overwrite")
    assert rc == 0, err
    assert f"reference log-probs: computed 40 into {out / REFERENCE_FILE}" in stdout
    _, after = load_reference(out / REFERENCE_FILE)
    assert after != before and not (out / SET_ASIDE).exists()
