"""Stage 2 of the decode (grid ``B·Hq·q × D/32``): the parts merged by log-sum-exp, the centers' terms added, the
windows' and the history's shares written apart where a V rotation follows."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["total_splits", "hist_from"])
def decode_stage2_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, out_hist_ptr, total_splits, hist_from, q_ptr, stride_qb, stride_qh, stride_qt,
    mu_k_ptr, mu_v_ptr, stride_mu_b, stride_mu_h, HQ, qk_scale, sinks_ptr,
    G_Q: tl.constexpr, Q_LEN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    CENTERED: tl.constexpr, APART: tl.constexpr, PDL: tl.constexpr, HAS_SINKS: tl.constexpr,
    HEAD_MAJOR: tl.constexpr = False,
):
    """Merge the splits of output row ``(b·Hq + head)·Q_LEN + t`` by log-sum-exp over BLOCK_D output channels (grid
    ``B·Hq·Q_LEN × D/BLOCK_D``), BLOCK_S splits per step with an online max (one step for up to 256 splits: each step
    waits on its loads). Rows with no valid key give 0. CENTERED: the history splits (from ``hist_from``) get
    ``q·μ_K`` (q: the rotated query) on their lse, and the output ``μ_V`` times their share of the weight. APART: the
    history splits' share goes to ``out_hist`` and the windows' to ``out`` (both over the whole weight). HAS_SINKS:
    the head's learned sink logit (``sinks [Hq]``, natural units) is one more term of the merge, with no value.
    HEAD_MAJOR: both outputs ``[H, B, G_Q, Q_LEN, D]`` (KV head first, for a per-head R_V's batched GEMM), else
    ``[B, Hq, Q_LEN, D]``."""
    row = tl.program_id(0).to(tl.int64)
    out_row = row
    if HEAD_MAJOR:
        batch = tl.num_programs(0) // (HQ * Q_LEN)
        q_head = row // Q_LEN % HQ
        out_row = ((q_head // G_Q * batch + row // Q_LEN // HQ) * G_Q + q_head % G_Q) * Q_LEN + row % Q_LEN
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    if CENTERED:  # independent of stage 1: done before waiting on it
        head = row // Q_LEN % HQ
        b = row // Q_LEN // HQ
        chans = tl.arange(0, D)
        mu_off = b * stride_mu_b + head // G_Q * stride_mu_h
        q = tl.load(q_ptr + b * stride_qb + head * stride_qh + row % Q_LEN * stride_qt + chans).to(tl.float32)
        q_mu = tl.sum(q * tl.load(mu_k_ptr + mu_off + chans), axis=0) * qk_scale
        mu_v = tl.load(mu_v_ptr + mu_off + cols)
    if PDL:  # launched early: wait until stage 1 has finished and its writes are visible. The next kernel launches
        # once this one has exited, onto idle SMs (let early, its programs would be in a one-wave stage 1's way)
        tl.extra.cuda.gdc_wait()
    m = -1.0e30  # finite: a step of empty splits leaves alpha = 1 and w = 0
    den = 0.0
    if HAS_SINKS:  # the sink's term: weight 1 at the running max it starts
        m = tl.load(sinks_ptr + row // Q_LEN % HQ).to(tl.float32) * 1.4426950408889634
        den = 1.0
    hist_den = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    hist_acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, total_splits, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        live = s < total_splits
        in_hist = s >= hist_from
        lse = tl.load(part_lse_ptr + row * total_splits + s, mask=live, other=float("-inf"))
        if CENTERED:
            lse = tl.where(in_hist, lse + q_mu, lse)
        o = tl.load(part_o_ptr + (row * total_splits + s)[:, None] * D + cols[None, :], mask=live[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        den = den * alpha + tl.sum(w, axis=0)
        if CENTERED:
            hist_den = hist_den * alpha + tl.sum(tl.where(in_hist, w, 0.0), axis=0)
        if APART:
            acc = acc * alpha + tl.sum(tl.where(in_hist, 0.0, w)[:, None] * o, axis=0)
            hist_acc = hist_acc * alpha + tl.sum(tl.where(in_hist, w, 0.0)[:, None] * o, axis=0)
        else:
            acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    if CENTERED:
        if APART:
            hist_acc += hist_den * mu_v
        else:
            acc += hist_den * mu_v
    inv_den = 1.0 / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + out_row * D + cols, (acc * inv_den).to(out_ptr.dtype.element_ty))
    if APART:
        tl.store(out_hist_ptr + out_row * D + cols, (hist_acc * inv_den).to(out_hist_ptr.dtype.element_ty))
