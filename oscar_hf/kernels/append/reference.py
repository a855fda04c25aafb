"""The append kernel's torch twin: one token into a PackedKV with device counts, demoting the window's oldest rows
(rotated) into the history when it is full. Same arguments and effects as
:func:`oscar_hf.kernels.append.triton.append`."""

from __future__ import annotations

import torch

from ...quantizer import GRID_OF_META, quantize
from .. import flags as flag_bits
from ..packed import PackedKV


def rotate_rows(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``x [..., D] @ rotation`` with fp32 sums rounded once to x's dtype (x itself for None). Rows of KV heads
    ``[B, H, n, D]`` take a rotation ``[D, D]`` or, one per KV head, ``[H, D, D]`` (matmul broadcasting)."""
    return x if rotation is None else (x.float() @ rotation.float()).to(x.dtype)


def rotate_queries(query: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """``query [B, Hq, q, D]`` times its KV head's rotation, as :func:`rotate_rows` rounds it: ``rotation [D, D]``, or
    ``[H, D, D]`` where query head ``h·g + r`` (``g = Hq / H``) takes KV head ``h``'s."""
    if rotation is None or rotation.ndim == 2:
        return rotate_rows(query, rotation)
    batch, hq, q_len, d = query.shape
    groups = query.unflatten(1, (rotation.shape[0], hq // rotation.shape[0])).flatten(2, 3)  # [B, H, g·q, D]
    return rotate_rows(groups, rotation).view(batch, hq, q_len, d)


def append(packed: PackedKV, key: torch.Tensor, value: torch.Tensor, *, flags: torch.Tensor, max_len: int,
           sink_tokens: int, limit: int, flush: int, k_clip: float, v_clip: float,
           key_rotation: torch.Tensor | None = None, value_rotation: torch.Tensor | None = None,
           query: torch.Tensor | None = None) -> torch.Tensor | None:
    """Store one token's K and V ``[B, H, 1, D]`` as given, demoting the window's ``flush`` oldest rows, rotated,
    where it is full, and advance ``packed.counts`` (int32 ``[8]``); errors are or-ed into ``flags[0]``. Returns
    ``query`` rotated by ``key_rotation`` where both are given, else None. Rotations are ``[D, D]`` or ``[H, D, D]``
    (one per KV head; query head ``h·g + r`` takes KV head ``h``'s)."""
    counts = packed.counts
    n_sink, n_hist, n_rec, start = packed.lengths()
    cap = packed.recent_k.shape[2]
    room = n_sink + n_hist + n_rec < max_len
    to_sink = room and n_sink < sink_tokens
    to_recent = room and n_sink >= sink_tokens
    demoted = flush if to_recent and n_rec == limit else 0
    sides = (("key", key, key_rotation, k_clip, flag_bits.KEY_SHIFT),
             ("value", value, value_rotation, v_clip, flag_bits.VALUE_SHIFT))
    for side, x, rotation, clip, shift in sides:
        sink, recent, rows, center, bits = packed.side(side)
        x = x[:, :, 0]
        if to_sink:
            sink[:, :, n_sink] = x
        elif to_recent:
            if demoted:
                ring = (start + torch.arange(flush, device=recent.device)) % cap
                old = rotate_rows(recent.index_select(2, ring), rotation).float()
                if center is not None:
                    if n_hist == 0:
                        center.copy_(old.mean(dim=2, keepdim=True))
                    old = old - center
                method = GRID_OF_META[rows.meta]
                quantized, error = _quantize(old, clip, bits, packed.group_size, rows.scale.dtype, method)
                flags[0] |= error << shift
                for stored, part in zip(rows, quantized or ()):
                    stored[:, :, n_hist : n_hist + flush] = part
            recent[:, :, (start + n_rec) % cap] = x
    if not room:
        flags[0] |= flag_bits.FULL
    counts[4:8] = torch.tensor([n_sink, n_hist, n_rec, start], dtype=counts.dtype)
    counts[:4] = torch.tensor([n_sink + to_sink, n_hist + demoted, n_rec + to_recent - demoted,
                               (start + demoted) % cap], dtype=counts.dtype)
    if query is None or key_rotation is None:
        return None
    return rotate_queries(query, key_rotation).contiguous()


def _quantize(rows: torch.Tensor, clip: float, bits: int, group: int, scale_dtype: torch.dtype, method: str):
    """``(QuantizedRows, 0)`` of fp32 ``rows`` by the quantizer ``method``, or ``(None, the flag bits the write
    kernel's tile sets)``."""
    if not bool(torch.isfinite(rows).all()):
        return None, flag_bits.NON_FINITE
    try:
        return quantize(rows, bits=bits, group_size=group, clip=clip, scale_dtype=scale_dtype, method=method), 0
    except ValueError:
        return None, flag_bits.OVERFLOW
