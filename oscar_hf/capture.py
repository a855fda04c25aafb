"""Calibration's view of a model: post-norm, post-RoPE q, k and v exactly where the cache sees them, with no dump
to disk.

:func:`run_capture` runs a forward with ``CaptureCache`` (which stores nothing) under the ``"oscar"`` attention: its
layers hand K/V to the attention function as :class:`CapturedKV`, whose ``attend`` calls the observer's ``observe``
with the query, K, V and the attention output of every layer and returns the model's own attention. A model on
another implementation is left on ``"oscar"``, as :func:`oscar_hf.enable` leaves it: over plain tensors that is SDPA
(or the model's eager attention for soft-capped and sink logits), and nothing is switched back and forth, so other
users of the model (another thread's ``generate``, another calibration) see one implementation throughout. Under
tensor parallelism the observer gets every head on every rank (the ranks' shares
gathered).
"""

from __future__ import annotations

import contextvars
from typing import Protocol

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import oscar_attention_forward
from .cache.hybrid import with_state
from .model_support import ModelShape, cache_kwargs
from .parallel import TensorParallel


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

    def attend(self, module, query, value: "CapturedKV", attention_mask, scaling,
               **kwargs) -> tuple[torch.Tensor, None]:
        """The model's own attention over the raw K/V (the "oscar" attention over tensors: soft-capped and sink logits
        included), reporting q, k, v and the output to the observer. Queries fewer than the keys are not reported: they
        are a layer that reads this layer's K/V (KV sharing), which transformers runs on the last token alone in a
        forward that keeps one logit (a layer's own queries are its keys' tokens)."""
        out, _ = oscar_attention_forward(module, query, self.states, value.states, attention_mask, scaling=scaling,
                                         **kwargs)
        if query.shape[2] != self.states.shape[2]:
            return out, None
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        tensors = (query, self.states, value.states, out.transpose(1, 2))
        tp, (kv_heads, heads) = self.layer.tensor_parallel, self.layer.heads
        if tp is not None:  # the observer sees every head, on every rank
            tensors = [tp.all_heads(x, total) for x, total in zip(tensors, (heads, kv_heads, kv_heads, heads))]
        self.layer.observer.observe(self.layer.layer_idx, *tensors, scaling)
        return out, None


class CapturedLatent(torch.Tensor):
    """A latent attention layer's latent ``[B, 1, T, r]`` on its way through the model's expansion (``kv_b_proj``):
    every tensor computed from it stays one, so the expanded K reaches the attention function as one, and ``attend``
    reports the attention each latent token receives before the model's attention."""

    def attend(self, module, query, value, attention_mask, scaling, **kwargs) -> tuple[torch.Tensor, None]:
        key, value = self.as_subclass(torch.Tensor), value.as_subclass(torch.Tensor)
        if query.shape[2] == key.shape[2]:  # the layer's own tokens (see CapturedKV.attend)
            layer = _ACTIVE.get().layers[module.layer_idx]
            layer.attention_received(query, key, query.shape[-1] ** -0.5 if scaling is None else scaling)
        return oscar_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


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
    attention each of its tokens receives go to the observer's ``observe_latent`` (where it has one); the latent goes
    back as a :class:`CapturedLatent` and the RoPE key as a tensor, for the model to expand and attend over."""

    QUERY_CHUNK = 256  # query rows per step of the attention weights (bounds their [B, H, chunk, T] memory)

    def update(self, latent, rope, *args, **kwargs) -> tuple[CapturedLatent, torch.Tensor]:
        self.latent = latent
        return latent.as_subclass(CapturedLatent), rope

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
        layers = []
        attention = LatentCaptureLayer if shape.latent is not None else CaptureLayer
        for i in range(shape.num_layers):
            args = (observer, i, (shape.kv_heads[i], shape.num_heads), tensor_parallel)
            if not shape.has_state(i):
                layers.append(attention(*args))
            elif shape.attention(i) is None:
                layers.append(cache_utils.LinearAttentionLayer(number_of_states=shape.states[i]))
            else:
                layers.append(with_state(attention)(*args, number_of_states=shape.states[i]))
        super().__init__(layers=layers)


# the CaptureCache of this thread's capture forward (where a CapturedLatent finds its layer)
_ACTIVE: contextvars.ContextVar[CaptureCache | None] = contextvars.ContextVar("oscar_capture_cache", default=None)


@torch.no_grad()
def run_capture(model: torch.nn.Module, observer: Observer, input_ids: torch.Tensor) -> None:
    """One forward of unpadded ``input_ids [B, L]`` with every layer's q, k, v sent to ``observer``. A model on
    another attention implementation is switched to ``"oscar"`` for good, as :func:`oscar_hf.enable` does."""
    from .cache import enable

    enable(model)
    cache = CaptureCache(observer, ModelShape.from_config(model.config), TensorParallel.of(model))
    token = _ACTIVE.set(cache)
    try:
        model(input_ids=input_ids.to(model.device), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    finally:
        _ACTIVE.reset(token)
