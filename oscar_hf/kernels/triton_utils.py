"""Triton helpers shared by the kernels: dots that the interpreter computes exactly, rounding, L2 prefetch, and the
clip-quantize-pack tile of the write and append kernels (its torch twin: ``oscar_hf.quantizer.quantize``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quantizer import BYTE_META as _BYTE_META
from ..quantizer import (
    BYTE_SCALE_MANTISSA_BITS,
    BYTE_SCALE_MIN_EXPONENT,
    ZERO_EIGHTHS,
    ZERO_LIMIT,
    clip_index,
)
from ..quantizer import IMPLIED_ZERO as _IMPLIED_ZERO

FP32_MAX = tl.constexpr(3.4028234663852886e38)
# the metadata formats (``quantizer.QuantizedRows.meta``), the kernels' META
IMPLIED_ZERO = tl.constexpr(_IMPLIED_ZERO)
BYTE_META = tl.constexpr(_BYTE_META)
_MANTISSA_BITS = tl.constexpr(BYTE_SCALE_MANTISSA_BITS)
_MANTISSA_SHIFT = tl.constexpr(23 - BYTE_SCALE_MANTISSA_BITS)
_MANTISSA_MASK = tl.constexpr((1 << BYTE_SCALE_MANTISSA_BITS) - 1)
_ROUND_UP = tl.constexpr((1 << (23 - BYTE_SCALE_MANTISSA_BITS)) - 1)  # to add, then drop: rounds up
_EXPONENT_BIAS = tl.constexpr(127 + BYTE_SCALE_MIN_EXPONENT)
_MIN_BYTE_SCALE = tl.constexpr(2.0**BYTE_SCALE_MIN_EXPONENT)
_EIGHTH = tl.constexpr(1 / ZERO_EIGHTHS)
_ZERO_LIMIT = tl.constexpr(ZERO_LIMIT)


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.uint8: tl.uint8}


def scale_floor(scale_dtype: torch.dtype) -> float:
    """The least scale the write and append kernels store in ``scale_dtype`` (its ``tiny``; byte scales have their
    own floor)."""
    return 0.0 if scale_dtype == torch.uint8 else torch.finfo(scale_dtype).tiny


@triton.jit
def byte_scale(code):
    """int32 byte-scale codes → fp32 scales, from their bits (``quantizer.decode_byte_scale``)."""
    exponent = (code >> _MANTISSA_BITS) + _EXPONENT_BIAS
    return (exponent << 23 | (code & _MANTISSA_MASK) << _MANTISSA_SHIFT).to(tl.float32, bitcast=True)


@triton.jit
def meta_values(scale, zero, BITS: tl.constexpr, META: tl.constexpr):
    """Stored scales and zeros (any shape; ``zero`` unread where META is IMPLIED_ZERO) → fp32 ``(scale, zero)``,
    exactly as ``quantizer.stored_values`` (and ``QuantizedRows.zeros`` for implied zeros)."""
    if META == BYTE_META:
        s = byte_scale(scale.to(tl.int32))
        z = zero.to(tl.float32) * (s * _EIGHTH)
    elif META == IMPLIED_ZERO:
        s = scale.to(tl.float32)
        z = s * (-((1 << BITS) - 1) / 2)
    else:
        s = scale.to(tl.float32)
        z = zero.to(tl.float32)
    return s, z


@triton.jit
def dot(a, b, acc, FP32_DOT: tl.constexpr):
    # TRITON_INTERPRET multiplies bf16 operands as raw integers: give it fp32 ones (products are exact either way)
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def to_nearest_even(x, DT: tl.constexpr):
    """fp32 ``x`` rounded to ``DT`` (bf16 by hand: TRITON_INTERPRET truncates; NaN stays NaN)."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = tl.where(x == x, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, 0x7FC0)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DT)


