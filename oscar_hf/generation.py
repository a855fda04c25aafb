"""Overlapped decoding: transformers' greedy/sampling loop with the host one step ahead of the GPU.

``generate`` decides after every step whether to stop by reading a flag from the GPU, so the host prepares and launches
step t+1 only once step t has finished, and the GPU idles meanwhile (for an 8B model on an H100, 2-5 ms of a 10-16 ms
step: eval/results/README.md). transformers has the cure, ``DeferredStopCheck`` (the flag is copied asynchronously and
read one step late; the one step too many that this runs is undone with ``crop(-1)``), but enables it on Apple GPUs
only. :func:`overlapped_sample` runs transformers' own loop with it enabled on every accelerator::

    cache = OscarQuantizedCache.from_pretrained(src, model=model, max_cache_len=prompt_len + max_new_tokens)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=max_new_tokens,
                         custom_generate=oscar_hf.overlapped_sample)

A cache that generate returns (one passed in, or ``return_dict_in_generate=True``) must be croppable by a step
(``Cache.is_croppable``; OSCAR's caches are), else the loop synchronises every step as usual.
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import torch
import transformers
from transformers.generation import utils as generation_utils
from transformers.generation.configuration_utils import GenerationMode

from .cache import OscarLayer, OscarQuantizedCache

MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


@functools.cache
def deferred_stop_check() -> type:
    """transformers' ``DeferredStopCheck``, supported wherever torch has events (not on the CPU)."""
    base = getattr(generation_utils, "DeferredStopCheck", None)
    if base is None:
        raise ImportError(f"overlapped_sample needs transformers' DeferredStopCheck, which transformers "
                          f"{transformers.__version__} does not have (5.17 to 5.24 do)")

    class DeferredOnEveryAccelerator(base):
        @staticmethod
        def is_supported(device: torch.device, cache, cache_is_returned: bool, is_assistant: bool) -> bool:
            if device.type == "cpu" or is_assistant:
                return False
            return cache is None or not cache_is_returned or cache.is_croppable

    return DeferredOnEveryAccelerator


def _check_capacity(cache, max_length: int) -> None:
    """Raise before decoding if a static OscarLayer cannot hold what generate stores (``max_length - 1`` tokens:
    every token but the last generated one). With the stop check deferred, the host no longer reads the counts
    every step, so a full cache would otherwise only be reported after the call."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, OscarLayer) and layer.max_cache_len is not None and max_length - 1 > layer.max_cache_len:
            raise ValueError(
                f"OscarQuantizedCache(max_cache_len={layer.max_cache_len}) cannot hold the {max_length - 1} tokens "
                "this generate call may store (prompt + max_new_tokens - 1): build it with a larger max_cache_len"
            )


def overlapped_sample(model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                      synced_gpus: bool = False, **model_kwargs):
    """``generate``'s decoding loop for ``custom_generate=``: ``GenerationMixin._sample`` (greedy search or
    sampling) with its stop check deferred by a step on every accelerator, and OSCAR's static layers reading their
    length on the device meanwhile. Returns what ``generate`` returns.

    transformers passes no ``streamer`` to a ``custom_generate`` callable. While the call runs, transformers'
    ``DeferredStopCheck`` is replaced for the whole process, so a generate in another thread may defer too.
    """
    mode = generation_config.get_generation_mode()
    if mode not in MODES:
        raise ValueError(f"overlapped_sample runs greedy search and sampling, not {mode.value}: drop custom_generate "
                         "to let generate choose the loop")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))  # transformers 5.24 calls it cache
    _check_capacity(cache, generation_config.max_length)
    deferred = cache.host_reads_deferred() if isinstance(cache, OscarQuantizedCache) else contextlib.nullcontext()
    with deferred, mock.patch.object(generation_utils, "DeferredStopCheck", deferred_stop_check()):
        return model._sample(input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                             **model_kwargs)
