"""The "oscar" attention implementation: dispatch to the K handle the cache returned, or the model's own attention.

Registered with transformers' AttentionInterface (and the matching sdpa mask function, without which left padding
would be silently ignored) when oscar_hf is imported.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from .cache import ATTN_IMPLEMENTATION
from .kernels.decode.reference import model_attention


def oscar_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for ``query [B, Hq, q, D]`` (post-RoPE) → ``([B, q, Hq, D], None)``.

    ``key`` and ``value`` are what the cache's ``update`` returned: plain tensors (no cache, another cache, a layer
    kept in the model dtype) get the model's own attention; a handle (an OSCAR layer's, or calibration's capture)
    attends itself: ``key.attend(module, query, value, attention_mask, scaling, **kwargs)``.
    """
    if getattr(type(key), "attend", None) is None:
        return _model_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs), None
    return key.attend(module, query, value, attention_mask, scaling, dropout=dropout, **kwargs)


@torch.compiler.disable  # a graph break inside a compiled forward
def _model_attention(module, query, key, value, attention_mask, dropout, scaling, softcap=None, s_aux=None,
                     **kwargs):
    return model_attention(module, query, key, value, attention_mask, scaling, softcap, s_aux, dropout=dropout,
                           **kwargs)


def register() -> None:
    """Make ``attn_implementation="oscar"`` available to every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, oscar_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
