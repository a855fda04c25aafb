"""Kernels over plain tensors (a :class:`PackedKV`), and the registry of backends by name.

"torch" runs the twins (``*/reference.py``); "triton" (registered when triton imports) runs the Triton kernels where
they serve a call and the twins elsewhere (and SDPA while nothing is quantized: the default cache's attention,
exactly). Nothing here imports the cache, and nothing imports triton before a Triton kernel runs.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from .decode import reference as decode_reference
from .dequantize.reference import dequantize_rows
from .packed import PackedKV
from .write.reference import quantize_kv

__all__ = ["ATTENTION_BACKENDS", "DEQUANTIZE_BACKENDS", "WRITE_BACKENDS", "PackedKV", "attention_backend",
           "dequantize_backend", "quantize_kv", "resolve", "write_backend"]


def _torch_attend(module, query, packed: PackedKV, new_key, new_value, attention_mask, scaling, recent_tokens: int,
                  softcap=None, sinks=None, window=None, order=None):
    return decode_reference.attend(module, query, packed, new_key, new_value, attention_mask, scaling,
                                   softcap=softcap, sinks=sinks, window=window, order=order)


ATTENTION_BACKENDS = {"torch": _torch_attend}
WRITE_BACKENDS = {"torch": quantize_kv}
DEQUANTIZE_BACKENDS = {"torch": dequantize_rows}

if importlib.util.find_spec("triton") is not None:
    # The Triton modules are imported on first use: the interpreter mode (TRITON_INTERPRET) is read when they are.
    def _triton_attend(module, query, packed: PackedKV, new_key, new_value, attention_mask, scaling,
                       recent_tokens: int, softcap=None, sinks=None, window=None, order=None):
        from .decode import launch
        from .decode.triton import decode
        from .dequantize import triton as dequantize

        lengths = packed.lengths()
        if lengths[1] == 0:  # nothing quantized yet: SDPA over the model's own K and V, as the default cache
            return decode_reference.attend(module, query, packed, new_key, new_value, attention_mask, scaling,
                                           softcap=softcap, sinks=sinks, window=window, order=order)
        if launch.supports_call(query, packed, attention_mask, recent_tokens, sum(lengths[:3])):
            if order is not None and attention_mask is not None:  # the mask read in the stored order
                attention_mask = attention_mask.gather(-1, order[:, None, None, :].expand(attention_mask.shape))
            return decode(query, packed, attention_mask, scaling, softcap=softcap, sinks=sinks)
        fill = dequantize.fill_history if dequantize.supports(packed) else None
        return decode_reference.attend(module, query, packed, new_key, new_value, attention_mask, scaling, fill,
                                       softcap=softcap, sinks=sinks, window=window, order=order)

    def _triton_write(key, value, **kwargs):
        from .write.triton import quantize_pack_kv

        return quantize_pack_kv(key, value, **kwargs)

    def _triton_dequantize(rows, center, out, *, bits):
        from .dequantize.triton import dequantize_rows, supports_rows

        (dequantize_rows if supports_rows(out.shape[-1], bits) else DEQUANTIZE_BACKENDS["torch"])(
            rows, center, out, bits=bits)

    ATTENTION_BACKENDS["triton"] = _triton_attend
    WRITE_BACKENDS["triton"] = _triton_write
    DEQUANTIZE_BACKENDS["triton"] = _triton_dequantize


@functools.cache
def _triton_imports() -> bool:
    """Whether the installed triton imports (a build for another CUDA may not)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(name: str, device: torch.device) -> str:
    """The backend OscarConfig.backend ``name`` means on ``device``: "auto" is triton on CUDA where triton is
    installed and imports, else torch; other names must be registered (ValueError listing those that are)."""
    if name == "auto":
        return "triton" if device.type == "cuda" and "triton" in ATTENTION_BACKENDS and _triton_imports() else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"backend {name!r} is not available; available: {sorted(ATTENTION_BACKENDS)}")
    return name


def attention_backend(name: str, device: torch.device):
    """``attend(module, query, packed, new_key, new_value, attention_mask, scaling, recent_tokens, softcap=None,
    sinks=None, window=None, order=None)`` of backend ``name`` on ``device`` (see :func:`resolve`); ``order``: int64
    ``[B, >= T]``, the model's position of each stored position (a left-padded prompt stored in its rows' own
    order), or None."""
    return ATTENTION_BACKENDS[resolve(name, device)]


def write_backend(name: str, device: torch.device):
    """The K/V writer ``(key, value, *, bits, key_bits, group_size, k_clip, v_clip, scale_dtype, method, key_center,
    value_center)`` of backend ``name`` on ``device``."""
    return WRITE_BACKENDS[resolve(name, device)]


def dequantize_backend(name: str, device: torch.device):
    """The per-token row reader ``(rows, center, out, *, bits)`` of backend ``name`` on ``device``: dequantize
    ``rows`` (plus ``center``) into ``out``."""
    return DEQUANTIZE_BACKENDS[resolve(name, device)]
