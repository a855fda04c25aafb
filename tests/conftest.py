"""Test setup: fully offline (no Hub, no datasets download); the ``arch`` fixture runs a test on every tiny
architecture of ``helpers.ARCHITECTURES``."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
from helpers import ARCHITECTURES  # noqa: E402

import oscar_hf  # noqa: E402,F401  (registers the "oscar" attention)


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param
