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


def pytest_collection_modifyitems(config, items):
    """The real-model tests (marked slow: minutes each) first, so that parallel workers
    (pytest-xdist, --dist loadfile) start them early instead of one worker running the longest
    file alone at the end. A stable sort: the order is otherwise the collection's."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)
