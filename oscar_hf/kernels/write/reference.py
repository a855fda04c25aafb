"""The torch writer: the write kernel's twin, and the writer wherever the kernel does not run."""

from __future__ import annotations

import torch

from ...quantizer import QuantizedRows, quantize, quantize_per_channel


def check_center(rows: torch.Tensor, center: torch.Tensor | None) -> torch.Tensor | None:
    """``center``, after checking that it is an fp32 ``[..., 1, D]`` over the leading dims of ``rows [..., n, D]``
    on their device (ValueError naming what differs)."""
    if center is not None and (center.dtype != torch.float32 or center.device != rows.device
                               or center.shape != (*rows.shape[:-2], 1, rows.shape[-1])):
        raise ValueError(f"a writer's center must be float32 of shape {(*rows.shape[:-2], 1, rows.shape[-1])} on "
                         f"{rows.device} for rows of shape {tuple(rows.shape)}; got {center.dtype} "
                         f"{tuple(center.shape)} on {center.device}")
    return center


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
    """``quantizer.quantize`` on K (``key_bits``, default ``bits``) and on V (``bits``), with the same keyword
    arguments otherwise (``group_size``, ``scale_dtype``, ``method``), each side first minus its center where one is
    given (fp32 ``[..., 1, D]`` over the rows' leading dims: ``x.float() - center``).

    With ``key_token_group`` G (per-channel K), K ``[..., N, D]`` (N a multiple of G) goes through
    ``quantizer.quantize_per_channel`` instead, unclipped (OscarConfig requires ``k_clip=1.0`` and the uniform
    quantizer there).
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
