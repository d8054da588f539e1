"""`leantune doctor`: check the environment and say what leantune will use on this machine.

One line per check, each marked:
    ok       fine
    no       absent but optional, or a capability this machine lacks (leantune falls back)
    MISSING  a required piece is absent or too old: the line says what to install

`run_doctor` returns 0 when every essential check is ok (Python, torch and the required
libraries), 1 otherwise. No GPU is not a failure: leantune then trains on the CPU.
"""

from __future__ import annotations

import importlib
import os
import platform
import re
import sys
from collections.abc import Callable

OK, NO, MISSING = "ok", "no", "MISSING"

MIN_PYTHON = (3, 10)
# Required libraries: (import name, distribution name, minimum version) as in pyproject.toml.
REQUIRED = [
    ("transformers", "transformers", "4.45"),
    ("safetensors", "safetensors", "0.4"),
    ("huggingface_hub", "huggingface_hub", "0.24"),
    ("yaml", "pyyaml", "6"),
    ("tqdm", "tqdm", "4.66"),
]
# Optional extras: (distribution, what it is for, the leantune extra that installs it).
OPTIONAL = [
    ("gguf", "GGUF export", "gguf"),
    ("datasets", "Hugging Face hub datasets", "datasets"),
    ("pyarrow", ".parquet data files", "parquet"),
    ("matplotlib", "loss-curve plots", "plot"),
    ("tensorboard", "TensorBoard logging", "tensorboard"),
    ("wandb", "Weights & Biases logging", "wandb"),
]
MIN_TORCH = "2.4"
# PyPI's Linux torch wheels are CUDA builds (GBs of nvidia-* packages); PyTorch's CPU index has
# the CPU builds
TORCH_INSTALL = ("pip install torch on a GPU machine, pip install torch --index-url "
                 "https://download.pytorch.org/whl/cpu on a CPU-only one")


def _vtuple(v: str) -> tuple[int, ...]:
    """'2.13.0+cpu' -> (2, 13, 0); unparsable parts stop the tuple."""
    out = []
    for part in str(v).split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def version_at_least(v: str, minimum: str) -> bool:
    return _vtuple(v) >= _vtuple(minimum)


def import_version(module: str) -> str | None:
    """The version of an importable module ('?' when it has none), None when it does not import."""
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", "?"))


def installed_version(dist: str) -> str | None:
    """The installed version of a distribution, None when it is not installed (not imported:
    some extras take seconds to import)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def training_dtype(cuda: bool, bf16: bool) -> str:
    """What leantune trains in by default: bf16 on capable GPUs, fp16 on older ones, fp32 on CPU."""
    if cuda:
        return "bf16" if bf16 else "fp16"
    return "fp32"


def attention_path(cuda: bool, has_varlen: bool) -> str:
    if cuda and has_varlen:
        return ("varlen flash attention (torch.nn.attention.varlen.varlen_attn) over packed "
                "rows")
    if cuda:
        return ("SDPA (no torch.nn.attention.varlen.varlen_attn in this torch: packed rows use "
                "a block-diagonal mask; torch >= 2.10 is faster)")
    return "SDPA with a block-diagonal causal mask for packed rows (CPU)"


def fp8_path(device: str) -> tuple[str, str]:
    """(mark, detail) of the doctor's fp8 line: whether --precision fp8 runs here, and how."""
    from .kernels.fp8 import emulating, fp8_unsupported

    why = fp8_unsupported(device)
    if why:
        return NO, f"--precision fp8 is refused: {why}"
    if emulating():
        return OK, ("--precision fp8 emulated in PyTorch (LEANTUNE_FP8_EMULATE=1: the reference "
                    "GEMMs, slow)")
    return OK, ("--precision fp8: e4m3 base weights (128 x 128 block scales), Triton FP8 GEMMs "
                "quantising the activations inside them")


def _has_varlen() -> bool:
    try:  # the model's own test, so doctor and training agree
        from .model.attention import HAS_VARLEN

        return bool(HAS_VARLEN)
    except Exception:
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except Exception:
            return False
        return True


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of host RAM: psutil when installed, else /proc/meminfo."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:
        pass
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]
    except Exception:
        return None


