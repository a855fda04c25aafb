"""The "oscar" attention implementation: attention over the OSCAR cache (the kernels handle the history's rotations).

Registered with transformers' AttentionInterface (and the matching sdpa mask function, without which left padding
would be silently ignored) when oscar_hf is imported.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import sdpa_mask

from .cache import ATTN_IMPLEMENTATION, OscarKV
from .kernels import attention_backend
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

    K/V that are plain tensors (no cache, another cache, sliding-window layers) go to sdpa; OscarKV handles to the
    kernel backend named by the cache's OscarConfig. A static layer's one-token steps read the cache on the device
    (no graph break under torch.compile); everything else runs eagerly. Logit soft-capping (``softcap``, Gemma-2)
    and learned sink logits (``s_aux [Hq]``, gpt-oss) are applied by the decode kernel and by the torch path
    (:func:`dense_attention`).
    """
    if (isinstance(key, OscarKV) and key.layer.graph_step and query.shape[2] == 1
            and kwargs.get("sliding_window") is None
            and (attention_mask is None or attention_mask.dtype == torch.bool)):
        from .kernels.decode.triton import decode_static  # imported on first use (TRITON_INTERPRET)

        layer = key.layer
        rotated = layer.store_pending(query)  # the step's token, stored by a kernel that rotates q as well
        return decode_static(query, layer.packed(), attention_mask, scaling, layer.decode_splits, rotated,
                             kwargs.get("softcap"), kwargs.get("s_aux")), None
    return _attend_on_host(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


@torch.compiler.disable  # a graph break inside a compiled forward
def _attend_on_host(module, query, key, value, attention_mask, dropout, scaling, **kwargs):
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if not isinstance(key, OscarKV):  # the model's own K/V (a sliding-window layer's, or another cache's)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("softcap", "s_aux")}
        return model_attention(module, query, key, value, attention_mask, scaling, softcap, sinks, dropout=dropout,
                               **kwargs), None
    layer = key.layer
    layer.check_flags()  # (stores a token a graph step left pending first)
    if kwargs.get("sliding_window") is not None and not layer.is_sliding:
        raise NotImplementedError("a sliding-window attention layer reached an OSCAR full-attention cache layer")
    attend = attention_backend(layer.config.backend, query.device)
    out = attend(module, query, layer.packed(), key.new, value.new, attention_mask, scaling,
                 layer.config.recent_tokens, softcap=softcap, sinks=sinks,
                 window=layer.sliding_window if layer.is_sliding else None)
    return out, None


def register() -> None:
    """Make ``attn_implementation="oscar"`` available to every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, oscar_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
