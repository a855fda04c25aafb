"""OSCAR cache layers: what every one shares (:class:`OscarLayer`), the full-attention K/V storage with its host-side
writes and reads (:class:`KVOscarLayer`), and the growing layer (:class:`DynamicOscarLayer`).

A layer takes new K/V in ``update`` and hands the attention function :class:`OscarKV` handles; the attention function
calls ``handle.attend``, and the layer attends over its storage. The new tokens are stored at one point,
:meth:`KVOscarLayer._store_pending`: when the layer attends (which knows the attention mask, so a left-padded prompt
is stored row by row as that row alone would be: :mod:`oscar_hf.cache.padding`), or at any other read of the layer's
counts, whichever comes first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import OscarConfig
from ..kernels import PackedKV, attention_backend
from ..kernels.append.reference import rotate_rows
from ..kernels.dequantize.reference import dequantize_history, materialize, unrotate
from ..parallel import TensorParallel
from ..quantizer import QuantizedRows
from .padding import LeftPadding
from .segments import Segment, tensor_bytes

if TYPE_CHECKING:
    from ..codebooks import KeyCodebook

SIDES = ("key", "value")


def is_identity(rotation: torch.Tensor) -> bool:
    """Whether ``rotation`` (``[D, D]``, or ``[H, D, D]`` per KV head) is the identity (every head's)."""
    eye = torch.eye(rotation.shape[-1], dtype=rotation.dtype, device=rotation.device)
    return torch.equal(rotation, eye.expand(rotation.shape))


def stored(private: str, doc: str) -> property:
    """A storage attribute (kept as ``private``) whose read stores a pending update first: no reader sees storage
    without it."""

    def get(self):
        if self._pending is not None:
            self._store_pending()
        return getattr(self, private)

    def set(self, value) -> None:
        setattr(self, private, value)

    return property(get, set, doc=doc)


def _count(index: int, doc: str) -> property:
    """One of a layer's counts as a Python int (reading a static layer's device counts synchronises)."""

    def get(self) -> int:
        return int(self.counts[index])

    def set(self, value: int) -> None:
        self.counts[index] = value
        self.counts_changed_on_host()

    return property(get, set, doc=doc)


class OscarKV:
    """What ``update`` hands to the attention function in place of K or V ``[B, H, T, D]``: the tokens this update
    added (``new``, as given) and the layer that holds the rest."""

    __slots__ = ("layer", "new")

    def __init__(self, layer: "KVOscarLayer", new: torch.Tensor):
        self.layer = layer
        self.new = new

    def attend(self, module, query, value: "OscarKV", attention_mask, scaling, **kwargs):
        """The attention function's call: ``(output [B, q, Hq, D], None)`` (see :meth:`KVOscarLayer.attend`)."""
        return self.layer.attend(module, query, self.new, value.new, attention_mask, scaling, **kwargs)

    @property
    def shape(self) -> torch.Size:
        """``[B, H, T, D]`` with ``T`` the tokens held, this update's included (read without storing them)."""
        b, h, n, d = self.new.shape
        layer = self.layer
        counts = layer._counts.tolist() if layer.counts_on_device else layer._counts
        return torch.Size((b, h, sum(counts[:3]) + (n if layer._pending is not None else 0), d))

    @property
    def dtype(self) -> torch.dtype:
        return self.new.dtype

    @property
    def device(self) -> torch.device:
        return self.new.device

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            "OscarQuantizedCache returned packed K/V to an attention function that is not oscar_hf's. "
            "Build the cache with OscarQuantizedCache.from_pretrained(..., model=model), or call "
            "oscar_hf.enable(model) first."
        )


