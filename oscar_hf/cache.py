"""OscarQuantizedCache: a transformers Cache that keeps K and V mostly in 2 bits, rotated.

Per full-attention layer and KV head the cached sequence is ``sink ‖ history ‖ recent``, in a
:class:`~oscar_hf.kernels.PackedKV`'s layout:

* ``sink``    model dtype ``[B, H, ≤ sink_tokens, D]``: the first tokens, as the model produced them;
* ``history`` rotated (``k @ R_K``, ``v @ R_V``; ``R [D, D]`` shared by the layer's KV heads, or ``[H, D, D]``, one
  per KV head) packed codes with scales and zeros, per token (and per channel for K
  with per-channel keys: the K layout, :mod:`oscar_hf.layouts`); ``center`` fp32 ``[B, H, 1, D]`` per centered side,
  set by the first tokens to reach an empty history, which then stores ``x @ R - center``;
* ``recent``  model dtype ``[B, H, ≤ recent_tokens + flush_tokens - 1, D]``: the newest tokens, as the model produced
  them, rotated and demoted to the history ``flush_tokens`` at a time.

Only what is quantized is rotated, so attention over tokens that never leave the windows is the model's own, in every
dtype.

One layer class per allocation mode, as in transformers: :class:`DynamicOscarLayer` grows its buffers;
:class:`StaticOscarLayer` (``max_cache_len``) allocates them once, keeps its counts on the device and, where the Triton
kernels serve it, takes each decode step as device-only operators (a graph step: no host synchronisation, one CUDA
graph per model step under ``torch.compile``). ``update`` returns :class:`OscarKV` handles instead of dense tensors;
the ``"oscar"`` attention function reads the storage through them. Sliding-window and chunked-attention layers keep
transformers' own layer (sliding ones are OSCAR layers too with ``quantize_sliding``: :class:`SlidingOscarLayer`);
linear-attention and state-space layers keep transformers' state layer, and a layer with both keeps its state beside
its OSCAR storage. Under tensor parallelism each rank's cache holds the KV heads that rank computes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .config import OscarConfig
from .kernels import WRITE_BACKENDS, PackedKV, dequantize_backend, resolve
from .kernels.append.reference import rotate_rows
from .kernels.decode import launch as decode_launch
from .kernels.dequantize.reference import dequantize_history, materialize, unrotate
from .kernels.flags import raise_for_flags
from .model_support import ModelShape, check_model_supported
from .parallel import TensorParallel
from .quantizer import QuantizedRows, quantize
from .rotations import OscarRotations

if TYPE_CHECKING:
    from .codebooks import KeyCodebook

# set, in a model's config and in the bundle absorb_latent_rotation returns, where kv_b_proj holds the latent rotation
LATENT_ABSORBED = "latent_rotation_absorbed"

ATTN_IMPLEMENTATION = "oscar"
HISTORY_GROWTH = 1024  # tokens; a growing history grows by at least this much, or by an eighth of itself
# A growing history's capacities are multiples of this many tokens, so that growing cannot change whether the
# per-token scale/zero strides are divisible by 16, on which Triton specializes (and recompiles) the decode kernel.
HISTORY_ALIGN = 16
BEFORE_STEP = 4  # a static layer's counts[4:8]: its counts before its last graph step, or counts[4] = -1
SIDES = ("key", "value")
# The cache layer of a layer that reads an earlier layer's K/V (KV sharing) and stores none: transformers' own
# (an empty DynamicLayer where transformers has none)
NoKVLayer = getattr(cache_utils, "DummyLayer", cache_utils.DynamicLayer)


def _is_identity(rotation: torch.Tensor) -> bool:
    """Whether ``rotation`` (``[D, D]``, or ``[H, D, D]`` per KV head) is the identity (every head's)."""
    eye = torch.eye(rotation.shape[-1], dtype=rotation.dtype, device=rotation.device)
    return torch.equal(rotation, eye.expand(rotation.shape))


@dataclass
class _UpdateRecord:
    """A host-side update's undo: the counts (sink, history, recent) before it, its tokens, and the recent rows and
    means before it where its demotion overwrote them (else None)."""

    counts: tuple[int, int, int]
    new: dict[str, torch.Tensor]
    recent: dict[str, torch.Tensor] | None = None
    center: dict[str, torch.Tensor] | None = None


class OscarKV:
    """What ``update`` hands to the attention function in place of K or V ``[B, H, T, D]``.

    ``new`` holds the K (or V) of the tokens added by this update, as given; the rest of the sequence is read from
    ``layer``.
    """

    __slots__ = ("layer", "new")

    def __init__(self, layer: "OscarLayer", new: torch.Tensor):
        self.layer = layer
        self.new = new

    @property
    def shape(self) -> torch.Size:
        b, h, _, d = self.new.shape
        return torch.Size((b, h, self.layer.length, d))

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


class _Segment:
    """Preallocated rows of one K or V side, along dim 2 of ``[B, H, rows, ...]`` tensors.

    Positions and capacities are in tokens. A tensor named in ``tokens_per_row`` has one row per that many tokens
    (per-channel K scales and zeros: one per token group); writes to it start at a multiple of that width.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], tokens_per_row: dict[str, int] | None = None):
        self.tensors = tensors
        self.tokens_per_row = tokens_per_row or {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def _width(self, name: str) -> int:
        return self.tokens_per_row.get(name, 1)

    def _rows(self, name: str, tokens: int) -> int:
        """Rows of tensor ``name`` that the first ``tokens`` tokens touch."""
        return -(-tokens // self._width(name))

    @property
    def capacity(self) -> int:
        return min(t.shape[2] * self._width(name) for name, t in self.tensors.items())

    def write(self, start: int, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            row = start // self._width(name)
            self.tensors[name][:, :, row : row + value.shape[2]] = value

    def read(self, stop: int, start: int = 0) -> dict[str, torch.Tensor]:
        """Every tensor's rows of tokens ``[start, stop)``."""
        return {name: t[:, :, start // self._width(name) : self._rows(name, stop)] for name, t in self.tensors.items()}

    def grow(self, used: int, capacity: int) -> None:
        for name, old in self.tensors.items():
            new = old.new_empty(*old.shape[:2], self._rows(name, capacity), *old.shape[3:])
            rows = self._rows(name, used)
            new[:, :, :rows] = old[:, :, :rows]
            self.tensors[name] = new

    def drop_front(self, used: int, tokens: int) -> None:
        """Drop the first ``tokens`` of the ``used`` ones (a multiple of every width), moving the rest to the front."""
        for name, t in self.tensors.items():
            start, stop = tokens // self._width(name), self._rows(name, used)
            t[:, :, : stop - start] = t[:, :, start:stop].clone()

    def map(self, fn) -> None:
        self.tensors = {name: fn(t) for name, t in self.tensors.items()}

    def used_bytes(self, used: int) -> int:
        return sum(t[:, :, : self._rows(name, used)].numel() * t.element_size() for name, t in self.tensors.items())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _aligned(tokens: int) -> int:
    """``tokens`` rounded up to a multiple of HISTORY_ALIGN."""
    return -(-tokens // HISTORY_ALIGN) * HISTORY_ALIGN


def _grow_history(segment: _Segment, used: int, needed: int) -> None:
    """Grow a growing history (or a latent layer's RoPE key rows) so that it holds ``needed`` tokens: by at least
    HISTORY_GROWTH tokens or an eighth of itself, to a multiple of HISTORY_ALIGN."""
    capacity = segment.capacity
    if needed > capacity:
        segment.grow(used, _aligned(max(needed, capacity + max(HISTORY_GROWTH, capacity // 8))))


def _grow_window(segment: _Segment, used: int, needed: int, limit: int) -> None:
    """Grow a window segment (doubling, at most to ``limit`` tokens) so that it holds ``needed`` tokens."""
    if needed > segment.capacity:
        segment.grow(used, min(limit, max(needed, 2 * segment.capacity, 16)))


def _count(index: int, doc: str) -> property:
    """One of an OscarLayer's counts as a Python int (reading a static layer's device counts synchronises)."""

    def get(self) -> int:
        return int(self.counts[index])

    def set(self, value: int) -> None:
        self.counts[index] = value
        if self.counts_on_device:
            self.counts[BEFORE_STEP] = -1  # a host-side change: the last graph step can no longer be undone

    return property(get, set, doc=doc)


class _GrowingLayer(CacheLayerMixin):
    """What OSCAR's layers share with a plain growing cache layer: a mask over every token held, no maximum length,
    no offloading."""

    length: int

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def offload(self):
        raise NotImplementedError("OscarQuantizedCache does not support offloading")

    prefetch = offload

    def _segments(self) -> tuple[_Segment, ...]:
        """Every segment of the layer's storage (none before its first update)."""
        return ()

    def _before_reindexing(self) -> None:
        """Settle what the batch rows' reordering must not leave half done."""

    def _reindex(self, fn) -> None:
        self._before_reindexing()
        for segment in self._segments():
            segment.map(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(lambda t: t[indices])


class OscarLayer(_GrowingLayer):
    """One full-attention layer's OSCAR storage (see the module docstring), with the host-side updates and reads that
    both allocation modes share. Use :class:`DynamicOscarLayer` or :class:`StaticOscarLayer`."""

    is_compileable = False
    is_sliding = False
    # A crop right after an update leaves no trace, as transformers' rollbacks need (a deferred stop check's extra
    # step, assisted decoding's rejected candidates): a crop right after a host-side update of at most recent_tokens
    # tokens takes it back (_last_update) and stores the kept tokens again; a static layer's crop(-1) right after a
    # graph step restores the counts it started from. (Other crops keep in the history the tokens that the removed
    # ones pushed there.)
    is_croppable = True
    max_cache_len: int | None = None
    graph_step = False  # decode steps as device-only operators
    tensor_parallel: TensorParallel | None = None  # set by the cache for a tensor-parallel model

    def __init__(self, config: OscarConfig, key_rotation: torch.Tensor, value_rotation: torch.Tensor, *,
                 key_codebook: KeyCodebook | None = None):
        """``key_rotation``, ``value_rotation``: the layer's ``[D, D]`` (shared by its KV heads) or ``[H, D, D]`` (one
        per KV head); ``key_codebook``: its K codebook, for product-quantized K."""
        super().__init__()
        if config.key_bits_layers is not None:
            raise ValueError("an OSCAR layer takes one layer's config: pass OscarConfig.for_layer(layer_idx), which "
                             "resolves key_bits_layers")
        self.config = config
        # the layer's own copies: a bundle changed after the cache was built cannot change what the cache reads
        self.key_rotation = key_rotation.detach().clone()
        self.value_rotation = value_rotation.detach().clone()
        # an identity rotation (data-free baselines, per-channel K, an absorbed V) costs no GEMM per step
        self.rotates_keys, self.rotates_values = (not _is_identity(r) for r in (key_rotation, value_rotation))
        if config.key_layout.uses_codebook and key_codebook is None:
            raise ValueError(f"key_quantization={config.key_quantization!r} needs the layer's key_codebook")
        self.key_codebook = key_codebook.clone() if config.key_layout.uses_codebook else None
        self.counts: list[int] | torch.Tensor = [0, 0, 0, 0]  # sink, history, recent, ring start
        self._last_update: _UpdateRecord | None = None  # what crop needs to take back the last host-side update
        self._packed: PackedKV | None = None  # a static layer's PackedKV: its buffers and counts never move
        self.defers_host_reads = False  # set by oscar_hf.generation.overlapped_sample (see get_seq_length)

    n_sink = _count(0, "tokens in the sink")
    n_history = _count(1, "tokens in the quantized history")
    n_recent = _count(2, "tokens in the recent window")
    recent_start = _count(3, "ring-buffer row of the oldest recent token")

    @property
    def counts_on_device(self) -> bool:
        return isinstance(self.counts, torch.Tensor)

    @property
    def length(self) -> int:
        counts = self.counts.tolist() if self.counts_on_device else self.counts
        return sum(counts[:3])

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

        self.sink = _Segment({side: empty(dim, dtype=self.dtype) for side in SIDES})
        self.recent = _Segment({side: empty(dim, dtype=self.dtype) for side in SIDES})
        self.center = _Segment({side: torch.zeros(batch, heads, int(side in cfg.centered_sides), dim,
                                                  device=self.device) for side in SIDES})
        # per side: (scale and zero columns, tokens per scale row)
        meta = {"key": (layout.scale_columns(dim, self.group_size), layout.tokens_per_scale_row(cfg)),
                "value": (dim // self.group_size, 1)}
        history = {}
        for side, bits in cfg.side_bits.items():
            history[f"{side}_codes"] = empty(dim * bits // 8, dtype=torch.uint8)
            for part in ("scale", "zero"):
                history[f"{side}_{part}"] = empty(meta[side][0], dtype=cfg.torch_scale_dtype)
        self.history = _Segment(history, {f"{side}_{part}": meta[side][1] for side in SIDES
                                          for part in ("scale", "zero")})
        self.is_initialized = True

    def packed(self) -> PackedKV:
        """The storage as the kernels take it (the layer's buffers and its counts). Built once for a static layer,
        whose buffers keep their addresses and whose device counts change in place (a graph step builds none)."""
        if self._packed is not None:
            return self._packed
        h, cfg = self.history, self.config
        centers = [self.center[side] if side in cfg.centered_sides else None for side in SIDES]
        counts = self.counts if self.counts_on_device else tuple(self.counts)
        packed = PackedKV(self.sink["key"], self.sink["value"], self.recent["key"], self.recent["value"],
                          *(QuantizedRows(h[f"{side}_codes"], h[f"{side}_scale"], h[f"{side}_zero"]) for side in SIDES),
                          counts, *cfg.side_bits.values(), self.group_size, *centers,
                          cfg.key_layout.token_group(cfg), self.rotation("key"), self.rotation("value"),
                          self.key_codebook)
        if self.counts_on_device:
            self._packed = packed
        return packed

    # -------------------------------------------------------------------------------- writes
    def takes_graph_step(self, key_states: torch.Tensor) -> bool:
        """Whether ``update(key_states)`` is a graph step (a static layer's device-only one-token update)."""
        return False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[OscarKV, OscarKV]:
        """Store new K/V ``[B, H, n, D]``; return handles for the attention function."""
        self.store_pending()
        self._check_room(key_states, value_states)
        self._append({"key": key_states, "value": value_states})
        return OscarKV(self, key_states), OscarKV(self, value_states)

    def _check_room(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Initialize on the first update; raise what device-side steps flagged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.check_flags()

    def store_pending(self, query: torch.Tensor | None = None) -> torch.Tensor | None:
        """Store a token that a graph step left to the attention function (a static layer's); see there."""
        return None

    def check_flags(self) -> None:
        """Raise what device-side steps flagged (a static layer's)."""

    def _unroll_recent(self) -> None:
        """Make the recent window's oldest token row 0 again, for the host-side code (a static layer's ring)."""

    def _sink_room(self) -> int:
        """Tokens the sink can still take."""
        return self.config.sink_tokens - self.n_sink

    def _reserve(self, segment: _Segment, used: int, needed: int, limit: int) -> None:
        """Make ``segment`` hold ``needed`` tokens (at most ``limit``), keeping its first ``used``."""

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
                self.center[side].copy_(rows[side].mean(dim=2, keepdim=True, dtype=torch.float32))
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
        self.store_pending()
        self.check_flags()
        return self.length

    def _segments(self) -> tuple[_Segment, ...]:
        return (self.sink, self.history, self.recent, self.center) if self.is_initialized else ()

    def _tensors(self) -> list[torch.Tensor]:
        return [t for segment in self._segments() for t in segment.tensors.values()]

    def reset(self) -> None:
        self._last_update = None
        self.counts = [0, 0, 0, 0]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (transformers passes a negative count, sometimes as a 0-d
        tensor). ``crop(0)`` touches nothing (a deferred stop check calls it every step); a crop right after a
        host-side update of at most ``recent_tokens`` tokens leaves what that update's kept tokens alone would have
        left (see ``is_croppable``)."""
        self.store_pending()
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

    def _before_reindexing(self) -> None:
        """Store a pending graph step's token; forget the last update (a crop can no longer undo it) and the
        PackedKV (its tensors are replaced)."""
        self.store_pending()
        self._last_update = None
        self._packed = None

    # ---------------------------------------------------------------------------- accounting
    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds, capacity and the rotations (and K codebook) it applies included."""
        tables = [r for r in map(self.rotation, SIDES) if r is not None]
        if self.key_codebook is not None:
            tables += self.key_codebook.tensors().values()
        fixed = sum(t.numel() * t.element_size() for t in tables)
        return sum(s.nbytes() for s in self._segments()) + (fixed if self.is_initialized else 0)

    def stored_bits_and_elements(self) -> tuple[int, int]:
        """(bits of stored data, K and V elements stored) over the tokens in use."""
        if not self.is_initialized:
            return 0, 0
        self.store_pending()
        used = (
            self.sink.used_bytes(self.n_sink)
            + self.history.used_bytes(self.n_history)
            + self.recent.used_bytes(self.n_recent)
            + (self.center.used_bytes(1) if self.n_history else 0)
        )
        b, h, _, d = self.sink["key"].shape
        return 8 * used, 2 * b * h * self.length * d

    def history_bits_and_elements(self) -> tuple[int, int]:
        """(bits of stored data, K and V elements) of the quantized history alone: codes, scales and zeros, and
        the centers."""
        if not self.is_initialized:
            return 0, 0
        self.store_pending()
        if not self.n_history:
            return 0, 0
        b, h, _, d = self.sink["key"].shape
        return 8 * (self.history.used_bytes(self.n_history) + self.center.used_bytes(1)), 2 * b * h * self.n_history * d


class DynamicOscarLayer(OscarLayer):
    """An OSCAR layer whose buffers grow with the sequence: windows by doubling up to their limits, the history in
    chunks of at least HISTORY_GROWTH tokens. Counts are Python ints; every update runs on the host."""

    def _reserve(self, segment: _Segment, used: int, needed: int, limit: int) -> None:
        _grow_window(segment, used, needed, limit)

    def _reserve_history(self, needed: int) -> None:
        _grow_history(self.history, self.n_history, needed)


class SlidingOscarLayer(DynamicOscarLayer):
    """A sliding-window layer stored like a full one (sink, INT2 body, recent window), holding the tokens that later
    queries can still see: those older than ``sliding_window - 1`` are dropped, the sink first, then the history from
    its front, in steps of at least ``EVICTION_STEP`` tokens (the tokens kept past the window are masked out by the
    model's sliding-window mask, which is built from :meth:`get_mask_sizes`'s offset). Once dropped, the sink is not
    refilled. Host-side updates only (``OscarConfig.quantize_sliding``)."""

    is_sliding = True
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
        return _aligned(self.sliding_window + step + self.config.demotion_unit)

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


class LatentOscarLayer(_GrowingLayer):
    """A multi-head latent attention (MLA) layer's storage: the compressed latent ``[B, 1, T, r]`` (what DeepSeek-V3
    and its kin hand to ``update`` as K) as ``sink ‖ history ‖ recent``, the history rotated (``c @ R``), centered
    and quantized per token like an OSCAR layer's K; the RoPE part of the key ``[B, 1, T, rope]`` (handed as V) kept
    in the model dtype for every token, since 2-bit RoPE keys wreck attention. ``update`` returns both whole and
    dense, the history dequantized and rotated back, for the model to expand through ``kv_b_proj`` (its attention
    then runs on plain tensors): a dequantize path, no fused kernel. Host-side updates only.

    ``absorbed``: the rotation is folded into ``kv_b_proj`` (:func:`oscar_hf.absorb_latent_rotation`), so ``update``
    returns the latent in the rotated basis: the windows rotated (a few hundred rows), the history as stored."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    counts_on_device = False

    def __init__(self, config: OscarConfig, rotation: torch.Tensor, absorbed: bool = False):
        super().__init__()
        self.config = config
        self.rotation = rotation.detach().clone()  # [r, r]
        self.rotates = not _is_identity(rotation)
        self.absorbed = absorbed
        self.counts = [0, 0, 0]  # sink, history, recent

    n_sink = _count(0, "tokens in the sink")
    n_history = _count(1, "tokens in the quantized history")
    n_recent = _count(2, "tokens in the recent window")

    @property
    def length(self) -> int:
        return sum(self.counts)

    def lazy_initialization(self, latent: torch.Tensor, rope: torch.Tensor) -> None:
        batch, heads, _, dim = latent.shape
        if self.rotation.shape != (dim, dim):
            raise ValueError(f"a latent rotation {tuple(self.rotation.shape)} does not fit a latent of {dim} channels")
        self.dtype, self.device = latent.dtype, latent.device
        cfg = self.config
        self.group_size = cfg.resolved_group_size(dim)
        self.rotation = self.rotation.to(self.device, torch.float32)
        # what materialize applies in the model dtype: R to the windows (absorbed), else Rᵀ to the history
        self.rotation_mt = (self.rotation if self.absorbed else self.rotation.mT).to(self.dtype).contiguous()
        self.dequantize = dequantize_backend(cfg.backend, self.device)

        def empty(*tail: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(batch, heads, 0, *tail, dtype=dtype, device=self.device)

        self.windows = {name: _Segment({"latent": empty(dim, dtype=self.dtype)}) for name in ("sink", "recent")}
        bits, groups = cfg.side_bits["key"], dim // self.group_size
        self.history = _Segment({"codes": empty(dim * bits // 8, dtype=torch.uint8),
                                 "scale": empty(groups, dtype=cfg.torch_scale_dtype),
                                 "zero": empty(groups, dtype=cfg.torch_scale_dtype)})
        self.center = _Segment({"latent": torch.zeros(batch, heads, 1, dim, device=self.device)})
        self.rope = _Segment({"rope": empty(rope.shape[-1], dtype=rope.dtype)})
        self.is_initialized = True

    def update(self, latent: torch.Tensor, rope: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``latent [B, 1, n, r]`` and ``rope [B, 1, n, rope]``; return the whole sequence of each, dense."""
        if not self.is_initialized:
            self.lazy_initialization(latent, rope)
        total = self.length + latent.shape[2]
        _grow_history(self.rope, self.length, total)
        self.rope.write(self.length, {"rope": rope})
        self._append(latent)
        return self.materialize(), self.rope["rope"][:, :, :total]

    def _append(self, latent: torch.Tensor) -> None:
        cfg, sink, recent = self.config, self.windows["sink"], self.windows["recent"]
        to_sink = min(cfg.sink_tokens - self.n_sink, latent.shape[2])
        if to_sink:
            _grow_window(sink, self.n_sink, self.n_sink + to_sink, cfg.sink_tokens)
            sink.write(self.n_sink, {"latent": latent[:, :, :to_sink]})
            self.n_sink += to_sink
        rest, limit = latent[:, :, to_sink:], cfg.recent_tokens + cfg.flush_tokens - 1
        if self.n_recent + rest.shape[2] <= limit:  # no demotion (most decode steps): append in place
            _grow_window(recent, self.n_recent, self.n_recent + rest.shape[2], limit)
            recent.write(self.n_recent, {"latent": rest})
            self.n_recent += rest.shape[2]
            return
        window = torch.cat([recent["latent"][:, :, :self.n_recent], rest], dim=2)
        demoted = (window.shape[2] - cfg.recent_tokens) // cfg.flush_tokens * cfg.flush_tokens
        self._quantize_into_history(window[:, :, :demoted])
        self.n_recent = window.shape[2] - demoted
        _grow_window(recent, 0, self.n_recent, limit)
        recent.write(0, {"latent": window[:, :, demoted:]})

    def _quantize_into_history(self, rows: torch.Tensor) -> None:
        cfg = self.config
        rows = rows.float() @ self.rotation if self.rotates else rows.float()
        center = self.center["latent"]
        if not self.n_history and cfg.centering:
            center.copy_(rows.mean(dim=2, keepdim=True))
        quantized = quantize(rows - center, bits=cfg.side_bits["key"], group_size=self.group_size,
                             clip=cfg.side_clip["key"], scale_dtype=cfg.torch_scale_dtype, method=cfg.quantizer)
        _grow_history(self.history, self.n_history, self.n_history + rows.shape[2])
        self.history.write(self.n_history, quantized._asdict())
        self.n_history += rows.shape[2]

    def materialize(self) -> torch.Tensor:
        """The latent sequence ``[B, 1, T, r]`` in the model dtype: the windows as stored; the history dequantized
        with its center added (the dequantize kernel on CUDA, its twin elsewhere) and rotated back, both in the
        model dtype. (The rotation back is a ``[T, r] × [r, r]`` product every step: in fp32 it would cost more
        than the model's own expansion of the latent through ``kv_b_proj``.) Absorbed: the windows rotated instead,
        the history as dequantized."""
        out = torch.empty(*self.center["latent"].shape[:2], self.length, self.rotation.shape[0], dtype=self.dtype,
                          device=self.device)
        n_sink, n_history, n_recent = self.counts
        out[:, :, :n_sink] = self.windows["sink"]["latent"][:, :, :n_sink]
        history = out[:, :, n_sink:n_sink + n_history]
        stored = self.history.read(n_history)
        center = self.center["latent"] if self.config.centering else None
        self.dequantize(QuantizedRows(stored["codes"], stored["scale"], stored["zero"]), center, history,
                        bits=self.config.side_bits["key"])
        out[:, :, n_sink + n_history:] = self.windows["recent"]["latent"][:, :, :n_recent]
        if self.rotates and self.absorbed:
            for window in (out[:, :, :n_sink], out[:, :, n_sink + n_history:]):
                window.copy_(window @ self.rotation_mt)
        elif self.rotates and n_history:
            history.copy_(history @ self.rotation_mt)
        return out

    # ------------------------------------------------------------------ cache bookkeeping API
    def get_seq_length(self) -> int:
        return self.length

    def _segments(self) -> tuple[_Segment, ...]:
        return (*self.windows.values(), self.history, self.rope, self.center) if self.is_initialized else ()

    def reset(self) -> None:
        self.counts = [0, 0, 0]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (from the recent window, then the history, then the sink: the
        history's dropped tokens cannot return to the window, so a crop past it keeps its quantized ones)."""
        remove = min(-int(tokens_to_remove), self.length)
        for i in (2, 1, 0):
            taken = min(remove, self.counts[i])
            self.counts[i] -= taken
            remove -= taken

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds, capacity and the rotation it applies included."""
        if not self.is_initialized:
            return 0
        rotations = (self.rotation, self.rotation_mt) if self.rotates else ()
        return sum(s.nbytes() for s in self._segments()) + sum(r.numel() * r.element_size() for r in rotations)

    def _bits_and_elements(self, tokens: int, used_bytes: int) -> tuple[int, int]:
        """(bits of ``used_bytes`` bytes, elements of ``tokens`` tokens: latent and RoPE part)."""
        b, h, _, r = self.windows["sink"]["latent"].shape
        return 8 * used_bytes, b * h * tokens * (r + self.rope["rope"].shape[-1])

    def _history_bytes(self) -> int:
        """Bytes of the history tokens: the quantized latent, its center (if any), and their RoPE keys."""
        center = self.center.used_bytes(1) if self.n_history and self.config.centering else 0
        return self.history.used_bytes(self.n_history) + self.rope.used_bytes(self.n_history) + center

    def stored_bits_and_elements(self) -> tuple[int, int]:
        """(bits of stored data, elements stored: latent and RoPE part) over the tokens in use."""
        if not self.is_initialized:
            return 0, 0
        windows = self.windows["sink"].used_bytes(self.n_sink) + self.windows["recent"].used_bytes(self.n_recent)
        window_rope = self.rope.used_bytes(self.length) - self.rope.used_bytes(self.n_history)
        return self._bits_and_elements(self.length, windows + window_rope + self._history_bytes())

    def history_bits_and_elements(self) -> tuple[int, int]:
        """(bits, elements) of the history tokens alone: the quantized latent, its center, and their RoPE keys."""
        if not self.is_initialized or not self.n_history:
            return 0, 0
        return self._bits_and_elements(self.n_history, self._history_bytes())


OSCAR_LAYERS = (OscarLayer, LatentOscarLayer)  # the layers whose storage OSCAR quantizes


class StaticOscarLayer(OscarLayer):
    """An OSCAR layer with every buffer at its final size from the first update (``max_cache_len`` tokens), a fixed
    attention-mask size, and its counts in an int32 device tensor: compileable. Where the Triton kernels serve it
    (:meth:`_graph_step_supported`), a one-token update is a graph step: the append operator stores the token (or the
    attention function does, rotating q in the same kernel: :meth:`store_pending`) and the decode operator reads the
    counts on the device. The counts before the last graph step (``counts[4:8]``, -1 where host-side code changed the
    layer since) let ``crop(-1)`` undo it exactly. The recent window is a ring buffer (one more row than it holds)."""

    is_compileable = True

    def __init__(self, config: OscarConfig, key_rotation: torch.Tensor, value_rotation: torch.Tensor,
                 max_cache_len: int, *, key_codebook: KeyCodebook | None = None):
        super().__init__(config, key_rotation, value_rotation, key_codebook=key_codebook)
        self.max_cache_len = max_cache_len
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # a graph step's K/V left to the attention

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Every buffer at its final size, the counts and the flags (errors, and the append kernel's arrival count)
        on the device, all at static addresses for CUDA graphs."""
        super().lazy_initialization(key_states, value_states)
        cfg = self.config
        _grow_window(self.sink, 0, min(cfg.sink_tokens, self.max_cache_len), cfg.sink_tokens)
        _grow_window(self.recent, 0, min(self.recent_limit + 1, self.max_cache_len), self.recent_limit + 1)
        self.history.grow(0, max(0, self.max_cache_len - cfg.sink_tokens - cfg.recent_tokens))
        self.counts = torch.tensor([0, 0, 0, 0, -1, -1, -1, -1], dtype=torch.int32, device=self.device)
        self.flags = torch.zeros(2, dtype=torch.int32, device=self.device)
        if not torch.compiler.is_compiling():
            rotations = [r for r in map(self.rotation, SIDES) if r is not None]
            for t in (*self._tensors(), self.counts, self.flags, *rotations):
                torch._dynamo.mark_static_address(t)
        self.graph_step = self._graph_step_supported()
        if self.graph_step:
            self.decode_splits = decode_launch.plan(self.packed(), key_states.shape[0])  # one launch shape

    def _graph_step_supported(self) -> bool:
        """Whether the Triton append and decode kernels serve every one-token step of this layer."""
        cfg = self.config
        if resolve(cfg.backend, self.device) != "triton":
            return False
        from .kernels.write.triton import supports as write_supports

        return decode_launch.supports_storage(self.packed(), cfg.recent_tokens) and write_supports(
            self.sink["key"], self.group_size, cfg.quantizer, *cfg.side_bits.values())

    # -------------------------------------------------------------------------------- writes
    def takes_graph_step(self, key_states: torch.Tensor) -> bool:
        """Whether ``update(key_states)`` is a graph step: one token, stored by the device-only append operator with
        no host synchronisation (torch.compile traces it whole)."""
        return self.is_initialized and self.graph_step and key_states.shape[2] == 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, leave_to_attention: bool = False,
               **kwargs) -> tuple[OscarKV, OscarKV]:
        """Store new K/V ``[B, H, n, D]``. ``leave_to_attention`` (OscarQuantizedCache.update): a graph step's token
        is stored by the attention function, whose append kernel then also rotates q (:meth:`store_pending`), or else
        by the layer's next use."""
        if not self.takes_graph_step(key_states):
            return super().update(key_states, value_states)
        self.store_pending()
        self._last_update = None
        if leave_to_attention:
            self._pending = (key_states, value_states)
        else:
            self._append_on_device(key_states, value_states)
        return OscarKV(self, key_states), OscarKV(self, value_states)

    def _append_on_device(self, key: torch.Tensor, value: torch.Tensor,
                          query: torch.Tensor | None = None) -> torch.Tensor | None:
        from .kernels.append.triton import append

        cfg = self.config
        clip = cfg.side_clip
        return append(self.packed(), key, value, flags=self.flags, max_len=self.max_cache_len,
                      sink_tokens=cfg.sink_tokens, limit=self.recent_limit, flush=cfg.flush_tokens,
                      k_clip=clip["key"], v_clip=clip["value"], key_rotation=self.rotation("key"),
                      value_rotation=self.rotation("value"), query=query)

    def _check_room(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super()._check_room(key_states, value_states)
        if (length := self.length) + key_states.shape[2] > self.max_cache_len:
            raise ValueError(
                f"OscarQuantizedCache(max_cache_len={self.max_cache_len}) cannot take {key_states.shape[2]} more "
                f"tokens after {length}: build it with a larger max_cache_len (prompt + max_new_tokens)"
            )

    def store_pending(self, query: torch.Tensor | None = None) -> torch.Tensor | None:
        """Store the token a graph step left to the attention, if any (the append kernel); returns the step's
        ``query [B, Hq, 1, D]`` rotated by R_K in the same kernel, or None (nothing pending, no query, or an identity
        R_K: q stays as it is)."""
        if self._pending is None:
            return None
        (key, value), self._pending = self._pending, None
        return self._append_on_device(key, value, query)

    def check_flags(self) -> None:
        """Raise what the device-side steps flagged (non-finite K/V, a scale overflow, a full cache)."""
        self.store_pending()
        if self.counts_on_device and self.is_initialized:
            raise_for_flags(int(self.flags[0]), self.config.torch_scale_dtype)

    def _unroll_recent(self) -> None:
        start = self.recent_start
        if start:
            for t in self.recent.tensors.values():
                t.copy_(t.roll(-start, dims=2))
            self.recent_start = 0

    # ------------------------------------------------------------------ cache bookkeeping API
    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens stored: an int, after raising what the device flagged; or a 0-d device tensor, without
        synchronising, inside a compiled region (no graph break) and while ``defers_host_reads``."""
        self.store_pending()
        if self.counts_on_device and (torch.compiler.is_compiling() or self.defers_host_reads):
            return self.counts[:3].sum()
        return super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0  # a fixed size, so that a compiled forward sees one mask shape

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self._last_update = self._pending = None
        if not self.counts_on_device:
            return super().reset()
        self.counts.zero_()  # in place: compiled graphs hold these addresses
        self.counts[BEFORE_STEP] = -1
        self.flags.zero_()

    def crop(self, tokens_to_remove: int) -> None:
        """As :meth:`OscarLayer.crop`; ``crop(-1)`` right after a graph step undoes that step exactly."""
        self.store_pending()
        if (int(tokens_to_remove) == -1 and self.counts_on_device and self._last_update is None
                and int(self.counts[BEFORE_STEP]) >= 0):
            self.counts[:BEFORE_STEP] = self.counts[BEFORE_STEP:].clone()
            self.counts[BEFORE_STEP] = -1
            return
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.counts_on_device:
            return super().reorder_cache(beam_idx)
        self.store_pending()
        self._last_update = None
        for t in self._tensors():  # in place: compiled graphs hold these addresses
            t.copy_(t.index_select(0, beam_idx.to(t.device)))


@functools.cache
def _with_state(attention_layer: type) -> type:
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

    WithState.__name__ = WithState.__qualname__ = f"{attention_layer.__name__}WithState"
    return WithState


class _LayerBuilder:
    """The cache layer of each model layer, by what it caches (:meth:`ModelShape.attention`): OSCAR layers for full
    attention (and sliding-window attention with ``quantize_sliding``), transformers' own layers for the rest, a
    linear-attention state beside them where the layer keeps one, and nothing where it caches nothing. Each entry
    of ATTENTION gives a layer's attention part as (layer class or None, its arguments)."""

    def __init__(self, config, rotations, shape, max_cache_len, quantize_sliding):
        self.config, self.rotations, self.shape = config, rotations, shape
        self.max_cache_len, self.quantize_sliding = max_cache_len, quantize_sliding

    def __call__(self, i: int):
        shape = self.shape
        if not shape.reads_own_kv(i):  # reads an earlier layer's K/V (KV sharing): stores nothing
            return NoKVLayer()
        cls, args = self.ATTENTION[shape.attention(i)](self, i)
        kwargs = self._codebook(i, args[0]) if isinstance(cls, type) and issubclass(cls, OscarLayer) else {}
        if shape.has_state(i):
            with_state = (cache_utils.LinearAttentionLayer if cls is None else
                          cache_utils.LinearAttentionAndSlidingWindowAttentionLayer if cls is DynamicSlidingWindowLayer
                          else _with_state(cls))
            return with_state(*args, number_of_states=shape.states[i], **kwargs)
        return cls(*args, **kwargs) if cls is not None else NoKVLayer()

    def _codebook(self, i: int, config: OscarConfig) -> dict:
        """``{"key_codebook": ...}`` where the layer's K layout reads the bundle's codebook (``config``: the
        layer's)."""
        if not config.key_layout.uses_codebook:
            return {}
        return {"key_codebook": self.rotations.key_codebook(i, config.side_bits["key"])}

    def _rotations(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotations.key_rotation[i], self.rotations.value_rotation[i]

    def full(self, i: int):
        if self.shape.latent is not None:
            if self.config.key_layout.uses_codebook:
                raise ValueError("product-quantized keys are not available for multi-head latent attention layers "
                                 "(their history is the latent, stored per token)")
            if self.max_cache_len is not None:
                raise ValueError("multi-head latent attention layers are stored on the host (the model expands the "
                                 "whole latent each step): build the cache without max_cache_len")
            return LatentOscarLayer, (self.config.for_layer(i), self.rotations.key_rotation[i],
                                      bool(self.rotations.calibration.get(LATENT_ABSORBED)))
        if self.max_cache_len is None:
            return DynamicOscarLayer, (self.config.for_layer(i), *self._rotations(i))
        return StaticOscarLayer, (self.config.for_layer(i), *self._rotations(i), self.max_cache_len)

    def sliding(self, i: int):
        window = self.shape.window("sliding_attention")
        if not self.quantize_sliding:  # transformers' own layer, as DynamicCache's
            return DynamicSlidingWindowLayer, (window,)
        cfg = self.config
        recent = cfg.recent_tokens if cfg.sliding_recent_tokens is None else cfg.sliding_recent_tokens
        return SlidingOscarLayer, (cfg.for_layer(i).replace(recent_tokens=recent), *self._rotations(i), window)

    def chunked(self, i: int):
        return DynamicSlidingWindowLayer, (self.shape.window("chunked_attention"),)

    def none(self, i: int):
        return None, ()

    ATTENTION = {"full_attention": full, "sliding_attention": sliding, "chunked_attention": chunked, None: none}


class OscarQuantizedCache(Cache):
    """A transformers Cache holding rotated K/V in INT2 (or INT4) with sink and recent windows.

    Example::

        cache = OscarQuantizedCache.from_pretrained("rotations/qwen3-8b", model=model)
        out = model.generate(**inputs, past_key_values=cache)

    Args:
        model_config: the model's config (its text config is used for composite models).
        rotations: an OscarRotations bundle that fits the model.
        config: storage settings; defaults to the bundle's recommended config, else OscarConfig().
        tensor_parallel: where the model is tensor-parallel (``tp_plan``), this process's place in its mesh, as a
            :class:`~oscar_hf.parallel.TensorParallel` or ``(rank, size)``: each rank stores the KV heads it computes,
            with its slice of per-head rotations. ``from_pretrained`` reads it from the model.
        max_cache_len: the most tokens a sequence will hold (prompt + new tokens), or None (grow as needed).
            With it, every buffer is allocated at its final size on the first update and the attention mask
            has a fixed size, so the cache is compileable: on CUDA, ``generate`` then compiles the model
            (``mode="reduce-overhead"``: CUDA graphs). Where the Triton kernels serve a layer (bf16/fp16, per-token
            K, uniform quantizer), its decode step is device-only operators and the whole model step is one
            graph; otherwise the cache update and the attention run eagerly (graph breaks).
        **config_overrides: OscarConfig fields to change.
    """

    def __init__(
        self,
        model_config,
        rotations: OscarRotations,
        config: OscarConfig | None = None,
        max_cache_len: int | None = None,
        tensor_parallel: TensorParallel | tuple[int, int] | None = None,
        **config_overrides,
    ):
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive integer or None; got {max_cache_len!r}")
        if max_cache_len is not None:
            # One compiled attention-module frame for every layer: its layer_idx must not be specialised (the
            # graph break at the cache update would otherwise compile it once per layer, past dynamo's limit).
            torch._dynamo.config.allow_unspec_int_on_nn_module = True
        rotations.check_compatible(model_config)
        config = config or rotations.config or OscarConfig()
        if config_overrides:
            config = config.replace(**config_overrides)
        if config.backend == "triton" and "triton" not in WRITE_BACKENDS:
            raise ImportError("OscarConfig.backend='triton' needs the triton package (pip install oscar-hf[triton])")
        shape = ModelShape.from_config(model_config)
        folded = bool(getattr(model_config, LATENT_ABSORBED, False))
        if shape.latent is not None and folded != bool(rotations.calibration.get(LATENT_ABSORBED)):
            raise ValueError("the model's kv_b_proj " + ("holds" if folded else "does not hold") + " a latent rotation "
                             "(absorb_latent_rotation) and the bundle is " + ("not " if folded else "")
                             + "the one absorb_latent_rotation returned: the latent would be read in the wrong basis")
        kinds = [shape.attention(i) for i in range(shape.num_layers)]
        # sliding-window layers stored by OSCAR too: on request, or where the model has no full-attention layer
        quantize_sliding = config.quantize_sliding or "full_attention" not in kinds
        stored = ("full_attention", "sliding_attention") if quantize_sliding else ("full_attention",)
        if quantize_sliding and max_cache_len is not None and "sliding_attention" in kinds:
            raise ValueError("quantized sliding-window layers drop the tokens that leave their window on the host: "
                             "build the cache without max_cache_len" + (
                                 "" if config.quantize_sliding else
                                 " (every layer of this model is sliding-window attention, so they are all quantized)"))
        for i, kind in enumerate(kinds):
            if kind in stored:
                config.resolved_group_size(shape.head_dims[i])
        for i in config.key_bits_layers or ():
            if i >= len(kinds) or kinds[i] not in stored:
                raise ValueError(f"OscarConfig.key_bits_layers lists layer {i}, which this cache does not quantize "
                                 f"({len(kinds)} layers; sliding-window layers are in the model dtype "
                                 "unless quantize_sliding)")
        build = _LayerBuilder(config, rotations, shape, max_cache_len, quantize_sliding)
        layers = [build(i) for i in range(shape.num_layers)]
        if tensor_parallel is not None and not isinstance(tensor_parallel, TensorParallel):
            tensor_parallel = TensorParallel(*tensor_parallel)
        for layer in layers:
            if isinstance(layer, OscarLayer):
                layer.tensor_parallel = tensor_parallel
        super().__init__(layers=layers)
        self.config = config
        self.rotations = rotations
        self._text_config = model_config.get_text_config(decoder=True)

    @classmethod
    def from_pretrained(
        cls,
        src: str | OscarRotations | None = None,
        *,
        model: torch.nn.Module,
        subfolder: str | None = None,
        revision: str | None = None,
        max_cache_len: int | None = None,
        tokenizer=None,
        calibration_texts=None,
        **config_overrides,
    ) -> "OscarQuantizedCache":
        """Load rotations from a folder or Hub repo (or take an OscarRotations), check them against
        ``model``, route the model's attention through oscar_hf, and build an empty cache.

        Without ``src``, the rotations made for ``model`` on demand (:mod:`oscar_hf.autocalibrate`): the first call
        calibrates them (seconds for a small model on a CPU; a model without a recipe also has its layout chosen,
        about seven more passes over 1,024 held-out tokens) on ``calibration_texts`` (default: the Austen excerpt
        shipped with oscar-hf) with ``tokenizer`` (default: loaded from the model's name or path) and saves the
        bundle in the Hugging Face cache folder; later calls, in this process or another, reuse it.
        """
        if src is None:
            from .autocalibrate import rotations_for_model

            rotations = rotations_for_model(model, tokenizer, calibration_texts)
        elif tokenizer is not None or calibration_texts is not None:
            raise ValueError("tokenizer= and calibration_texts= are for calibrating a bundle; they go with no src")
        else:
            rotations = (
                src
                if isinstance(src, OscarRotations)
                else OscarRotations.from_pretrained(src, subfolder=subfolder, revision=revision)
            )
        enable(model)
        return cls(model.config, rotations, max_cache_len=max_cache_len, tensor_parallel=TensorParallel.of(model),
                   **config_overrides)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, OscarLayer) and layer.takes_graph_step(key_states):
            return layer.update(key_states, value_states, leave_to_attention=True)
        return self._update_on_host(key_states, value_states, layer_idx, *args, **kwargs)

    @torch.compiler.disable  # runs eagerly (a graph break) inside a compiled forward
    def _update_on_host(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if isinstance(self.layers[layer_idx], OscarLayer):
            implementation = self._text_config._attn_implementation
            if implementation != ATTN_IMPLEMENTATION:
                raise RuntimeError(
                    f"the model's attention implementation is {implementation!r}, but OscarQuantizedCache needs "
                    f"{ATTN_IMPLEMENTATION!r}: call oscar_hf.enable(model) or use OscarQuantizedCache.from_pretrained"
                )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (capacity included, linear-attention and state-space layers' states
        too), read from the tensors; under tensor parallelism, this rank's."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, OSCAR_LAYERS):
                total += layer.nbytes
            elif getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
            for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
                total += sum(t.numel() * t.element_size() for t in states.values() if t is not None)
        return total

    @property
    def bits_per_element(self) -> float:
        """Bits of stored data over the number of K and V elements stored (0.0 when empty)."""
        bits = elements = 0
        for layer in self.layers:
            if isinstance(layer, OSCAR_LAYERS):
                b, e = layer.stored_bits_and_elements()
            elif getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None:
                e = layer.keys.numel() + layer.values.numel()
                b = 8 * layer.keys.element_size() * e
            else:
                b = e = 0
            bits, elements = bits + b, elements + e
        return bits / elements if elements else 0.0

    @property
    def history_bits_per_element(self) -> float:
        """Bits per K/V element of the quantized history alone (what a token costs once it leaves the windows; 0.0
        while nothing is quantized)."""
        bits = elements = 0
        for layer in self.layers:
            if isinstance(layer, OSCAR_LAYERS):
                b, e = layer.history_bits_and_elements()
                bits, elements = bits + b, elements + e
        return bits / elements if elements else 0.0


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Check that ``model`` can be served, and route its attention through oscar_hf ("oscar")."""
    check_model_supported(model)
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
