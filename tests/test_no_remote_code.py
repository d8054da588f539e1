"""No path runs a checkpoint's own code.

1. Every transformers `from_pretrained` call in the source passes trust_remote_code=False (a scan
   of the source with `ast`; it fails naming file:line).
2. A model folder whose config.json and tokenizer_config.json name Python code of their own
   (auto_map), next to a .py that would write a marker file when imported, is either used
   without running it or refused in one line, by every command that reads a model folder:
   train, export (merged, GGUF), generate, chat and inspect-data. (`doctor` reads no model
   folder.)
"""

from __future__ import annotations

import ast
import builtins
import json
import shutil
from pathlib import Path

import pytest
from helpers import FAST, alpaca_file, cli_error, run_cli, tiny_ckpt  # noqa: F401

import leantune

SRC = Path(leantune.__file__).parent
# Calls that load a transformers (or PEFT, datasets...) object from a folder or the hub.
LOADERS = {"from_pretrained"}


def loads_without_trust_flag(source: str, filename: str) -> list[str]:
    """`file:line` of each loader call in `source` that does not pass trust_remote_code=False
    as a literal keyword, and of any call passing trust_remote_code other than False."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        flag = next((k for k in node.keywords if k.arg == "trust_remote_code"), None)
        explicit_false = (flag is not None and isinstance(flag.value, ast.Constant)
                          and flag.value.value is False)
        if (name in LOADERS and not explicit_false) or (flag is not None and not explicit_false):
            bad.append(f"{filename}:{node.lineno}")
    return bad


def test_the_scan_finds_a_load_without_the_flag():
    src = ("from transformers import AutoTokenizer as A\n"
           "A.from_pretrained('x')\n"
           "A.from_pretrained('x', trust_remote_code=False)\n"
           "A.from_pretrained('x', trust_remote_code=True)\n"
           "A.from_pretrained('x', **kw)\n"
           "f(trust_remote_code=flag)\n")
    assert loads_without_trust_flag(src, "m.py") == ["m.py:2", "m.py:4", "m.py:5", "m.py:6"]


def test_every_transformers_load_passes_trust_remote_code_false():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50  # (the package, not an empty folder)
    bad, loads = [], 0
    for f in files:
        text = f.read_text()
        bad += loads_without_trust_flag(text, str(f.relative_to(SRC.parent)))
        loads += text.count(".from_pretrained(")
    assert loads >= 2  # the trainer's and the exporter's tokenizer loads at least
    assert not bad, "loads without trust_remote_code=False: " + ", ".join(bad)


# --- a model folder that names its own code -----------------------------------------------------

def code_folder(tiny, tmp_path: Path, custom_class: bool) -> tuple[Path, Path]:
    """(a copy of the tiny checkpoint whose config.json and tokenizer_config.json have an
    auto_map to custom.py, the marker file custom.py would write). `custom_class`: the tokenizer
    class is the custom one (transformers cannot load it without the code), else a class of
    transformers' own stays named (it loads from the files)."""
    folder = tmp_path / ("custom-class" if custom_class else "auto-map")
    shutil.copytree(tiny, folder)
    marker = tmp_path / f"code-ran-{folder.name}"
    (folder / "custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig as CustomConfig, LlamaForCausalLM as CustomModel\n"
        "from transformers import PreTrainedTokenizerFast as CustomTokenizer\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "custom.CustomConfig",
                          "AutoModelForCausalLM": "custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["custom.CustomTokenizer", None]}
    if custom_class:
        tok["tokenizer_class"] = "CustomTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    return folder, marker


def script_input(monkeypatch, lines):
    it = iter(lines)

    def fake_input(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", fake_input)


GEN = ["--device", "cpu", "--max-new-tokens", "2"]


def test_every_command_uses_an_auto_map_folder_without_running_its_code(
        tiny_ckpt, alpaca_file, tmp_path, capsys, monkeypatch):  # noqa: F811
    """auto_map beside classes transformers has: every command works from the files alone."""
    pytest.importorskip("gguf")
    folder, marker = code_folder(tiny_ckpt, tmp_path, custom_class=False)
    run = tmp_path / "run"
    rc, _, err = run_cli(capsys, "train", "--model", folder, "--data", alpaca_file, "--output",
                         run, "--max-steps", "1", *FAST)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "export", "--model", folder, "--adapter", run, "--output",
                         tmp_path / "merged")
    assert rc == 0, err
    exported = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "auto_map" not in exported and not (tmp_path / "merged" / "custom.py").exists()
    rc, _, err = run_cli(capsys, "export", "--model", folder, "--format", "gguf", "--quant",
                         "f32", "--output", tmp_path / "gguf")
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "generate", "--model", folder, "--prompt", "hello", *GEN)
    assert rc == 0, err
    script_input(monkeypatch, ["hello"])
    rc, out, err = run_cli(capsys, "chat", "--model", folder, *GEN)
    assert rc == 0, err
    rc, out, err = run_cli(capsys, "inspect-data", "--model", folder, "--data", alpaca_file)
    assert rc == 0, err
    assert not marker.exists()


def test_a_tokenizer_that_needs_its_code_is_refused_in_one_line(
        tiny_ckpt, alpaca_file, tmp_path, capsys, monkeypatch):  # noqa: F811
    """A tokenizer class only the folder's own code defines: train, generate, chat and
    inspect-data refuse in one line naming the auto_map; export copies the tokenizer files
    (it reads tokenizer.json as data). The code never runs."""
    folder, marker = code_folder(tiny_ckpt, tmp_path, custom_class=True)
    expect = (f"{folder}: the tokenizer needs the checkpoint's own Python code "
              "(tokenizer_config.json auto_map AutoTokenizer -> custom.CustomTokenizer), which "
              "leantune never runs")
    script_input(monkeypatch, ["hello"])
    for args in (["train", "--model", folder, "--data", alpaca_file, "--output",
                  tmp_path / "run", "--max-steps", "1", *FAST],
                 ["generate", "--model", folder, "--prompt", "hello", *GEN],
                 ["chat", "--model", folder, *GEN],
                 ["inspect-data", "--model", folder, "--data", alpaca_file]):
        assert cli_error(capsys, *args).startswith(expect), args[0]
    assert not (tmp_path / "run").exists()
    rc, _, err = run_cli(capsys, "export", "--model", folder, "--output", tmp_path / "merged")
    assert rc == 0, err
    assert "auto_map" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    assert not marker.exists()


def test_a_hub_download_never_fetches_code():
    """What `resolve_checkpoint` downloads from the hub: no .py file can match."""
    import fnmatch

    from leantune.data.inspect import TOKENIZER_PATTERNS
    from leantune.model.loader import CHECKPOINT_PATTERNS

    for name in ("custom.py", "modeling_x.py", "tokenization_x.py", "configuration_x.py"):
        assert not any(fnmatch.fnmatch(name, p) for p in CHECKPOINT_PATTERNS + TOKENIZER_PATTERNS)
