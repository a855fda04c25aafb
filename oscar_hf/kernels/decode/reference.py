"""Torch attention over a PackedKV: dequantize, then SDPA. The decode kernel's twin, and the attention for every call
the kernel does not serve (prefill chunks, fp32, per-channel K)."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..dequantize.reference import materialize
from ..packed import PackedKV


def attend(module: torch.nn.Module, query: torch.Tensor, packed: PackedKV, new_key: torch.Tensor,
           new_value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
           fill=None) -> torch.Tensor:
    """Attention of queries over ``sink ‖ dequantized history ‖ recent``, all in the model's basis (the history
    rotated back): where no token has reached the history, this is SDPA over the model's own K and V.

    Args:
        module: the attention module (SDPA reads its GQA grouping and causality from it).
        query: queries ``[B, Hq, q, D]`` in the model dtype, as the model produced them.
        packed: the layer's storage, which already holds the ``q`` newest tokens; they are read at full precision
            from ``new_key``/``new_value`` ``[B, H, q, D]`` instead (the current chunk is attended unquantized, as
            in the OSCAR reference).
        attention_mask: bool ``[B, 1, q, >= T]`` (True = attend) or None (causal, aligned bottom-right).
        fill: the history fill of :func:`materialize` (None: torch; the Triton backend passes its dequantize kernel).
    Returns:
        ``[B, q, Hq, D]``.
    """
    past = sum(packed.lengths()[:3]) - new_key.shape[2]
    k, v = (materialize(packed, side, past, new=new, fill=fill)
            for side, new in (("key", new_key), ("value", new_value)))
    q_len, kv_len = query.shape[2], k.shape[2]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :kv_len]
    if attention_mask is None and 1 < q_len < kv_len:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    out, _ = sdpa_attention_forward(module, query, k, v, attention_mask, scaling=scaling)
    return out
