"""Stage 1 of the decode (grid ``B·H × splits``): a program attends one KV head's whole GQA group over one part of the
sequence, history parts from packed codes (:func:`_attend_codes`), sink and recent parts from model-dtype rows
(:func:`_window_split`), and writes a normalised partial output and its log-sum-exp."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_utils import IMPLIED_ZERO, dot, meta_values, prefetch_window

# dot dtype, bits of M (a power of two whose mantissa is zero), M, and the mantissa's width
MAGIC = {torch.bfloat16: (tl.bfloat16, 0x4300, 128.0, 7), torch.float16: (tl.float16, 0x6400, 1024.0, 10)}


@triton.jit
def _dot_columns(x, DT: tl.constexpr, FP32_DOT: tl.constexpr):
    """``x [BLOCK_G]`` fp32 laid out as the columns of a dot's accumulator (it passes through a dot of zeros), so that
    the per-tile products of the history loop with it stay in the accumulator's registers instead of going through
    shared memory every tile."""
    acc = dot(tl.zeros([16, 16], DT), tl.zeros([16, x.shape[0]], DT), tl.zeros([16, x.shape[0]], tl.float32)
               + x[None, :], FP32_DOT)
    return tl.max(acc, axis=0)


@triton.jit
def _position(col, P: tl.constexpr, BITS: tl.constexpr, MANTISSA: tl.constexpr, W: tl.constexpr, BYTES: tl.constexpr):
    """``1/f`` of position P (a scalar) and the channel of each element ``col`` of a tile row (module docstring):
    halfwords of a token's ``W``-byte code row or of a pair row (``col >= W/2``: the second token's), or BYTES."""
    NB: tl.constexpr = 8 // BITS
    if BYTES:  # sub-tile P, f = 1
        return 1.0, col + P * W
    return 1.0 / (1 << (P % (MANTISSA // BITS) * BITS)), 2 * (col % (W // 2)) + P // NB + P % NB * W


@triton.jit
def _shifted(x, SHIFT: tl.constexpr, FAST_UNPACK: tl.constexpr):
    """int16 halfwords ``x`` shifted right by SHIFT bits (two per 32-bit shift on the fast path: the bits that
    cross from the neighbour land above the ones :func:`_unpack` keeps)."""
    if FAST_UNPACK:
        shifted = tl.inline_asm_elementwise("shr.b32 $0, $1, $2;", "=r,r,r,r", [x, tl.full(x.shape, SHIFT, tl.int32)],
                                            dtype=tl.int16, is_pure=True, pack=2)
    else:
        shifted = (x >> SHIFT).to(tl.int16)
    return shifted


@triton.jit
def _unpack(x, P: tl.constexpr, BITS: tl.constexpr, MANTISSA: tl.constexpr, DT: tl.constexpr,
            MAGIC_BITS: tl.constexpr, FAST_UNPACK: tl.constexpr, BYTES: tl.constexpr):
    """The codes at position P of a tile ``x`` of code rows as ``DT`` values ``M + code·f`` (M = 128 or 1024).

    Halfwords: ``(x >> shift) & mask | magic`` with the code kept inside the mantissa at bit ``log2 f``; a shift
    serves ``MANTISSA // BITS`` positions (pure inline asm is deduplicated), and one ``lop3`` makes two values.
    BYTES: shift, mask and two byte permutes per 4 codes (``f = 1``)."""
    full = tl.full(x.shape, 0, tl.int32)
    if BYTES:
        if FAST_UNPACK:
            codes = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $2, $3; and.b32 t, t, $7;"
                " prmt.b32 $0, t, $11, 0x5140; prmt.b32 $1, t, $11, 0x7362; }",
                "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                [x, full + P * BITS, full + ((1 << BITS) - 1) * 0x01010101, full + (MAGIC_BITS >> 8) * 0x01010101],
                dtype=tl.int16, is_pure=True, pack=4,
            )
        else:
            codes = (((x.to(tl.int32) >> (P * BITS)) & ((1 << BITS) - 1)) | MAGIC_BITS).to(tl.int16)
    else:
        PER: tl.constexpr = MANTISSA // BITS
        MASK: tl.constexpr = ((1 << BITS) - 1) << (P % PER * BITS)
        if P >= PER:
            x = _shifted(x, P // PER * PER * BITS, FAST_UNPACK)
        if FAST_UNPACK:
            codes = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $4, 0xEA;", "=r,r,r,r,r,r",
                                              [x, full + MASK * 0x10001, full + MAGIC_BITS * 0x10001],
                                              dtype=tl.int16, is_pure=True, pack=2)
        else:
            codes = ((x & MASK) | MAGIC_BITS).to(tl.int16)
    return codes.to(DT, bitcast=True)


@triton.jit
def _softcap(x, cap):
    """``cap · tanh(x / cap)`` (Gemma-2's logit soft-capping) from one exp2; -inf stays -inf."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x) / cap)  # e^(-2|x|/cap)
    t = cap * (1.0 - e) / (1.0 + e)
    return tl.where(x == float("-inf"), x, tl.where(x < 0, -t, t))


@triton.jit
def _online_softmax(logits, m, den):
    """One tile of base-2 logits ``[BLOCK_H, BLOCK_N]`` (masked = -inf) → new m and den, p, and the rescale alpha."""
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(logits - m_new[:, None])
    return m_new, den * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _mask_bytes(mask_row, stride_mt, pos, live, HAS_MASK: tl.constexpr):
    """The attention-mask bytes of key positions ``pos`` (nonzero = attend); all ones without a mask."""
    if HAS_MASK:
        return tl.load(mask_row + pos * stride_mt, mask=live, other=0)
    return tl.full(pos.shape, 1, tl.uint8)


@triton.jit
def _mask_tile(mask_row, stride_mq, stride_mt, pos, live, query, HAS_MASK: tl.constexpr, Q_LEN: tl.constexpr):
    """The mask bytes of key positions ``pos [n]`` for query tokens ``query [c]``, ``[n, c]`` (``[n, 1]``, one
    mask row, when Q_LEN is 1)."""
    if Q_LEN > 1 and HAS_MASK:
        tile = tl.load(mask_row + query[None, :] * stride_mq + pos[:, None] * stride_mt, mask=live[:, None], other=0)
    else:
        tile = _mask_bytes(mask_row, stride_mt, pos, live, HAS_MASK)[:, None]
    return tile


@triton.jit
def _tokens(n, col, HALF: tl.constexpr):
    """Token of each element ``[rows, cols]`` of a pair tile: row ``n`` holds tokens ``2n`` (columns ``col < HALF``)
    and ``2n + 1``."""
    return 2 * n[:, None] + (col >= HALF)[None, :]


@triton.jit
def _column_token(BLOCK_G: tl.constexpr):
    """Which token of a pair row each of a pair tile's ``BLOCK_G`` columns reads: column ``2r + t`` is query row ``r``
    over token ``t`` (a thread's accumulator registers alternate tokens, so which one a register holds is static)."""
    return tl.arange(0, BLOCK_G) % 2


@triton.jit
def _column_tokens(n, BLOCK_G: tl.constexpr):
    """Token of each element ``[rows, BLOCK_G]`` of a pair tile's logits (:func:`_column_token`)."""
    return 2 * n[:, None] + _column_token(BLOCK_G)[None, :]


@triton.jit
def _meta(ks, kz, vs, vz, n, hi, NG: tl.constexpr, MASKED: tl.constexpr, PAIRED: tl.constexpr, BLOCK_G: tl.constexpr,
          K_BITS: tl.constexpr, V_BITS: tl.constexpr, META: tl.constexpr):
    """fp32 K scale, K zero, V scale, V zero of tile rows ``n`` (MASKED: of the tokens below ``hi``), per
    group: a tuple of 4·NG vectors ``[rows]``, or with PAIRED (row ``n`` = tokens ``2n``, ``2n + 1``) ``[rows,
    BLOCK_G]``, the first token's value in the even columns. Each is read as one ``[rows, NG]`` (``2·NG``)
    block of contiguous rows, so that the loop pipeliner streams it through shared memory as it does the codes (no
    register prefetch waiting in the loop), and decoded by its format META (``meta_values``; IMPLIED_ZERO reads no
    zeros)."""
    NGR: tl.constexpr = 2 * NG if PAIRED else NG
    cols = tl.arange(0, NGR)
    offs = n[:, None] * NGR + cols[None, :]
    if MASKED:
        live = _tokens(n, cols, NG) < hi if PAIRED else (n < hi)[:, None]
        k_s = tl.load(ks + offs, mask=live, other=0)
        v_s = tl.load(vs + offs, mask=live, other=0)
        if META != IMPLIED_ZERO:
            k_z = tl.load(kz + offs, mask=live, other=0)
            v_z = tl.load(vz + offs, mask=live, other=0)
    else:
        k_s = tl.load(ks + offs)
        v_s = tl.load(vs + offs)
        if META != IMPLIED_ZERO:
            k_z = tl.load(kz + offs)
            v_z = tl.load(vz + offs)
    if META == IMPLIED_ZERO:
        k_z = k_s
        v_z = v_s
    k_s, k_z = meta_values(k_s, k_z, K_BITS, META)
    v_s, v_z = meta_values(v_s, v_z, V_BITS, META)
    blocks = (k_s, k_z, v_s, v_z)
    second = _column_token(BLOCK_G) == 1
    out = ()
    for g in tl.static_range(NG):
        for i in tl.static_range(4):
            value = tl.sum(tl.where(cols[None, :] == g, blocks[i], 0), axis=1)
            if PAIRED:
                after = tl.sum(tl.where(cols[None, :] == NG + g, blocks[i], 0), axis=1)
                value = tl.where(second[None, :], after[:, None], value[:, None])
            out = out + (value,)
    return out


@triton.jit
def _rows(x, PAIRED: tl.constexpr):
    """A per-row value of :func:`_meta` as a ``[rows, 1 or BLOCK_G]`` operand of the tile's elements."""
    if PAIRED:
        rows = x
    else:
        rows = x[:, None]
    return rows


@triton.jit
def _mask_pairs(mask_row, stride_mq, stride_mt, tokens, pos0, hi, query, HAS_MASK: tl.constexpr):
    """The mask bytes of the tokens ``[rows, c]`` of a pair tile for the query token of each column ``query [c]``;
    ones without a mask."""
    if HAS_MASK:
        return tl.load(mask_row + query[None, :] * stride_mq + (pos0 + tokens) * stride_mt, mask=tokens < hi, other=0)
    return tl.full(tokens.shape, 1, tl.uint8)


@triton.jit
def _tile_codes(kc, vc, n, hi, HW_K: tl.constexpr, HW_V: tl.constexpr, MASKED: tl.constexpr, PAIRED: tl.constexpr):
    """The K code tile ``[rows, HW_K]`` and the V code tile transposed ``[HW_V, rows]`` of tile rows ``n`` (MASKED:
    zeros past token ``hi``; else the tile is whole and nothing is checked)."""
    k_col = tl.arange(0, HW_K)
    v_col = tl.arange(0, HW_V)
    if MASKED:
        if PAIRED:
            kh = tl.load(kc + n[:, None] * HW_K + k_col[None, :], mask=_tokens(n, k_col, HW_K // 2) < hi, other=0)
            vh = tl.load(vc + n[None, :] * HW_V + v_col[:, None],
                         mask=2 * n[None, :] + (v_col >= HW_V // 2)[:, None] < hi, other=0)
        else:
            kh = tl.load(kc + n[:, None] * HW_K + k_col[None, :], mask=(n < hi)[:, None], other=0)
            vh = tl.load(vc + n[None, :] * HW_V + v_col[:, None], mask=(n < hi)[None, :], other=0)
    else:
        kh = tl.load(kc + n[:, None] * HW_K + k_col[None, :])
        vh = tl.load(vc + n[None, :] * HW_V + v_col[:, None])
    return kh, vh


@triton.jit
def _tile_logits(kh, meta, n, hi, mask_here, qts, qsums, q_offs, K_BITS: tl.constexpr, GROUP: tl.constexpr,
                 W_K: tl.constexpr, DT: tl.constexpr, MAGIC_BITS: tl.constexpr, MANTISSA: tl.constexpr,
                 FAST_UNPACK: tl.constexpr, FP32_DOT: tl.constexpr, HAS_MASK: tl.constexpr, MASKED: tl.constexpr,
                 PAIRED: tl.constexpr):
    """The logits ``[rows, BLOCK_G]`` of the K code tile ``kh`` of tile rows ``n``, in raw units (qk_scale goes
    into exp2): ``s·(q·c) + z·Σq`` per group; -inf past token ``hi`` (MASKED) and where the mask bytes
    ``mask_here`` are 0 (HAS_MASK)."""
    ROWS: tl.constexpr = kh.shape[0]
    BLOCK_G: tl.constexpr = qts[0].shape[1]
    BYTES_K: tl.constexpr = W_K < 32 and not PAIRED
    NB_K: tl.constexpr = 8 // K_BITS
    NG: tl.constexpr = W_K * NB_K // GROUP
    logits = tl.zeros([ROWS, BLOCK_G], tl.float32)
    for g in tl.static_range(NG):
        qk = tl.zeros([ROWS, BLOCK_G], tl.float32) + q_offs[g][None, :]
        for P in tl.static_range(len(qts)):
            if P % NB_K * W_K // GROUP == g:
                kq = _unpack(kh, P, K_BITS, MANTISSA, DT, MAGIC_BITS, FAST_UNPACK, BYTES_K)
                qk = dot(kq, qts[P], qk, FP32_DOT)
        logits = qk * _rows(meta[4 * g], PAIRED).to(tl.float32) + (
            _rows(meta[4 * g + 1], PAIRED).to(tl.float32) * qsums[g][None, :] + logits)
    if MASKED:
        inside = _column_tokens(n, BLOCK_G) < hi if PAIRED else (n < hi)[:, None]
        logits = tl.where(inside, logits, float("-inf"))
    if HAS_MASK:  # a tile whose keys are all attended (every tile but those holding padding) skips the masking
        if tl.min(tl.min(mask_here, axis=1), axis=0) == 0:
            logits = tl.where(mask_here != 0, logits, float("-inf"))
    return logits


@triton.jit
def _tile_values(prob, meta, vh, den, pss, pzs, accs, V_BITS: tl.constexpr, GROUP: tl.constexpr,
                 W_V: tl.constexpr, DT: tl.constexpr, MAGIC_BITS: tl.constexpr, MANTISSA: tl.constexpr,
                 FAST_UNPACK: tl.constexpr, FP32_DOT: tl.constexpr, PAIRED: tl.constexpr):
    """Adds a history tile's weights ``prob [rows, BLOCK_G]`` to den, per group Σ p·s and Σ p·(z + c̄·s), and the
    outputs (V codesᵀ · (p·s) per position)."""
    BYTES_V: tl.constexpr = W_V < 32 and not PAIRED
    NB_V: tl.constexpr = 8 // V_BITS
    NG: tl.constexpr = len(pss)
    CENTER: tl.constexpr = ((1 << V_BITS) - 1) / 2
    den += tl.sum(prob, axis=0)
    new_pss = ()
    new_pzs = ()
    ps_groups = ()
    for g in tl.static_range(NG):
        s = _rows(meta[4 * g + 2], PAIRED).to(tl.float32)
        mid = _rows(meta[4 * g + 3], PAIRED).to(tl.float32) + CENTER * s
        ps = (prob * s).to(DT, fp_downcast_rounding="rtne")  # the rounding then weighs |code - CENTER|
        new_pss = new_pss + (pss[g] + tl.sum(ps.to(tl.float32), axis=0),)
        new_pzs = new_pzs + (pzs[g] + tl.sum(prob * mid, axis=0),)
        ps_groups = ps_groups + (ps,)
    new_accs = ()
    for P in tl.static_range(len(accs)):
        vq = _unpack(vh, P, V_BITS, MANTISSA, DT, MAGIC_BITS, FAST_UNPACK, BYTES_V)
        new_accs = new_accs + (dot(vq, ps_groups[P % NB_V * W_V // GROUP], accs[P], FP32_DOT),)
    return den, new_pss, new_pzs, new_accs


@triton.jit
def _rescaled(alpha, den, pss, pzs, accs):
    """The softmax state times ``alpha [BLOCK_G]`` (the running max moved)."""
    new_pss = ()
    new_pzs = ()
    for g in tl.static_range(len(pss)):
        new_pss = new_pss + (pss[g] * alpha,)
        new_pzs = new_pzs + (pzs[g] * alpha,)
    new_accs = ()
    for P in tl.static_range(len(accs)):
        new_accs = new_accs + (accs[P] * alpha[None, :],)
    return den * alpha, new_pss, new_pzs, new_accs


@triton.jit
def _codes_tile(
    state, start, step, hi, pos0, kc, ks, kz, vc, vs, vz, mask_row, stride_mq, stride_mt, qk_scale, query,
    qts, qsums, q_offs, cap, q_mu, SOFTCAP: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    GROUP: tl.constexpr, W_K: tl.constexpr, W_V: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    Q_LEN: tl.constexpr, DT: tl.constexpr,
    MAGIC_BITS: tl.constexpr, MAGIC_VALUE: tl.constexpr, MANTISSA: tl.constexpr, FAST_UNPACK: tl.constexpr,
    FP32_DOT: tl.constexpr, STREAM_META: tl.constexpr, MASKED: tl.constexpr, PAIRED: tl.constexpr,
    META: tl.constexpr,
):
    """One history tile of :func:`_attend_codes` at tokens ``start + [0, BLOCK_N)`` (MASKED: those below ``hi``;
    else all of them), a row per token or, PAIRED, per two (:func:`_attend_codes`). ``state``: m (in raw logit
    units), den, per group Σ p·s and Σ p·(z + c̄·s), the outputs, the prefetched scale/zero of this tile (empty when
    STREAM_META: the loop pipeliner streams them with the codes) and its prefetched mask bytes; returns the next
    state. SOFTCAP: the logits are capped at ``cap`` (raw units), ``q_mu [BLOCK_G]`` (q·μ_K, which stage 2 adds to the
    lse) included in what is capped.

    Lazy rescaling: the running max moves only when a tile's max exceeds it by more than SLACK (so p ≤ 2**SLACK);
    bf16 has the range for that, while fp16's p·s could overflow, so there it moves with every larger max."""
    HW_K: tl.constexpr = qts[0].shape[0]
    BYTES_V: tl.constexpr = W_V < 32 and not PAIRED
    HW_V: tl.constexpr = W_V if PAIRED or BYTES_V else W_V // 2
    BLOCK_G: tl.constexpr = qts[0].shape[1]
    ROWS: tl.constexpr = BLOCK_N // 2 if PAIRED else BLOCK_N
    NB_K: tl.constexpr = 8 // K_BITS
    NG: tl.constexpr = W_K * NB_K // GROUP
    SLACK: tl.constexpr = 8.0 if DT == tl.bfloat16 else 0.0
    m, den, pss, pzs, accs, meta, mask_here = state
    n = start // (BLOCK_N // ROWS) + tl.arange(0, ROWS)  # tile rows: tokens, or token pairs
    n_next = n + step // (BLOCK_N // ROWS)  # the program's next tile
    if STREAM_META:
        meta = _meta(ks, kz, vs, vz, n, hi, NG, MASKED, PAIRED, BLOCK_G, K_BITS, V_BITS, META)
        meta_next = ()
    else:
        meta_next = _meta(ks, kz, vs, vz, n_next, hi, NG, True, PAIRED, BLOCK_G, K_BITS, V_BITS, META)
    if PAIRED:
        mask_next = _mask_pairs(mask_row, stride_mq, stride_mt, _column_tokens(n_next, BLOCK_G), pos0, hi, query,
                                HAS_MASK)
    else:
        mask_next = _mask_tile(mask_row, stride_mq, stride_mt, pos0 + n_next, n_next < hi, query, HAS_MASK, Q_LEN)
    kh, vh = _tile_codes(kc, vc, n, hi, HW_K, HW_V, MASKED, PAIRED)
    logits = _tile_logits(kh, meta, n, hi, mask_here, qts, qsums, q_offs, K_BITS, GROUP, W_K, DT, MAGIC_BITS,
                          MANTISSA, FAST_UNPACK, FP32_DOT, HAS_MASK, MASKED, PAIRED)
    if SOFTCAP:
        logits = _softcap(logits + q_mu[None, :], cap) - q_mu[None, :]
    tile_max = tl.max(logits, axis=0)
    if tl.max(tile_max - m, axis=0) * qk_scale > SLACK:  # rare once the running max has settled
        m_new = tl.maximum(m, tile_max)
        den, pss, pzs, accs = _rescaled(tl.exp2((m - m_new) * qk_scale), den, pss, pzs, accs)
        m = m_new
    prob = tl.exp2(logits * qk_scale - (m * qk_scale)[None, :])  # at most 2**SLACK
    den, pss, pzs, accs = _tile_values(prob, meta, vh, den, pss, pzs, accs, V_BITS, GROUP, W_V, DT, MAGIC_BITS,
                                       MANTISSA, FAST_UNPACK, FP32_DOT, PAIRED)
    return m, den, pss, pzs, accs, meta_next, mask_next


@triton.jit
def _diagonal(x):
    """The blocks ``x[:HW/2, 0::2] + x[HW/2:, 1::2]`` of ``x [HW, G]``: a pair tile's output, each token's half of
    the rows read by its own columns."""
    HW: tl.constexpr = x.shape[0]
    G: tl.constexpr = x.shape[1]
    x = tl.permute(tl.reshape(x, [2, HW // 2, G // 2, 2]), [1, 2, 0, 3])  # [rows, columns, row half, column token]
    first, second = tl.split(x)
    return tl.split(first)[0] + tl.split(second)[1]


@triton.jit
def _attend_codes(
    qps, lo, step, hi, pos0, kc, ks, kz, vc, vs, vz, mask_row, stride_mq, stride_mt,
    qk_scale, query, cap, q_mu, SOFTCAP: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    GROUP: tl.constexpr, W_K: tl.constexpr, W_V: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr,
    Q_LEN: tl.constexpr, DT: tl.constexpr,
    MAGIC_BITS: tl.constexpr, MAGIC_VALUE: tl.constexpr, MANTISSA: tl.constexpr, FAST_UNPACK: tl.constexpr,
    FP32_DOT: tl.constexpr, NUM_STAGES: tl.constexpr, PAIRED: tl.constexpr, META: tl.constexpr,
):
    """History tiles of tokens ``lo + i·step`` onwards, below ``hi`` (``step`` a multiple of ``BLOCK_N``), tokens as the
    MMA rows. ``kc``/``vc``: the codes as contiguous rows of ``HW`` halfwords: a token's ``W/2``, or PAIRED (``W < 32``:
    D = 64 at 2 bits) a pair's ``W``, a row holding tokens ``2n`` and ``2n + 1``; a constant row stride keeps short rows
    aligned for cp.async. ``qps``: q at K's positions, transposed, ``[HW_K, BLOCK_G]`` each (query rows as columns);
    PAIRED, column ``2r + t`` of query row ``r`` reads token ``t``'s halfwords of a pair row (zeros in the others),
    each column a softmax of its own, merged at the end. ``query [BLOCK_G]``: each column's query token, for
    the mask. ``cap``, ``q_mu``, SOFTCAP: :func:`_codes_tile`'s. Returns m, den ``[BLOCK_G]`` and the output at V's
    positions, transposed, ``[HW_V, BLOCK_G]`` each (PAIRED: ``[BLOCK_G/2]`` and ``[HW_V/2, BLOCK_G/2]``).

    The codes of whole tiles are pipelined by Triton (cp.async, ``NUM_STAGES``; the loop names its stages, so loads
    that feed no dot are streamed too), and so are their scales and zeros where a tile's block of them is wide
    enough for cp.async (else they are prefetched by hand one tile ahead, as the mask bytes are: their key positions
    start at a count read on the device, too unaligned for cp.async). The loop-carried register copy of a prefetch
    would wait on its load within the same tile.

    Logits are ``[rows, BLOCK_G]`` = K codes ``[rows, HW_K]`` · qᵀ per position, the output is V codesᵀ
    ``[HW_V, rows]`` · (p·s) per position: both dots run with the tokens on the tensor cores' big dimensions, so
    a GQA group pads to 8 columns (not 16 rows), and one warp owns whole rows of tokens (its reductions over tokens
    stay in the warp).
    """
    HW_K: tl.constexpr = qps[0].shape[0]  # elements per tile row (as in the kernel)
    BYTES_K: tl.constexpr = W_K < 32 and not PAIRED
    BYTES_V: tl.constexpr = W_V < 32 and not PAIRED
    HW_V: tl.constexpr = W_V if PAIRED or BYTES_V else W_V // 2
    BLOCK_G: tl.constexpr = qps[0].shape[1]
    NB_K: tl.constexpr = 8 // K_BITS  # codes per byte
    NB_V: tl.constexpr = 8 // V_BITS
    NP_K: tl.constexpr = len(qps)  # positions (code sub-tiles)
    NP_V: tl.constexpr = NB_V if BYTES_V else 2 * NB_V
    NG: tl.constexpr = W_K * NB_K // GROUP
    CENTER: tl.constexpr = ((1 << V_BITS) - 1) / 2
    # a tile's scale/zero block gives each thread of one warp at least 4 bytes: cp.async can stream it
    STREAM_META: tl.constexpr = BLOCK_N * NG >= 64
    k_col = tl.arange(0, HW_K)
    v_col = tl.arange(0, HW_V)
    # q/f per position (exact: f is a power of two); per group Σq for the zero term, and -M·Σ(q/f) to start the
    # group's logit accumulator, which then holds q·code
    qts = ()
    for P in tl.static_range(NP_K):
        qts = qts + ((qps[P].to(tl.float32) * _position(k_col, P, K_BITS, MANTISSA, W_K, BYTES_K)[0]).to(DT),)
    qsums = ()
    q_offs = ()
    for g in tl.static_range(NG):  # a group's positions are added elementwise, then reduced once
        total = tl.zeros([HW_K, BLOCK_G], tl.float32)
        scaled = tl.zeros([HW_K, BLOCK_G], tl.float32)
        for P in tl.static_range(NP_K):
            if P % NB_K * W_K // GROUP == g:
                total += qps[P].to(tl.float32)
                scaled += qts[P].to(tl.float32)
        qsums = qsums + (_dot_columns(tl.sum(total, axis=0), DT, FP32_DOT),)
        q_offs = q_offs + (-MAGIC_VALUE * tl.sum(scaled, axis=0),)
    pss = ()  # per group: Σ p·s (as rounded for the dots), and Σ p·(z + c̄·s)
    pzs = ()
    for g in tl.static_range(NG):
        pss = pss + (tl.zeros([BLOCK_G], tl.float32),)
        pzs = pzs + (tl.zeros([BLOCK_G], tl.float32),)
    accs = ()
    for P in tl.static_range(NP_V):
        accs = accs + (tl.zeros([HW_V, BLOCK_G], tl.float32),)
    m = tl.full([BLOCK_G], -1.0e30, tl.float32)  # finite: a fully masked tile leaves alpha = 1 and p = 0
    den = tl.zeros([BLOCK_G], tl.float32)
    first = lo // (2 if PAIRED else 1) + tl.arange(0, BLOCK_N // 2 if PAIRED else BLOCK_N)  # the first tile's rows
    meta_next = () if STREAM_META else _meta(ks, kz, vs, vz, first, hi, NG, True, PAIRED, BLOCK_G, K_BITS, V_BITS,
                                             META)
    if PAIRED:
        mask_next = _mask_pairs(mask_row, stride_mq, stride_mt, _column_tokens(first, BLOCK_G), pos0, hi, query,
                                HAS_MASK)
    else:
        mask_next = _mask_tile(mask_row, stride_mq, stride_mt, pos0 + first, first < hi, query, HAS_MASK, Q_LEN)
    state = (m, den, pss, pzs, accs, meta_next, mask_next)
    full = lo + tl.cdiv(tl.maximum(hi // BLOCK_N * BLOCK_N - lo, 0), step) * step  # past the program's whole tiles
    for start in tl.range(lo, full, step, num_stages=NUM_STAGES):  # whole tiles: no bounds checks
        state = _codes_tile(state, start, step, hi, pos0, kc, ks, kz, vc, vs, vz, mask_row, stride_mq, stride_mt,
                            qk_scale, query, qts, qsums, q_offs, cap, q_mu, SOFTCAP, K_BITS, V_BITS, GROUP, W_K,
                            W_V, BLOCK_N,
                            HAS_MASK, Q_LEN, DT, MAGIC_BITS, MAGIC_VALUE, MANTISSA, FAST_UNPACK, FP32_DOT, STREAM_META,
                            False, PAIRED, META)
    for start in tl.range(full, hi, step, num_stages=1):  # the last, partial tile, if it is the program's
        state = _codes_tile(state, start, step, hi, pos0, kc, ks, kz, vc, vs, vz, mask_row, stride_mq, stride_mt,
                            qk_scale, query, qts, qsums, q_offs, cap, q_mu, SOFTCAP, K_BITS, V_BITS, GROUP, W_K,
                            W_V, BLOCK_N,
                            HAS_MASK, Q_LEN, DT, MAGIC_BITS, MAGIC_VALUE, MANTISSA, FAST_UNPACK, FP32_DOT, STREAM_META,
                            True, PAIRED, META)
    m, den, pss, pzs, accs, _, _ = state
    if PAIRED:  # each column's weight in its query row's softmax, whose max is that of the row's two columns
        HALF: tl.constexpr = BLOCK_G // 2
        m_row = tl.max(tl.reshape(m, [HALF, 2]), axis=1)
        weight = tl.exp2((m - tl.reshape(tl.broadcast_to(m_row[:, None], [HALF, 2]), [BLOCK_G])) * qk_scale)
        den = tl.sum(tl.reshape(den * weight, [HALF, 2]), axis=1)
        m = m_row
    out = ()
    for P in tl.static_range(NP_V):  # (acc - M·Σ p·s) / f + Σ p·(z + c̄·s) - c̄·Σ p·s
        inv_f = _position(v_col, P, V_BITS, MANTISSA, W_V, BYTES_V)[0]
        ps_sum = pss[P % NB_V * W_V // GROUP]
        o = ((accs[P] - MAGIC_VALUE * ps_sum[None, :]) * inv_f
             + (pzs[P % NB_V * W_V // GROUP] - CENTER * ps_sum)[None, :])
        if PAIRED:
            o = _diagonal(o * weight[None, :])
        out = out + (o,)
    return m * qk_scale, den, out


@triton.jit
def _attend_dense(
    qs, m, den, accs, lo, hi, pos0, k, v, stride_n, ring_start, ring_cap, mask_row, stride_mq, stride_mt, qk_scale,
    query, last, cap, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, Q_LEN: tl.constexpr, DT: tl.constexpr,
    FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Sink or recent tokens ``[lo, hi)`` in the model dtype, by the same channel sub-tiles; token ``n`` is stored
    in row ``(ring_start + n) % ring_cap`` (the recent window is a ring buffer). ``query [rows]``: each row's query
    token ``t``, which sees key positions up to ``last + t`` (causal among the new tokens). SOFTCAP: logits capped at
    ``cap`` (raw units)."""
    NSUB: tl.constexpr = len(qs)
    W: tl.constexpr = qs[0].shape[1]
    cols = tl.arange(0, W)
    for start in tl.range(lo, hi, BLOCK_N, num_stages=1):  # a few tiles: no pipeline buffers (shared memory)
        n = start + tl.arange(0, BLOCK_N)
        live = n < hi
        row = ((ring_start + n) % ring_cap).to(tl.int64) * stride_n
        logits = tl.zeros([qs[0].shape[0], BLOCK_N], tl.float32)
        for i in tl.static_range(NSUB):
            kt = tl.load(k + row[:, None] + i * W + cols[None, :], mask=live[:, None], other=0.0)
            logits = dot(qs[i], tl.trans(kt), logits, FP32_DOT)
        if SOFTCAP:
            logits = _softcap(logits, cap)
        allowed = tl.trans(live[:, None] & (_mask_tile(mask_row, stride_mq, stride_mt, pos0 + n, live, query,
                                                       HAS_MASK, Q_LEN) != 0))  # [rows or 1, BLOCK_N]
        if Q_LEN > 1:
            allowed = allowed & ((pos0 + n)[None, :] <= (last + query)[:, None])
        m, den, p, alpha = _online_softmax(tl.where(allowed, logits * qk_scale, float("-inf")), m, den)
        p = p.to(DT, fp_downcast_rounding="rtne")
        new_accs = ()
        for i in tl.static_range(NSUB):
            vt = tl.load(v + row[:, None] + i * W + cols[None, :], mask=live[:, None], other=0.0)
            new_accs = new_accs + (dot(p, vt, accs[i] * alpha[:, None], FP32_DOT),)
        accs = new_accs
    return m, den, accs


# Sequence-dependent ints are not specialized (on == 1 / divisibility by 16): each new combination would compile.
@triton.jit(do_not_specialize=["stride_mb", "hist_splits", "sink_splits", "total_splits", "rec_cap"])
def decode_stage1_kernel(
    q_ptr, stride_qb, stride_qh, stride_qt, qr_ptr, stride_qrb, stride_qrh, stride_qrt,
    sk_ptr, sv_ptr, stride_sink_b, stride_sink_h, stride_sink_n,
    rk_ptr, rv_ptr, stride_rec_b, stride_rec_h, stride_rec_n,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    stride_kcb, stride_kch, stride_vcb, stride_vch, stride_zb, stride_zh,
    mask_ptr, stride_mb, stride_mq, stride_mt,
    part_o_ptr, part_lse_ptr,
    counts_ptr, hist_splits, sink_splits, total_splits, rec_cap,
    H, qk_scale, mu_k_ptr, stride_mu_b, stride_mu_h, cap,
    G_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, K_BITS: tl.constexpr,
    V_BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HAS_MASK: tl.constexpr, Q_LEN: tl.constexpr,
    DT: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC_VALUE: tl.constexpr,
    MANTISSA: tl.constexpr, FAST_UNPACK: tl.constexpr, FP32_DOT: tl.constexpr, PDL: tl.constexpr,
    NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, PAIRED: tl.constexpr, WINDOW_TILES: tl.constexpr,
    SOFTCAP: tl.constexpr, CENTERED: tl.constexpr, META: tl.constexpr,
):
    """Query row ``c = r·Q_LEN + t`` of a program is query head ``h·G_Q + r`` at query token ``t``; its partial
    output and lse go to row ``(b·Hq + h·G_Q + r)·Q_LEN + t``. Window programs read q (``q_ptr``), history programs
    q·R_K (``qr_ptr``). SOFTCAP: logits capped at ``cap`` (raw units; the history's with q·μ_K added where
    CENTERED)."""
    W_K: tl.constexpr = D * K_BITS // 8  # bytes per code row
    W_V: tl.constexpr = D * V_BITS // 8
    BYTES_K: tl.constexpr = W_K < 32 and not PAIRED  # rows narrower than one MMA K in halfwords: pairs or bytes
    BYTES_V: tl.constexpr = W_V < 32 and not PAIRED
    HW_K: tl.constexpr = W_K if PAIRED or BYTES_K else W_K // 2  # elements per tile row
    HW_V: tl.constexpr = W_V if PAIRED or BYTES_V else W_V // 2
    W: tl.constexpr = W_V  # the window chunks' channel sub-tiles
    WIN_CHUNK: tl.constexpr = WINDOW_TILES * BLOCK_W
    if PDL:  # launched early: wait for the kernel before; then stage 2 may launch (it waits for this grid, but reads
        # q before that: the kernel that wrote q is then done)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q_head = q_ptr + b * stride_qb + h * G_Q * stride_qh
    mask_row = mask_ptr + b * stride_mb
    n_sink = tl.load(counts_ptr)
    n_hist = tl.load(counts_ptr + 1)
    n_recent = tl.load(counts_ptr + 2)
    win_splits = total_splits - hist_splits
    if split >= win_splits:  # history; query rows as columns: q and the output transposed, per halfword position
        cols = tl.arange(0, BLOCK_G)
        heads = cols // 2 if PAIRED else cols  # PAIRED: two columns per query row, one per token of a pair
        keep = heads < G_Q * Q_LEN
        q_cols = (qr_ptr + b * stride_qrb + h * G_Q * stride_qrh + (heads // Q_LEN) * stride_qrh
                  + (heads % Q_LEN) * stride_qrt)
        k_col = tl.arange(0, HW_K)
        live = keep[None, :]
        if PAIRED:  # block-diagonal: a pair's second token's halfwords for the odd columns, its first's for the even
            live = live & ((k_col >= HW_K // 2)[:, None] == (_column_token(BLOCK_G) == 1)[None, :])
        qps = ()
        q_mu = tl.zeros([BLOCK_G], tl.float32)
        for P in tl.static_range(8 // K_BITS if BYTES_K else 16 // K_BITS):
            ch = _position(k_col, P, K_BITS, MANTISSA, W_K, BYTES_K)[1]
            qps = qps + (tl.load(q_cols[None, :] + ch[:, None], mask=live, other=0.0),)
            if SOFTCAP and CENTERED:  # q·μ_K per column, for the cap
                mu = tl.load(mu_k_ptr + b * stride_mu_b + h * stride_mu_h + ch)
                q_mu += tl.sum(qps[P].to(tl.float32) * mu[:, None], axis=0)
        meta_off = b * stride_zb + h * stride_zh
        m, den, accs = _attend_codes(
            qps, (split - win_splits) * BLOCK_N, hist_splits * BLOCK_N, n_hist, n_sink,
            kc_ptr + b * stride_kcb + h * stride_kch, ks_ptr + meta_off, kz_ptr + meta_off,
            vc_ptr + b * stride_vcb + h * stride_vch, vs_ptr + meta_off, vz_ptr + meta_off,
            mask_row, stride_mq, stride_mt, qk_scale, heads % Q_LEN, cap, q_mu, SOFTCAP, K_BITS, V_BITS, GROUP,
            W_K, W_V,
            BLOCK_N, HAS_MASK, Q_LEN, DT, MAGIC_BITS, MAGIC_VALUE, MANTISSA, FAST_UNPACK, FP32_DOT, NUM_STAGES,
            PAIRED, META,
        )
        heads = tl.arange(0, BLOCK_G // 2 if PAIRED else BLOCK_G)
        keep = heads < G_Q * Q_LEN
        safe_den = tl.where(den > 0, den, 1.0)
        inv_den = 1.0 / safe_den  # one division per query row, then products (a division costs ~10 instructions)
        part = (bh * G_Q * Q_LEN + heads).to(tl.int64) * total_splits + split
        v_col = tl.arange(0, HW_V // 2 if PAIRED else HW_V)
        for P in tl.static_range(len(accs)):
            ch = _position(v_col, P, V_BITS, MANTISSA, W_V, BYTES_V)[1]
            tl.store(part_o_ptr + part[None, :] * D + ch[:, None], accs[P] * inv_den[None, :], mask=keep[None, :])
        tl.store(part_lse_ptr + part, tl.where(den > 0, m + tl.log2(safe_den), float("-inf")), mask=keep)
    else:  # one code path for sink and recent chunks (pointers chosen per program)
        in_sink = split < sink_splits
        lo = (split - tl.where(in_sink, 0, sink_splits)) * WIN_CHUNK
        off = tl.where(in_sink, b * stride_sink_b + h * stride_sink_h, b * stride_rec_b + h * stride_rec_h)
        _window_split(
            q_head, stride_qh, stride_qt, lo, tl.minimum(lo + WIN_CHUNK, tl.where(in_sink, n_sink, n_recent)),
            tl.where(in_sink, 0, n_sink + n_hist), tl.where(in_sink, sk_ptr, rk_ptr) + off,
            tl.where(in_sink, sv_ptr, rv_ptr) + off, tl.where(in_sink, stride_sink_n, stride_rec_n),
            tl.where(in_sink, 0, tl.load(counts_ptr + 3)), tl.where(in_sink, 1 << 30, rec_cap),
            mask_row, stride_mq, stride_mt, qk_scale, n_sink + n_hist + n_recent - Q_LEN, part_o_ptr, part_lse_ptr,
            bh * G_Q * Q_LEN, total_splits, split, cap, G_Q, BLOCK_H, D, W, BLOCK_W, HAS_MASK, Q_LEN, DT,
            FP32_DOT, PREFETCH, WIN_CHUNK, SOFTCAP,
        )


@triton.jit
def _window_split(
    q_head, stride_qh, stride_qt, lo, hi, pos0, k, v, stride_n, ring_start, ring_cap, mask_row, stride_mq, stride_mt,
    qk_scale, last, part_o_ptr, part_lse_ptr, row0, total_splits, split, cap,
    G_Q: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLOCK_W: tl.constexpr,
    HAS_MASK: tl.constexpr, Q_LEN: tl.constexpr, DT: tl.constexpr, FP32_DOT: tl.constexpr, PREFETCH: tl.constexpr,
    CHUNK: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """A sink or recent chunk of stage 1, query rows as rows (padded to BLOCK_H): :func:`_attend_dense`, then its
    normalised partial output and log-sum-exp. ``last``: the position of the last key before the query tokens."""
    NSUB: tl.constexpr = D // W
    if PREFETCH:
        prefetch_window((k, v), lo, hi, stride_n, ring_start, ring_cap, CHUNK, D)
    rows = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, W)
    keep = rows < G_Q * Q_LEN
    q_rows = q_head + (rows // Q_LEN) * stride_qh + (rows % Q_LEN) * stride_qt
    qs = ()
    accs = ()
    for i in tl.static_range(NSUB):
        qs = qs + (tl.load(q_rows[:, None] + i * W + cols[None, :], mask=keep[:, None], other=0.0),)
        accs = accs + (tl.zeros([BLOCK_H, W], tl.float32),)
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    m, den, accs = _attend_dense(qs, m, den, accs, lo, hi, pos0, k, v, stride_n, ring_start, ring_cap, mask_row,
                                 stride_mq, stride_mt, qk_scale, rows % Q_LEN, last, cap, BLOCK_W, HAS_MASK, Q_LEN,
                                 DT, FP32_DOT, SOFTCAP)
    safe_den = tl.where(den > 0, den, 1.0)
    inv_den = 1.0 / safe_den
    part = (row0 + rows).to(tl.int64) * total_splits + split
    for i in tl.static_range(NSUB):
        tl.store(part_o_ptr + part[:, None] * D + i * W + cols[None, :], accs[i] * inv_den[:, None],
                 mask=keep[:, None])
    tl.store(part_lse_ptr + part, tl.where(den > 0, m + tl.log2(safe_den), float("-inf")), mask=keep)