class OscarLayer(CacheLayerMixin, ABC):
    """Every OSCAR layer: ``sink ‖ quantized history ‖ recent`` per batch row, with counts (sink, history, recent,
    ...) as Python ints or an int32 device tensor, storage segments, and one byte count for every kind."""

    is_compileable = False
    is_sliding = False
    # A crop right after an update leaves no trace, as transformers' rollbacks need (a deferred stop check's extra
    # step, assisted decoding's rejected candidates); other crops keep in the history the tokens that the removed
    # ones pushed there.
    is_croppable = True
    max_cache_len: int | None = None
    tensor_parallel: TensorParallel | None = None  # set by the cache for a tensor-parallel model

    def __init__(self, config: OscarConfig, counts: int):
        super().__init__()
        if config.key_bits_layers is not None:
            raise ValueError("an OSCAR layer takes one layer's config: pass OscarConfig.for_layer(layer_idx), which "
                             "resolves key_bits_layers")
        self.config = config
        self._counts: list[int] | torch.Tensor = [0] * counts
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # an update not stored yet

    counts = stored("_counts", "sink, history and recent tokens (and more, per layer kind): ints or a device tensor")

    def _store_pending(self, attention_mask: torch.Tensor | None = None, query: torch.Tensor | None = None):
        """Store the pending update (layers that defer their writes)."""

    def counts_changed_on_host(self) -> None:
        """Note that host-side code changed the counts (a static layer can no longer undo its last graph step)."""

    n_sink = _count(0, "tokens in the sink")
    n_history = _count(1, "tokens in the quantized history")
    n_recent = _count(2, "tokens in the recent window")

    @property
    def counts_on_device(self) -> bool:
        return isinstance(self._counts, torch.Tensor)

    @property
    def length(self) -> int:
        counts = self.counts.tolist() if self.counts_on_device else self.counts
        return sum(counts[:3])

    def get_seq_length(self) -> int | torch.Tensor:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        raise NotImplementedError("OscarQuantizedCache does not support offloading")

    prefetch = offload

    # ------------------------------------------------------------------ batch rows
    @abstractmethod
    def _segments(self) -> tuple[Segment, ...]:
        """Every segment of the layer's storage (none before its first update)."""

    def _reindex(self, fn) -> None:
        """Apply ``fn`` (a batch-row reordering) to every stored tensor."""
        self.counts  # noqa: B018  (stores a pending update first)
        for segment in self._segments():
            segment.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(lambda t: t[indices])

    # ------------------------------------------------------------------ accounting
    def _fixed_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Tables the layer applies (rotations, codebooks): counted in :attr:`nbytes`."""
        return ()

    @abstractmethod
    def _used_bytes(self, history_only: bool) -> int:
        """Bytes of the stored data over the tokens in use (the quantized history's alone)."""

    @abstractmethod
    def _elements_per_token(self) -> int:
        """Elements a token stores across the batch (K and V, or latent and RoPE key)."""

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds: capacity and the tables it applies included."""
        if not self.is_initialized:
            return 0
        return sum(s.nbytes() for s in self._segments()) + tensor_bytes(*self._fixed_tensors())

    def stored_bits_and_elements(self) -> tuple[int, int]:
        """(bits of stored data, elements stored) over the tokens in use."""
        if not self.is_initialized:
            return 0, 0
        return 8 * self._used_bytes(False), self.length * self._elements_per_token()

    def history_bits_and_elements(self) -> tuple[int, int]:
        """(bits, elements) of the quantized history alone: codes, scales and zeros, and the centers."""
        if not self.is_initialized or not self.n_history:
            return 0, 0
        return 8 * self._used_bytes(True), self.n_history * self._elements_per_token()


@dataclass
class _UpdateRecord:
    """A host-side update's undo: the counts (sink, history, recent) before it, its tokens, and the recent rows and
    means before it where its demotion overwrote them (else None)."""

    counts: tuple[int, int, int]
    new: dict[str, torch.Tensor]
    recent: dict[str, torch.Tensor] | None = None
    center: dict[str, torch.Tensor] | None = None


class KVOscarLayer(OscarLayer):
    """One full-attention layer's K/V storage (the package docstring of :mod:`oscar_hf.cache`), with the host-side
    writes and reads both allocation modes share. Use :class:`DynamicOscarLayer` or
    :class:`~oscar_hf.cache.static.StaticOscarLayer`."""

    reorders_padding = True  # a padded prompt's own first tokens go to the sink (LeftPadding)
    graph_step = False  # one-token updates as device-only operators (a static layer's, where the kernels serve it)

    def __init__(self, config: OscarConfig, key_rotation: torch.Tensor, value_rotation: torch.Tensor, *,
                 key_codebook: KeyCodebook | None = None):
        """``key_rotation``, ``value_rotation``: the layer's ``[D, D]`` (shared by its KV heads) or ``[H, D, D]`` (one
        per KV head); ``key_codebook``: its K codebook, for product-quantized K."""
        super().__init__(config, 4)  # sink, history, recent, ring start
        # the layer's own copies: a bundle changed after the cache was built cannot change what the cache reads
        self.key_rotation = key_rotation.detach().clone()
        self.value_rotation = value_rotation.detach().clone()
        # an identity rotation (data-free baselines, per-channel K, an absorbed V) costs no GEMM per step
        self.rotates_keys, self.rotates_values = (not is_identity(r) for r in (key_rotation, value_rotation))
        if config.key_layout.uses_codebook and key_codebook is None:
            raise ValueError(f"key_quantization={config.key_quantization!r} needs the layer's key_codebook")
        self.key_codebook = key_codebook.clone() if config.key_layout.uses_codebook else None
        self._last_update: _UpdateRecord | None = None  # what crop needs to take back the last host-side update
        self._packed: PackedKV | None = None  # a static layer's PackedKV: its buffers and counts never move
        self._padding: LeftPadding | None = None

    recent_start = _count(3, "ring-buffer row of the oldest recent token")
    sink = stored("_sink", "the first tokens' K and V, model dtype")
    history = stored("_history_rows", "the quantized history's codes, scales and zeros")
    recent = stored("_recent", "the newest tokens' K and V, model dtype")
    center = stored("_center", "the history's means, fp32 [B, H, 1 or 0, D] per side")

    @property
    def recent_limit(self) -> int:
        """Most tokens the recent window holds: ``recent_tokens + flush_tokens - 1``."""
        return self.config.recent_tokens + self.config.flush_tokens - 1

    def rotation(self, side: str) -> torch.Tensor | None:
        """The history basis of ``side`` in the model dtype (``[D, D]`` or ``[H, D, D]``), or None for an identity
        rotation (no GEMM)."""
        if side == "key":
            return self.key_rotation if self.rotates_keys else None
        return self.value_rotation if self.rotates_values else None

    def _keep_own_heads(self, heads: int) -> None:
        """Per-head rotations cut to the ``heads`` KV heads this rank holds, where the model's tensor-parallel ranks
        split the layer's heads."""
        tp = self.tensor_parallel
        for name in ("key_rotation", "value_rotation"):
            rotation = getattr(self, name)
            if tp is not None and rotation.ndim == 3 and rotation.shape[0] == heads * tp.size:
                setattr(self, name, rotation[tp.heads(rotation.shape[0])])
        book = self.key_codebook
        if tp is not None and book is not None and book.heads == heads * tp.size:
            self.key_codebook = book.select_heads(tp.heads(book.heads))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self._keep_own_heads(heads)
        for rotation in (self.key_rotation, self.value_rotation):
            if rotation.shape[-1] != dim or (rotation.ndim == 3 and rotation.shape[0] != heads):
                raise ValueError(
                    f"a rotation {tuple(rotation.shape)} does not fit K/V of {heads} heads of head_dim {dim}"
                    + ("" if self.tensor_parallel is not None or rotation.ndim != 3 else
                       " (if the model was loaded with tp_plan, each rank holds a share of the heads: build the cache "
                       "with OscarQuantizedCache.from_pretrained(..., model=model), or pass tensor_parallel=)"))
        self.dtype, self.device = key_states.dtype, key_states.device
        self._packed = None
        cfg = self.config
        layout = cfg.key_layout
        self.group_size = cfg.resolved_group_size(dim)
        if self.key_codebook is not None:
            self.key_codebook = self.key_codebook.to(self.device)
        self.writer = layout.writer(cfg, self.device, self.key_codebook)
        # row-major: the append kernel reads them as such; an identity is never read and stays where it is
        if self.rotates_keys:
            self.key_rotation = self.key_rotation.to(self.device, self.dtype).contiguous()
        if self.rotates_values:
            self.value_rotation = self.value_rotation.to(self.device, self.dtype).contiguous()

        def empty(*tail: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(batch, heads, 0, *tail, dtype=dtype, device=self.device)

        self.sink = Segment({side: empty(dim, dtype=self.dtype) for side in SIDES})
        self.recent = Segment({side: empty(dim, dtype=self.dtype) for side in SIDES})
        self.center = Segment({side: torch.zeros(batch, heads, int(side in cfg.centered_sides), dim,
                                                 device=self.device) for side in SIDES})
        # per side: (scale columns, tokens per scale row); zeros alike, or none where the quantizer implies them
        meta = {"key": (layout.scale_columns(dim, self.group_size), layout.tokens_per_scale_row(cfg)),
                "value": (dim // self.group_size, 1)}
        history = {}
        for side, bits in cfg.side_bits.items():
            history[f"{side}_codes"] = empty(dim * bits // 8, dtype=torch.uint8)
            scale_dtype, zero_dtype = cfg.meta_dtypes
            history[f"{side}_scale"] = empty(meta[side][0], dtype=scale_dtype)
            history[f"{side}_zero"] = empty(meta[side][0] * cfg.grid.stores_zero, dtype=zero_dtype)
        self.history = Segment(history, {f"{side}_{part}": meta[side][1] for side in SIDES
                                         for part in ("scale", "zero")})
        self.is_initialized = True

    def packed(self) -> PackedKV:
        """The storage as the kernels take it (the layer's buffers and its counts). Built once for a static layer,
        whose buffers keep their addresses and whose device counts change in place (a graph step builds none)."""
        counts = self.counts
        if self._packed is not None:
            return self._packed
        h, cfg = self.history, self.config
        centers = [self.center[side] if side in cfg.centered_sides else None for side in SIDES]
        packed = PackedKV(self.sink["key"], self.sink["value"], self.recent["key"], self.recent["value"],
                          *(QuantizedRows(h[f"{side}_codes"], h[f"{side}_scale"], h[f"{side}_zero"]) for side in SIDES),
                          counts if self.counts_on_device else tuple(counts), *cfg.side_bits.values(),
                          self.group_size, *centers, cfg.key_layout.token_group(cfg), self.rotation("key"),
                          self.rotation("value"), self.key_codebook)
        if self.counts_on_device:
            self._packed = packed
        return packed

    # -------------------------------------------------------------------------------- writes
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[OscarKV, OscarKV]:
        """Take new K/V ``[B, H, n, D]`` (stored when the layer attends, or at its next read); return handles for the
        attention function."""
        self._store_pending()  # an update no attention read
        self._prepare(key_states, value_states)
        self._pending = (key_states, value_states)
        return OscarKV(self, key_states), OscarKV(self, value_states)

    @torch.compiler.disable  # a graph break inside a compiled forward
    def _prepare(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Initialize on the first update; raise what device-side steps flagged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_flags()

    def _store_pending(self, attention_mask: torch.Tensor | None = None, query: torch.Tensor | None = None):
        """Store the pending update: a prompt into an empty layer in its rows' own order where ``attention_mask``
        shows left padding (:class:`LeftPadding`). Returns None (a static layer's graph step: ``query`` rotated)."""
        if self._pending is None:
            return None
        (key, value), self._pending = self._pending, None
        n = key.shape[2]
        if not self.length:  # a new sequence: its prompt's padding, if any
            sink = self.config.sink_tokens if self.reorders_padding else 0
            self._padding = LeftPadding.of_prompt(attention_mask, n, sink) if n > 1 else None
            if self._padding is not None:
                key, value = self._padding.store_order(key), self._padding.store_order(value)
        self._append({"key": key, "value": value})
        return None

    def check_flags(self) -> None:
        """Raise what device-side steps flagged (a static layer's)."""

    def _unroll_recent(self) -> None:
        """Make the recent window's oldest token row 0 again, for the host-side code (a static layer's ring)."""

    def _sink_room(self) -> int:
        """Tokens the sink can still take."""
        return self.config.sink_tokens - self.n_sink

    @abstractmethod
    def _reserve(self, segment: Segment, used: int, needed: int, limit: int) -> None:
        """Make ``segment`` hold ``needed`` tokens (at most ``limit``), keeping its first ``used``."""

    @abstractmethod
    def _reserve_history(self, needed: int) -> None:
        """Make the history hold ``needed`` tokens."""

    def _append(self, new: dict[str, torch.Tensor]) -> None:
        self._unroll_recent()
        cfg = self.config
        n = new["key"].shape[2]
        record = _UpdateRecord((self.n_sink, self.n_history, self.n_recent), new) if n <= cfg.recent_tokens else None
        self._last_update = record
        to_sink = min(self._sink_room(), n)
        if to_sink:
            self._reserve(self.sink, self.n_sink, self.n_sink + to_sink, cfg.sink_tokens)
            self.sink.write(self.n_sink, {s: t[:, :, :to_sink] for s, t in new.items()})
            self.n_sink += to_sink
        rest = {s: t[:, :, to_sink:] for s, t in new.items()}
        resident, limit = self.n_recent + (n - to_sink), self.recent_limit
        if resident <= limit:
            self._reserve(self.recent, self.n_recent, resident, limit)
            self.recent.write(self.n_recent, rest)
            self.n_recent = resident
            return
        # Too many tokens for the window: the oldest ones, down to recent_tokens (rounded down to whole demotion
        # units), go to the history.
        window = rest  # a prompt that reaches an empty window is not copied
        if self.n_recent:
            window = {s: torch.cat([self.recent[s][:, :, : self.n_recent], t], dim=2) for s, t in rest.items()}
            if record is not None:  # the rows the write below overwrites, for a crop (window is a copy)
                record.recent = {s: t[:, :, : self.n_recent] for s, t in window.items()}
        if record is not None and not self.n_history:  # the means the demotion sets
            record.center = {s: t.clone() for s, t in self.center.tensors.items()}
        demoted = (resident - cfg.recent_tokens) // cfg.demotion_unit * cfg.demotion_unit
        self._quantize_into_history({s: t[:, :, :demoted] for s, t in window.items()})
        self.n_recent = resident - demoted
        self._reserve(self.recent, 0, self.n_recent, limit)
        self.recent.write(0, {s: t[:, :, demoted:] for s, t in window.items()})

    def _take_back(self, record: _UpdateRecord, tokens: int) -> None:
        """Undo the update of ``record``, then store its first ``tokens`` tokens again."""
        if record.recent is not None:
            self.recent.write(0, record.recent)
        if record.center is not None:
            for side, t in record.center.items():
                self.center[side].copy_(t)
        self.n_sink, self.n_history, self.n_recent = record.counts
        if tokens:
            self._append({s: t[:, :, :tokens] for s, t in record.new.items()})

    def _quantize_into_history(self, rows: dict[str, torch.Tensor]) -> None:
        """Rotate ``rows`` (fp32 sums rounded once to the model dtype, as the append kernel does), then center,
        quantize and append them to the history."""
        cfg = self.config
        rows = {side: rotate_rows(t, self.rotation(side)) for side, t in rows.items()}
        n = rows["key"].shape[2]
        if not self.n_history:  # the first rows to reach the history (usually the prompt) set the means
            for side in cfg.centered_sides:
                mean = (rows[side].mean(dim=2, keepdim=True, dtype=torch.float32) if self._padding is None
                        else self._padding.mean(rows[side], self.n_sink))
                self.center[side].copy_(mean)
        needed = self.n_history + n
        self._reserve_history(needed)
        clip = cfg.side_clip
        quantized = self.writer(
            rows["key"],
            rows["value"],
            bits=cfg.bits,
            key_bits=cfg.side_bits["key"],
            group_size=self.group_size,
            k_clip=clip["key"],
            v_clip=clip["value"],
            scale_dtype=cfg.torch_scale_dtype,
            method=cfg.quantizer,
            **{f"{side}_center": self.center[side] for side in cfg.centered_sides},  # the writer stores x - μ
        )
        packed = {f"{side}_{part}": t for side, q in zip(SIDES, quantized) for part, t in zip(q._fields, q)}
        self.history.write(self.n_history, packed)
        self.n_history = needed

    # --------------------------------------------------------------------------------- reads
    def attend(self, module: torch.nn.Module, query: torch.Tensor, new_key: torch.Tensor, new_value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None, *, softcap: float | None = None,
               s_aux: torch.Tensor | None = None, sliding_window: int | None = None, **kwargs):
        """Attention of ``query [B, Hq, q, D]`` (post-RoPE) over the layer's tokens, this update's ``new_key`` /
        ``new_value [B, H, q, D]`` read as given: ``([B, q, Hq, D], None)``. Logit soft-capping (``softcap``) and
        learned sink logits (``s_aux [Hq]``) as the model applies them. Runs eagerly (a graph break when compiled)."""
        return self._attend_on_host(module, query, new_key, new_value, attention_mask, scaling, softcap, s_aux,
                                    sliding_window), None

    @torch.compiler.disable  # a graph break inside a compiled forward
    def _attend_on_host(self, module, query, new_key, new_value, attention_mask, scaling, softcap, sinks,
                        sliding_window):
        self._store_pending(attention_mask)
        self.check_flags()
        if sliding_window is not None and not self.is_sliding:
            raise NotImplementedError("a sliding-window attention layer reached an OSCAR full-attention cache layer")
        order = None  # stored tokens in their rows' own order: where each sits in the model's
        if self._padding is not None and self.reorders_padding and self.length > new_key.shape[2]:
            order = self._padding.index(max(self.length, 0 if attention_mask is None else attention_mask.shape[-1]))
        attend = attention_backend(self.config.backend, query.device)
        return attend(module, query, self.packed(), new_key, new_value, attention_mask, scaling,
                      self.config.recent_tokens, softcap=softcap, sinks=sinks,
                      window=getattr(self, "sliding_window", None), order=order)

    def _history(self, side: str, stop: int, start: int = 0) -> torch.Tensor:
        """History tokens ``[start, stop)`` of ``side``, dequantized (center added back), in its rotated basis: fp32
        ``[B, H, stop - start, D]``. With per-channel K, ``start`` and ``stop`` are multiples of the token group."""
        return dequantize_history(self.packed(), side, stop, start)

    def materialize(self, side: str, stop: int | None = None, dtype: torch.dtype | None = None,
                    new: torch.Tensor | None = None, fill=None) -> torch.Tensor:
        """The sequence ``sink ‖ dequantized history ‖ recent`` of ``side`` in the model's basis: its first ``stop``
        tokens (default all), then ``new`` if given, in ``dtype`` (default the model's); ``fill`` as
        :func:`oscar_hf.kernels.dequantize.reference.materialize`'s."""
        self.check_flags()
        return materialize(self.packed(), side, stop, new, dtype, fill)

    # ------------------------------------------------------------------ cache bookkeeping API
    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens stored, after raising what the device flagged."""
        self.check_flags()
        return self.length

    def _segments(self) -> tuple[Segment, ...]:
        return (self.sink, self.history, self.recent, self.center) if self.is_initialized else ()

    def _tensors(self) -> list[torch.Tensor]:
        return [t for segment in self._segments() for t in segment.tensors.values()]

    def _reindex(self, fn) -> None:
        super()._reindex(fn)
        self._last_update = self._packed = None  # a crop can no longer undo the last update; tensors replaced
        if self._padding is not None:
            self._padding.map(fn)

    def reset(self) -> None:
        self._last_update = self._pending = self._padding = None
        self._counts = [0, 0, 0, 0]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (transformers passes a negative count, sometimes as a 0-d
        tensor). ``crop(0)`` touches nothing (a deferred stop check calls it every step); a crop right after a
        host-side update of at most ``recent_tokens`` tokens leaves what that update's kept tokens alone would have
        left."""
        self.counts  # noqa: B018  (stores a pending update first)
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove; got {tokens_to_remove}")
        if tokens_to_remove == 0:
            return
        record, self._last_update = self._last_update, None
        if record is not None and -tokens_to_remove <= record.new["key"].shape[2]:
            self._take_back(record, record.new["key"].shape[2] + tokens_to_remove)
            return
        self._unroll_recent()
        remove = min(-tokens_to_remove, self.length)
        for count in ("n_recent", "n_history", "n_sink"):
            taken = min(remove, getattr(self, count))
            setattr(self, count, getattr(self, count) - taken)
            remove -= taken
        self._return_cut_group()

    def _return_cut_group(self) -> None:
        """After a crop into a K token group of the history (per-channel K, whose scale and zero also cover cropped
        tokens), move the group's surviving tokens back to the (then empty) recent window, dequantized; their next
        demotion quantizes them again, with the group they join."""
        unit = self.config.demotion_unit
        cut = self.n_history % unit
        if not cut:
            return
        start = self.n_history - cut
        survivors = {side: unrotate(self._history(side, start + unit, start)[:, :, :cut], self.rotation(side))
                     for side in SIDES}
        self._reserve(self.recent, 0, cut, self.recent_limit)
        self.recent.write(0, survivors)
        self.n_history, self.n_recent = start, cut

    # ---------------------------------------------------------------------------- accounting
    def _fixed_tensors(self) -> tuple[torch.Tensor | None, ...]:
        book = self.key_codebook
        return (*map(self.rotation, SIDES), *(book.tensors().values() if book is not None else ()))

    def _used_bytes(self, history_only: bool) -> int:
        center = self.center.used_bytes(1) if self.n_history else 0
        history = self.history.used_bytes(self.n_history) + center
        if history_only:
            return history
        return self.sink.used_bytes(self.n_sink) + history + self.recent.used_bytes(self.n_recent)

    def _elements_per_token(self) -> int:
        b, h, _, d = self.sink["key"].shape
        return 2 * b * h * d


class DynamicOscarLayer(KVOscarLayer):
    """An OSCAR layer whose buffers grow with the sequence: windows by doubling up to their limits, the history in
    chunks of at least HISTORY_GROWTH tokens. Counts are Python ints; every update runs on the host."""

    def _reserve(self, segment: Segment, used: int, needed: int, limit: int) -> None:
        segment.grow_window(used, needed, limit)

    def _reserve_history(self, needed: int) -> None:
        self.history.grow_history(self.n_history, needed)
