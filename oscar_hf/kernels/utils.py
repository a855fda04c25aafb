"""Device helpers shared by the kernel launchers."""

from __future__ import annotations

import contextlib
import functools

import torch


def on_device_of(t: torch.Tensor):
    """Context for a Triton launch over ``t``: Triton launches on the current CUDA device, and with
    ``device_map="auto"`` a layer's tensors may live on another one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def has_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch early (programmatic dependent launch: sm_90 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (an H100's 132 elsewhere, so that plans match the GPU's)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: CUDA, or anywhere under TRITON_INTERPRET=1."""
    if device.type == "cuda":
        return True
    try:
        import triton
    except ImportError:
        return False
    return bool(triton.knobs.runtime.interpret)
