"""Quantization of rotated K/V rows: clip, quantize, pack, and back (pure torch).

A row is one token of one KV head, ``x [D]``. It is stored as

* ``codes``: uint8 ``[D * bits / 8]``. With ``n = 8 / bits`` codes per byte, byte ``j`` holds the
  codes of channels ``j, j + D/n, ..., j + (n-1)·D/n`` at bit offsets ``0, bits, ...`` (for INT2:
  channels j, j+D/4, j+D/2, j+3D/4 at bits 0, 2, 4, 6, as in the OSCAR reference);
* ``scale``, ``zero``: ``[D / group_size]`` per group, with ``x̂ = zero + scale · code``.
  ``zero`` is the value of code 0 (the group minimum for the uniform quantizer), so a kernel
  computes ``q·x̂ = scale·(q·code) + zero·Σq``. How a group's pair is stored is its metadata format
  (:attr:`QuantizedRows.meta`, the kernels' ``META``):

  - :data:`FLOAT_META`: scale and zero in the scale dtype (fp16: 32 bits per group);
  - :data:`IMPLIED_ZERO`: the symmetric quantizer's scale alone, zero ``[0]``: its grid is centred on 0,
    ``zero = -scale·(2^bits - 1)/2``, which halves the metadata of rows that are themselves centred (the cache's
    ``x - μ``);
  - :data:`BYTE_META`: the compact quantizer's byte each (16 bits per group): the scale as an unsigned float
    with 5 exponent and 3 mantissa bits (uint8, :func:`decode_byte_scale`), the zero as an int8 count of eighths of
    the scale.

The quantizers (:data:`QUANTIZERS`, by ``OscarConfig.quantizer``) are :class:`Grid` objects.

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


FLOAT_META, IMPLIED_ZERO, BYTE_META = 0, 1, 2  # metadata formats (module docstring)
BYTE_SCALE_MANTISSA_BITS = 3  # a byte scale: 5 exponent bits, 3 mantissa bits, no sign
BYTE_SCALE_MIN_EXPONENT = -18  # byte scales span 2^-18 (code 0) to 1.875·2^13 (code 255)
BYTE_SCALE_MAX = (2 - 2.0**-BYTE_SCALE_MANTISSA_BITS) * 2.0 ** (BYTE_SCALE_MIN_EXPONENT
                                                                 + (255 >> BYTE_SCALE_MANTISSA_BITS))
_MANTISSA_SHIFT = 23 - BYTE_SCALE_MANTISSA_BITS  # of the kept mantissa bits in an fp32
_MANTISSA_MASK = (1 << BYTE_SCALE_MANTISSA_BITS) - 1
ZERO_EIGHTHS = 8  # a byte zero counts eighths of its scale
ZERO_LIMIT = 127 / ZERO_EIGHTHS  # a byte scale covers at least |min| / ZERO_LIMIT, so that the zero fits int8


class QuantizedRows(NamedTuple):
    codes: torch.Tensor  # uint8 [..., D * bits / 8]
    scale: torch.Tensor  # [..., D / group_size]: the scale dtype, or uint8 (BYTE_META)
    zero: torch.Tensor  # [..., D / group_size] like scale (int8 for BYTE_META), or [..., 0] where the grid implies it

    @property
    def implied_zero(self) -> bool:
        """Whether the zero is not stored but implied by the scale (the symmetric quantizer's rows)."""
        return self.zero.shape[-1] == 0 < self.scale.shape[-1]

    @property
    def meta(self) -> int:
        """The metadata format: :data:`BYTE_META` for uint8 scales, :data:`IMPLIED_ZERO` without zeros, else
        :data:`FLOAT_META`."""
        if self.scale.dtype == torch.uint8:
            return BYTE_META
        return IMPLIED_ZERO if self.implied_zero else FLOAT_META

    def scales(self) -> torch.Tensor:
        """Each group's scale, fp32 (exact: the stored value, or a byte scale decoded)."""
        return decode_byte_scale(self.scale) if self.meta == BYTE_META else self.scale.float()

    def zeros(self, bits: int) -> torch.Tensor:
        """The zero of each scale, fp32, shaped like ``scale``: the stored one, ``-scale·(2^bits - 1)/2``, or a byte
        zero's eighths of its scale (exact)."""
        if self.implied_zero:
            return implied_zero(self.scale, bits)
        return stored_values(self.scale, self.zero)[1]


def stored_values(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored scales and zeros (the same shape) → fp32 ``(scale, zero)``, exactly: byte ones decoded (uint8 scales,
    int8 zeros in eighths of them), float ones widened. The kernels' ``meta_values`` does the same."""
    if scale.dtype == torch.uint8:
        s = decode_byte_scale(scale)
        return s, byte_zero(zero, s)
    return scale.float(), zero.float()


def decode_byte_scale(code: torch.Tensor) -> torch.Tensor:
    """uint8 byte scales → fp32: ``(1 + m/8)·2^(e + BYTE_SCALE_MIN_EXPONENT)`` for ``code = e·8 + m``, built
    from its bits (exact; the kernels' ``byte_scale`` does the same)."""
    return _byte_scale_bits(code.to(torch.int32))


def byte_zero(zero: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 byte zeros (eighths of their fp32 ``scale``) → fp32, exact (8 bits times a 4-bit mantissa)."""
    return zero.float() * (scale * (1 / ZERO_EIGHTHS))


def implied_zero(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The symmetric grid's zero, fp32: ``-scale·(2^bits - 1)/2`` (exact in fp32 for fp16 and bf16 scales)."""
    return scale.float() * (-((1 << bits) - 1) / 2)


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


def overflow_message(scale_dtype: torch.dtype) -> str:
    """The error for K/V values past what a stored scale of ``scale_dtype`` (uint8: a byte scale) represents."""
    if scale_dtype == torch.uint8:
        return (f"K/V values exceed the compact quantizer's scale range (steps up to {BYTE_SCALE_MAX:g}); use "
                "quantizer='uniform'")
    return f"K/V values exceed the range of scale_dtype {scale_dtype}; use scale_dtype='float32'"


def _check_finite_range(scale: torch.Tensor, zero: torch.Tensor, scale_dtype: torch.dtype) -> None:
    """Raise ValueError when a scale or zero (in ``scale_dtype``) overflowed to inf."""
    if not bool(torch.isfinite(scale).all() & torch.isfinite(zero).all()):
        raise ValueError(overflow_message(scale_dtype))


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


class Grid:
    """A per-token quantizer: a group's ``(scale, zero)`` from its values, then its codes. ``meta``: how the rows
    store the pair (module docstring); ``triton``: whether the Triton write and append kernels compute it (else the
    torch writer does)."""

    name: str
    meta = FLOAT_META
    triton = True
    bits: tuple[int, ...] = (2, 4)

    @property
    def stores_zero(self) -> bool:
        """Whether the rows keep a zero per scale (else :func:`implied_zero`)."""
        return self.meta != IMPLIED_ZERO

    def meta_dtypes(self, scale_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """The stored dtypes of scale and zero for the config's ``scale_dtype``."""
        return scale_dtype, scale_dtype

    def meta_bits(self, scale_dtype: torch.dtype) -> int:
        """Stored bits per group: its scale and, where stored, its zero."""
        scale, zero = (torch.iinfo(t).bits if t == torch.uint8 or t == torch.int8 else torch.finfo(t).bits
                       for t in self.meta_dtypes(scale_dtype))
        return scale + zero * self.stores_zero

    def fit(self, xg: torch.Tensor, levels: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 groups ``xg [..., G, group]`` → (scale, zero) ``[..., G]`` as stored (:meth:`meta_dtypes`; an
        implied zero as fp32). Raises ValueError where a scale or zero overflows its format."""
        raise NotImplementedError

    def codes(self, xg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> torch.Tensor:
        s, z = stored_values(scale, zero)
        return _uniform_codes(xg, s[..., None], z[..., None], levels)


class UniformGrid(Grid):
    """Asymmetric min-max: ``zero`` the group minimum rounded down, ``scale = (max - zero)/levels`` rounded up, so
    every element dequantizes within ``scale / 2`` of its value."""

    name = "uniform"

    def fit(self, xg, levels, scale_dtype):
        scale, zero = _min_max_grid(xg.amin(-1), xg.amax(-1), levels, scale_dtype)
        _check_finite_range(scale, zero, scale_dtype)
        return scale, zero


class SymmetricGrid(Grid):
    """Symmetric about 0: ``scale = 2·max|x|/levels`` rounded up, levels at ``scale·(code - levels/2)``; no zero is
    stored (``implied_zero``). Every element dequantizes within ``scale / 2`` of its value. For rows centred on 0
    (the cache's ``x - μ``, clipped at ``±τ``) the grid is nearly the min-max one at half the metadata."""

    name = "symmetric"
    meta = IMPLIED_ZERO

    def fit(self, xg, levels, scale_dtype):
        step = (2 * xg.abs().amax(-1)) / torch.full_like(xg[..., 0], levels)
        scale = _round_to(step.clamp_min(torch.finfo(scale_dtype).tiny), scale_dtype, math.inf)
        zero = scale.float() * (-levels / 2)
        _check_finite_range(scale, zero, scale_dtype)
        return scale, zero


class CompactGrid(Grid):
    """The uniform grid with a byte each for scale and zero (:data:`BYTE_META`): half the metadata of fp16's.

    The scale is the smallest byte scale ``s >= max((max - min)/levels, |min|/ZERO_LIMIT)``, the zero
    ``floor(8·min/s)/8·s``: at most ``s/8`` below the minimum, and within int8 whatever the group's offset. Where that
    drop leaves the top level short of the maximum, the scale takes the next byte up (the zero refit). Every element
    then dequantizes within ``s / 2`` of its value. Scales are exact fp32 built from bits, so kernels and twin agree
    bit for bit.
    """

    name = "compact"
    meta = BYTE_META

    def meta_dtypes(self, scale_dtype):
        return torch.uint8, torch.int8

    def fit(self, xg, levels, scale_dtype):
        low, high = xg.amin(-1), xg.amax(-1)
        need = torch.maximum((high - low) / torch.full_like(low, levels), low.abs() / torch.full_like(low, ZERO_LIMIT))
        need = need.clamp_min(2.0**BYTE_SCALE_MIN_EXPONENT)
        up = (need.view(torch.int32) + (1 << _MANTISSA_SHIFT) - 1) & -(1 << _MANTISSA_SHIFT)  # rounded up
        exponent = (up >> 23) - (127 + BYTE_SCALE_MIN_EXPONENT)
        code = exponent << BYTE_SCALE_MANTISSA_BITS | up >> _MANTISSA_SHIFT & _MANTISSA_MASK
        s = _byte_scale_bits(code)
        code = code + (byte_zero(_zero_eighths(low, s), s) + levels * s < high).to(torch.int32)
        if bool((code > 255).any()):
            raise ValueError(overflow_message(torch.uint8))
        return code.to(torch.uint8), _zero_eighths(low, _byte_scale_bits(code)).to(torch.int8)


def _byte_scale_bits(code: torch.Tensor) -> torch.Tensor:
    """int32 byte-scale codes → fp32 scales, from their bits."""
    exponent = (code >> BYTE_SCALE_MANTISSA_BITS) + (127 + BYTE_SCALE_MIN_EXPONENT)
    return (exponent << 23 | (code & _MANTISSA_MASK) << _MANTISSA_SHIFT).view(torch.float32)


def _zero_eighths(low: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``floor(8·low/scale)`` in int8's range, as fp32."""
    return torch.floor(low * ZERO_EIGHTHS / scale).clamp_(-128, 127)


class LloydMaxGrid(Grid):
    """Gaussian Lloyd-Max levels (2 bits), in the uniform dequantization form the OSCAR reference uses."""

    name = "lloyd-max"
    triton = False
    bits = (2,)

    def fit(self, xg, levels, scale_dtype):
        mean = xg.mean(-1)
        scale = (LLOYD_MAX_STEP * _std(xg)).to(scale_dtype)
        zero = (mean - 1.5 * scale.float()).to(scale_dtype)
        _check_finite_range(scale, zero, scale_dtype)
        return scale, zero

    def codes(self, xg, scale, zero, levels):
        z = (xg - xg.mean(-1, keepdim=True)) / _std(xg)[..., None]
        codes = sum((z >= t).float() for t in (-LLOYD_MAX_THRESHOLD, 0.0, LLOYD_MAX_THRESHOLD))
        return codes.clamp_(0, levels).to(torch.uint8)


def _std(xg: torch.Tensor) -> torch.Tensor:
    return (xg.var(-1, unbiased=False) + 1e-8).sqrt()


QUANTIZERS: dict[str, Grid] = {grid.name: grid for grid in (UniformGrid(), SymmetricGrid(), CompactGrid(),
                                                             LloydMaxGrid())}
# the quantizer that wrote rows of each metadata format, as the append path reads it back from the storage
GRID_OF_META = {FLOAT_META: "uniform", IMPLIED_ZERO: "symmetric", BYTE_META: "compact"}


def grid_for(method: str) -> Grid:
    """The quantizer named ``method`` (ValueError naming the known ones)."""
    if method not in QUANTIZERS:
        raise ValueError(f"unknown quantizer {method!r}; expected one of {sorted(QUANTIZERS)}")
    return QUANTIZERS[method]


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 2,
    group_size: int | None = None,
    clip: float = 1.0,
    scale_dtype: torch.dtype = torch.float16,
    method: str = "uniform",
) -> QuantizedRows:
    """Clip, quantize and pack rows ``x [..., D]`` (any float dtype) per group of ``group_size`` channels with the
    quantizer ``method`` (:data:`QUANTIZERS`).

    The uniform, symmetric and compact grids round their stored scale (and zero) outward, so that every element
    dequantizes within ``scale / 2`` of its clipped value; round-half-up. Raises ValueError on NaN or inf input, or
    when a scale or zero overflows its format (``scale_dtype``, or the compact quantizer's byte).
    """
    grid = grid_for(method)
    if bits not in grid.bits:
        raise ValueError(f"the {method} quantizer has {'/'.join(map(str, grid.bits))}-bit levels; got {bits}")
    _check_finite_input(x)
    d = x.shape[-1]
    group = group_size or d
    levels = 2**bits - 1
    xg = clip_rows(x.float(), clip).unflatten(-1, (d // group, group))
    scale, zero = grid.fit(xg, levels, scale_dtype)
    codes = grid.codes(xg, scale, zero, levels)
    stored = zero if grid.stores_zero else scale.new_empty(*scale.shape[:-1], 0)
    return QuantizedRows(pack(codes.flatten(-2), bits), scale, stored)


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
    x = rows.zeros(bits).unsqueeze(dim) + rows.scales().unsqueeze(dim) * codes
    return x.flatten(dim - 1, dim).to(dtype)


def dequantize(rows: QuantizedRows, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows from :func:`quantize` (scale and zero ``[..., D / group]``) → ``[..., D]`` in ``dtype``."""
    return _dequantize_along(rows, bits, -1, dtype)


def dequantize_per_channel(rows: QuantizedRows, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A block from :func:`quantize_per_channel` (codes ``[..., N, D·bits/8]``, scale and zero
    ``[..., N / token_group, D]``) → ``[..., N, D]`` in ``dtype``."""
    return _dequantize_along(rows, bits, -2, dtype)
