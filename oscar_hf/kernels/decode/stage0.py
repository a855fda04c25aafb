"""Stage 0 of the decode: the query rows times R_K on the tensor cores (its twin:
:func:`oscar_hf.kernels.append.reference.rotate_queries`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import dot, to_nearest_even
from ..utils import on_device_of


@triton.jit
def _rotate_query_kernel(
    q_ptr, stride_qb, stride_qh, stride_qt, r_ptr, stride_rh, out_ptr, rows, blocks, HEADS, HQ, Q_LEN,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Stage 0 (grid ``parts · blocks × D / BLOCK_C``): query rows ``b·Hq·q + head·q + t`` times columns of ``R [D,
    D]`` on the tensor cores (fp32 sums, rounded once), into a contiguous ``[B, Hq, q, D]``. The rows are ``parts``
    consecutive parts of ``rows`` rows, each of ``blocks`` blocks of BLOCK_R rows; part ``i`` takes the rotation at
    ``r_ptr + (i % HEADS)·stride_rh``: one part per (batch, KV head) for per-head rotations (its GQA group's rows),
    one part of every row for a shared one. Launched early, it loads its columns of R (constant; DRAM, as the weights
    evict them from L2) while the kernel that writes q runs."""
    part = tl.program_id(0) // blocks
    inner = tl.arange(0, D)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = tl.load(r_ptr + (part % HEADS).to(tl.int64) * stride_rh + inner[:, None] * D + cols[None, :])
    if PDL:  # wait for q; then stage 1 may launch (stage 2, launched once stage 1 has waited, reads q before waiting)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    local = tl.program_id(0) % blocks * BLOCK_R + tl.arange(0, BLOCK_R)
    live = local < rows
    row = part * rows + local
    q_rows = q_ptr + row // Q_LEN // HQ * stride_qb + row // Q_LEN % HQ * stride_qh + row % Q_LEN * stride_qt
    x = tl.load(q_rows[:, None] + inner[None, :], mask=live[:, None], other=0.0)
    acc = dot(x, r, tl.zeros([BLOCK_R, BLOCK_C], tl.float32), FP32_DOT)
    tl.store(out_ptr + row[:, None].to(tl.int64) * D + cols[None, :], to_nearest_even(acc, out_ptr.dtype.element_ty),
             mask=live[:, None])


def rotate_query(query: torch.Tensor, rotation: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``query [B, Hq, q, D]`` times ``rotation [D, D]``, or per KV head ``[H, D, D]`` (query head ``h·g + r`` takes
    KV head ``h``'s), in the query's dtype, as a contiguous tensor: stage 0 of the decode, whose pure-torch twin is
    :func:`oscar_hf.kernels.append.reference.rotate_queries`. ``pdl``: launched early (sm_90), waiting for the kernel
    before."""
    batch, hq, q_len, d = query.shape
    heads = rotation.shape[0] if rotation.ndim == 3 else 1
    if hq % heads:
        raise ValueError(f"{hq} query heads do not split into the groups of {heads} per-head rotations")
    parts = batch * heads if rotation.ndim == 3 else 1  # a (batch, KV head)'s GQA group, or every row
    rows = batch * hq * q_len // parts
    block_r = min(64, max(16, triton.next_power_of_2(rows)))
    blocks = triton.cdiv(rows, block_r)
    rotation = rotation.to(query.dtype).contiguous()
    out = torch.empty(batch, hq, q_len, d, dtype=query.dtype, device=query.device)
    interpreting = triton.knobs.runtime.interpret
    with on_device_of(query):
        _rotate_query_kernel[(parts * blocks, d // 64)](
            query, *query.stride()[:3], rotation, rotation.stride(0) if rotation.ndim == 3 else 0, out, rows, blocks,
            heads, hq, q_len, D=d, BLOCK_R=block_r, BLOCK_C=64, PDL=pdl,
            FP32_DOT=query.dtype == torch.bfloat16 and interpreting, num_warps=4, launch_pdl=pdl,
        )
    return out