def run_doctor(print_fn: Callable[[str], None] = print) -> int:
    """Print the environment report, one line per check. Returns 0 if the essentials are ok."""
    problems = 0

    def line(mark: str, what: str, detail: str) -> None:
        print_fn(f"{mark:<8} {what:<18} {detail}")

    def fail(what: str, detail: str) -> None:
        nonlocal problems
        problems += 1
        line(MISSING, what, detail)

    print_fn(f"leantune doctor ({platform.system()} {platform.machine()})")

    # Python
    py = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] >= MIN_PYTHON:
        line(OK, "python", py)
    else:
        fail("python", f"{py}: leantune needs Python >= {'.'.join(map(str, MIN_PYTHON))}")

    # torch
    try:
        import torch
    except Exception as e:
        torch = None
        fail("torch", f"not importable ({type(e).__name__}): {TORCH_INSTALL}")
    if torch is not None:
        tv = torch.__version__
        if version_at_least(tv, MIN_TORCH):
            line(OK, "torch", tv)
        else:
            fail("torch", f"{tv}: leantune needs torch >= {MIN_TORCH}: {TORCH_INSTALL}")

    # CUDA, GPU, bf16
    cuda = False
    bf16 = False
    cc: tuple[int, int] | None = None
    if torch is not None:
        try:
            cuda = bool(torch.cuda.is_available())
        except Exception:
            cuda = False
        cuda_build = getattr(torch.version, "cuda", None)
        if cuda:
            line(OK, "CUDA", f"available (torch built with CUDA {cuda_build}), "
                             f"{torch.cuda.device_count()} GPU(s)")
            name = torch.cuda.get_device_name(0)
            cc = tuple(torch.cuda.get_device_capability(0))
            line(OK, "GPU", f"{name}, compute capability {cc[0]}.{cc[1]}")
            bf16 = bool(torch.cuda.is_bf16_supported())
            if bf16:
                line(OK, "bf16", "supported")
            else:
                line(NO, "bf16", f"not supported on compute capability {cc[0]}.{cc[1]} "
                                 "(needs >= 8.0): training uses fp16")
        else:
            if cuda_build:
                why = (f"torch is built with CUDA {cuda_build} but no GPU is visible: check the "
                       "driver (nvidia-smi) and CUDA_VISIBLE_DEVICES")
            else:
                why = ("this torch is a CPU-only build: for GPU training install a CUDA build "
                       "(on Linux, plain `pip install torch` is one)")
            line(NO, "CUDA", f"not available; {why}. leantune will train on the CPU (slow; the "
                             "built-in demo still runs)")
            line(NO, "GPU", "none")
            line(NO, "bf16", "no CUDA GPU; CPU training uses fp32")

    # Triton and the kernels
    tri = import_version("triton")
    forced = os.environ.get("LEANTUNE_KERNELS", "auto")
    if tri is not None:
        line(OK, "triton", tri)
    else:
        hint = ("pip install triton (Linux)" if platform.system() == "Linux"
                else "Triton is Linux-only")
        line(NO, "triton", f"not importable: {hint}; fused kernels fall back to the PyTorch "
                           "reference ops")
    if forced == "reference":
        line(OK, "kernels", "reference PyTorch ops (forced by LEANTUNE_KERNELS=reference)")
    elif cuda and tri is not None:
        note = ""
        if cc is not None and cc < (7, 5):
            note = (f"; compute capability {cc[0]}.{cc[1]} is older than Triton supports well: "
                    "if kernels fail, set LEANTUNE_KERNELS=reference")
        line(OK, "kernels", f"Triton kernels on the GPU (RMSNorm, RoPE, SwiGLU, cross-entropy)"
                            f"{note}")
    elif cuda:
        line(NO, "kernels", "reference PyTorch ops on the GPU (install triton for the fused "
                            "kernels)")
    else:
        line(OK, "kernels", "reference PyTorch ops (Triton kernels need a CUDA GPU)")

    # Memory
    if cuda:
        try:
            free, total = torch.cuda.mem_get_info(0)
            line(OK, "GPU memory", f"{_gib(free)} free of {_gib(total)}")
        except Exception as e:
            line(NO, "GPU memory", f"unknown ({type(e).__name__})")
    mem = host_memory()
    if mem is not None:
        line(OK, "host memory", f"{_gib(mem[0])} available of {_gib(mem[1])}")
    else:
        line(NO, "host memory", "unknown (pip install psutil to report it)")

    # Libraries
    for module, dist, minimum in REQUIRED:
        v = import_version(module)
        if v is None:
            fail(dist, f"not importable: pip install '{dist}>={minimum}'")
        elif v != "?" and not version_at_least(v, minimum):
            fail(dist, f"{v}: leantune needs {dist} >= {minimum}: "
                       f"pip install -U '{dist}>={minimum}'")
        else:
            line(OK, dist, v)
    pv = import_version("peft")
    if pv is not None:
        line(OK, "peft", f"{pv} (optional)")
    else:
        line(NO, "peft", "not installed (optional: leantune writes PEFT-format adapters without "
                         "it; pip install peft to load them with PEFT)")
    for dist, purpose, extra in OPTIONAL:
        v = installed_version(dist)
        if v is not None:
            line(OK, dist, f"{v} (optional: {purpose})")
        else:
            line(NO, dist, f"not installed (optional, for {purpose}): "
                           f"pip install 'leantune[{extra}]'")

    # What leantune will use
    if torch is not None:
        dev = "cuda" if cuda else "cpu"
        line(OK, "device", f"{dev}" + (f" ({torch.cuda.get_device_name(0)})" if cuda else ""))
        line(OK, "training dtype", training_dtype(cuda, bf16))
        line(OK, "attention", attention_path(cuda, _has_varlen()))
        mark, detail = fp8_path(dev)
        line(mark, "fp8", detail)

    if problems:
        print_fn(f"{problems} problem(s): fix the MISSING lines above, then rerun leantune doctor")
        return 1
    print_fn("ready: leantune can train here" + ("" if cuda else " (on the CPU)"))
    return 0


def main(argv=None) -> int:
    return run_doctor()


if __name__ == "__main__":
    sys.exit(main())
