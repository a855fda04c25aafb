"""Torch reads of a PackedKV: the history dequantized (the twin of the dequantize kernel), and the whole sequence in
the model's basis and dtype (what the torch attention reads)."""

from __future__ import annotations

import torch

from ...quantizer import QuantizedRows, dequantize, dequantize_per_channel
from ..packed import PackedKV


def dequantize_history(packed: PackedKV, side: str, stop: int, start: int = 0) -> torch.Tensor:
    """History tokens ``[start, stop)`` of ``side`` ("key" or "value"), dequantized, center added back, in the
    history's (rotated) basis: fp32 ``[B, H, stop - start, D]``. Per-channel K reads whole token groups: ``start``
    and ``stop`` are multiples of ``key_token_group`` there; product-quantized K is read through its codebook."""
    _, _, rows, center, bits = packed.side(side)
    if side == "key" and packed.key_codebook is not None:
        history = packed.key_codebook.decode(rows.codes[:, :, start:stop])
        return history if center is None else history + center
    per_channel = side == "key" and not packed.per_token_keys
    group = packed.key_token_group if per_channel else 1
    meta = slice(start // group, -(-stop // group))
    part = QuantizedRows(rows.codes[:, :, start:stop], rows.scale[:, :, meta], rows.zero[:, :, meta])
    history = dequantize_per_channel(part, bits) if per_channel else dequantize(part, bits)
    return history if center is None else history + center


def dequantize_rows(rows: QuantizedRows, center: torch.Tensor | None, out: torch.Tensor, *, bits: int) -> None:
    """Per-token rows dequantized in fp32, plus ``center`` where given, rounded once into ``out [B, H, n, D]``: the
    dequantize kernel's contract (:func:`oscar_hf.kernels.dequantize.triton.dequantize_rows`), in torch."""
    x = dequantize(rows, bits)
    out.copy_(x if center is None else x + center)


def fill_history(packed: PackedKV, side: str, out: torch.Tensor) -> None:
    """Write the first ``out.shape[2]`` history tokens of ``side``, dequantized (rotated basis), into ``out`` (a
    ``[B, H, n, D]`` view of a buffer): the dequantize kernel's contract, in torch (per-channel K dequantizes whole
    groups)."""
    n = out.shape[2]
    group = packed.key_token_group if side == "key" and packed.key_token_group is not None else 1
    stop = -(-n // group) * group
    out.copy_(dequantize_history(packed, side, stop)[:, :, :n])


def recent_rows(packed: PackedKV, side: str, n: int) -> torch.Tensor:
    """The ``n`` oldest recent tokens of ``side`` in order (the ring unrolled from ``counts[3]``)."""
    _, recent, _, _, _ = packed.side(side)
    start = packed.lengths()[3]
    if not start:
        return recent[:, :, :n]
    rows = (start + torch.arange(n, device=recent.device)) % recent.shape[2]
    return recent.index_select(2, rows)


def unrotate(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:
    """fp32 rows ``x [..., D]`` in a rotated basis, back in the model's: ``x @ Rᵀ`` in fp32 (x itself for None);
    rows of KV heads ``[B, H, n, D]`` take ``R [D, D]`` or ``[H, D, D]``."""
    return x if rotation is None else x @ rotation.float().mT


def materialize(packed: PackedKV, side: str, stop: int | None = None, new: torch.Tensor | None = None,
                dtype: torch.dtype | None = None, fill=None) -> torch.Tensor:
    """The sequence ``sink ‖ dequantized history ‖ recent`` of ``side`` in the model's basis (the history rotated
    back, in fp32, rounded once): its first ``stop`` tokens (default all), then ``new [B, H, q, D]`` if given, as
    one ``[B, H, stop + q, D]`` buffer in ``dtype`` (default the storage's). ``fill(packed, side, out)`` writes the
    dequantized history (default :func:`fill_history`; the Triton backend passes the dequantize kernel)."""
    n_sink, n_history, n_recent, _ = packed.lengths()
    total = n_sink + n_history + n_recent
    stop = total if stop is None else min(stop, total)
    sink, _, _, _, _ = packed.side(side)
    n_sink = min(n_sink, stop)
    n_hist = min(n_history, stop - n_sink)
    batch, heads, _, dim = sink.shape
    extra = 0 if new is None else new.shape[2]
    out = torch.empty(batch, heads, stop + extra, dim, dtype=dtype or packed.dtype, device=packed.device)
    out[:, :, :n_sink] = sink[:, :, :n_sink]
    if n_hist:
        rotation = packed.rotation(side)
        history = out[:, :, n_sink : n_sink + n_hist]
        if rotation is None:
            (fill or fill_history)(packed, side, history)
        else:
            rotated = torch.empty(history.shape, dtype=torch.float32, device=out.device)
            (fill or fill_history)(packed, side, rotated)
            history.copy_(unrotate(rotated, rotation))
    out[:, :, n_sink + n_hist : stop] = recent_rows(packed, side, stop - n_sink - n_hist)
    if new is not None:
        out[:, :, stop:] = new
    return out
