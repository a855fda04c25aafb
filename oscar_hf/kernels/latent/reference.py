"""Absorbed multi-head latent attention (MLA) in torch, for the few query tokens of a decode step.

The model expands every cached latent ``c [T, r]`` through ``kv_b_proj`` into per-head K and V before attending: a
product over the whole sequence in every layer and step. Absorbed, the queries move instead: with ``W_UK [H, d_nope,
r]`` and ``W_UV [H, d_v, r]`` the rows of ``kv_b_proj``'s weight,

    logits = scaling·(q_nope·W_UK·cᵀ + q_rope·k_ropeᵀ),    output = softmax(logits)·c·W_UVᵀ,

so the latent is read as it is stored, once for all heads (the heads share it, as MQA's do).
"""

from __future__ import annotations

import torch


def absorbed_attention(query: torch.Tensor, rope: torch.Tensor, latent: torch.Tensor, kv_weight: torch.Tensor, *,
                       nope_dim: int, attention_mask: torch.Tensor | None, scaling: float,
                       basis: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query [B, H, q, d_nope + d_rope]`` (``q_nope ‖ q_rope``) over the latent sequence
    ``latent [B, 1, T, r]`` with RoPE keys ``rope [B, 1, T, d_rope]``.

    Args:
        kv_weight: ``kv_b_proj``'s weight ``[H·(d_nope + d_v), r]``.
        nope_dim: ``d_nope``, the channels of each head's key that the latent gives.
        attention_mask: bool ``[B, 1, q, >= T]`` (True = attend), additive float, or None (causal, bottom-right).
        basis: ``R [r, r]`` where the latent is stored rotated (``ĉ = c·R``; ``kv_b_proj`` reads ``c``), else None:
            the queries take ``q·W_UK·R`` and the output ``·Rᵀ``.

    Returns ``[B, q, H, d_v]`` in the query's dtype. Products in the latent's dtype (fp32 sums); logits, softmax and
    the mask in fp32.
    """
    batch, heads, q_len, _ = query.shape
    dtype = latent.dtype
    weight = kv_weight.view(heads, -1, kv_weight.shape[-1]).to(dtype)
    w_uk, w_uv = weight[:, :nope_dim], weight[:, nope_dim:]
    q_latent = torch.einsum("bhqd,hdr->bhqr", query[..., :nope_dim].to(dtype), w_uk)
    if basis is not None:
        q_latent = q_latent @ basis.to(dtype)

    def shared(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:  # every head's rows against one [B, 1, ., .]
        return (x.to(keys.dtype).reshape(batch, 1, heads * q_len, -1) @ keys).view(batch, heads, q_len, -1)

    logits = shared(q_latent, latent.mT).float() + shared(query[..., nope_dim:], rope.mT).float()
    logits *= scaling
    total = logits.shape[-1]
    if attention_mask is None:
        attention_mask = torch.ones(q_len, total, dtype=torch.bool, device=query.device).tril(total - q_len)
    mask = attention_mask[..., :total]
    logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.float()
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # a row with no key to read (padding) reads nothing
    out = shared(probs, latent)
    if basis is not None:
        out = out @ basis.to(dtype).mT
    return torch.einsum("bhqr,hvr->bqhv", out, w_uv).to(query.dtype)
