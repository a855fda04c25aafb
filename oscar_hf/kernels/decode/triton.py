"""Triton decode attention over a PackedKV: split-K flash-decoding of one query token (a decode step) or of the few
newest ones (assisted decoding's verify step, causal among them).
Twin: :func:`oscar_hf.kernels.decode.reference.attend`.

The windows hold K and V as the model produced them and the history holds them rotated, so the window parts attend
with q and the history parts with ``q·R_K``, and the history's share of the output is in the rotated V basis.
Stage 0 (:func:`rotate_query`, where no rotated q is given): q times R_K. Stage 1 (grid ``B·H × splits``): a program
serves one KV head's whole GQA group over one part of the sequence, with a one-pass online softmax in base 2, and writes
a normalised partial output and its log-sum-exp; history programs read packed codes, sink/recent programs model-dtype
rows (the recent window a ring buffer). Stage 2 (grid ``B·Hq·q × D/32``) merges the parts by log-sum-exp and adds the
centers' terms (``q·R_K·μ_K`` on the history parts' lse, ``μ_V`` times their share of the weight); with a V rotation
it writes the windows' and the history's shares apart, and the output is ``o_windows + o_history·R_Vᵀ`` (one GEMM;
batched over the KV heads, from outputs written KV head first, where each KV head has its own R_V). A rotation is
``[D, D]`` or ``[H, D, D]`` (one per KV head: query head ``h·g + r`` reads KV head ``h``'s).
On sm_90 every stage is launched early (programmatic dependent launch), waiting for the kernel before it.

History tiles put the tokens on the tensor cores' big dimension and read codes as halfwords: ``(h >> shift) & mask |
magic`` read as bf16 (fp16) is ``M + c·f`` (M = 128, or 1024 for fp16), so the dots need no int-to-float conversion;
the ``1/f`` goes into q and into the output's scaling, and the offset ``M`` is taken out through ``Σq`` for K and
``Σ p·s`` for V. Scale and zero stay out of the element loop: ``logit = s·(q·c) + z·Σq``. Rows narrower than 32 bytes
(D = 64 at 2 bits) are read two tokens per tile row where that leaves at most 16 columns. Whole tiles run without
bounds checks, and the running max is rescaled lazily (only past a jump of 8 in log2 units; fp16 at every larger max).
The attention mask ``[B, 1, 1 or q, T]`` (True = attend) is read per key and query token, so left padding is exact.
The layout tricks and the measurements behind them are in ``docs/kernels/decode.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...quantizer import IMPLIED_ZERO, QuantizedRows
from ..packed import PackedKV
from ..utils import has_pdl, on_device_of
from .launch import WINDOW_BLOCK, DecodeConfig, default_config, plan, window_prefetch
from .stage0 import rotate_query
from .stage1 import MAGIC, decode_stage1_kernel
from .stage2 import decode_stage2_kernel

LOG2E = 1.4426950408889634

__all__ = ["WINDOW_BLOCK", "decode", "decode_attention", "decode_static", "rotate_query"]


def _storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a one-element stand-in when it is empty (its pointer is never read then: uninitialised, no kernel)."""
    return t if t.numel() else t.new_empty(1)


