"""Pure-torch attention over the OSCAR cache: dequantize, then SDPA. The oracle for the Triton kernels."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dequantize_into=None,
) -> torch.Tensor:
    """Attention of rotated queries over ``sink ‖ dequantized history ‖ recent``.

    Args:
        query: rotated queries ``[B, Hq, q, D]`` in the model dtype.
        key, value: OscarKV handles; the ``q`` newest tokens are read at full precision from ``.new``
            (the current chunk is attended unquantized, as in the OSCAR reference).
        attention_mask: bool ``[B, 1, q, ≥ T]`` (True = attend; a compileable cache's mask is longer than the
            sequence) or None (causal, aligned bottom-right).
        dequantize_into: the history fill of :meth:`OscarLayer.materialize` (None: torch; the Triton backend
            passes ``triton_dequant.dequantize_into``).
    Returns:
        ``[B, q, Hq, D]`` in the rotated V basis.
    """
    layer = key.layer
    past = layer.length - key.new.shape[2]
    k, v = (layer.materialize(side, past, new=kv.new, dequantize_into=dequantize_into)
            for side, kv in (("key", key), ("value", value)))
    q_len, kv_len = query.shape[2], k.shape[2]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :kv_len]
    if attention_mask is None and 1 < q_len < kv_len:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    out, _ = sdpa_attention_forward(module, query, k, v, attention_mask, scaling=scaling)
    return out
