"""Absorbed multi-head latent attention (MLA) in torch, for the few query tokens of a decode step.

The model expands every cached latent ``c [T, r]`` through ``kv_b_proj`` into per-head K and V before attending: a
product over the whole sequence in every layer and step. Absorbed, the queries move instead: with ``W_UK [H, d_nope,
r]`` and ``W_UV [H, d_v, r]`` the rows of ``kv_b_proj``'s weight,

    logits = scaling·(q_nope·W_UK·cᵀ + q_rope·k_ropeᵀ),    output = softmax(logits)·c·W_UVᵀ,

so the latent is read as it is stored, once for all heads (the heads share it, as MQA's do).
"""

from __future__ import annotations

import torch


def absorbed_attention(query: torch.Tensor, rope: torch.Tensor, sink: torch.Tensor, history: torch.Tensor,
                       recent: torch.Tensor, kv_weight: torch.Tensor, *, nope_dim: int,
                       attention_mask: torch.Tensor | None, scaling: float,
                       history_basis: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query [B, H, q, d_nope + d_rope]`` (``q_nope ‖ q_rope``, model dtype) over the latent sequence
    ``sink ‖ history ‖ recent`` (each ``[B, 1, n, r]``, model dtype) with RoPE keys ``rope [B, 1, T, d_rope]``.

    Args:
        kv_weight: ``kv_b_proj``'s weight ``[H·(d_nope + d_v), r]``.
        nope_dim: ``d_nope``, the channels of each head's key that the latent gives.
        attention_mask: bool ``[B, 1, q, >= T]`` (True = attend), additive float, or None (causal, bottom-right).
        history_basis: ``R [r, r]`` where the history is stored rotated (``ĉ = c·R``; the windows are not), else
            None: the history's scores take ``q·W_UK·R`` and its share of the output ``·Rᵀ``.

    Returns ``[B, q, H, d_v]`` in the query's dtype; scores, softmax and sums in fp32 (products of the latent in the
    model dtype, accumulated in fp32).
    """
    batch, heads, q_len, _ = query.shape
    dtype = query.dtype
    weight = kv_weight.view(heads, -1, kv_weight.shape[-1]).float()
    w_uk, w_uv = weight[:, :nope_dim], weight[:, nope_dim:]
    q_latent = torch.einsum("bhqd,hdr->bhqr", query[..., :nope_dim].float(), w_uk)
    q_history = q_latent if history_basis is None else q_latent @ history_basis.float()

    def scores(q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:  # [B, H, q, n]: every head against one latent
        flat = q.to(latent.dtype).reshape(batch, 1, heads * q_len, -1)
        return (flat @ latent.mT).float().view(batch, heads, q_len, -1)

    logits = torch.cat([scores(q_latent, sink), scores(q_history, history), scores(q_latent, recent)], dim=-1)
    logits += scores(query[..., nope_dim:], rope)
    logits *= scaling
    total = logits.shape[-1]
    if attention_mask is None:
        attention_mask = torch.ones(q_len, total, dtype=torch.bool, device=query.device).tril(total - q_len)
    mask = attention_mask[..., :total]
    logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.float()
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a row with no key to read (padding) reads nothing

    def weighted(p: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:  # [B, H, q, r]
        flat = p.to(latent.dtype).reshape(batch, 1, heads * q_len, -1)
        return (flat @ latent).float().view(batch, heads, q_len, -1)

    p_sink, p_history, p_recent = probs.split([sink.shape[2], history.shape[2], recent.shape[2]], dim=-1)
    from_history = weighted(p_history, history)
    if history_basis is not None:
        from_history = from_history @ history_basis.float().mT
    out = weighted(p_sink, sink) + from_history + weighted(p_recent, recent)
    return torch.einsum("bhqr,hvr->bqhv", out, w_uv).to(dtype)