def _launch(query, windows, history, center, attention_mask, counts, scaling, key_bits, value_bits, group, splits,
            config=None, key_rotation=None, value_rotation=None, rotated_query=None, softcap=None, sinks=None):
    """Both stages over a PackedKV's ``windows``, ``history`` and ``centers`` lists, the counts int32 ``[4+]`` (sink,
    history, recent, ring start) and the ``splits`` of :func:`launch.plan`, with the history's rotations (None:
    identity); ``rotated_query`` is ``query @ key_rotation`` where the caller has it (else stage 0 computes it);
    ``softcap`` and ``sinks`` as :func:`decode`'s."""
    batch, hq, q_len, d = query.shape
    sink_k, sink_v, rec_k, rec_v = windows
    heads = sink_k.shape[1]
    group_q = hq // heads
    rows = group_q * q_len  # query rows per program
    cfg = config or default_config(batch, d, q_len)
    dt, magic_bits, magic_value, mantissa = MAGIC[query.dtype]
    interpreting = triton.knobs.runtime.interpret
    pdl = cfg.pdl and not interpreting and has_pdl(query.device)
    query = query if query.stride(-1) == 1 else query.contiguous()
    if rotated_query is None:
        rotated_query = query if key_rotation is None else rotate_query(query, key_rotation, pdl)
    elif rotated_query.stride(-1) != 1:
        rotated_query = rotated_query.contiguous()
    hist_splits, sink_splits, total, window_tiles = splits
    if attention_mask is None:  # a pointer never read: uninitialised, so that no fill kernel delays stage 1
        mask, mask_strides = query.new_empty(1, dtype=torch.uint8), (0, 0, 0)
    else:
        mask = attention_mask[:, 0, -q_len:, :].expand(batch, q_len, -1).view(torch.uint8)
        mask_strides = mask.stride()
    part_o = torch.empty(batch * hq * q_len, total, d, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(batch * hq * q_len, total, dtype=torch.float32, device=query.device)
    # a per-head R_V: the outputs KV head first, [H, B·g·q, D], for one batched GEMM
    head_major = value_rotation is not None and value_rotation.ndim == 3
    shape = (heads, batch * rows, d) if head_major else (batch, hq, q_len, d)
    out = torch.empty(shape, dtype=query.dtype, device=query.device)
    out_hist = out if value_rotation is None else torch.empty_like(out)
    scaling = d**-0.5 if scaling is None else scaling
    # code rows narrower than 32 bytes (D = 64 at 2 bits): two tokens' per tile row where that leaves at most 16
    # columns (each query row twice), else bytes
    paired = d * min(key_bits, value_bits) // 8 < 32 and 2 * rows <= 16
    meta = QuantizedRows(*history[:3]).meta  # how both sides store their scales and zeros
    if meta != QuantizedRows(*history[3:]).meta:
        raise ValueError("decode reads K and V rows of one metadata format (scale and zero dtypes alike)")
    if meta == IMPLIED_ZERO:  # the scales stand in for the zeros' pointers (never read)
        history = [history[0], history[1], history[1], history[3], history[4], history[4]]
    history = [t.view(torch.int16) if i % 3 == 0 and (paired or t.shape[-1] >= 32) else t
               for i, t in enumerate(history)]
    if any(t.stride(2) != t.shape[3] for t in history[::3]):
        raise ValueError("decode reads code rows of contiguous halfwords; got strides "
                         f"{history[0].stride()} and {history[3].stride()}")
    if any(t.stride(2) != t.shape[3] or t.stride() != history[1].stride() for t in history[1:3] + history[4:6]):
        raise ValueError("decode reads scale and zero rows of contiguous groups, all four alike; got strides "
                         f"{[t.stride() for t in history[1:3] + history[4:6]]}")
    hist_strides = history[0].stride()[:2] + history[3].stride()[:2] + history[1].stride()[:2]
    mu = (*center, *center[0].stride()[:2]) if center else (mask, mask, 0, 0)
    with on_device_of(query):
        decode_stage1_kernel[(batch * heads, total)](
            query, *query.stride()[:3], rotated_query, *rotated_query.stride()[:3],
            _storage(sink_k), _storage(sink_v), *sink_k.stride()[:3],
            _storage(rec_k), _storage(rec_v), *rec_k.stride()[:3],
            *[_storage(t) for t in history], *hist_strides,
            mask, *mask_strides,
            part_o, part_lse,
            counts, hist_splits, sink_splits, total, max(rec_k.shape[2], 1),
            heads, scaling * LOG2E, mu[0], *mu[2:], 1.0 if softcap is None else softcap / scaling,
            G_Q=group_q, BLOCK_G=max(8, triton.next_power_of_2(rows * (2 if paired else 1))),
            BLOCK_H=max(16, triton.next_power_of_2(rows)), D=d, K_BITS=key_bits, V_BITS=value_bits,
            GROUP=group, BLOCK_N=cfg.block_n, BLOCK_W=WINDOW_BLOCK[d], HAS_MASK=attention_mask is not None,
            Q_LEN=q_len, DT=dt, MAGIC_BITS=magic_bits, MAGIC_VALUE=magic_value,
            MANTISSA=mantissa, FAST_UNPACK=cfg.fast_unpack and not interpreting,
            FP32_DOT=dt == tl.bfloat16 and interpreting, PDL=pdl, NUM_STAGES=cfg.num_stages,
            PREFETCH=window_prefetch(cfg, batch * heads, history[0].shape[2], splits, query.device)
            and not interpreting, PAIRED=paired, WINDOW_TILES=window_tiles, SOFTCAP=softcap is not None,
            CENTERED=bool(center), META=meta, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, launch_pdl=pdl,
            **({"maxnreg": cfg.max_registers} if cfg.max_registers and not interpreting else {}),
        )
        decode_stage2_kernel[(batch * hq * q_len, d // 32)](
            part_o, part_lse, out, out_hist, total, total - hist_splits, rotated_query, *rotated_query.stride()[:3],
            *mu, hq, scaling * LOG2E, mask if sinks is None else sinks,
            G_Q=group_q, Q_LEN=q_len, D=d, BLOCK_D=32, BLOCK_S=min(256, triton.next_power_of_2(total)),
            CENTERED=bool(center), APART=value_rotation is not None, PDL=pdl, HAS_SINKS=sinks is not None,
            HEAD_MAJOR=head_major, num_warps=4, launch_pdl=pdl,
        )
    # o_windows + o_history · R_Vᵀ, one rounding of the sum: one GEMM, batched over the KV heads for a per-head R_V
    if head_major:  # [H, B·g·q, D] → [B, q, Hq, D] (a view at batch 1)
        out = torch.baddbmm(out, out_hist, value_rotation.to(out.dtype).mT)
        return out.view(heads, batch, group_q, q_len, d).permute(1, 3, 0, 2, 4).reshape(batch, q_len, hq, d)
    if value_rotation is not None:
        out = torch.addmm(out.view(-1, d), out_hist.view(-1, d), value_rotation.to(out.dtype).mT).view(out.shape)
    return out.transpose(1, 2)


def decode(query: torch.Tensor, packed: PackedKV, attention_mask: torch.Tensor | None, scaling: float | None,
           config: DecodeConfig | None = None, rotated_query: torch.Tensor | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query tokens over ``packed``'s ``sink ‖ history ‖ recent``: one (a decode step) or the ``q``
    newest tokens (a verify step, a small prefill chunk), causal among them.

    Args:
        query: queries ``[B, Hq, q, D]`` as the model produced them, bf16 or fp16 as the storage; ``Hq = g·H``
            (query head ``h·g + r`` reads KV head ``h``); D in 64, 128, 256; the q tokens are the newest, still in
            the recent window.
        packed: per-token storage (:func:`launch.supports_call`). Device counts are read by the kernel, with a plan
            for the capacities (no host synchronisation); host counts plan for the lengths.
        attention_mask: bool ``[B or 1, 1, 1 or q, >= T]`` (True = attend; key ``t`` at column ``t``), or None.
        scaling: logit scale (None: ``D**-0.5``).
        config: launch parameters (None: :func:`launch.default_config`).
        rotated_query: ``query @ packed.key_rotation`` where the caller has it (the append kernel's), else None.
        softcap: logits soft-capped to ``softcap·tanh(s / softcap)`` (Gemma-2), or None.
        sinks: a learned sink logit per query head ``[Hq]`` (gpt-oss): one more softmax term, with no value.
    Returns:
        ``[B, q, Hq, D]`` in the query dtype.
    """
    if isinstance(packed.counts, torch.Tensor):
        splits = plan(packed, query.shape[0], config=config, query_len=query.shape[2])
    else:
        splits = plan(packed, query.shape[0], packed.lengths()[:3], config, query.shape[2])
    return _launch(query, packed.windows, packed.history, packed.centers, attention_mask, packed.device_counts(),
                   scaling, packed.key_bits, packed.value_bits, packed.group_size, splits, config,
                   packed.key_rotation, packed.value_rotation, rotated_query, softcap, sinks)


@torch.library.custom_op("oscar_hf::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    rotated_query: torch.Tensor | None,
    key_rotation: torch.Tensor | None,
    value_rotation: torch.Tensor | None,
    windows: list[torch.Tensor],
    history: list[torch.Tensor],
    center: list[torch.Tensor],
    attention_mask: torch.Tensor | None,
    counts: torch.Tensor,
    scaling: float,
    key_bits: int,
    value_bits: int,
    group: int,
    splits: list[int],
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`decode` over device counts as an operator that torch.compile traces without a graph break and CUDA
    graphs capture. Arguments as :func:`_launch`'s."""
    return _launch(query, windows, history, center, attention_mask, counts, scaling, key_bits, value_bits, group,
                   splits, key_rotation=key_rotation, value_rotation=value_rotation, rotated_query=rotated_query,
                   softcap=softcap, sinks=sinks)


@decode_attention.register_fake
def _(query, rotated_query, key_rotation, value_rotation, windows, history, center, attention_mask, counts, scaling,
      key_bits, value_bits, group, splits, softcap, sinks):
    batch, hq, _, d = query.shape
    return query.new_empty(batch, 1, hq, d)


def decode_static(query: torch.Tensor, packed: PackedKV, attention_mask: torch.Tensor | None, scaling: float | None,
                  splits: list[int], rotated_query: torch.Tensor | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`decode` of one query token over storage with device counts, as the operator, with a plan made once
    (for the capacities)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.oscar_hf.decode_attention(query, rotated_query, packed.key_rotation, packed.value_rotation,
                                               packed.windows, packed.history, packed.centers, attention_mask,
                                               packed.counts, scaling, packed.key_bits, packed.value_bits,
                                               packed.group_size, splits, softcap, sinks)
