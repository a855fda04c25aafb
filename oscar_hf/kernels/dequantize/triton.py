"""Triton dequantize kernel: a per-token INT2/INT4 history back to the model dtype, written in place into the
buffer that attention over a prefill chunk reads with SDPA.

Its twin is :func:`oscar_hf.kernels.dequantize.reference.dequantize_rows`: ``zero + scale·code (+ μ)`` in fp32 with the
same roundings (no fused multiply-add), rounded to the model dtype to nearest even, so on a GPU the output is
bit-identical (under TRITON_INTERPRET=1 fp32 → bf16 rounds toward zero: up to one bf16 ulp apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quantizer import QuantizedRows
from ..packed import PackedKV
from ..triton_utils import IMPLIED_ZERO, meta_values
from ..utils import on_device_of, triton_runs_on

BLOCK_N = 32  # tokens per program


@triton.jit
def _dequantize_kernel(
    codes_ptr, scale_ptr, zero_ptr, center_ptr, out_ptr,
    stride_cb, stride_ch, stride_cn, stride_zb, stride_zh, stride_zn, stride_mu_b, stride_mu_h,
    stride_ob, stride_oh, stride_on,
    n_tokens, H,
    D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, CENTERED: tl.constexpr,
    META: tl.constexpr,
):
    """Grid ``B·H × cdiv(n_tokens, BLOCK_N)``. Byte ``j`` of a token's codes holds channels ``j + i·W`` at bit
    ``i·bits`` (``W = D·bits/8``); its scale and zero are ``[n_tokens, D/GROUP]``, decoded by their format META
    (``meta_values``; IMPLIED_ZERO: no zero, it is ``-scale·(2^bits - 1)/2``)."""
    W: tl.constexpr = D * BITS // 8
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = (n < n_tokens)[:, None]
    byte = tl.arange(0, W)
    packed = tl.load(codes_ptr + b * stride_cb + h * stride_ch + n[:, None] * stride_cn + byte[None, :], mask=live,
                     other=0)
    meta = b * stride_zb + h * stride_zh + n[:, None] * stride_zn
    out = out_ptr + b * stride_ob + h * stride_oh + n[:, None] * stride_on
    for i in tl.static_range(8 // BITS):
        channel = i * W + byte
        code = ((packed >> (i * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        scale = tl.load(scale_ptr + meta + (channel // GROUP)[None, :], mask=live, other=0)
        zero = scale
        if META != IMPLIED_ZERO:
            zero = tl.load(zero_ptr + meta + (channel // GROUP)[None, :], mask=live, other=0)
        scale, zero = meta_values(scale, zero, BITS, META)
        x = zero + scale * code
        if CENTERED:
            x += tl.load(center_ptr + b * stride_mu_b + h * stride_mu_h + channel)[None, :]
        if out_ptr.dtype.element_ty != tl.float32:  # (the rounding mode applies to downcasts only)
            x = x.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out + channel[None, :], x, mask=live)


def supports(packed: PackedKV) -> bool:
    """Whether :func:`fill_history` serves ``packed``: per-token history on CUDA (or the interpreter), its rows on
    both sides served by :func:`supports_rows`."""
    return (packed.per_token_keys and triton_runs_on(packed.device)
            and all(supports_rows(packed.head_dim, bits) for bits in (packed.key_bits, packed.value_bits)))


def supports_rows(dim: int, bits: int) -> bool:
    """Whether :func:`dequantize_rows` serves rows of ``dim`` channels at ``bits``: its bytes per row a power of
    two (one block of ``tl.arange``)."""
    width = dim * bits // 8
    return width > 0 and width & (width - 1) == 0


def dequantize_rows(rows: QuantizedRows, center: torch.Tensor | None, out: torch.Tensor, *, bits: int) -> None:
    """Per-token rows (codes ``[B, H, n, D·bits/8]`` uint8, scale and zero ``[B, H, n, D/group]``) dequantized,
    plus ``center [B, H, 1, D]`` (fp32) where given, written into ``out [B, H, n, D]`` (fp32, fp16 or bf16, any
    strides along its first three dims). Scale and zero share strides (they are allocated alike); a zero of
    ``[..., 0]`` is implied by the scale (``QuantizedRows.implied_zero``)."""
    batch, heads, n, dim = out.shape
    if not n:
        return
    codes, scale, zero = rows
    if not rows.implied_zero and zero.stride() != scale.stride():
        raise ValueError(f"scale and zero must share strides (the kernel reads both with scale's); got "
                         f"{scale.stride()} and {zero.stride()}")
    centered = center is not None
    center = center if centered else scale  # (a stand-in pointer, never read)
    with on_device_of(out):
        _dequantize_kernel[(batch * heads, triton.cdiv(n, BLOCK_N))](
            codes, scale, zero, center, out,
            *codes.stride()[:3], *scale.stride()[:3], *center.stride()[:2], *out.stride()[:3],
            n, heads,
            D=dim, BITS=bits, GROUP=dim // scale.shape[-1], BLOCK_N=BLOCK_N, CENTERED=centered,
            META=rows.meta, num_warps=4, enable_fp_fusion=False,
        )


def fill_history(packed: PackedKV, side: str, out: torch.Tensor) -> None:
    """The first ``out.shape[2]`` history tokens of ``side``, dequantized, written into ``out`` (a ``[B, H, n, D]``
    view of the buffer; see :func:`supports`)."""
    n_hist = out.shape[2]
    _, _, rows, center, bits = packed.side(side)
    dequantize_rows(QuantizedRows(*(t[:, :, :n_hist] for t in rows)), center, out, bits=bits)
