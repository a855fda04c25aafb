"""The error word the write and append kernels set on the device, and the errors it stands for.

Each side has two bits, K's at :data:`KEY_SHIFT`, V's at :data:`VALUE_SHIFT`: :data:`NON_FINITE` (a NaN or an inf in
the input) and :data:`OVERFLOW` (a scale or zero past its format's range). :data:`FULL` is set by the append kernel
when a static cache has no room for a decode step's token."""

from __future__ import annotations

import torch

from ..quantizer import overflow_message

NON_FINITE = 1
OVERFLOW = 2
KEY_SHIFT = 0
VALUE_SHIFT = 2
FULL = 1 << 16


def raise_for_flags(flags: int, scale_dtype: torch.dtype) -> None:
    """Raise the torch quantizer's ValueError for a flag word (K checked before V), or the full-cache error;
    ``scale_dtype``: the stored scales' dtype (uint8: byte scales)."""
    for shift in (KEY_SHIFT, VALUE_SHIFT):
        if flags >> shift & NON_FINITE:
            raise ValueError("cannot quantize K/V rows that contain NaN or inf")
        if flags >> shift & OVERFLOW:
            raise ValueError(overflow_message(scale_dtype))
    if flags & FULL:
        raise ValueError("a decode step found the OscarQuantizedCache full (max_cache_len tokens) and did not store "
                         "its token: build the cache with a larger max_cache_len (prompt + max_new_tokens)")
