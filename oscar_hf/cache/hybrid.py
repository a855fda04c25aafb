"""Layers that keep a linear-attention or state-space state beside their attention storage, or store nothing."""

from __future__ import annotations

import functools

import torch
from transformers import cache_utils

from .segments import tensor_bytes

# The cache layer of a layer that reads an earlier layer's K/V (KV sharing) and stores none: transformers' own
# (an empty DynamicLayer where transformers has none)
NoKVLayer = getattr(cache_utils, "DummyLayer", cache_utils.DynamicLayer)


@functools.cache
def with_state(attention_layer: type) -> type:
    """``attention_layer`` with a linear-attention / state-space layer's conv and recurrent states beside it (the
    "hybrid" layers of Falcon-H1 and Zamba), as transformers' LinearAttentionAndFullAttentionLayer combines them."""
    state_layer = cache_utils.LinearAttentionLayer

    class WithState(state_layer, attention_layer):
        def __init__(self, *args, number_of_states: int = 1, **kwargs):
            attention_layer.__init__(self, *args, **kwargs)
            state_layer.__init__(self, number_of_states=number_of_states)

        def lazy_initialization(self, *args, **kwargs) -> None:
            if len(args) == 2 and not kwargs:  # K/V, from update
                attention_layer.lazy_initialization(self, *args)
            else:  # conv or recurrent states, from update_conv_state / update_recurrent_state
                state_layer.lazy_initialization(self, **kwargs)

        def reset(self) -> None:
            state_layer.reset(self)
            attention_layer.reset(self)

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            state_layer.reorder_cache(self, beam_idx)
            attention_layer.reorder_cache(self, beam_idx)

        def crop(self, tokens_to_remove: int) -> None:
            state_layer.crop(self, tokens_to_remove)
            attention_layer.crop(self, tokens_to_remove)

        is_compileable = attention_layer.is_compileable
        is_croppable = False  # a recurrent state cannot be taken back
        get_max_length = attention_layer.get_max_length
        get_seq_length = attention_layer.get_seq_length

    WithState.__name__ = WithState.__qualname__ = f"{attention_layer.__name__}WithState"
    return WithState


def state_bytes(layer) -> int:
    """Bytes of a layer's linear-attention / state-space states (conv and recurrent), if it keeps any."""
    return tensor_bytes(getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None))
