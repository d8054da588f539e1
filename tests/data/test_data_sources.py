"""Where rows come from: files, dataset folders (through the `datasets` library) and hub datasets
(`org/name`; tested offline by pointing `datasets.load_dataset` at a local folder), with the
one-line errors for a missing package, offline, unknown datasets, splits and subsets."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import FAST, alpaca_rows, cli_error, make_tokenizer, read_metrics, run_cli
from helpers import tiny_ckpt  # noqa: F401  (fixture)

from leantune.data import SFTDataset
from leantune.data.sources import check_source, is_hub_dataset, load_rows
from leantune.errors import LeantuneError

datasets = pytest.importorskip("datasets")


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg
    return msg


@pytest.fixture
def data_folder(tmp_path):
    """A folder of data files the `datasets` library reads as splits train (5 rows), test (2)."""
    folder = tmp_path / "local-ds"
    (folder / "data").mkdir(parents=True)
    for split, rows in (("train", alpaca_rows(5)), ("test", alpaca_rows(2, seed=1))):
        (folder / "data" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture
def hub(monkeypatch, data_folder):
    """`datasets.load_dataset` answering hub ids from `data_folder`; records each call."""
    real = datasets.load_dataset
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return real(str(data_folder), name=name, split=split)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


# --- hub id or local path ------------------------------------------------------------------------

def test_hub_id_or_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_dataset("org/name") and is_hub_dataset("Org-1/name_2.v3")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").write_text("{}")
    assert not is_hub_dataset("org/name")  # an existing local path always wins
    assert not is_hub_dataset("org/other")  # "org" is a local folder: a missing file in it
    for spec in ("team/train.jsonl", "team/rows.CSV", "./team/name", "/team/name", "name",
                 "a/b/c", "-a/b", "a/"):
        assert not is_hub_dataset(spec), spec


def test_check_source(tmp_path, monkeypatch):
    check_source("org/name")  # datasets is installed: a hub id passes the cheap check
    check_source(tmp_path)  # a folder too
    with pytest.raises(LeantuneError) as ei:
        check_source(tmp_path / "missing.jsonl", "--eval-data")
    assert _one_line(ei) == f"{tmp_path / 'missing.jsonl'}: data file not found; check the " \
                            "--eval-data path"

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(LeantuneError) as ei:
        check_source("org/name")
    assert _one_line(ei) == ("org/name: loading a Hugging Face hub dataset needs the datasets "
                             "library; run `pip install 'leantune[datasets]'` (or pass a .jsonl, "
                             ".json, .csv or .parquet file)")
    with pytest.raises(LeantuneError, match="loading a dataset folder needs the datasets library"):
        load_rows(tmp_path)


# --- loading ---------------------------------------------------------------------------------------

def test_hub_dataset_rows_and_labels(hub):
    label, rows = load_rows("org/name")
    assert hub == [("org/name", None, "train")]
    assert label == "org/name[train]"
    assert rows == [(f"row {i}", r) for i, r in enumerate(alpaca_rows(5), start=1)]

    label, rows = load_rows("org/name", "test", "default")
    assert hub[-1] == ("org/name", "default", "test")
    assert label == "org/name:default[test]" and len(rows) == 2


def test_dataset_folder_of_data_files(data_folder):
    label, rows = load_rows(data_folder, "test")
    assert label == f"{data_folder}[test]"
    assert [r for _, r in rows] == alpaca_rows(2, seed=1)


def test_saved_to_disk_folders(tmp_path):
    one = tmp_path / "one"
    datasets.Dataset.from_list(alpaca_rows(3)).save_to_disk(str(one))
    label, rows = load_rows(one, split="ignored")  # one saved dataset has no splits
    assert label == str(one) and [r for _, r in rows] == alpaca_rows(3)

    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(alpaca_rows(3)),
                          "dev": datasets.Dataset.from_list(alpaca_rows(1, seed=2))}
                         ).save_to_disk(str(both))
    label, rows = load_rows(both, "dev")
    assert label == f"{both}[dev]" and [r for _, r in rows] == alpaca_rows(1, seed=2)
    with pytest.raises(LeantuneError) as ei:
        load_rows(both, "test", split_flag="--eval-split")
    assert _one_line(ei) == (f"{both}: the saved dataset has no split 'test' (it has train, dev); "
                             "pass --eval-split with one of them")


def test_messages_rows_from_a_dataset(tmp_path):
    """Lists of turns survive the `datasets` round trip and train as the messages format."""
    conv = [{"messages": [{"role": "user", "content": "What is the capital of France?"},
                          {"role": "assistant", "content": "Paris"}]}] * 3
    folder = tmp_path / "chat"
    datasets.Dataset.from_list(conv).save_to_disk(str(folder))
    ds = SFTDataset(folder, make_tokenizer(), 64)
    assert ds.format == "messages" and ds.num_docs == 3 and ds.locations == ["row 1", "row 2",
                                                                              "row 3"]


def test_errors_in_hub_rows_name_the_dataset_and_row(monkeypatch):
    rows = alpaca_rows(3)
    del rows[1]["output"]
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda path, name=None, split=None: datasets.Dataset.from_list(rows))
    with pytest.raises(LeantuneError) as ei:
        SFTDataset("org/name", make_tokenizer(), 64, format="alpaca")
    # (a dataset's rows share its columns: a row without the field holds null there)
    assert _one_line(ei).startswith("org/name[train] (row 2): field 'output' is null")


# --- errors ----------------------------------------------------------------------------------------

def test_offline_with_the_real_library():
    """HF_HUB_OFFLINE=1 (tests/conftest.py): the library refuses at once, without the network."""
    if not datasets.config.HF_HUB_OFFLINE:
        pytest.skip("HF_HUB_OFFLINE is not set: this test must not reach the network")
    with pytest.raises(LeantuneError) as ei:
        load_rows("leantune-test/no-such-dataset")
    msg = _one_line(ei)
    assert msg.startswith("leantune-test/no-such-dataset: no local file or folder of that name, "
                          "and the Hugging Face hub cannot be reached to load it as a dataset (")
    assert msg.endswith("check the path, or the network (a hub dataset loaded once is cached and "
                        "then loads offline)")


@pytest.mark.parametrize("raised, expect", [
    (lambda: datasets.exceptions.DatasetNotFoundError(
        "Dataset 'org/name' doesn't exist on the Hub or cannot be accessed."),
     "org/name: no local file or folder of that name, and no such dataset on the Hugging Face "
     "hub (Dataset 'org/name' doesn't exist on the Hub or cannot be accessed); check the path or "
     "the id (a private or gated dataset needs HF_TOKEN)"),
    (lambda: ValueError("Config name is missing. Please pick one among the available configs: "
                        "['en', 'fr']"),
     "org/name: Config name is missing. Please pick one among the available configs: ['en', "
     "'fr']; pass --data-subset with one of them"),
    (lambda: ValueError("Bad feature type"),
     "org/name[train]: cannot load the dataset (Bad feature type)"),
    (lambda: RuntimeError("disk\nfull"),
     "org/name[train]: cannot load the dataset (RuntimeError: disk full)"),
])
def test_load_errors_are_one_line(monkeypatch, raised, expect):
    def load_dataset(path, name=None, split=None):
        raise raised()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(LeantuneError) as ei:
        load_rows("org/name")
    assert _one_line(ei) == expect


def test_unknown_split_and_subset(hub, data_folder):
    with pytest.raises(LeantuneError) as ei:
        load_rows("org/name", "validation", split_flag="--eval-split")
    assert _one_line(ei) == ("org/name[validation]: Unknown split \"validation\". Should be one of "
                             "['train', 'test']; pass --eval-split with one of them")
    with pytest.raises(LeantuneError) as ei:
        load_rows("org/name", subset="fr")
    msg = _one_line(ei)
    assert msg.startswith("org/name: BuilderConfig 'fr' not found.")
    assert msg.endswith("; pass --data-subset with one of them")


def test_empty_dataset(monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None, split=None:
                        datasets.Dataset.from_dict({"text": []}))
    with pytest.raises(LeantuneError) as ei:
        load_rows("org/name", "test")
    assert _one_line(ei) == "org/name[test]: the dataset has no rows; pick another split or dataset"


def test_folder_without_data(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(LeantuneError) as ei:
        load_rows(bare)
    assert _one_line(ei) == (f"{bare}: the folder holds no data files the datasets library "
                             "reads; pass a data file instead, or a folder of them")


# --- through `leantune train` ----------------------------------------------------------------------

def test_train_on_a_hub_dataset(hub, tiny_ckpt, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    rc, stdout, err = run_cli(capsys, "train", "--model", tiny_ckpt, "--data", "org/name",
                              "--eval-data", "org/name", "--data-split", "test", "--eval-split",
                              "train", "--data-subset", "default", "--output", out,
                              "--max-steps", 2, *FAST)
    assert rc == 0, err
    assert hub == [("org/name", "default", "test"), ("org/name", "default", "train")]
    assert "data: 2 documents" in stdout and "eval: 5 documents" in stdout
    assert [r["step"] for r in read_metrics(out) if "eval_loss" in r] == [0, 2]


def test_train_hub_dataset_errors(hub, tiny_ckpt, tmp_path, capsys, monkeypatch):  # noqa: F811
    def one_line(*args):
        return cli_error(capsys, "train", "--model", tiny_ckpt, "--output", tmp_path / "run",
                         *FAST, *args)

    assert one_line("--data", "org/name", "--data-split", "dev").endswith(
        "Should be one of ['train', 'test']; pass --data-split with one of them")
    assert one_line("--data", "org/name", "--eval-data", "org/name", "--eval-split",
                    "dev").endswith("pass --eval-split with one of them")
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert one_line("--data", "org/name") == (
        "org/name: loading a Hugging Face hub dataset needs the datasets "
        "library; run `pip install 'leantune[datasets]'` (or pass a .jsonl, .json, .csv or "
        ".parquet file)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
