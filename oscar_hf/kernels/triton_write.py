"""Triton write kernel: clip, quantize and pack K and V rows in one launch.

The pure-torch twin (and oracle) is :func:`oscar_hf.quantizer.quantize`; the kernel reproduces it
bit for bit (codes, scale and zero) for the uniform quantizer:

* clip threshold ``τ = sort(|x|)[floor(c·D)]``, found exactly on the bit patterns of ``|x|`` (non-negative
  floats order like their int32 bits), so ties give the same ``τ`` as the sort: by taking the largest values in
  turn where few lie above τ (c = 0.96 at D = 128: 6 rounds), else by bisection (31 rounds);
* centering (the cache's ``x - μ``, fp32) on the loaded rows, so that no fp32 copy of them is made;
* per group ``zero = min`` rounded down and ``scale = (max - zero) / levels`` rounded up to the scale
  dtype (IEEE divisions, ``div_rn``), codes ``floor((x - zero) / scale + 0.5)`` clamped to the levels;
* packing: byte ``j`` holds channels ``j, j + D/n, …`` (``n = 8 / bits``) at bit offsets ``0, bits, …``.

Non-finite input (or a scale/zero that overflows the scale dtype) sets a flag word in the kernel;
the launcher reads that word back (one 4-byte device-to-host copy, i.e. one synchronisation per call;
no extra pass over the input) and raises the same ValueError as the oracle.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..quantizer import QuantizedRows, clip_index, quantize
from . import check_center, on_device_of, quantize_kv

FP32_MAX = tl.constexpr(3.4028234663852886e38)
FULL_FLAG = 1 << 16  # set by the append kernel (triton_append.py) when a static cache is full
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def _round_to(x, DT: tl.constexpr, UP: tl.constexpr):
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
def _clip_threshold(xs, CLIP_INDEX: tl.constexpr):
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
def _quantize_tile(xs, tiny, CLIP_INDEX: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
                   SCALE_DT: tl.constexpr):
    """Rows as their ``8/bits`` channel sub-tiles ``xs[i] = x[:, i·W:(i+1)·W]`` (fp32 ``[R, W]``, ``W = D·bits/8``,
    ``GROUP`` a multiple of W) → (packed codes uint8 ``[R, W]``, scales and zeros: tuples of ``D/GROUP`` vectors
    ``[R]`` in SCALE_DT, a flag: 1 if some input is not finite, else 2 if a scale or zero overflows SCALE_DT, else 0).

    Working on sub-tiles keeps every reduction along a row inside one warp and packs without a reshape: byte ``j``
    is ``Σ_i code_i[:, j] << (i·bits)``."""
    NSUB: tl.constexpr = len(xs)
    SUBS_PER_GROUP: tl.constexpr = GROUP // xs[0].shape[1]
    LEVELS: tl.constexpr = (1 << BITS) - 1
    bad = 0
    for i in tl.static_range(NSUB):  # NaN compares False
        bad = bad | tl.max(tl.max(tl.where(tl.abs(xs[i]) <= FP32_MAX, 0, 1), axis=1), axis=0)
    if CLIP_INDEX >= 0:
        tau = _clip_threshold(xs, CLIP_INDEX).to(tl.float32, bitcast=True)[:, None]
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
        zero = _round_to(lo_x, SCALE_DT, False)
        z32 = zero.to(tl.float32)
        step = tl.maximum(tl.math.div_rn(hi_x - z32, tl.full(lo_x.shape, LEVELS, tl.float32)), tiny)
        scale = _round_to(step, SCALE_DT, True)
        s32 = scale.to(tl.float32)
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
def _store_rows(codes_ptr, scale_ptr, zero_ptr, rows, stride_cn, stride_zn, live, packed, scales, zeros):
    """Store ``_quantize_tile``'s output at history rows ``rows`` (int64 ``[R]``; ``live`` masks them)."""
    tl.store(codes_ptr + rows[:, None] * stride_cn + tl.arange(0, packed.shape[1])[None, :], packed,
             mask=live[:, None])
    for g in tl.static_range(len(scales)):
        tl.store(scale_ptr + rows * stride_zn + g, scales[g], mask=live)
        tl.store(zero_ptr + rows * stride_zn + g, zeros[g], mask=live)


