"""The static layer: every buffer at its final size, counts on the device, and device-only decode steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import OscarConfig
from ..kernels import resolve
from ..kernels.decode import launch as decode_launch
from ..kernels.flags import raise_for_flags
from .layer import SIDES, KVOscarLayer, OscarKV, stored
from .segments import Segment

if TYPE_CHECKING:
    from ..codebooks import KeyCodebook

BEFORE_STEP = 4  # counts[4:8]: the counts before the last graph step, or counts[4] = -1


class StaticOscarLayer(KVOscarLayer):
    """An OSCAR layer with every buffer at its final size from the first update (``max_cache_len`` tokens), a fixed
    attention-mask size, and its counts in an int32 device tensor: compileable.

    Where the Triton kernels serve it, a one-token update is a graph step: the token waits for the attention call,
    whose append kernel stores it and rotates the query in one launch, and the decode kernel reads the counts on the
    device (no host synchronisation; one CUDA graph per model step under ``torch.compile``). The counts before the
    last graph step (``counts[4:8]``, -1 where host-side code changed the layer since) let ``crop(-1)`` undo it
    exactly. The recent window is a ring buffer (one more row than it holds).
    """

    is_compileable = True
    flags = stored("_flags", "int32 [2] on the device: the error word the append kernel sets, and its arrival count")

    def __init__(self, config: OscarConfig, key_rotation: torch.Tensor, value_rotation: torch.Tensor,
                 max_cache_len: int, *, key_codebook: KeyCodebook | None = None):
        super().__init__(config, key_rotation, value_rotation, key_codebook=key_codebook)
        self.max_cache_len = max_cache_len
        # While True (oscar_hf.generation's overlapped loop), the length is read as a device tensor, without
        # synchronising, and what the device flagged is raised once the loop ends.
        self.defers_host_reads = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Every buffer at its final size, the counts and the flags (errors, and the append kernel's arrival count)
        on the device, all at static addresses for CUDA graphs."""
        super().lazy_initialization(key_states, value_states)
        cfg = self.config
        self.sink.grow_window(0, min(cfg.sink_tokens, self.max_cache_len), cfg.sink_tokens)
        self.recent.grow_window(0, min(self.recent_limit + 1, self.max_cache_len), self.recent_limit + 1)
        self.history.grow(0, max(0, self.max_cache_len - cfg.sink_tokens - cfg.recent_tokens))
        self._counts = torch.tensor([0, 0, 0, 0, -1, -1, -1, -1], dtype=torch.int32, device=self.device)
        self.flags = torch.zeros(2, dtype=torch.int32, device=self.device)
        if not torch.compiler.is_compiling():
            rotations = [r for r in map(self.rotation, SIDES) if r is not None]
            for t in (*self._tensors(), self._counts, self.flags, *rotations):
                torch._dynamo.mark_static_address(t)
        self.graph_step = self._graph_step_supported()
        if self.graph_step:
            self._decode_splits = decode_launch.plan(self.packed(), key_states.shape[0])  # one launch shape

    def _graph_step_supported(self) -> bool:
        """Whether the Triton append and decode kernels serve every one-token step of this layer."""
        cfg = self.config
        if resolve(cfg.backend, self.device) != "triton":
            return False
        from ..kernels.write.triton import supports as write_supports

        return decode_launch.supports_storage(self.packed(), cfg.recent_tokens) and write_supports(
            self.sink["key"], self.group_size, cfg.quantizer, *cfg.side_bits.values())

    def counts_changed_on_host(self) -> None:
        if self.counts_on_device:
            self._counts[BEFORE_STEP] = -1  # the last graph step can no longer be undone

    # -------------------------------------------------------------------------------- writes
    def _takes_graph_step(self, key_states: torch.Tensor) -> bool:
        return self.graph_step and key_states.shape[2] == 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[OscarKV, OscarKV]:
        """Take new K/V ``[B, H, n, D]``. A graph step's token is stored by the attention call (its append kernel also
        rotates the query) or else by the layer's next read; nothing here synchronises."""
        if not (self.is_initialized and self._takes_graph_step(key_states)):
            return super().update(key_states, value_states)
        self.counts  # noqa: B018  (stores an earlier pending update first)
        self._last_update = None
        self._pending = (key_states, value_states)
        return OscarKV(self, key_states), OscarKV(self, value_states)

    @torch.compiler.disable  # a graph break inside a compiled forward
    def _prepare(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super()._prepare(key_states, value_states)
        if (length := self.length) + key_states.shape[2] > self.max_cache_len:
            raise ValueError(
                f"OscarQuantizedCache(max_cache_len={self.max_cache_len}) cannot take {key_states.shape[2]} more "
                f"tokens after {length}: build it with a larger max_cache_len (prompt + max_new_tokens)"
            )

    def _store_pending(self, attention_mask: torch.Tensor | None = None, query: torch.Tensor | None = None):
        """Store the pending update; a graph step's by the append kernel, which returns ``query [B, Hq, 1, D]``
        rotated by R_K in the same launch (None without a query or for an identity R_K)."""
        if self._pending is None:
            return None
        key, value = self._pending
        if not self._takes_graph_step(key):
            super()._store_pending(attention_mask)
            if self._padding is not None:  # the graph steps' masks have max_cache_len keys
                self._padding.index_masks_of(self.max_cache_len)
            return None
        self._pending = None
        from ..kernels.append.triton import append

        cfg = self.config
        clip = cfg.side_clip
        return append(self.packed(), key, value, flags=self.flags, max_len=self.max_cache_len,
                      sink_tokens=cfg.sink_tokens, limit=self.recent_limit, flush=cfg.flush_tokens,
                      k_clip=clip["key"], v_clip=clip["value"], key_rotation=self.rotation("key"),
                      value_rotation=self.rotation("value"), query=query)

    def check_flags(self) -> None:
        """Raise what the device-side steps flagged (non-finite K/V, a scale overflow, a full cache)."""
        self.counts  # noqa: B018  (stores a pending update first)
        if self.counts_on_device and self.is_initialized:
            raise_for_flags(int(self.flags[0]), self.config.meta_dtypes[0])

    def _unroll_recent(self) -> None:
        start = self.recent_start
        if start:
            for t in self.recent.tensors.values():
                t.copy_(t.roll(-start, dims=2))
            self.recent_start = 0

    def _reserve(self, segment: Segment, used: int, needed: int, limit: int) -> None:
        """Every buffer has its final size: nothing to reserve."""

    def _reserve_history(self, needed: int) -> None:
        """Every buffer has its final size: nothing to reserve."""

    # --------------------------------------------------------------------------------- reads
    def attend(self, module, query, new_key, new_value, attention_mask, scaling, *, softcap=None, s_aux=None,
               sliding_window=None, **kwargs):
        """As :meth:`KVOscarLayer.attend`; a one-token query of a graph-step layer is device-only operators (the
        pending token's append, then the decode kernel over the device counts), traced whole by torch.compile."""
        if not (self.graph_step and query.shape[2] == 1 and sliding_window is None
                and (attention_mask is None or attention_mask.dtype == torch.bool)):
            return super().attend(module, query, new_key, new_value, attention_mask, scaling, softcap=softcap,
                                  s_aux=s_aux, sliding_window=sliding_window)
        from ..kernels.decode.triton import decode_static  # imported on first use (TRITON_INTERPRET)

        rotated = self._store_pending(query=query)
        if self._padding is not None and attention_mask is not None:
            attention_mask = self._padding.mask(attention_mask)
        return decode_static(query, self.packed(), attention_mask, scaling, self._decode_splits, rotated, softcap,
                             s_aux), None

    # ------------------------------------------------------------------ cache bookkeeping API
    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens stored: an int, after raising what the device flagged; or a 0-d device tensor, without
        synchronising, inside a compiled region (no graph break) and while ``defers_host_reads``."""
        if self.counts_on_device and (torch.compiler.is_compiling() or self.defers_host_reads):
            return self.counts[:3].sum()
        return super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0  # a fixed size, so that a compiled forward sees one mask shape

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if not self.counts_on_device:
            return super().reset()
        self._last_update = self._pending = self._padding = None
        self._counts.zero_()  # in place: compiled graphs hold these addresses
        self._counts[BEFORE_STEP] = -1
        self.flags.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """As :meth:`KVOscarLayer.crop`; ``crop(-1)`` right after a graph step undoes that step exactly."""
        counts = self.counts
        if (int(tokens_to_remove) == -1 and self.counts_on_device and self._last_update is None
                and int(counts[BEFORE_STEP]) >= 0):
            counts[:BEFORE_STEP] = counts[BEFORE_STEP:].clone()
            counts[BEFORE_STEP] = -1
            return
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.counts_on_device:
            return super().reorder_cache(beam_idx)
        self.counts  # noqa: B018  (stores a pending update first)
        self._last_update = None
        for t in self._tensors():  # in place: compiled graphs hold these addresses
            t.copy_(t.index_select(0, beam_idx.to(t.device)))
        if self._padding is not None:
            self._padding.map(lambda t: t.index_select(0, beam_idx.to(t.device)))
