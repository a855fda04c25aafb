"""Quantization of rotated K/V rows: clip, quantize, pack, and back (pure torch).

A row is one token of one KV head, ``x [D]``. It is stored as

* ``codes``: uint8 ``[D * bits / 8]``. With ``n = 8 / bits`` codes per byte, byte ``j`` holds the
  codes of channels ``j, j + D/n, ..., j + (n-1)·D/n`` at bit offsets ``0, bits, ...`` (for INT2:
  channels j, j+D/4, j+D/2, j+3D/4 at bits 0, 2, 4, 6, as in the OSCAR reference);
* ``scale``, ``zero``: ``[D / group_size]`` in the scale dtype, with ``x̂ = zero + scale · code``.
  ``zero`` is the value of code 0 (the group minimum for the uniform quantizer), so a kernel
  computes ``q·x̂ = scale·(q·code) + zero·Σq``.

Per-channel quantization (KIVI's key layout, :func:`quantize_per_channel`) packs the codes of a block
``x [N, D]`` per token exactly as above; only its scale and zero change shape, to
``[N / token_group, D]``: one pair per channel and group of ``token_group`` consecutive tokens.

This module is the oracle for the Triton write kernel (per token).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# Gaussian Lloyd-Max decision thresholds for 4 levels, and the uniform-equivalent step that the
# OSCAR reference uses so that the standard dequantization applies (levels μ ± 0.584σ, μ ± 1.751σ).
LLOYD_MAX_THRESHOLD = 0.98107
LLOYD_MAX_STEP = 2 * 1.50956 / 3 * 1.16


class QuantizedRows(NamedTuple):
    codes: torch.Tensor  # uint8 [..., D * bits / 8]
    scale: torch.Tensor  # scale dtype [..., D / group_size]
    zero: torch.Tensor  # scale dtype [..., D / group_size]


def clip_index(ratio: float, head_dim: int) -> int:
    """Position in the ascending ``|x|`` of a row whose value is the clip threshold."""
    return min(max(math.floor(ratio * head_dim), 0), head_dim - 1)


def clip_rows(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp each row of ``x [..., D]`` to ``±τ``, ``τ = sort(|x|)[floor(ratio·D)]``; ratio 1.0 is a no-op."""
    if ratio >= 1.0:
        return x
    tau = x.abs().kthvalue(clip_index(ratio, x.shape[-1]) + 1, dim=-1, keepdim=True).values
    return torch.clamp(x, -tau, tau)