@triton.jit
def _quantize_block(
    x_ptr, stride_p, stride_n, n_per_p, rows, mu_ptr,
    codes_ptr, scale_ptr, zero_ptr, flag_ptr, tiny,
    FLAG_SHIFT: tl.constexpr, CLIP_INDEX: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BITS: tl.constexpr, BLOCK_R: tl.constexpr, SCALE_DT: tl.constexpr, CENTERED: tl.constexpr,
):
    """Rows ``r`` of BLOCK_R (row ``r`` at ``x[r // n_per_p, r % n_per_p]``), minus ``μ[r // n_per_p]`` (fp32
    ``[P, D]``) where CENTERED, quantized into codes, scale and zero row ``r``."""
    W: tl.constexpr = D * BITS // 8
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < rows
    p = (r // n_per_p).to(tl.int64)
    src = x_ptr + p * stride_p + (r % n_per_p).to(tl.int64) * stride_n
    xs = ()
    for i in tl.static_range(8 // BITS):
        cols = i * W + tl.arange(0, W)
        x = tl.load(src[:, None] + cols[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        if CENTERED:
            x = tl.where(live[:, None], x - tl.load(mu_ptr + p[:, None] * D + cols[None, :], mask=live[:, None]), 0.0)
        xs = xs + (x,)
    packed, scales, zeros, flag = _quantize_tile(xs, tiny, CLIP_INDEX, GROUP, BITS, SCALE_DT)
    flags = flag << FLAG_SHIFT
    tl.atomic_or(flag_ptr, flags, mask=flags != 0)
    _store_rows(codes_ptr, scale_ptr, zero_ptr, r.to(tl.int64), W, D // GROUP, live, packed, scales, zeros)


@triton.jit(do_not_specialize=["k_stride_p", "v_stride_p", "n_per_p", "rows"])  # lengths vary: compile once
def _quantize_kv_kernel(
    k_ptr, k_stride_p, k_stride_n, v_ptr, v_stride_p, v_stride_n, n_per_p, rows, k_mu_ptr, v_mu_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, flag_ptr, tiny,
    K_CLIP_INDEX: tl.constexpr, V_CLIP_INDEX: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, BLOCK_R: tl.constexpr, SCALE_DT: tl.constexpr,
    K_CENTERED: tl.constexpr, V_CENTERED: tl.constexpr,
):
    # grid (row blocks, sides): side 0 quantizes K, side 1 V, each into its own codes, scales and zeros
    if tl.program_id(1) == 0:
        _quantize_block(k_ptr, k_stride_p, k_stride_n, n_per_p, rows, k_mu_ptr, kc_ptr, ks_ptr, kz_ptr, flag_ptr,
                        tiny, 0, K_CLIP_INDEX, D, GROUP, K_BITS, BLOCK_R, SCALE_DT, K_CENTERED)
    else:
        _quantize_block(v_ptr, v_stride_p, v_stride_n, n_per_p, rows, v_mu_ptr, vc_ptr, vs_ptr, vz_ptr, flag_ptr,
                        tiny, 2, V_CLIP_INDEX, D, GROUP, V_BITS, BLOCK_R, SCALE_DT, V_CENTERED)


def kernel_clip_index(ratio: float, head_dim: int) -> int:
    """The kernels' CLIP_INDEX for a clip ratio: ``quantizer.clip_index``, or -1 (no clipping) for 1.0."""
    return clip_index(ratio, head_dim) if ratio < 1.0 else -1


def raise_for_flags(flags: int, scale_dtype: torch.dtype) -> None:
    """Raise the oracle's ValueError for a flag word (K's bits at 0, V's at 2; bit 0 non-finite input, bit 1 a scale
    or zero overflow; checked K before V) and for ``FULL_FLAG`` (a decode step past a static cache's end)."""
    for side in (0, 2):
        if flags >> side & 1:
            raise ValueError("cannot quantize K/V rows that contain NaN or inf")
        if flags >> side & 2:
            raise ValueError(f"K/V values exceed the range of scale_dtype {scale_dtype}; use scale_dtype='float32'")
    if flags & FULL_FLAG:
        raise ValueError("a decode step found the OscarQuantizedCache full (max_cache_len tokens) and did not store "
                         "its token: build the cache with a larger max_cache_len (prompt + max_new_tokens)")


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n, D]`` as ``[P, n, D]`` with unit stride on D (a view when the leading dims collapse)."""
    x3 = x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:]) if x.dim() >= 2 else x.reshape(1, 1, -1)
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def kernel_supports(x: torch.Tensor, group: int, method: str, *bits: int) -> bool:
    """Whether the kernel handles these rows, group size and quantizer at each of ``bits`` (else the oracle runs):
    the uniform quantizer, power-of-two D and group, a group spanning whole channel sub-tiles (``group >=
    D·bits/8``), on CUDA (or anywhere under TRITON_INTERPRET=1)."""
    d = x.shape[-1]
    return (method == "uniform" and d >= 8 and d & (d - 1) == 0 and d * max(bits) // 8 <= group <= d
            and group & (group - 1) == 0 and (x.is_cuda or triton.knobs.runtime.interpret))


def quantize_pack_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    bits: int = 2,
    key_bits: int | None = None,
    group_size: int | None = None,
    k_clip: float = 1.0,
    v_clip: float = 1.0,
    scale_dtype: torch.dtype = torch.float16,
    method: str = "uniform",
    key_center: torch.Tensor | None = None,
    value_center: torch.Tensor | None = None,
) -> tuple[QuantizedRows, QuantizedRows]:
    """Quantize K (to ``key_bits``, default ``bits``) and V (to ``bits``) rows (``[..., D]``, same shape,
    bf16/fp16/fp32, any leading strides) in one launch, each minus its center where one is given (fp32
    ``[..., 1, D]``, the rows' leading dims: the cache's ``x - μ``, computed in the kernel).

    Returns ``(QuantizedRows for key, QuantizedRows for value)``: codes uint8 ``[..., D·bits/8]``, scale
    and zero ``[..., D/group]`` in ``scale_dtype``, equal to the torch writer (``kernels.quantize_kv``:
    ``quantizer.quantize`` of ``x.float() - center``) on each side. The Lloyd-Max quantizer and non-power-of-two D
    fall back to that writer.
    """
    group = group_size or key.shape[-1]
    key_bits = bits if key_bits is None else key_bits
    centers = (key_center, value_center)
    if key.shape != value.shape or not kernel_supports(key, group, method, key_bits, bits):
        return quantize_kv(key, value, bits=bits, key_bits=key_bits, group_size=group_size, k_clip=k_clip,
                           v_clip=v_clip, scale_dtype=scale_dtype, method=method, key_center=key_center,
                           value_center=value_center)
    for x, center in zip((key, value), centers):
        check_center(x, center)
    return _launch((key, value), (k_clip, v_clip), (key_bits, bits), group, scale_dtype, centers)


def quantize_pack(
    x: torch.Tensor,
    *,
    bits: int = 2,
    group_size: int | None = None,
    clip: float = 1.0,
    scale_dtype: torch.dtype = torch.float16,
    method: str = "uniform",
) -> QuantizedRows:
    """Drop-in for :func:`oscar_hf.quantizer.quantize` (one side, ``x [..., D]``); see :func:`quantize_pack_kv`."""
    group = group_size or x.shape[-1]
    if not kernel_supports(x, group, method, bits):
        return quantize(x, bits=bits, group_size=group_size, clip=clip, scale_dtype=scale_dtype, method=method)
    return _launch((x,), (clip,), (bits,), group, scale_dtype)[0]


def _launch(sides, clips, bits, group, scale_dtype, centers=(None,)) -> tuple[QuantizedRows, ...]:
    """One launch over 1 or 2 same-shape sides (``bits`` and ``centers``: one per side); raises the oracle's
    ValueErrors from the kernel's flag word."""
    views = [_rows_view(x) for x in sides]
    k3 = views[0]
    d, n, rows = k3.shape[2], k3.shape[1], k3.shape[0] * k3.shape[1]
    ng, device = d // group, k3.device
    outs = [QuantizedRows(torch.empty(rows, d * b // 8, dtype=torch.uint8, device=device),
                          torch.empty(rows, ng, dtype=scale_dtype, device=device),
                          torch.empty(rows, ng, dtype=scale_dtype, device=device)) for b in bits]
    if rows:
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        clip_indices = [kernel_clip_index(c, d) for c in clips]
        v3, vo = views[-1], outs[-1]
        mus = [k3.new_empty(1, dtype=torch.float32) if c is None else c.reshape(-1, d).contiguous() for c in centers]
        block_r = max(1, 1024 // d)  # one warp per program: 0.51 ms for 32K tokens x 8 heads x D128 on an H100
        with on_device_of(k3):
            _quantize_kv_kernel[(triton.cdiv(rows, block_r), len(sides))](
                k3, k3.stride(0), k3.stride(1), v3, v3.stride(0), v3.stride(1), n, rows, mus[0], mus[-1],
                *outs[0], *vo, flag, torch.finfo(scale_dtype).tiny,
                K_CLIP_INDEX=clip_indices[0], V_CLIP_INDEX=clip_indices[-1],
                D=d, GROUP=group, K_BITS=bits[0], V_BITS=bits[-1], BLOCK_R=block_r, SCALE_DT=TL_DTYPES[scale_dtype],
                K_CENTERED=centers[0] is not None, V_CENTERED=centers[-1] is not None, num_warps=1,
            )
        raise_for_flags(int(flag.item()), scale_dtype)
    lead = sides[0].shape[:-1]
    return tuple(QuantizedRows(*(t.view(*lead, t.shape[-1]) for t in out)) for out in outs)
