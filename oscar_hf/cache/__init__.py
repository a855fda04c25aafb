"""The OSCAR cache: per full-attention layer and KV head, ``sink ‖ history ‖ recent`` in a
:class:`~oscar_hf.kernels.PackedKV`'s layout.

* ``sink``    model dtype ``[B, H, ≤ sink_tokens, D]``: the first tokens, as the model produced them;
* ``history`` rotated (``k @ R_K``, ``v @ R_V``; ``R [D, D]`` shared by the layer's KV heads, or ``[H, D, D]``)
  packed codes with scales and zeros, per token (per channel too for per-channel K: :mod:`oscar_hf.layouts`);
  ``center`` fp32 ``[B, H, 1, D]`` per centered side, set by the first tokens to reach an empty history, which then
  stores ``x @ R - center``;
* ``recent``  model dtype ``[B, H, ≤ recent_tokens + flush_tokens - 1, D]``: the newest tokens, rotated and demoted
  to the history ``flush_tokens`` at a time.

Only what is quantized is rotated, so attention over tokens that never leave the windows is the model's own.

Modules, in the order data flows: :mod:`.segments` (preallocated rows), :mod:`.padding` (left-padded prompts),
:mod:`.layer` (what every layer shares; the K/V layer's host-side writes and reads; the growing layer),
:mod:`.sliding`, :mod:`.static` (device counts, graph steps), :mod:`.latent` (MLA), :mod:`.hybrid` (layers with
linear-attention states), :mod:`.quantized_cache` (:class:`OscarQuantizedCache`, which builds a layer per model
layer). Sliding-window and chunked-attention layers keep transformers' own layer unless quantized; under tensor
parallelism each rank's cache holds the KV heads that rank computes.
"""

from .hybrid import NoKVLayer, with_state
from .latent import LATENT_ABSORBED, LatentOscarLayer
from .layer import DynamicOscarLayer, KVOscarLayer, OscarKV, OscarLayer
from .quantized_cache import ATTN_IMPLEMENTATION, OscarQuantizedCache, cache_nbytes, dense_layer_bytes, enable
from .sliding import SlidingOscarLayer
from .static import StaticOscarLayer

__all__ = ["ATTN_IMPLEMENTATION", "LATENT_ABSORBED", "DynamicOscarLayer", "KVOscarLayer", "LatentOscarLayer",
           "NoKVLayer", "OscarKV", "OscarLayer", "OscarQuantizedCache", "SlidingOscarLayer", "StaticOscarLayer",
           "cache_nbytes", "dense_layer_bytes", "enable", "with_state"]
