"""Triton dequantize kernel: a per-token INT2/INT4 history back to the model dtype, written in place into the
``sink ‖ history ‖ recent ‖ new`` buffer (:meth:`OscarLayer.materialize`) that attention over a prefill chunk
reads with SDPA.

The pure-torch twin is materialize's default history fill (``quantizer.dequantize``, the center added back, cast
to the buffer's dtype): the kernel computes ``zero + scale·code (+ μ)`` in fp32 with the same roundings (no fused
multiply-add) and rounds to the model dtype to nearest even, so on a GPU its output is bit-identical (under
TRITON_INTERPRET=1, fp32 → bf16 rounds toward zero: up to one bf16 ulp apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import on_device_of

BLOCK_N = 32  # tokens per program


@triton.jit
def _dequantize_kernel(
    codes_ptr, scale_ptr, zero_ptr, center_ptr, out_ptr,
    stride_cb, stride_ch, stride_cn, stride_zb, stride_zh, stride_zn, stride_mu_b, stride_mu_h,
    stride_ob, stride_oh, stride_on,
    n_tokens, H,
    D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, CENTERED: tl.constexpr,
):
    """Grid ``B·H × cdiv(n_tokens, BLOCK_N)``. Byte ``j`` of a token's codes holds channels ``j + i·W`` at bit
    ``i·bits`` (``W = D·bits/8``); its scale and zero are ``[n_tokens, D/GROUP]``."""
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
        scale = tl.load(scale_ptr + meta + (channel // GROUP)[None, :], mask=live, other=0).to(tl.float32)
        zero = tl.load(zero_ptr + meta + (channel // GROUP)[None, :], mask=live, other=0).to(tl.float32)
        x = zero + scale * code
        if CENTERED:
            x += tl.load(center_ptr + b * stride_mu_b + h * stride_mu_h + channel)[None, :]
        if out_ptr.dtype.element_ty != tl.float32:  # (the rounding mode applies to downcasts only)
            x = x.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out + channel[None, :], x, mask=live)


def layer_supports(layer) -> bool:
    """Whether :func:`dequantize_into` serves an initialized OscarLayer (per-token history, on CUDA or the
    interpreter)."""
    return layer.config.key_quantization == "per-token" and (
        layer.device.type == "cuda" or triton.knobs.runtime.interpret
    )


def dequantize_into(layer, side: str, out: torch.Tensor) -> None:
    """:meth:`OscarLayer.materialize`'s history fill on the kernel: the first ``out.shape[2]`` history tokens of
    ``side``, dequantized, written into ``out`` (a ``[B, H, n, D]`` view of the buffer; a per-token layer, see
    :func:`layer_supports`)."""
    n_hist = out.shape[2]
    h = layer.history.read(n_hist)
    codes, scale, zero = h[f"{side}_codes"], h[f"{side}_scale"], h[f"{side}_zero"]
    centered = side in layer.config.centered_sides
    center = layer.center[side] if centered else scale  # (a stand-in pointer, never read)
    batch, heads, _, dim = out.shape
    with on_device_of(out):
        _dequantize_kernel[(batch * heads, triton.cdiv(n_hist, BLOCK_N))](
            codes, scale, zero, center, out,
            *codes.stride()[:3], *scale.stride()[:3], *center.stride()[:2], *out.stride()[:3],
            n_hist, heads,
            D=dim, BITS=layer.config.side_bits[side], GROUP=layer.group_size, BLOCK_N=BLOCK_N, CENTERED=centered,
            num_warps=4, enable_fp_fusion=False,
        )
