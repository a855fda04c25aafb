"""Triton append kernel: one decode step's K and V into a static layer's PackedKV, with the counts read and advanced
on the device (no host synchronisation). Twin: :func:`oscar_hf.kernels.append.reference.append`.

The token goes, as the model produced it, to the sink while it has room, else to the recent window, a ring buffer of
``limit + 1`` rows starting at ``counts[3]``; when the window holds ``limit`` tokens, its ``flush`` oldest rows are
first rotated (on the tensor cores: fp32 sums, rounded once to the model dtype, to nearest even), centered (the first
rows to reach an empty history set the means), clipped, quantized and packed into the history with the write
kernel's tile (:func:`oscar_hf.kernels.triton_utils.quantize_tile`), and the ring start moves past them: demotion
moves no data, and the new token never lands on a demoted row. Given the step's query, the K program also rotates its
GQA group's query rows (for the decode's history programs). A rotation is ``[D, D]`` (every head's: head stride 0)
or ``[H, D, D]`` (one per KV head): a program reads its head's. K and V each have a program per (batch, head). Every
program reads the counts; the last to arrive (an atomic count in ``flags[1]``, which it resets) writes them advanced,
with the counts it started from in ``counts[4:8]``, so that undoing the step is restoring them. Errors (non-finite
K/V, a scale overflow, a full cache) are or-ed into ``flags[0]`` (:mod:`oscar_hf.kernels.flags`). Design notes:
``docs/kernels/append.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quantizer import QuantizedRows
from ..flags import FULL as FULL_FLAG
from ..flags import KEY_SHIFT, VALUE_SHIFT
from ..packed import PackedKV
from ..triton_utils import (
    TL_DTYPES,
    dot,
    kernel_clip_index,
    prefetch_window,
    quantize_tile,
    scale_floor,
    store_rows,
    to_nearest_even,
)
from ..utils import has_pdl, on_device_of

FULL = tl.constexpr(FULL_FLAG)
K_FLAGS = tl.constexpr(KEY_SHIFT)
V_FLAGS = tl.constexpr(VALUE_SHIFT)


@triton.jit
def _ring_rows(ring, stride_rn, start, mu, n_hist, r_ptr, CAP: tl.constexpr, FLUSH: tl.constexpr,
               BLOCK_F: tl.constexpr, CENTERED: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
               ROTATE: tl.constexpr, FP32_DOT: tl.constexpr):
    """The FLUSH oldest ring rows of one (batch, head) and side, times ``R [D, D]`` where ROTATE (fp32 sums rounded
    once to the model dtype, as the torch writes), as the write kernel's channel sub-tiles (fp32
    ``[BLOCK_F, D·BITS/8]`` each; rows past FLUSH zero), and their mean where the history is empty and CENTERED
    (the first tokens to reach it set its means; else the stored means, or nothing)."""
    W: tl.constexpr = D * BITS // 8
    r = tl.arange(0, BLOCK_F)
    live = r < FLUSH
    slots = ((start + r) % CAP).to(tl.int64)
    if ROTATE:
        inner = tl.arange(0, D)
        rows = tl.load(ring + slots[:, None] * stride_rn + inner[None, :], mask=live[:, None], other=0.0)
    xs = ()
    centers = ()
    for i in tl.static_range(8 // BITS):
        cols = i * W + tl.arange(0, W)
        if ROTATE:
            rotation = tl.load(r_ptr + inner[:, None] * D + cols[None, :])
            x = dot(rows, rotation, tl.zeros([BLOCK_F, W], tl.float32), FP32_DOT)
            x = to_nearest_even(x, ring.dtype.element_ty).to(tl.float32)
        else:
            x = tl.load(ring + slots[:, None] * stride_rn + cols[None, :], mask=live[:, None],
                        other=0.0).to(tl.float32)
        xs = xs + (x,)
        if CENTERED:
            if n_hist == 0:
                center = tl.sum(x, axis=0) / FLUSH
            else:
                center = tl.load(mu + cols)
            centers = centers + (center,)
    return xs, centers


@triton.jit
def _demote_rows(xs, centers, codes, scale, zero, stride_cn, stride_zn, n_hist, mu, tiny, FLUSH: tl.constexpr,
                 BLOCK_F: tl.constexpr, CENTERED: tl.constexpr, CLIP_INDEX: tl.constexpr, D: tl.constexpr,
                 GROUP: tl.constexpr, BITS: tl.constexpr, SCALE_DT: tl.constexpr, META: tl.constexpr):
    """:func:`_ring_rows`' rows, centered, clipped, quantized and packed into history rows ``n_hist ...`` (the means
    stored where they set them); returns the write kernel's flag (0, 1 non-finite, 2 overflow)."""
    W: tl.constexpr = D * BITS // 8
    r = tl.arange(0, BLOCK_F)
    live = r < FLUSH
    if CENTERED:
        centered = ()
        for i in tl.static_range(len(xs)):
            if n_hist == 0:
                tl.store(mu + i * W + tl.arange(0, W), centers[i])
            centered = centered + (tl.where(live[:, None], xs[i] - centers[i][None, :], 0.0),)
        xs = centered
    packed, scales, zeros, flag = quantize_tile(xs, tiny, CLIP_INDEX, GROUP, BITS, SCALE_DT, META)
    store_rows(codes, scale, zero, (n_hist + r).to(tl.int64), stride_cn, stride_zn, live, packed, scales, zeros,
               META)
    return flag


