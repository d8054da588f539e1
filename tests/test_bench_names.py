"""A bench script runs with bench/ first on sys.path, so a bench module named like an installed
package hides it from everything the script imports (transformers >= 5.25 imports the hub
`kernels` package: a bench/kernels.py broke every bench script)."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_no_bench_module_hides_an_installed_module(monkeypatch):
    here = {str(BENCH), "", "."}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in here])
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "harness" in names  # (the folder was found)
    for n in names:  # (a bench module another test imported: found again by its path)
        mod = sys.modules.get(n)
        if mod is not None and str(getattr(mod, "__file__", "")).startswith(str(BENCH)):
            monkeypatch.delitem(sys.modules, n)
    hidden = [n for n in names if importlib.util.find_spec(n) is not None]
    assert not hidden, f"bench modules named like installed modules: {hidden}"
