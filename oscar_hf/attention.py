"""The "oscar" attention implementation: rotate q, attend over the OSCAR cache, rotate the output back.

Registered with transformers' AttentionInterface (and the matching sdpa mask function, without
which left padding would be silently ignored) when oscar_hf is imported.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .cache import ATTN_IMPLEMENTATION, OscarKV
from .capture import CapturedKV
from .kernels import attention_backend

UNSUPPORTED_KWARGS = {"softcap": "attention logit soft-capping", "s_aux": "learned attention sinks"}


@torch.compiler.disable  # the kernels take per-step lengths: a graph break inside a compiled forward
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

    K/V that are plain tensors (no cache, another cache, sliding-window layers) go to sdpa.
    OscarKV handles go to the backend named by the cache's OscarConfig; CapturedKV (calibration)
    to sdpa, reporting the tensors to its observer.
    """
    if isinstance(key, CapturedKV):
        return key.attend(module, query, value, attention_mask, scaling)
    if not isinstance(key, OscarKV):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for name, feature in UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"OscarQuantizedCache does not support {feature} ({name}=...)")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("a sliding-window attention layer reached an OSCAR (full-attention) cache layer")
    layer = key.layer
    rotated_query = (query.float() @ layer.key_rotation).to(query.dtype)
    attend = attention_backend(layer.config.backend, query.device)
    out = attend(module, rotated_query, key, value, attention_mask, scaling)
    return (out.float() @ layer.value_rotation.mT).to(query.dtype), None


def register() -> None:
    """Make ``attn_implementation="oscar"`` available to every transformers model."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, oscar_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