@triton.jit
def _rotation(r_ptr, D: tl.constexpr, ROTATE: tl.constexpr, CHUNK: tl.constexpr = 64):
    """``R [D, D]`` as blocks of CHUNK rows, loaded at once where all of it fits in shared memory (D <= 128: 32 KB);
    empty without ROTATE or at D = 256 (128 KB), which :func:`_rotate_queries` loads a block at a time."""
    blocks = ()
    if ROTATE and D <= 128:
        cols = tl.arange(0, D)
        for i in tl.static_range(0, D, CHUNK):
            blocks = blocks + (tl.load(r_ptr + (i + tl.arange(0, CHUNK))[:, None] * D + cols[None, :]),)
    return blocks


@triton.jit
def _rotate_queries(q_ptr, stride_qh, q_out, r_ptr, blocks, D: tl.constexpr, G_Q: tl.constexpr,
                    BLOCK_Q: tl.constexpr, FP32_DOT: tl.constexpr, CHUNK: tl.constexpr = 64):
    """A GQA group's ``G_Q`` query rows (at ``q_ptr``, ``stride_qh`` apart) times R_K on the tensor cores (fp32 sums
    of exact products, rounded once), stored contiguous at ``q_out``. ``blocks``: R as :func:`_rotation` loaded it
    ahead (R comes from DRAM: the weights evict it from L2); else (D = 256) CHUNK rows at a time."""
    cols = tl.arange(0, D)
    rows = tl.arange(0, BLOCK_Q)
    is_q = rows < G_Q
    acc = tl.zeros([BLOCK_Q, D], tl.float32)
    for i in tl.static_range(0, D, CHUNK):
        inner = i + tl.arange(0, CHUNK)
        q = tl.load(q_ptr + rows[:, None] * stride_qh + inner[None, :], mask=is_q[:, None], other=0.0)
        if len(blocks) > 0:
            r = blocks[i // CHUNK]
        else:
            r = tl.load(r_ptr + inner[:, None] * D + cols[None, :])
        acc = dot(q, r, acc, FP32_DOT)
    tl.store(q_out + rows[:, None] * D + cols[None, :], to_nearest_even(acc, q_out.dtype.element_ty),
             mask=is_q[:, None])


@triton.jit
def _append_side(
    x_ptr, stride_nb, stride_nh, sink_ptr, stride_sb, stride_sh, stride_sn, ring_ptr, stride_rb, stride_rh, stride_rn,
    codes_ptr, scale_ptr, zero_ptr, stride_cb, stride_ch, stride_cn, stride_zb, stride_zh, stride_zn,
    mu_ptr, stride_mu_b, stride_mu_h, rot_ptr, stride_rot_h, q_ptr, stride_qb, stride_qh, q_out_ptr,
    counts_ptr, flag_ptr, tiny, H, max_len,
    SINK: tl.constexpr, LIMIT: tl.constexpr, CAP: tl.constexpr, FLUSH: tl.constexpr, BLOCK_F: tl.constexpr,
    CENTERED: tl.constexpr, CLIP_INDEX: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
    SCALE_DT: tl.constexpr, ROTATE: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr, G_Q: tl.constexpr,
    BLOCK_Q: tl.constexpr, FLAG_SHIFT: tl.constexpr, META: tl.constexpr,
):
    """One side (K or V) of the token of (batch, head) ``tl.program_id(0)``: stored into the sink or the ring, and,
    where the window is full, the side's FLUSH oldest ring rows demoted (rotated where ROTATE, by the head's
    rotation: ``rot_ptr + h·stride_rot_h``) into its history; the side's flags or-ed into ``flags[0]`` at bit
    FLAG_SHIFT. G_Q > 0 (K): the GQA group's query rows are rotated too."""
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rot_ptr += h * stride_rot_h
    rot = _rotation(rot_ptr, D, ROTATE and G_Q > 0)
    ring = ring_ptr + b * stride_rb + h * stride_rh
    if PDL:
        if (tl.load(counts_ptr) >= SINK) & (tl.load(counts_ptr + 2) == LIMIT):
            prefetch_window((ring,), 0, FLUSH, stride_rn, tl.load(counts_ptr + 3), CAP, BLOCK_F, D)
        tl.extra.cuda.gdc_wait()
    n_sink = tl.load(counts_ptr)
    n_hist = tl.load(counts_ptr + 1)
    n_rec = tl.load(counts_ptr + 2)
    start = tl.load(counts_ptr + 3)
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + b * stride_nb + h * stride_nh + cols)
    if G_Q > 0:  # the GQA group's query rows times R_K (the decode's stage 0)
        _rotate_queries(q_ptr + b * stride_qb + h * G_Q * stride_qh, stride_qh, q_out_ptr + (b * H + h) * G_Q * D,
                        rot_ptr, rot, D, G_Q, BLOCK_Q, FP32_DOT)
    # the counts after this token (as the branches below store it); the last program to arrive writes them, and
    # flags a full cache (the token is then not stored)
    room = n_sink + n_hist + n_rec < max_len
    to_sink = room & (n_sink < SINK)
    to_recent = room & (n_sink >= SINK)
    demoted = tl.where(to_recent & (n_rec == LIMIT), FLUSH, 0)
    arrived = tl.atomic_add(flag_ptr + 1, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:  # the others have read the counts
        tl.store(counts_ptr, n_sink + to_sink.to(tl.int32))
        tl.store(counts_ptr + 1, n_hist + demoted)
        tl.store(counts_ptr + 2, n_rec + to_recent.to(tl.int32) - demoted)
        tl.store(counts_ptr + 3, (start + demoted) % CAP)
        tl.store(counts_ptr + 4, n_sink)  # the counts before this step: undoing it restores them
        tl.store(counts_ptr + 5, n_hist)
        tl.store(counts_ptr + 6, n_rec)
        tl.store(counts_ptr + 7, start)
        tl.store(flag_ptr + 1, 0)
        if not room:
            tl.atomic_or(flag_ptr, FULL)
    if to_sink:
        tl.store(sink_ptr + b * stride_sb + h * stride_sh + n_sink * stride_sn + cols, x)
    elif to_recent:
        if demoted > 0:
            mu = mu_ptr + b * stride_mu_b + h * stride_mu_h
            rows, centers = _ring_rows(ring, stride_rn, start, mu, n_hist, rot_ptr, CAP, FLUSH, BLOCK_F, CENTERED, D,
                                       BITS, ROTATE, FP32_DOT)
            meta = b * stride_zb + h * stride_zh
            flag = _demote_rows(rows, centers, codes_ptr + b * stride_cb + h * stride_ch, scale_ptr + meta,
                                zero_ptr + meta, stride_cn, stride_zn, n_hist, mu, tiny, FLUSH, BLOCK_F, CENTERED,
                                CLIP_INDEX, D, GROUP, BITS, SCALE_DT, META)
            tl.atomic_or(flag_ptr, flag << FLAG_SHIFT, mask=flag != 0)
        # the new token's row is not one of those demoted (the ring has one more row than the window holds)
        tl.store(ring + ((start + n_rec) % CAP).to(tl.int64) * stride_rn + cols, x)


@triton.jit
def _append_token_kernel(
    k_ptr, v_ptr, stride_nb, stride_nh,
    sk_ptr, sv_ptr, stride_sb, stride_sh, stride_sn,
    rk_ptr, rv_ptr, stride_rb, stride_rh, stride_rn,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, stride_kcb, stride_kch, stride_kcn, stride_vcb, stride_vch,
    stride_vcn, stride_zb, stride_zh, stride_zn,
    mu_k_ptr, mu_v_ptr, stride_mu_b, stride_mu_h, rot_k_ptr, rot_v_ptr, stride_rot_kh, stride_rot_vh,
    q_ptr, stride_qb, stride_qh, q_out_ptr,
    counts_ptr, flag_ptr, tiny, H, max_len,
    SINK: tl.constexpr, LIMIT: tl.constexpr, CAP: tl.constexpr, FLUSH: tl.constexpr, BLOCK_F: tl.constexpr,
    CENTERED: tl.constexpr, K_CLIP_INDEX: tl.constexpr, V_CLIP_INDEX: tl.constexpr, D: tl.constexpr,
    GROUP: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, SCALE_DT: tl.constexpr,
    ROTATE_K: tl.constexpr, ROTATE_V: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr,
    G_Q: tl.constexpr, BLOCK_Q: tl.constexpr, META: tl.constexpr,
):
    # grid (B·H, 2): a program per (batch, KV head) and side, K (with the query rows) or V, so that the two sides'
    # demotions run side by side, of 8 warps (the demotion's clip rounds). PDL: launched early, a
    # program loads its (constant) rotation while the kernel before runs, and asks L2 for the ring rows a demotion
    # would take by the counts it finds then (a crop may change them until the wait); then it waits for that
    # kernel's K and V. The kernels after it launch when it exits, as they read what it writes (some before their
    # own wait)
    if tl.program_id(1) == 0:
        _append_side(k_ptr, stride_nb, stride_nh, sk_ptr, stride_sb, stride_sh, stride_sn, rk_ptr, stride_rb,
                     stride_rh, stride_rn, kc_ptr, ks_ptr, kz_ptr, stride_kcb, stride_kch, stride_kcn, stride_zb,
                     stride_zh, stride_zn, mu_k_ptr, stride_mu_b, stride_mu_h, rot_k_ptr, stride_rot_kh, q_ptr,
                     stride_qb, stride_qh,
                     q_out_ptr, counts_ptr, flag_ptr, tiny, H, max_len, SINK, LIMIT, CAP, FLUSH, BLOCK_F, CENTERED,
                     K_CLIP_INDEX, D, GROUP, K_BITS, SCALE_DT, ROTATE_K, FP32_DOT, PDL, G_Q, BLOCK_Q, K_FLAGS,
                     META)
    else:
        _append_side(v_ptr, stride_nb, stride_nh, sv_ptr, stride_sb, stride_sh, stride_sn, rv_ptr, stride_rb,
                     stride_rh, stride_rn, vc_ptr, vs_ptr, vz_ptr, stride_vcb, stride_vch, stride_vcn, stride_zb,
                     stride_zh, stride_zn, mu_v_ptr, stride_mu_b, stride_mu_h, rot_v_ptr, stride_rot_vh, q_ptr,
                     stride_qb, stride_qh,
                     q_out_ptr, counts_ptr, flag_ptr, tiny, H, max_len, SINK, LIMIT, CAP, FLUSH, BLOCK_F, CENTERED,
                     V_CLIP_INDEX, D, GROUP, V_BITS, SCALE_DT, ROTATE_V, FP32_DOT, PDL, 0, BLOCK_Q, V_FLAGS,
                     META)


def head_rotation(rotation: torch.Tensor | None, heads: int, placeholder: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(R, head stride)`` as the kernels take a rotation: ``[D, D]`` is every head's (stride 0), ``[H, D, D]`` one
    per head; row-major. None: ``placeholder`` (never read)."""
    if rotation is None:
        return placeholder, 0
    if rotation.ndim == 3 and rotation.shape[0] != heads:
        raise ValueError(f"a per-head rotation {tuple(rotation.shape)} for {heads} KV heads")
    rotation = rotation.contiguous()
    return rotation, rotation.stride(0) if rotation.ndim == 3 else 0


def _launch(key, value, key_rotation, value_rotation, windows, history, center, counts, flags, max_len, sink_tokens,
            limit, flush, key_bits, value_bits, group, k_clip_index, v_clip_index, query=None) -> torch.Tensor | None:
    """The append kernel over a PackedKV's ``windows``, ``history`` and ``centers`` lists (the operators'
    arguments); with ``query [B, Hq, 1, D]`` (and a ``key_rotation``) it also returns ``query @ key_rotation``,
    contiguous."""
    batch, heads, _, d = key.shape
    key, value = key.contiguous(), value.contiguous()
    sink_k, sink_v, rec_k, rec_v = windows
    kc, ks, kz, vc, vs, vz = history
    meta = QuantizedRows(kc, ks, kz).meta  # how both sides store their scales and zeros
    if meta != QuantizedRows(vc, vs, vz).meta:
        raise ValueError("the append kernel takes K and V rows of one metadata format (scale and zero dtypes alike)")
    mu = (*center, *center[0].stride()[:2]) if center else (key, key, 0, 0)
    q = q_out = key  # placeholders without a query (G_Q = 0: never read)
    if query is not None:
        q = query if query.stride(-1) == 1 else query.contiguous()
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
    group_q = 0 if query is None else q.shape[1] // heads
    (rot_k, stride_rot_k), (rot_v, stride_rot_v) = (head_rotation(r, heads, key) for r in (key_rotation,
                                                                                              value_rotation))
    interpreting = triton.knobs.runtime.interpret
    pdl = not interpreting and has_pdl(key.device)
    with on_device_of(key):
        _append_token_kernel[(batch * heads, 2)](
            key, value, key.stride(0), key.stride(1),
            sink_k, sink_v, *sink_k.stride()[:3],
            rec_k, rec_v, *rec_k.stride()[:3],
            kc, ks, kz, vc, vs, vz, *kc.stride()[:3], *vc.stride()[:3], *ks.stride()[:3],
            *mu, rot_k, rot_v, stride_rot_k, stride_rot_v,
            q, *q.stride()[:2], q_out,
            counts, flags, scale_floor(ks.dtype), heads, max_len,
            SINK=sink_tokens, LIMIT=limit, CAP=rec_k.shape[2], FLUSH=flush,
            BLOCK_F=max(16, triton.next_power_of_2(flush)), CENTERED=bool(center),
            K_CLIP_INDEX=k_clip_index, V_CLIP_INDEX=v_clip_index, D=d, GROUP=group, K_BITS=key_bits, V_BITS=value_bits,
            SCALE_DT=TL_DTYPES[ks.dtype], ROTATE_K=key_rotation is not None, ROTATE_V=value_rotation is not None,
            FP32_DOT=key.dtype == torch.bfloat16 and interpreting, PDL=pdl,
            G_Q=group_q, BLOCK_Q=max(16, triton.next_power_of_2(group_q)), META=meta, num_warps=8,
            launch_pdl=pdl,
        )
    return None if query is None else q_out


MUTATED = ("windows", "history", "center", "counts", "flags")


@torch.library.custom_op("oscar_hf::append_token", mutates_args=MUTATED)
def append_token(
    key: torch.Tensor,
    value: torch.Tensor,
    key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None,
    windows: list[torch.Tensor],
    history: list[torch.Tensor],
    center: list[torch.Tensor],
    counts: torch.Tensor,
    flags: torch.Tensor,
    max_len: int,
    sink_tokens: int,
    limit: int,
    flush: int,
    key_bits: int,
    value_bits: int,
    group: int,
    k_clip_index: int,
    v_clip_index: int,
) -> None:
    """Store one token's K and V ``[B, H, 1, D]`` (the model dtype) into a PackedKV's ``windows``, ``history`` and
    ``centers`` (rows demoted to the history times their rotations ``[D, D]`` or ``[H, D, D]``, the model dtype;
    None: as they are),
    and advance the counts int32
    ``[8]`` (sink, history, recent, ring start; then the same before this step); ``flags`` int32 ``[2]``: the error
    flags and the kernel's arrival count (zero between calls). An operator that torch.compile traces and CUDA graphs
    capture."""
    _launch(key, value, key_rotation, value_rotation, windows, history, center, counts, flags, max_len, sink_tokens,
            limit, flush, key_bits, value_bits, group, k_clip_index, v_clip_index)


@append_token.register_fake
def _(key, value, key_rotation, value_rotation, windows, history, center, counts, flags, max_len, sink_tokens, limit,
      flush, key_bits, value_bits, group, k_clip_index, v_clip_index):
    return None


@torch.library.custom_op("oscar_hf::append_token_rotating_query", mutates_args=MUTATED)
def append_token_rotating_query(
    key: torch.Tensor,
    value: torch.Tensor,
    query: torch.Tensor,
    key_rotation: torch.Tensor,
    value_rotation: torch.Tensor | None,
    windows: list[torch.Tensor],
    history: list[torch.Tensor],
    center: list[torch.Tensor],
    counts: torch.Tensor,
    flags: torch.Tensor,
    max_len: int,
    sink_tokens: int,
    limit: int,
    flush: int,
    key_bits: int,
    value_bits: int,
    group: int,
    k_clip_index: int,
    v_clip_index: int,
) -> torch.Tensor:
    """:func:`append_token`, and the step's query ``[B, Hq, 1, D]`` times ``key_rotation`` (its KV head's),
    returned contiguous: each K program rotates its GQA group's query rows (the decode then runs no stage 0)."""
    return _launch(key, value, key_rotation, value_rotation, windows, history, center, counts, flags, max_len,
                   sink_tokens, limit, flush, key_bits, value_bits, group, k_clip_index, v_clip_index, query=query)


