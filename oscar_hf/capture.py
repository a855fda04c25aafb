"""Read post-norm, post-RoPE q, k and v exactly where the cache sees them, with no dump to disk.

``CaptureCache`` is passed as the model's cache; it stores nothing. Its layers hand K/V to the
"oscar" attention function as :class:`CapturedKV`, which calls the observer's ``observe`` with
the query, K, V and the attention output of every layer, then returns the normal sdpa result.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward


class Observer(Protocol):
    def observe(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        scaling: float,
    ) -> None:
        """query ``[B, Hq, T, D]``, key/value ``[B, H, T, D]``, output ``[B, Hq, T, D]``, all unpadded."""


class CapturedKV:
    """K or V of one layer on its way to the attention function."""

    __slots__ = ("layer", "states")

    def __init__(self, layer: "CaptureLayer", states: torch.Tensor):
        self.layer, self.states = layer, states

    def attend(self, module, query, value: "CapturedKV", attention_mask, scaling) -> tuple[torch.Tensor, None]:
        """Plain sdpa over the raw K/V, reporting q, k, v and the output to the observer."""
        out, _ = sdpa_attention_forward(module, query, self.states, value.states, attention_mask, scaling=scaling)
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        self.layer.observer.observe(
            self.layer.layer_idx, query, self.states, value.states, out.transpose(1, 2), scaling
        )
        return out, None


class CaptureLayer(CacheLayerMixin):
    """A cache layer that keeps nothing: every forward is a fresh, unpadded sequence."""

    is_sliding = False

    def __init__(self, observer: Observer, layer_idx: int):
        super().__init__()
        self.observer, self.layer_idx = observer, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[CapturedKV, CapturedKV]:
        return CapturedKV(self, key_states), CapturedKV(self, value_states)

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def get_max_length(self) -> int:
        return -1


class CaptureCache(Cache):
    """The cache of a capture forward: one CaptureLayer per model layer."""

    def __init__(self, observer: Observer, num_layers: int):
        super().__init__(layers=[CaptureLayer(observer, i) for i in range(num_layers)])


@torch.no_grad()
def run_capture(model: torch.nn.Module, observer: Observer, input_ids: torch.Tensor) -> None:
    """One forward of unpadded ``input_ids [B, L]`` with every layer's q, k, v sent to ``observer``."""
    from .cache import enable
    from .model_support import ModelShape, cache_kwargs

    enable(model)
    cache = CaptureCache(observer, ModelShape.from_config(model.config).num_layers)
    model(input_ids=input_ids.to(model.device), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
