"""Torch attention over a PackedKV: dequantize, then SDPA (or, for learned sinks and logit soft-capping, which SDPA
lacks, :func:`dense_attention`; the model's own eager attention while nothing is quantized). The decode kernel's
twin, and the attention for every call the kernel does not serve (prefill chunks, fp32, per-channel K)."""

from __future__ import annotations

import sys

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..dequantize.reference import materialize
from ..packed import PackedKV


def dense_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``query [B, Hq, q, D]`` over ``key``/``value [B, H, T, D]`` (GQA by ``Hq / H``), with the logits
    soft-capped (``softcap·tanh(s / softcap)``, Gemma-2) and a learned sink logit per query head (``sinks [Hq]``
    joins each row's softmax denominator only, gpt-oss), as those models' own eager attention computes them: logits
    in the model dtype, softmax in fp32. ``attention_mask``: bool ``[B, 1, q, >= T]`` (True = attend) or None
    (causal, aligned bottom-right). Returns ``[B, q, Hq, D]``."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = (query @ key.transpose(2, 3)) * scaling
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and q_len > 1:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if attention_mask is not None:
        attention_mask = attention_mask[..., :kv_len]
        # the dtype's lowest value, not -inf: a row with no key to attend (left padding) stays finite, as in eager
        low = torch.finfo(logits.dtype).min
        logits = logits.masked_fill(~attention_mask, low) if attention_mask.dtype == torch.bool else (
            logits + attention_mask)
    logits = logits.float()
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :kv_len].to(value.dtype)
    return (probs @ value).transpose(1, 2)


def model_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Attention over the model's own K/V ``[B, H, T, D]`` as the model computes it by default, bit for bit: SDPA;
    or, with soft-capped or sink logits (which SDPA lacks, so those models run their own eager attention), the
    ``eager_attention_forward`` of the module's modeling file, with the bool mask made additive as its eager mask is
    (:func:`dense_attention` where the file has none). Returns ``[B, q, Hq, D]``."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if softcap is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0]
    if attention_mask is not None:
        attention_mask = attention_mask[..., :kv_len]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        return dense_attention(module, query, key, value, attention_mask, scaling, softcap, sinks)
    if attention_mask is None and q_len > 1:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min)
    return eager(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, s_aux=sinks)[0]


def attend(module: torch.nn.Module, query: torch.Tensor, packed: PackedKV, new_key: torch.Tensor,
           new_value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None,
           fill=None, softcap: float | None = None, sinks: torch.Tensor | None = None,
           window: int | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
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
        softcap, sinks: logit soft-capping and learned sink logits ``[Hq]`` (:func:`dense_attention`), or None.
        window: a sliding-window layer's window: only the last ``window - 1 + q`` keys are read (the ones its
            queries can see; the mask hides the older ones a layer may still hold), as transformers' own layer
            holds them.
        order: int64 ``[B, >= T]``, the model's position of each stored position where the storage holds a row's
            tokens in another order (a left-padded prompt: :mod:`oscar_hf.cache.padding`), or None: K and V are put
            back in the model's order, so that attention matches the model's to the bit where nothing is quantized.
    Returns:
        ``[B, q, Hq, D]``.
    """
    past = sum(packed.lengths()[:3]) - new_key.shape[2]
    k, v = (materialize(packed, side, past, new=new, fill=fill)
            for side, new in (("key", new_key), ("value", new_value)))
    if order is not None:
        index = order[:, None, : k.shape[2], None].expand(k.shape)
        k, v = torch.empty_like(k).scatter_(2, index, k), torch.empty_like(v).scatter_(2, index, v)
    q_len, kv_len = query.shape[2], k.shape[2]
    visible = kv_len if window is None else min(kv_len, window - 1 + q_len)
    if attention_mask is not None:
        attention_mask = attention_mask[..., kv_len - visible : kv_len]
    k, v, kv_len = k[:, :, kv_len - visible :], v[:, :, kv_len - visible :], visible
    if packed.lengths()[1] and (softcap is not None or sinks is not None):
        return dense_attention(module, query, k, v, attention_mask, scaling, softcap, sinks)
    if attention_mask is None and 1 < q_len < kv_len:
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    return model_attention(module, query, k, v, attention_mask, scaling, softcap, sinks)