@append_token_rotating_query.register_fake
def _(key, value, query, key_rotation, value_rotation, windows, history, center, counts, flags, max_len, sink_tokens,
      limit, flush, key_bits, value_bits, group, k_clip_index, v_clip_index):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def append(packed: PackedKV, key: torch.Tensor, value: torch.Tensor, *, flags: torch.Tensor, max_len: int,
           sink_tokens: int, limit: int, flush: int, k_clip: float, v_clip: float,
           key_rotation: torch.Tensor | None = None, value_rotation: torch.Tensor | None = None,
           query: torch.Tensor | None = None) -> torch.Tensor | None:
    """Store one token's K and V ``[B, H, 1, D]`` (the model dtype) into ``packed`` (device counts ``[8]``), demoting
    the window's oldest rows, rotated, where it is full, and advance its counts, on the device.

    Args:
        flags: int32 ``[2]``: the error word and the kernel's arrival count (zero between calls).
        max_len: tokens the storage takes in all (a full cache flags ``FULL`` and stores nothing).
        sink_tokens, limit, flush: sink size, most recent-window tokens, tokens demoted at a time.
        k_clip, v_clip: clip ratios of the demoted rows (1.0: none).
        key_rotation, value_rotation: the history's bases ``[D, D]``, or ``[H, D, D]`` one per KV head, in the
            model dtype, or None (identity).
        query: the step's ``[B, Hq, 1, D]``, rotated by ``key_rotation`` (query head ``h·g + r``: KV head ``h``'s) in
            the same kernel where both are given.
    Returns:
        the rotated query (contiguous), or None without a query or a key rotation.
    """
    d = key.shape[-1]
    tail = (packed.windows, packed.history, packed.centers, packed.counts, flags, max_len, sink_tokens, limit, flush,
            packed.key_bits, packed.value_bits, packed.group_size, kernel_clip_index(k_clip, d),
            kernel_clip_index(v_clip, d))
    if query is None or key_rotation is None:
        return torch.ops.oscar_hf.append_token(key, value, key_rotation, value_rotation, *tail)
    return torch.ops.oscar_hf.append_token_rotating_query(key, value, query, key_rotation, value_rotation, *tail)
