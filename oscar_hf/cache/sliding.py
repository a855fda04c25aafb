"""Sliding-window layers stored like full ones (``OscarConfig.quantize_sliding``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import OscarConfig
from .layer import DynamicOscarLayer, OscarKV
from .segments import aligned

if TYPE_CHECKING:
    from ..codebooks import KeyCodebook


class SlidingOscarLayer(DynamicOscarLayer):
    """A sliding-window layer stored like a full one (sink, INT2 body, recent window), holding the tokens that later
    queries can still see: those older than ``sliding_window - 1`` are dropped, the sink first, then the history from
    its front, in steps of at least ``EVICTION_STEP`` tokens (the tokens kept past the window are masked out by the
    model's sliding-window mask, which is built from :meth:`get_mask_sizes`'s offset). Once dropped, the sink is not
    refilled. Host-side updates only. A left-padded prompt is stored in the model's order (its pads leave first)."""

    is_sliding = True
    reorders_padding = False
    EVICTION_STEP = 64

    def __init__(self, config: OscarConfig, key_rotation: torch.Tensor, value_rotation: torch.Tensor,
                 sliding_window: int, *, key_codebook: KeyCodebook | None = None):
        super().__init__(config, key_rotation, value_rotation, key_codebook=key_codebook)
        self.sliding_window = sliding_window
        self.dropped = 0  # tokens dropped from the front: the position of the first one held

    def _sink_room(self) -> int:
        return 0 if self.dropped else super()._sink_room()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[OscarKV, OscarKV]:
        self._drop_old()
        return super().update(key_states, value_states, *args, **kwargs)

    def _droppable(self) -> tuple[int, int]:
        """(sink, history) tokens the next update drops: none until at least EVICTION_STEP tokens (and the whole
        sink, which leaves first) are older than the ``sliding_window - 1`` that its first query can see."""
        if not self.is_initialized:
            return 0, 0
        excess = self.length - (self.sliding_window - 1)
        unit = self.config.demotion_unit
        if excess < max(self.EVICTION_STEP, unit, self.n_sink):
            return 0, 0
        return self.n_sink, min(self.n_history, (excess - self.n_sink) // unit * unit)

    def _drop_old(self) -> None:
        sink, history = self._droppable()
        if not sink + history:
            return
        self._last_update = None  # a crop can no longer take the last update back exactly
        self._padding = None  # the pads leave first: what is left is the rows' own tokens
        if history:
            self.history.drop_front(self.n_history, history)
        self.n_sink, self.n_history = self.n_sink - sink, self.n_history - history
        self.dropped += sink + history
        if sink:
            self.sink.grow(0, 0)  # the sink is not refilled: free it
        if self.history.capacity > 2 * self._history_limit():  # after a long prompt, stored whole
            self.history.grow(self.n_history, self._history_limit())

    def _history_limit(self) -> int:
        """History tokens a layer holds at most between prompts: about a window, the dropping step and a demotion."""
        step = max(self.EVICTION_STEP, self.config.demotion_unit, self.config.sink_tokens)
        return aligned(self.sliding_window + step + self.config.demotion_unit)

    def _reserve_history(self, needed: int) -> None:
        if needed <= self._history_limit() and self.history.capacity < needed:
            self.history.grow(self.n_history, self._history_limit())
        super()._reserve_history(needed)

    def get_seq_length(self) -> int:
        """Tokens seen (held and dropped): the next token's position."""
        return self.dropped + super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys the next update's attention reads, the first one's position): what the model builds the mask for
        before the update, which drops the old tokens first."""
        dropped = sum(self._droppable())
        return self.length - dropped + query_length, self.dropped + dropped

    def get_max_length(self) -> int:
        return self.sliding_window

    def reset(self) -> None:
        super().reset()
        self.dropped = 0

    def crop(self, tokens_to_remove: int) -> None:
        if -int(tokens_to_remove) > self.length:
            raise ValueError(f"cannot crop {-int(tokens_to_remove)} tokens from a sliding-window layer that holds "
                             f"{self.length} (the older ones have left its window)")
        super().crop(tokens_to_remove)