def _round_to(x: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """Cast fp32 ``x`` to ``dtype``, rounding down (direction -inf) or up (+inf) instead of to nearest."""
    y = x.to(dtype)
    wrong_side = y.float() > x if direction < 0 else y.float() < x
    return torch.where(wrong_side, torch.nextafter(y, torch.full_like(y, direction)), y)


def _check_finite_input(x: torch.Tensor) -> None:
    """Raise ValueError when the K/V rows ``x`` (any shape and float dtype) hold a NaN or an inf."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError("cannot quantize K/V rows that contain NaN or inf")


def _check_finite_range(scale: torch.Tensor, zero: torch.Tensor, scale_dtype: torch.dtype) -> None:
    """Raise ValueError when a scale or zero (in ``scale_dtype``) overflowed to inf."""
    if not bool(torch.isfinite(scale).all() & torch.isfinite(zero).all()):
        raise ValueError(f"K/V values exceed the range of scale_dtype {scale_dtype}; use scale_dtype='float32'")


def _min_max_grid(
    low: torch.Tensor, high: torch.Tensor, levels: int, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min-max grid ``(scale, zero)`` in ``scale_dtype`` from fp32 group minima and maxima (same
    shape): ``zero`` is the minimum rounded down, ``scale = (max - zero) / levels`` rounded up (outward)."""
    zero = _round_to(low, scale_dtype, -math.inf)
    # a tensor divisor: CUDA turns division by a Python scalar into a multiply by its reciprocal
    step = (high - zero.float()) / torch.full_like(high, levels)
    return _round_to(step.clamp_min(torch.finfo(scale_dtype).tiny), scale_dtype, math.inf), zero


def _uniform_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> torch.Tensor:
    """uint8 codes ``clamp(floor((x - zero) / scale + 0.5), 0, levels)`` of fp32 ``x``; scale and zero broadcast."""
    return torch.floor((x - zero.float()) / scale.float() + 0.5).clamp_(0, levels).to(torch.uint8)


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 2,
    group_size: int | None = None,
    clip: float = 1.0,
    scale_dtype: torch.dtype = torch.float16,
    method: str = "uniform",
) -> QuantizedRows:
    """Clip, quantize and pack rows ``x [..., D]`` (any float dtype) per group of ``group_size`` channels.

    The uniform quantizer is asymmetric min-max with round-half-up; its stored scale and zero are
    rounded outward so that every element dequantizes within ``scale / 2`` of its clipped value.
    Raises ValueError on NaN or inf input, or when a scale or zero overflows ``scale_dtype``.
    """
    _check_finite_input(x)
    d = x.shape[-1]
    group = group_size or d
    levels = 2**bits - 1
    xg = clip_rows(x.float(), clip).unflatten(-1, (d // group, group))
    if method == "uniform":
        scale, zero = _min_max_grid(xg.amin(-1), xg.amax(-1), levels, scale_dtype)
    elif method == "lloyd-max":
        if bits != 2:
            raise ValueError("the lloyd-max quantizer has 2-bit levels only")
        mean = xg.mean(-1)
        std = (xg.var(-1, unbiased=False) + 1e-8).sqrt()
        scale = (LLOYD_MAX_STEP * std).to(scale_dtype)
        zero = (mean - 1.5 * scale.float()).to(scale_dtype)
    else:
        raise ValueError(f"unknown quantizer {method!r}; expected 'uniform' or 'lloyd-max'")
    _check_finite_range(scale, zero, scale_dtype)
    if method == "uniform":
        codes = _uniform_codes(xg, scale[..., None], zero[..., None], levels)
    else:
        z = (xg - xg.mean(-1, keepdim=True)) / std[..., None]
        codes = sum((z >= t).float() for t in (-LLOYD_MAX_THRESHOLD, 0.0, LLOYD_MAX_THRESHOLD))
        codes = codes.clamp_(0, levels).to(torch.uint8)
    return QuantizedRows(pack(codes.flatten(-2), bits), scale, zero)


def quantize_per_channel(
    x: torch.Tensor, *, token_group: int, bits: int = 2, scale_dtype: torch.dtype = torch.float16
) -> QuantizedRows:
    """Quantize and pack a block of tokens ``x [..., N, D]`` (any float dtype, ``N`` a multiple of ``token_group``)
    per channel over each group of ``token_group`` consecutive tokens: KIVI's key layout.

    Uniform asymmetric min-max with round-half-up and outward-rounded scale and zero, as :func:`quantize`
    (no clipping), so every element dequantizes within ``scale / 2`` of its value. Returns codes uint8
    ``[..., N, D * bits / 8]`` packed per token as in :func:`quantize`, and scale and zero
    ``[..., N / token_group, D]`` in ``scale_dtype``. Raises ValueError on NaN or inf input, on a scale or
    zero that overflows ``scale_dtype``, or when ``N`` is not a multiple of ``token_group``.
    """
    _check_finite_input(x)
    n = x.shape[-2]
    if n % token_group:
        raise ValueError(f"per-channel quantization takes a multiple of token_group={token_group} tokens; got {n}")
    levels = 2**bits - 1
    xb = x.float().unflatten(-2, (n // token_group, token_group))  # [..., N/G, G, D]
    scale, zero = _min_max_grid(xb.amin(-2), xb.amax(-2), levels, scale_dtype)
    _check_finite_range(scale, zero, scale_dtype)
    codes = _uniform_codes(xb, scale[..., None, :], zero[..., None, :], levels)
    return QuantizedRows(pack(codes.flatten(-3, -2), bits), scale, zero)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (values < 2**bits) → packed uint8 ``[..., D * bits / 8]``."""
    per_byte = 8 // bits
    quarters = codes.unflatten(-1, (per_byte, codes.shape[-1] // per_byte))
    packed = torch.zeros_like(quarters[..., 0, :])
    for k in range(per_byte):
        packed |= quarters[..., k, :] << (k * bits)
    return packed


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed uint8 ``[..., D * bits / 8]`` → uint8 codes ``[..., D]``."""
    shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
    codes = (packed.unsqueeze(-2) >> shifts[:, None]) & (2**bits - 1)
    return codes.flatten(-2)


def _dequantize_along(rows: QuantizedRows, bits: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``x̂ = zero + scale · code`` with one scale and zero per group of consecutive positions along ``dim`` of the
    unpacked codes ``[..., N, D]``: -1 (channel groups, per token) or -2 (token groups, per channel)."""
    codes = unpack(rows.codes, bits).float()
    groups = rows.scale.shape[dim]
    codes = codes.unflatten(dim, (groups, codes.shape[dim] // max(groups, 1)))  # (an empty block has no groups)
    x = rows.zero.float().unsqueeze(dim) + rows.scale.float().unsqueeze(dim) * codes
    return x.flatten(dim - 1, dim).to(dtype)


def dequantize(rows: QuantizedRows, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows from :func:`quantize` (scale and zero ``[..., D / group]``) → ``[..., D]`` in ``dtype``."""
    return _dequantize_along(rows, bits, -1, dtype)


def dequantize_per_channel(rows: QuantizedRows, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A block from :func:`quantize_per_channel` (codes ``[..., N, D·bits/8]``, scale and zero
    ``[..., N / token_group, D]``) → ``[..., N, D]`` in ``dtype``."""
    return _dequantize_along(rows, bits, -2, dtype)
