"""Test setup: fully offline (no Hub, no datasets download); the ``arch`` fixture runs a test on every tiny
architecture of ``helpers.ARCHITECTURES``."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import ARCHITECTURES, char_tokenizer, make_model  # noqa: E402

import oscar_hf  # noqa: E402,F401  (registers the "oscar" attention)

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist: the workers share the cores (OpenMP threads that spin after
    # a forward would otherwise take the other workers' cores)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a small, busy CPU,
    torch's OpenMP workers spinning after a forward starve MKL's eigh (seconds instead of a millisecond)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Llama (2 layers, 2 KV heads, head_dim 64) saved with a character tokenizer (with a chat template), so
    that both load from its folder."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model("llama-mha-d64").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)
