"""Triton write kernel: clip, center, quantize and pack K and V rows in one launch, bit for bit equal to
:func:`oscar_hf.kernels.write.reference.quantize_kv` (uniform, symmetric and compact quantizers, per token).

The clip threshold ``τ = sort(|x|)[floor(c·D)]`` is found exactly on the int32 bit patterns of ``|x|`` (largest values
taken in turn where few lie above τ, else bisection), so ties give the sort's τ; each group's zero is its minimum
rounded down and its scale ``(max - zero) / levels`` rounded up to the scale dtype (IEEE division), codes
``floor((x - zero) / scale + 0.5)``. Non-finite input or a scale overflow sets a flag word that the launcher reads back
(one 4-byte copy) and raises as the torch writer does. Design notes: ``docs/kernels/write.md``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...quantizer import QuantizedRows, grid_for, quantize
from ..flags import KEY_SHIFT, VALUE_SHIFT, raise_for_flags
from ..triton_utils import TL_DTYPES, kernel_clip_index, quantize_tile, scale_floor, store_rows
from ..utils import on_device_of, triton_runs_on
from .reference import check_center, quantize_kv

K_FLAGS = tl.constexpr(KEY_SHIFT)  # where each side's error bits go in the flag word
V_FLAGS = tl.constexpr(VALUE_SHIFT)

@triton.jit
def _quantize_block(
    x_ptr, stride_p, stride_n, n_per_p, rows, mu_ptr,
    codes_ptr, scale_ptr, zero_ptr, flag_ptr, tiny,
    FLAG_SHIFT: tl.constexpr, CLIP_INDEX: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    BITS: tl.constexpr, BLOCK_R: tl.constexpr, SCALE_DT: tl.constexpr, CENTERED: tl.constexpr,
    META: tl.constexpr,
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
    packed, scales, zeros, flag = quantize_tile(xs, tiny, CLIP_INDEX, GROUP, BITS, SCALE_DT, META)
    flags = flag << FLAG_SHIFT
    tl.atomic_or(flag_ptr, flags, mask=flags != 0)
    store_rows(codes_ptr, scale_ptr, zero_ptr, r.to(tl.int64), W, D // GROUP, live, packed, scales, zeros, META)


@triton.jit(do_not_specialize=["k_stride_p", "v_stride_p", "n_per_p", "rows"])  # lengths vary: compile once
def _quantize_kv_kernel(
    k_ptr, k_stride_p, k_stride_n, v_ptr, v_stride_p, v_stride_n, n_per_p, rows, k_mu_ptr, v_mu_ptr,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, flag_ptr, tiny,
    K_CLIP_INDEX: tl.constexpr, V_CLIP_INDEX: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, BLOCK_R: tl.constexpr, SCALE_DT: tl.constexpr,
    K_CENTERED: tl.constexpr, V_CENTERED: tl.constexpr, META: tl.constexpr,
):
    # grid (row blocks, sides): side 0 quantizes K, side 1 V, each into its own codes, scales and zeros
    if tl.program_id(1) == 0:
        _quantize_block(k_ptr, k_stride_p, k_stride_n, n_per_p, rows, k_mu_ptr, kc_ptr, ks_ptr, kz_ptr, flag_ptr,
                        tiny, K_FLAGS, K_CLIP_INDEX, D, GROUP, K_BITS, BLOCK_R, SCALE_DT, K_CENTERED, META)
    else:
        _quantize_block(v_ptr, v_stride_p, v_stride_n, n_per_p, rows, v_mu_ptr, vc_ptr, vs_ptr, vz_ptr, flag_ptr,
                        tiny, V_FLAGS, V_CLIP_INDEX, D, GROUP, V_BITS, BLOCK_R, SCALE_DT, V_CENTERED, META)


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x [..., n, D]`` as ``[P, n, D]`` with unit stride on D (a view when the leading dims collapse)."""
    x3 = x.reshape(math.prod(x.shape[:-2]), *x.shape[-2:]) if x.dim() >= 2 else x.reshape(1, 1, -1)
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def supports(x: torch.Tensor, group: int, method: str, *bits: int) -> bool:
    """Whether the kernel handles these rows, group size and quantizer at each of ``bits`` (else the oracle runs):
    the uniform, symmetric or compact quantizer, power-of-two D and group, a group spanning whole channel sub-tiles
    (``group >= D·bits/8``), on CUDA (or anywhere under TRITON_INTERPRET=1)."""
    d = x.shape[-1]
    return (grid_for(method).triton and d >= 8 and d & (d - 1) == 0 and d * max(bits) // 8 <= group <= d
            and group & (group - 1) == 0 and triton_runs_on(x.device))


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

    Returns ``(QuantizedRows for key, QuantizedRows for value)``: codes uint8 ``[..., D·bits/8]``, scale and zero
    ``[..., D/group]`` as the quantizer stores them (``Grid.meta_dtypes``), equal to the torch writer
    (``reference.quantize_kv``: ``quantizer.quantize`` of ``x.float() - center``) on each side (the symmetric
    quantizer's zero ``[..., 0]``).
    The Lloyd-Max quantizer and non-power-of-two D fall back to that writer.
    """
    group = group_size or key.shape[-1]
    key_bits = bits if key_bits is None else key_bits
    centers = (key_center, value_center)
    if key.shape != value.shape or not supports(key, group, method, key_bits, bits):
        return quantize_kv(key, value, bits=bits, key_bits=key_bits, group_size=group_size, k_clip=k_clip,
                           v_clip=v_clip, scale_dtype=scale_dtype, method=method, key_center=key_center,
                           value_center=value_center)
    for x, center in zip((key, value), centers):
        check_center(x, center)
    return _launch((key, value), (k_clip, v_clip), (key_bits, bits), group, scale_dtype, method, centers)


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
    if not supports(x, group, method, bits):
        return quantize(x, bits=bits, group_size=group_size, clip=clip, scale_dtype=scale_dtype, method=method)
    return _launch((x,), (clip,), (bits,), group, scale_dtype, method)[0]


def _launch(sides, clips, bits, group, scale_dtype, method, centers=(None,)) -> tuple[QuantizedRows, ...]:
    """One launch over 1 or 2 same-shape sides (``bits`` and ``centers``: one per side); raises the oracle's
    ValueErrors from the kernel's flag word."""
    views = [_rows_view(x) for x in sides]
    k3 = views[0]
    d, n, rows = k3.shape[2], k3.shape[1], k3.shape[0] * k3.shape[1]
    ng, device, grid = d // group, k3.device, grid_for(method)
    scale_dt, zero_dt = grid.meta_dtypes(scale_dtype)
    outs = [QuantizedRows(torch.empty(rows, d * b // 8, dtype=torch.uint8, device=device),
                          torch.empty(rows, ng, dtype=scale_dt, device=device),
                          torch.empty(rows, ng * grid.stores_zero, dtype=zero_dt, device=device)) for b in bits]
    if rows:
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        clip_indices = [kernel_clip_index(c, d) for c in clips]
        v3, vo = views[-1], outs[-1]
        mus = [k3.new_empty(1, dtype=torch.float32) if c is None else c.reshape(-1, d).contiguous() for c in centers]
        block_r = max(1, 1024 // d)  # rows per one-warp program (docs/kernels/write.md)
        with on_device_of(k3):
            _quantize_kv_kernel[(triton.cdiv(rows, block_r), len(sides))](
                k3, k3.stride(0), k3.stride(1), v3, v3.stride(0), v3.stride(1), n, rows, mus[0], mus[-1],
                *outs[0], *vo, flag, scale_floor(scale_dt),
                K_CLIP_INDEX=clip_indices[0], V_CLIP_INDEX=clip_indices[-1],
                D=d, GROUP=group, K_BITS=bits[0], V_BITS=bits[-1], BLOCK_R=block_r, SCALE_DT=TL_DTYPES[scale_dt],
                K_CENTERED=centers[0] is not None, V_CENTERED=centers[-1] is not None, META=grid.meta,
                num_warps=1,
            )
        raise_for_flags(int(flag.item()), scale_dt)
    lead = sides[0].shape[:-1]
    return tuple(QuantizedRows(*(t.view(*lead, t.shape[-1]) for t in out)) for out in outs)
