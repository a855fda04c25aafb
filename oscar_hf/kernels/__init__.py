"""Attention backends over the OSCAR cache, by name. "torch" is the reference (``naive.py``)."""

from __future__ import annotations

import torch

from . import naive

ATTENTION_BACKENDS = {"torch": naive.attend}


def attention_backend(name: str, device: torch.device):
    """The attention function for OscarConfig.backend ``name`` on ``device`` ("auto" picks the fastest available)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in ATTENTION_BACKENDS else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r} is not available; available: {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]
