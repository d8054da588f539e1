"""`leantune doctor` on this machine (CPU) and with pieces faked missing."""

import subprocess
import sys

import pytest
import torch

from leantune import doctor

MARKS = ("ok", "no", "MISSING")


def _run(**kw):
    lines = []
    rc = doctor.run_doctor(print_fn=lines.append, **kw)
    return rc, lines


def _check_lines(lines):
    """Every line but the header and the final verdict starts with a mark."""
    body = lines[1:-1]
    assert body, lines
    by_name = {}
    for ln in body:
        assert ln.split()[0] in MARKS, ln
        by_name.setdefault(ln[9:27].strip(), ln)  # "mark     name              detail"
    return by_name


def test_doctor_on_this_machine():
    rc, lines = _run()
    text = "\n".join(lines)
    assert rc == 0, text
    by_name = _check_lines(lines)
    for name in ("python", "torch", "CUDA", "GPU", "bf16", "triton", "kernels", "transformers",
                 "safetensors", "huggingface_hub", "peft", "training dtype", "attention",
                 "device"):
        assert name in by_name, f"no {name!r} line in:\n{text}"
    assert by_name["python"].startswith("ok")
    assert torch.__version__ in by_name["torch"] and by_name["torch"].startswith("ok")
    assert "ready" in lines[-1]
    mem = by_name.get("host memory") or ""
    assert "GiB" in mem, text
    if not torch.cuda.is_available():
        assert by_name["CUDA"].startswith("no"), text
        assert "fp32" in by_name["training dtype"], text
        assert "CPU" in by_name["device"] or "cpu" in by_name["device"]
        assert "block-diagonal" in by_name["attention"], text
        assert "reference" in by_name["kernels"], text
    else:
        assert by_name["CUDA"].startswith("ok")
        assert "compute capability" in by_name["GPU"]
        assert "free of" in by_name["GPU memory"], text
        assert by_name["training dtype"].split()[-1] in ("bf16", "fp16"), text


def test_missing_required_library_fails(monkeypatch):
    real = doctor.import_version
    monkeypatch.setattr(doctor, "import_version",
                        lambda m: None if m == "safetensors" else real(m))
    rc, lines = _run()
    assert rc == 1
    line = _check_lines(lines)["safetensors"]
    assert line.startswith("MISSING") and "pip install" in line
    assert "MISSING" in lines[-1]


def test_too_old_library_fails(monkeypatch):
    real = doctor.import_version
    monkeypatch.setattr(doctor, "import_version",
                        lambda m: "4.30.0" if m == "transformers" else real(m))
    rc, lines = _run()
    assert rc == 1
    line = _check_lines(lines)["transformers"]
    assert line.startswith("MISSING") and ">= 4.45" in line


def test_optional_peft_missing_is_not_a_failure(monkeypatch):
    real = doctor.import_version
    monkeypatch.setattr(doctor, "import_version", lambda m: None if m == "peft" else real(m))
    rc, lines = _run()
    assert rc == 0
    line = _check_lines(lines)["peft"]
    assert line.startswith("no") and "pip install peft" in line


def test_optional_extras_are_listed_with_their_install(monkeypatch):
    monkeypatch.setattr(doctor, "installed_version",
                        lambda d: None if d in ("wandb", "gguf") else "9.9")
    rc, lines = _run()
    assert rc == 0  # optional: not a failure
    by_name = _check_lines(lines)
    for dist, purpose, extra in doctor.OPTIONAL:
        line = by_name[dist]
        if dist in ("wandb", "gguf"):
            assert line == (f"no       {dist:<18} not installed (optional, for {purpose}): "
                            f"pip install 'leantune[{extra}]'")
        else:
            assert line.startswith("ok") and "9.9 (optional" in line
    assert {extra for _, _, extra in doctor.OPTIONAL} <= set(_pyproject_extras())


def _pyproject_extras() -> set[str]:
    """The extras pyproject.toml declares (doctor's install hints must name real ones)."""
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        pytest.skip("tomllib needs Python >= 3.11")
    root = Path(doctor.__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    return set(data["project"]["optional-dependencies"])


def test_host_memory_without_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    mem = doctor.host_memory()
    try:
        open("/proc/meminfo").close()
    except OSError:
        pytest.skip("no /proc/meminfo here")
    assert mem is not None and 0 < mem[0] <= mem[1]


@pytest.mark.parametrize("cuda,bf16,want", [(True, True, "bf16"), (True, False, "fp16"),
                                            (False, False, "fp32"), (False, True, "fp32")])
def test_training_dtype(cuda, bf16, want):
    assert doctor.training_dtype(cuda, bf16) == want


def test_attention_path():
    assert "varlen" in doctor.attention_path(True, True)
    assert doctor.attention_path(True, False).startswith("SDPA")
    cpu = doctor.attention_path(False, True)
    assert cpu.startswith("SDPA") and "block-diagonal" in cpu


def test_version_compare():
    assert doctor.version_at_least("2.13.0+cpu", "2.4")
    assert not doctor.version_at_least("2.3.1", "2.4")
    assert doctor.version_at_least("5.0.0rc1", "4.45")
    assert doctor.version_at_least("0.4", "0.4")


def test_cli_doctor():
    r = subprocess.run([sys.executable, "-m", "leantune", "doctor"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "torch" in r.stdout and "CUDA" in r.stdout and "training dtype" in r.stdout