@triton.jit
def prefetch_window(bases, lo, hi, stride_n, ring_start, ring_cap, ROWS: tl.constexpr, D: tl.constexpr):
    """Ask L2 for the 128-byte lines of the window rows of tokens ``[lo, hi)`` (at most ROWS) of each tensor in
    ``bases`` (K's and V's): a window chunk's loads are few and dependent, and wait behind the history's stream when
    they go to DRAM."""
    ELEMS: tl.constexpr = 1024 // bases[0].dtype.element_ty.primitive_bitwidth  # elements per line
    n = lo + tl.arange(0, ROWS)
    row = ((ring_start + tl.minimum(n, tl.maximum(hi - 1, lo))) % ring_cap).to(tl.int64) * stride_n
    offs = row[:, None] + tl.arange(0, D // ELEMS)[None, :] * ELEMS
    for i in tl.static_range(len(bases)):
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [bases[i] + offs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def round_to(x, DT: tl.constexpr, UP: tl.constexpr):
    """fp32 ``x`` → ``DT``, rounded up (UP) or down instead of to nearest (any conversion rounding)."""
    y = x.to(DT, fp_downcast_rounding="rtne")
    if DT != tl.float32:
        yf = y.to(tl.float32)
        bits = y.to(tl.int16, bitcast=True)
        if UP:  # toward +inf: positive y gains magnitude, negative y loses it, ±0 → smallest subnormal
            step = tl.where(yf > 0, bits + 1, tl.where(yf == 0, 1, bits - 1)).to(tl.int16)
            y = tl.where(yf < x, step.to(DT, bitcast=True), y)
        else:
            step = tl.where(yf > 0, bits - 1, tl.where(yf == 0, -32767, bits + 1)).to(tl.int16)
            y = tl.where(yf > x, step.to(DT, bitcast=True), y)
    return y


@triton.jit
def clip_threshold(xs, CLIP_INDEX: tl.constexpr):
    """The bits of ``τ = sort(|x|)[CLIP_INDEX]`` per row of the sub-tiles ``xs`` (fp32 ``[R, W]`` each): |x| as int32
    bits, which order like the values. Where few values lie above τ (``ABOVE = D - 1 - CLIP_INDEX < 31``), ABOVE + 1
    rounds each take the row's largest remaining value and its multiplicity until they pass ABOVE values; else
    bisection over the 31 bits (the smallest v with ``#{bits <= v} > CLIP_INDEX``)."""
    NSUB: tl.constexpr = len(xs)
    ABOVE: tl.constexpr = NSUB * xs[0].shape[1] - 1 - CLIP_INDEX
    a = ()
    for i in tl.static_range(NSUB):
        a = a + (tl.abs(xs[i]).to(tl.int32, bitcast=True),)
    if ABOVE < 31:
        taken = tl.zeros([xs[0].shape[0]], tl.int32)  # values above the current maximum
        tau = tl.full([xs[0].shape[0]], -1, tl.int32)
        for _ in tl.static_range(ABOVE + 1):
            top = tl.max(a[0], axis=1)
            for i in tl.static_range(1, NSUB):
                top = tl.maximum(top, tl.max(a[i], axis=1))
            ties = tl.zeros([xs[0].shape[0]], tl.int32)
            rest = ()
            for i in tl.static_range(NSUB):
                tied = a[i] == top[:, None]
                ties += tl.sum(tied.to(tl.int32), axis=1)
                rest = rest + (tl.where(tied, -1, a[i]),)
            a = rest
            tau = tl.where((tau < 0) & (taken + ties > ABOVE), top, tau)
            taken += ties
    else:
        lo = tl.zeros([xs[0].shape[0]], tl.int32)
        tau = tl.full([xs[0].shape[0]], 0x7F800000, tl.int32)
        for _ in range(31):
            mid = lo + ((tau - lo) >> 1)
            below = (a[0] <= mid[:, None]).to(tl.int32)
            for i in tl.static_range(1, NSUB):
                below += (a[i] <= mid[:, None]).to(tl.int32)
            enough = tl.sum(below, axis=1) > CLIP_INDEX
            tau = tl.where(enough, mid, tau)
            lo = tl.where(enough, lo, mid + 1)
    return tau


@triton.jit
def quantize_tile(xs, tiny, CLIP_INDEX: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                   SCALE_DT: tl.constexpr, META: tl.constexpr):
    """Rows as their ``8/bits`` channel sub-tiles ``xs[i] = x[:, i·W:(i+1)·W]`` (fp32 ``[R, W]``, ``W = D·bits/8``,
    ``GROUP`` a multiple of W) → (packed codes uint8 ``[R, W]``, scales and zeros: tuples of ``D/GROUP`` vectors
    ``[R]`` as stored, a flag: 1 if some input is not finite, else 2 if a scale or zero overflows its format, else 0).
    META picks the grid: the uniform one (scale and zero in SCALE_DT), IMPLIED_ZERO (``quantizer.SymmetricGrid``:
    centred on 0, its zeros implied, not stored) or BYTE_META (``quantizer.CompactGrid``: uint8 scales, int8 zeros).

    Working on sub-tiles keeps every reduction along a row inside one warp and packs without a reshape: byte ``j``
    is ``Σ_i code_i[:, j] << (i·bits)``."""
    NSUB: tl.constexpr = len(xs)
    SUBS_PER_GROUP: tl.constexpr = GROUP // xs[0].shape[1]
    LEVELS: tl.constexpr = (1 << BITS) - 1
    bad = 0
    for i in tl.static_range(NSUB):  # NaN compares False
        bad = bad | tl.max(tl.max(tl.where(tl.abs(xs[i]) <= FP32_MAX, 0, 1), axis=1), axis=0)
    if CLIP_INDEX >= 0:
        tau = clip_threshold(xs, CLIP_INDEX).to(tl.float32, bitcast=True)[:, None]
        clipped = ()
        for i in tl.static_range(NSUB):
            clipped = clipped + (tl.minimum(tl.maximum(xs[i], -tau), tau),)
        xs = clipped
    packed = tl.zeros(xs[0].shape, tl.int32)
    scales = ()
    zeros = ()
    overflow = 0
    for g in tl.static_range(NSUB // SUBS_PER_GROUP):
        lo_x = tl.min(xs[g * SUBS_PER_GROUP], axis=1)
        hi_x = tl.max(xs[g * SUBS_PER_GROUP], axis=1)
        for j in tl.static_range(1, SUBS_PER_GROUP):
            lo_x = tl.minimum(lo_x, tl.min(xs[g * SUBS_PER_GROUP + j], axis=1))
            hi_x = tl.maximum(hi_x, tl.max(xs[g * SUBS_PER_GROUP + j], axis=1))
        if META == IMPLIED_ZERO:
            half = tl.maximum(tl.abs(lo_x), tl.abs(hi_x))
            step = tl.maximum(tl.math.div_rn(2 * half, tl.full(lo_x.shape, LEVELS, tl.float32)), tiny)
            scale = round_to(step, SCALE_DT, True)
            s32 = scale.to(tl.float32)
            z32 = s32 * (-LEVELS / 2)
            zero = z32
        elif META == BYTE_META:
            need = tl.maximum(tl.math.div_rn(hi_x - lo_x, tl.full(lo_x.shape, LEVELS, tl.float32)),
                              tl.math.div_rn(tl.abs(lo_x), tl.full(lo_x.shape, _ZERO_LIMIT, tl.float32)))
            bits = tl.maximum(need, _MIN_BYTE_SCALE).to(tl.int32, bitcast=True)
            up = (bits + _ROUND_UP) & ~_ROUND_UP  # rounded up to the kept mantissa bits
            code = ((up >> 23) - _EXPONENT_BIAS) << _MANTISSA_BITS | (up >> _MANTISSA_SHIFT) & _MANTISSA_MASK
            s32, z32 = meta_values(code, _zero_eighths(lo_x, byte_scale(code)), BITS, META)
            code += (z32 + LEVELS * s32 < hi_x).to(tl.int32)  # the top level short of the maximum: the next byte up
            eighths = _zero_eighths(lo_x, byte_scale(code))
            s32, z32 = meta_values(code, eighths, BITS, META)
            overflow = overflow | tl.max(tl.where(code > 255, 2, 0), axis=0)
            scale = code.to(tl.uint8)
            zero = eighths.to(tl.int8)
        else:
            zero = round_to(lo_x, SCALE_DT, False)
            z32 = zero.to(tl.float32)
            step = tl.maximum(tl.math.div_rn(hi_x - z32, tl.full(lo_x.shape, LEVELS, tl.float32)), tiny)
            scale = round_to(step, SCALE_DT, True)
            s32 = scale.to(tl.float32)
        if META != BYTE_META:
            overflow = overflow | tl.max(tl.where((tl.abs(z32) <= FP32_MAX) & (s32 <= FP32_MAX), 0, 2), axis=0)
        for j in tl.static_range(SUBS_PER_GROUP):  # (a name bound to the index would stop being constexpr)
            x = xs[g * SUBS_PER_GROUP + j]
            codes = tl.floor(tl.math.div_rn(x - z32[:, None], tl.broadcast_to(s32[:, None], x.shape)) + 0.5)
            codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS).to(tl.int32)
            packed = packed | (codes << ((g * SUBS_PER_GROUP + j) * BITS))
        scales = scales + (scale,)
        zeros = zeros + (zero,)
    return packed.to(tl.uint8), scales, zeros, tl.where(bad != 0, 1, overflow)


@triton.jit
def _zero_eighths(lo, scale):
    """``floor(8·lo/scale)`` in int8's range, fp32 (``quantizer._zero_eighths``)."""
    return tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(lo * 8, scale)), -128.0), 127.0)


@triton.jit
def store_rows(codes_ptr, scale_ptr, zero_ptr, rows, stride_cn, stride_zn, live, packed, scales, zeros,
               META: tl.constexpr):
    """Store ``quantize_tile``'s output at history rows ``rows`` (int64 ``[R]``; ``live`` masks them); IMPLIED_ZERO
    rows store no zeros."""
    tl.store(codes_ptr + rows[:, None] * stride_cn + tl.arange(0, packed.shape[1])[None, :], packed,
             mask=live[:, None])
    for g in tl.static_range(len(scales)):
        tl.store(scale_ptr + rows * stride_zn + g, scales[g], mask=live)
        if META != IMPLIED_ZERO:
            tl.store(zero_ptr + rows * stride_zn + g, zeros[g], mask=live)


def kernel_clip_index(ratio: float, head_dim: int) -> int:
    """The kernels' CLIP_INDEX for a clip ratio: ``quantizer.clip_index``, or -1 (no clipping) for 1.0."""
    return clip_index(ratio, head_dim) if ratio < 1.0 else -1
