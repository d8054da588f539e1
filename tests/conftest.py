"""Test setup. Triton kernels run on the CPU through the interpreter, so TRITON_INTERPRET must be
set before any kernel module is imported (triton.jit reads it at decoration time)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# The suite's tensors are tiny: one thread avoids oversubscription on small CI machines.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


HEAVY_DIRS = ("tests/engine/", "tests/kernels/")  # files of minutes (kernels interpreted)


def pytest_collection_modifyitems(config, items):
    """The longest files first: the real-model tests (marked slow: minutes each), then the
    engine and kernel tests, so that parallel workers (pytest-xdist, --dist loadfile) end on
    short files instead of one worker running a long one alone at the end. A stable sort: the
    order is otherwise the collection's."""
    def rank(item):
        if item.get_closest_marker("slow"):
            return 0
        return 1 if any(d in item.nodeid.replace("\\", "/") for d in HEAVY_DIRS) else 2

    items.sort(key=rank)
