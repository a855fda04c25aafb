"""Calibration's view of a model: post-norm, post-RoPE q, k and v exactly where the cache sees them, with no dump
to disk.

:func:`run_capture` runs a forward with ``CaptureCache`` (which stores nothing) and calibration's own attention
function, ``"oscar_capture"``: its layers hand K/V to it as :class:`CapturedKV`, and it calls the observer's
``observe`` with the query, K, V and the attention output of every layer, then returns the normal sdpa result.
Under tensor parallelism the observer gets every head on every rank (the ranks' shares gathered).
"""

from __future__ import annotations

import contextvars
from typing import Protocol

import torch
from transformers import AttentionInterface, AttentionMaskInterface, cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .model_support import ModelShape, cache_kwargs, check_model_supported
from .parallel import TensorParallel

CAPTURE_IMPLEMENTATION = "oscar_capture"


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
        """Plain sdpa over the raw K/V, reporting q, k, v and the output to the observer. Queries fewer than the keys
        are not reported: they are a layer that reads this layer's K/V (KV sharing), which transformers runs on the
        last token alone in a forward that keeps one logit (a layer's own queries are its keys' tokens)."""
        out, _ = sdpa_attention_forward(module, query, self.states, value.states, attention_mask, scaling=scaling)
        if query.shape[2] != self.states.shape[2]:
            return out, None
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        tensors = (query, self.states, value.states, out.transpose(1, 2))
        tp, (kv_heads, heads) = self.layer.tensor_parallel, self.layer.heads
        if tp is not None:  # the observer sees every head, on every rank
            tensors = [tp.all_heads(x, total) for x, total in zip(tensors, (heads, kv_heads, kv_heads, heads))]
        self.layer.observer.observe(self.layer.layer_idx, *tensors, scaling)
        return out, None


class CaptureLayer(CacheLayerMixin):
    """A cache layer that keeps nothing: every forward is a fresh, unpadded sequence. ``heads``: the layer's (KV heads,
    query heads) in the whole model; ``tensor_parallel``: the model's, where its ranks split them."""

    is_sliding = False

    def __init__(self, observer: Observer, layer_idx: int, heads: tuple[int, int],
                 tensor_parallel: TensorParallel | None = None):
        super().__init__()
        self.observer, self.layer_idx = observer, layer_idx
        self.heads, self.tensor_parallel = heads, tensor_parallel

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


class LatentCaptureLayer(CaptureLayer):
    """A multi-head latent attention layer's capture: the latent ``[B, 1, T, r]`` (K in ``update``) and the
    attention each of its tokens receives go to the observer's ``observe_latent`` (where it has one); the latent and
    the RoPE key go back as tensors, for the model to expand and attend over."""

    QUERY_CHUNK = 256  # query rows per step of the attention weights (bounds their [B, H, chunk, T] memory)

    def update(self, latent, rope, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        self.latent = latent
        return latent, rope

    def attention_received(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        """Report the latent with each token's attention weight, summed over the (causal) queries and averaged over
        heads, ``[B, T]``: the weight of its row in the latent's covariance."""
        observe = getattr(self.observer, "observe_latent", None)
        if observe is None:
            return
        t = key.shape[2]
        weights = torch.zeros(key.shape[0], t, device=key.device)
        for start in range(0, query.shape[2], self.QUERY_CHUNK):
            q = query[:, :, start:start + self.QUERY_CHUNK].float()
            rows = torch.arange(start, start + q.shape[2], device=key.device)
            causal = rows[:, None] >= torch.arange(t, device=key.device)[None, :]
            logits = (q @ key.float().transpose(2, 3) * scaling).masked_fill(~causal, -torch.inf)
            weights += logits.softmax(-1).sum(dim=2).mean(dim=1)
        tp = self.tensor_parallel
        if tp is not None and tp.is_split(query.shape[1], self.heads[1]):
            weights = tp.mean(weights)
        observe(self.layer_idx, self.latent, weights)


class CaptureCache(Cache):
    """The cache of a capture forward: a CaptureLayer per attention layer; transformers' state layer for a
    linear-attention or state-space layer (beside the CaptureLayer where a layer has both)."""

    def __init__(self, observer: Observer, shape: ModelShape, tensor_parallel: TensorParallel | None = None):
        from .cache import _with_state

        layers = []
        attention = LatentCaptureLayer if shape.latent is not None else CaptureLayer
        for i in range(shape.num_layers):
            args = (observer, i, (shape.kv_heads[i], shape.num_heads), tensor_parallel)
            if not shape.has_state(i):
                layers.append(attention(*args))
            elif shape.attention(i) is None:
                layers.append(cache_utils.LinearAttentionLayer(number_of_states=shape.states[i]))
            else:
                layers.append(_with_state(attention)(*args, number_of_states=shape.states[i]))
        super().__init__(layers=layers)


_ACTIVE: contextvars.ContextVar[CaptureCache | None] = contextvars.ContextVar("oscar_capture_cache", default=None)


def capture_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs):
    """The ``"oscar_capture"`` attention: CapturedKV to the observer and sdpa, plain tensors to sdpa (a latent
    attention layer's expanded K/V: the attention its tokens receive goes to the observer first)."""
    if isinstance(key, CapturedKV):
        return key.attend(module, query, value, attention_mask, scaling)
    cache, index = _ACTIVE.get(), getattr(module, "layer_idx", None)
    if cache is not None and index is not None and isinstance(cache.layers[index], LatentCaptureLayer):
        layer = cache.layers[index]
        if query.shape[2] == key.shape[2]:  # the layer's own tokens (see CapturedKV.attend)
            layer.attention_received(query, key, query.shape[-1] ** -0.5 if scaling is None else scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _attention_implementations(config) -> dict:
    """The attention implementation of ``config`` and of each of its sub-configs, in the nested form that
    ``set_attn_implementation`` takes (composite models may run different ones in their parts)."""
    implementations = {"": config._attn_implementation}
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            implementations[key] = _attention_implementations(sub)
    return implementations


@torch.no_grad()
def run_capture(model: torch.nn.Module, observer: Observer, input_ids: torch.Tensor) -> None:
    """One forward of unpadded ``input_ids [B, L]`` with every layer's q, k, v sent to ``observer``; the model's
    attention implementation is restored afterwards."""
    check_model_supported(model)
    previous = _attention_implementations(model.config)
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    try:
        cache = CaptureCache(observer, ModelShape.from_config(model.config), TensorParallel.of(model))
        token = _ACTIVE.set(cache)
        try:
            model(input_ids=input_ids.to(model.device), **cache_kwargs(model, cache), use_cache=True,
                  logits_to_keep=1)
        finally:
            _ACTIVE.reset(token)
    finally:
        model.set_attn_implementation(previous)


AttentionInterface.register(CAPTURE_IMPLEMENTATION, capture_attention_forward)
AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, sdpa_mask)
