"""OscarQuantizedCache: a transformers Cache that keeps rotated K and V mostly in 2 bits.

Per full-attention layer and KV head the cached sequence is ``sink ‖ history ‖ recent``:

* ``sink``    model dtype ``[B, H, ≤ sink_tokens, D]``: the first tokens;
* ``history`` packed codes uint8 ``[B, H, N, D·bits/8]`` with scale and zero ``[B, H, N, D/group]``;
* ``recent``  model dtype ``[B, H, ≤ recent_tokens + flush_tokens - 1, D]``: the newest tokens.

Window buffers grow up to those sizes; the history grows in chunks of at least HISTORY_GROWTH tokens.

Everything is stored rotated (``k @ R_K``, ``v @ R_V``). ``update`` returns :class:`OscarKV`
handles instead of dense tensors; the attention function registered as ``"oscar"`` reads the
storage through them. Sliding-window layers keep transformers' own bf16 layer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .config import OscarConfig
from .kernels import WRITE_BACKENDS, write_backend
from .model_support import ModelShape, check_model_supported
from .quantizer import QuantizedRows, dequantize
from .rotations import OscarRotations

ATTN_IMPLEMENTATION = "oscar"
HISTORY_GROWTH = 1024  # tokens; the history grows by at least this much, or by an eighth of itself


class OscarKV:
    """What ``update`` hands to the attention function in place of K or V ``[B, H, T, D]``.

    ``new`` holds the rotated K (or V) of the tokens added by this update, at full precision;
    the rest of the sequence is read from ``layer``.
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
    """Preallocated rows of one K or V side, along dim 2 of ``[B, H, capacity, ...]`` tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[2]

    def write(self, start: int, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            self.tensors[name][:, :, start : start + value.shape[2]] = value

    def read(self, stop: int, start: int = 0) -> dict[str, torch.Tensor]:
        return {name: t[:, :, start:stop] for name, t in self.tensors.items()}

    def grow(self, used: int, capacity: int) -> None:
        for name, old in self.tensors.items():
            new = old.new_empty(*old.shape[:2], capacity, *old.shape[3:])
            new[:, :, :used] = old[:, :, :used]
            self.tensors[name] = new

    def map(self, fn) -> None:
        self.tensors = {name: fn(t) for name, t in self.tensors.items()}

    def used_bytes(self, used: int) -> int:
        return sum(t[:, :, :used].numel() * t.element_size() for t in self.tensors.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _reserve(segment: _Segment, used: int, needed: int, limit: int) -> None:
    """Grow a window segment (doubling, at most to ``limit`` tokens) so that it holds ``needed`` tokens."""
    if needed > segment.capacity:
        segment.grow(used, min(limit, max(needed, 2 * segment.capacity, 16)))


class OscarLayer(CacheLayerMixin):
    """One full-attention layer's OSCAR storage. See the module docstring for the layout."""

    is_compileable = False
    is_sliding = False
    # Demotions into the quantized history are not undone by ``crop``, so a rollback can leave a trace.
    is_croppable = False

    def __init__(self, config: OscarConfig, key_rotation: torch.Tensor, value_rotation: torch.Tensor):
        super().__init__()
        self.config = config
        self.key_rotation = key_rotation
        self.value_rotation = value_rotation
        self.n_sink = self.n_history = self.n_recent = 0

    @property
    def length(self) -> int:
        return self.n_sink + self.n_history + self.n_recent

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        cfg = self.config
        self.group_size = cfg.resolved_group_size(dim)
        self.writer = write_backend(cfg.backend, self.device)
        self.key_rotation = self.key_rotation.to(self.device, torch.float32)
        self.value_rotation = self.value_rotation.to(self.device, torch.float32)

        def empty(*tail: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(batch, heads, 0, *tail, dtype=dtype, device=self.device)

        self.sink = _Segment({"key": empty(dim, dtype=self.dtype), "value": empty(dim, dtype=self.dtype)})
        self.recent = _Segment({"key": empty(dim, dtype=self.dtype), "value": empty(dim, dtype=self.dtype)})
        codes, groups, scale_dtype = dim * cfg.bits // 8, dim // self.group_size, cfg.torch_scale_dtype
        self.history = _Segment(
            {
                f"{side}_{part}": empty(codes, dtype=torch.uint8)
                if part == "codes"
                else empty(groups, dtype=scale_dtype)
                for side in ("key", "value")
                for part in ("codes", "scale", "zero")
            }
        )
        self.is_initialized = True

    # -------------------------------------------------------------------------------- writes
    def _rotate(self, states: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        return (states.float() @ rotation).to(self.dtype)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[OscarKV, OscarKV]:
        """Rotate and store new K/V ``[B, H, n, D]``; return handles for the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = {
            "key": self._rotate(key_states, self.key_rotation),
            "value": self._rotate(value_states, self.value_rotation),
        }
        self._append(new)
        return OscarKV(self, new["key"]), OscarKV(self, new["value"])

    def _append(self, new: dict[str, torch.Tensor]) -> None:
        cfg = self.config
        n = new["key"].shape[2]
        to_sink = min(cfg.sink_tokens - self.n_sink, n)
        if to_sink:
            _reserve(self.sink, self.n_sink, self.n_sink + to_sink, cfg.sink_tokens)
            self.sink.write(self.n_sink, {s: t[:, :, :to_sink] for s, t in new.items()})
            self.n_sink += to_sink
        rest = {s: t[:, :, to_sink:] for s, t in new.items()}
        resident, limit = self.n_recent + (n - to_sink), cfg.recent_tokens + cfg.flush_tokens - 1
        if resident <= limit:
            _reserve(self.recent, self.n_recent, resident, limit)
            self.recent.write(self.n_recent, rest)
            self.n_recent = resident
            return
        # Too many tokens for the window: the oldest ones, down to recent_tokens, go to the history.
        window = {s: torch.cat([self.recent[s][:, :, : self.n_recent], t], dim=2) for s, t in rest.items()}
        demoted = resident - cfg.recent_tokens
        self._quantize_into_history({s: t[:, :, :demoted] for s, t in window.items()})
        _reserve(self.recent, 0, cfg.recent_tokens, limit)
        self.recent.write(0, {s: t[:, :, demoted:] for s, t in window.items()})
        self.n_recent = cfg.recent_tokens

    def _quantize_into_history(self, rows: dict[str, torch.Tensor]) -> None:
        cfg = self.config
        n = rows["key"].shape[2]
        needed = self.n_history + n
        if needed > self.history.capacity:
            capacity = max(needed, self.history.capacity + max(HISTORY_GROWTH, self.history.capacity // 8))
            self.history.grow(self.n_history, capacity)
        quantized = self.writer(
            rows["key"],
            rows["value"],
            bits=cfg.bits,
            group_size=self.group_size,
            k_clip=cfg.k_clip,
            v_clip=cfg.v_clip,
            scale_dtype=cfg.torch_scale_dtype,
            method=cfg.quantizer,
        )
        packed = {f"{side}_{part}": t for side, q in zip(("key", "value"), quantized) for part, t in zip(q._fields, q)}
        self.history.write(self.n_history, packed)
        self.n_history = needed

    # --------------------------------------------------------------------------------- reads
    def materialize(self, side: str, stop: int | None = None) -> torch.Tensor:
        """The stored sequence ``sink ‖ dequantized history ‖ recent`` of ``side`` ("key" or "value"),
        rotated, in the model dtype, ``[B, H, stop, D]`` (the first ``stop`` tokens, default all)."""
        h = self.history.read(self.n_history)
        history = dequantize(
            QuantizedRows(h[f"{side}_codes"], h[f"{side}_scale"], h[f"{side}_zero"]), self.config.bits, self.dtype
        )
        parts = [self.sink[side][:, :, : self.n_sink], history, self.recent[side][:, :, : self.n_recent]]
        return torch.cat(parts, dim=2)[:, :, :stop]

    # ------------------------------------------------------------------ cache bookkeeping API
    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _segments(self) -> tuple[_Segment, ...]:
        return (self.sink, self.history, self.recent) if self.is_initialized else ()

    def reset(self) -> None:
        self.n_sink = self.n_history = self.n_recent = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest ``-tokens_to_remove`` tokens (transformers passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove; got {tokens_to_remove}")
        remove = min(-tokens_to_remove, self.length)
        for count in ("n_recent", "n_history", "n_sink"):
            taken = min(remove, getattr(self, count))
            setattr(self, count, getattr(self, count) - taken)
            remove -= taken

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for segment in self._segments():
            segment.map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for segment in self._segments():
            segment.map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for segment in self._segments():
            segment.map(lambda t: t[indices])

    def offload(self):
        raise NotImplementedError("OscarQuantizedCache does not support offloading")

    prefetch = offload

    # ---------------------------------------------------------------------------- accounting
    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds, capacity and device rotations included."""
        rotations = sum(r.numel() * r.element_size() for r in (self.key_rotation, self.value_rotation))
        return sum(s.nbytes() for s in self._segments()) + (rotations if self.is_initialized else 0)

    def stored_bits_and_elements(self) -> tuple[int, int]:
        """(bits of stored data, K and V elements stored) over the tokens in use."""
        if not self.is_initialized:
            return 0, 0
        used = (
            self.sink.used_bytes(self.n_sink)
            + self.history.used_bytes(self.n_history)
            + self.recent.used_bytes(self.n_recent)
        )
        b, h, _, d = self.sink["key"].shape
        return 8 * used, 2 * b * h * self.length * d


class OscarQuantizedCache(Cache):
    """A transformers Cache holding rotated K/V in INT2 (or INT4) with sink and recent windows.

    Example::

        cache = OscarQuantizedCache.from_pretrained("rotations/qwen3-8b", model=model)
        out = model.generate(**inputs, past_key_values=cache)

    Args:
        model_config: the model's config (its text config is used for composite models).
        rotations: an OscarRotations bundle that fits the model.
        config: storage settings; defaults to the bundle's recommended config, else OscarConfig().
        **config_overrides: OscarConfig fields to change.
    """

    def __init__(
        self,
        model_config,
        rotations: OscarRotations,
        config: OscarConfig | None = None,
        **config_overrides,
    ):
        rotations.check_compatible(model_config)
        config = config or rotations.config or OscarConfig()
        if config_overrides:
            config = config.replace(**config_overrides)
        if config.backend == "triton" and "triton" not in WRITE_BACKENDS:
            raise ImportError("OscarConfig.backend='triton' needs the triton package (pip install oscar-hf[triton])")
        shape = ModelShape.from_config(model_config)
        config.resolved_group_size(shape.head_dim)
        layers = []
        for i, kind in enumerate(shape.layer_types):
            if kind == "full_attention":
                layers.append(OscarLayer(config, rotations.key_rotation[i], rotations.value_rotation[i]))
            elif kind == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=shape.sliding_window))
            else:
                raise ValueError(f"layer {i} has type {kind!r}, which OscarQuantizedCache cannot store")
        super().__init__(layers=layers)
        self.config = config
        self.rotations = rotations
        self._text_config = model_config.get_text_config(decoder=True)

    @classmethod
    def from_pretrained(
        cls,
        src: str | OscarRotations,
        *,
        model: torch.nn.Module,
        subfolder: str | None = None,
        revision: str | None = None,
        **config_overrides,
    ) -> "OscarQuantizedCache":
        """Load rotations from a folder or Hub repo (or take an OscarRotations), check them against
        ``model``, route the model's attention through oscar_hf, and build an empty cache."""
        rotations = (
            src
            if isinstance(src, OscarRotations)
            else OscarRotations.from_pretrained(src, subfolder=subfolder, revision=revision)
        )
        enable(model)
        return cls(model.config, rotations, **config_overrides)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
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
        """Bytes of every tensor the cache holds (capacity included), read from the tensors."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                total += layer.nbytes
            elif layer.is_initialized:
                total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return total

    @property
    def bits_per_element(self) -> float:
        """Bits of stored data over the number of K and V elements stored (0.0 when empty)."""
        bits = elements = 0
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                b, e = layer.stored_bits_and_elements()
            elif layer.is_initialized:
                e = layer.keys.numel() + layer.values.numel()
                b = 8 * layer.keys.element_size() * e
            else:
                b = e = 0
            bits, elements = bits + b, elements + e
        return bits / elements if elements else 0.0


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Check that ``model`` can be served, and route its attention through oscar_hf ("oscar")."""
    check_model_supported(model)
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model
