"""Choosing between a Triton kernel and its plain-PyTorch reference.

Default ("auto"): Triton for CUDA tensors when Triton imports, the reference elsewhere.
Force either with `set_backend("triton" | "reference" | "auto")` or the environment variable
LEANTUNE_KERNELS. Forcing "triton" on CPU tensors only works under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import contextlib
import os

import torch

_BACKENDS = ("auto", "triton", "reference")
_backend = os.environ.get("LEANTUNE_KERNELS", "auto")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


HAS_TRITON = _triton_available()


def set_backend(name: str) -> None:
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {_BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextlib.contextmanager
def backend(name: str):
    """Temporarily select a backend: `with backend("reference"): ...`."""
    old = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(old)


def sm_count(device: torch.device) -> int:
    """Multiprocessors on `device` (CUDA), used to size persistent grids; a small fixed number on
    CPU (the Triton interpreter), so the tests still exercise the multi-program paths."""
    if device.type != "cuda":
        return 2
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


_SM_COUNT: dict[int, int] = {}


def num_warps_for(elements: int) -> int:
    """Warps for a program that holds a tile of `elements` values: ~16 fp32 values per thread
    (enough bytes in flight per thread for 16-byte loads), 4 to 16 warps."""
    return max(4, min(16, elements // 512))


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op on tensor `t` should run its Triton kernel."""
    if _backend == "reference" or not HAS_TRITON:
        return False
    if _backend == "triton":
        return True
    return t.is_cuda
