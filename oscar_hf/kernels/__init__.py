"""Attention and write (quantize) backends over the OSCAR cache, by name. "torch" is the reference (``naive.py``,
``quantizer.py``); "triton" (``triton_decode.py``, ``triton_dequant.py``, ``triton_write.py``,
``triton_append.py``) is registered when triton imports."""

from __future__ import annotations

import contextlib
import functools

import torch

from ..quantizer import QuantizedRows, quantize, quantize_per_channel
from . import naive


def quantize_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    k_clip: float,
    v_clip: float,
    bits: int = 2,
    key_bits: int | None = None,
    key_token_group: int | None = None,
    key_center: torch.Tensor | None = None,
    value_center: torch.Tensor | None = None,
    **kwargs,
) -> tuple[QuantizedRows, QuantizedRows]:
    """The torch writer: ``quantizer.quantize`` on K (``key_bits``, default ``bits``) and on V (``bits``), with
    the same keyword arguments otherwise, each side first minus its center where one is given (fp32 ``[..., 1, D]``
    over the rows' leading dims: ``x.float() - center``).

    With ``key_token_group`` G (per-channel K, which the Triton write kernel does not do), K ``[..., N, D]``
    (N a multiple of G) goes through ``quantizer.quantize_per_channel`` instead, unclipped: OscarConfig
    requires ``k_clip=1.0`` and the uniform quantizer with per-channel K.
    """
    key_bits = bits if key_bits is None else key_bits
    if key_center is not None:
        key = key.float() - check_center(key, key_center)
    if value_center is not None:
        value = value.float() - check_center(value, value_center)
    values = quantize(value, clip=v_clip, bits=bits, **kwargs)
    if key_token_group is None:
        return quantize(key, clip=k_clip, bits=key_bits, **kwargs), values
    keys = quantize_per_channel(key, token_group=key_token_group, bits=key_bits, scale_dtype=kwargs["scale_dtype"])
    return keys, values


def check_center(rows: torch.Tensor, center: torch.Tensor | None) -> torch.Tensor | None:
    """``center``, after checking that it is an fp32 ``[..., 1, D]`` over the leading dims of ``rows [..., n, D]``
    on their device (ValueError naming what differs)."""
    if center is not None and (center.dtype != torch.float32 or center.device != rows.device
                               or center.shape != (*rows.shape[:-2], 1, rows.shape[-1])):
        raise ValueError(f"a writer's center must be float32 of shape {(*rows.shape[:-2], 1, rows.shape[-1])} on "
                         f"{rows.device} for rows of shape {tuple(rows.shape)}; got {center.dtype} "
                         f"{tuple(center.shape)} on {center.device}")
    return center


def on_device_of(t: torch.Tensor):
    """Context for a Triton launch over ``t``: Triton launches on the current CUDA device, and with
    ``device_map="auto"`` a layer's tensors may live on another one."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def has_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch early (programmatic dependent launch: sm_90 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


ATTENTION_BACKENDS = {"torch": naive.attend}
WRITE_BACKENDS = {"torch": quantize_kv}

try:
    import triton  # noqa: F401
except ImportError:
    pass
else:
    # Imported on first use, so that TRITON_INTERPRET set after ``import oscar_hf`` (as the tests do) still applies.
    def _triton_attend(module, query, key, value, attention_mask, scaling):
        from .triton_decode import attend

        return attend(module, query, key, value, attention_mask, scaling)

    def _triton_write(key, value, **kwargs):
        from .triton_write import quantize_pack_kv

        return quantize_pack_kv(key, value, **kwargs)

    ATTENTION_BACKENDS["triton"] = _triton_attend
    WRITE_BACKENDS["triton"] = _triton_write


def _resolve(name: str, device: torch.device, registry: dict) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" and "triton" in registry else "torch"
    if name not in registry:
        raise ValueError(f"backend {name!r} is not available; available: {sorted(registry)}")
    return name


def attention_backend(name: str, device: torch.device):
    """The attention function for OscarConfig.backend ``name`` on ``device`` ("auto": triton on CUDA, else torch)."""
    return ATTENTION_BACKENDS[_resolve(name, device, ATTENTION_BACKENDS)]


def graph_step_supported(layer) -> bool:
    """Whether an initialized static OscarLayer's one-token steps can run as the device-only Triton operators
    (``triton_append.append``, ``triton_decode.decode_on_device``): the Triton backend serves it."""
    if _resolve(layer.config.backend, layer.device, ATTENTION_BACKENDS) != "triton":
        return False
    from . import triton_decode, triton_write

    keys = layer.sink["key"]
    return triton_decode.layer_supports(layer, layer.dtype, layer.device) and triton_write.kernel_supports(
        keys, layer.group_size, layer.config.quantizer, *layer.config.side_bits.values()
    )


def write_backend(name: str, device: torch.device):
    """The K/V writer ``(key, value, *, bits, key_bits, group_size, k_clip, v_clip, scale_dtype, method, key_center,
    value_center)`` for ``name``."""
    return WRITE_BACKENDS[_resolve(name, device, WRITE_BACKENDS)]
