"""Test setup: fully offline (no Hub, no datasets download); the ``arch`` fixture runs a test on every tiny
architecture of ``helpers.ARCHITECTURES``."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import ARCHITECTURES  # noqa: E402

import oscar_hf  # noqa: E402,F401  (registers the "oscar" attention)

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist: the workers share the cores (OpenMP threads that spin after
    # a forward would otherwise take the other workers' cores)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param
