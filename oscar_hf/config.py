"""OscarConfig: how the cache stores K and V (bits, groups, windows, clipping, backend)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

from .layouts import KEY_LAYOUTS, KeyLayout
from .quantizer import QUANTIZERS, Grid

SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
BACKENDS = ("auto", "torch", "triton")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class OscarConfig:
    """Storage settings of an OSCAR KV cache.

    Per layer and KV head, the first ``sink_tokens`` and the newest ``recent_tokens`` (plus up to
    ``flush_tokens - 1`` more) stay in the model's dtype; every token between is clipped, quantized
    per token and per group of ``group_size`` channels to ``bits`` bits (K to ``key_bits``), and packed (K per
    channel instead with ``key_quantization="per-channel"``).

    Args:
        bits: 2 (OSCAR) or 4 (INT4 reference): V's bits, and K's unless ``key_bits`` is set.
        key_bits: K's bits, 2 or 4 (product K: 1 or 2); ``None`` means ``bits``. Retrieval leans on the keys: a
            2-bit history blurs which of several similar tokens a head points at, and 4-bit keys with 2-bit values
            restore it.
        key_bits_layers: the layer indices whose K gets ``key_bits`` (the others' K gets ``bits``); ``None``
            means every layer. :func:`oscar_hf.diagnostics.most_sensitive_layers` picks them from a bundle's
            calibration diagnostics.
        group_size: channels sharing one scale and zero; ``None`` means head_dim. A power of two
            that divides head_dim.
        sink_tokens: leading tokens kept in the model's dtype.
        recent_tokens: newest tokens kept in the model's dtype.
        flush_tokens: tokens are demoted to the quantized history this many at a time.
        k_clip, v_clip: per-row clip ratio in (0, 1] of the 2-bit rows: ``|x|`` is clamped to its
            ``floor(ratio * head_dim)``-th smallest absolute value. 1.0 means no clipping. 4-bit rows are never
            clipped (:attr:`side_clip`).
        scale_dtype: dtype of the stored scale and zero: "float16" (2.25 bits per element at
            group 128), "bfloat16" or "float32" (the compact quantizer stores bytes instead).
        quantizer: "uniform" (asymmetric min-max), "compact" (the uniform grid with a byte scale and a byte zero:
            half the metadata; 2.125 bits per element at group 128), "symmetric" (a grid centred on 0 and a scale
            alone: half the metadata, for centered rows) or "lloyd-max" (Gaussian levels, 2 bits only):
            :data:`oscar_hf.quantizer.QUANTIZERS`.
        centering: quantize ``x - μ`` instead of ``x``, with ``μ`` the mean K (V) per sequence and KV head over
            the first tokens that reach the history (for a prompt: all of it but the windows), stored in fp32
            and added back on reading. Keys carry large constant channels that a per-token 2-bit grid wastes
            its levels on; removing them costs one vector per sequence and head. With per-channel K only V is
            centered (K's token groups already take out each channel's offset).
        key_quantization: "per-token" (K like V), "per-channel" (KIVI's key layout: one scale and zero per
            channel and group of ``flush_tokens`` consecutive tokens, which then always reach the history whole;
            needs k_clip=1.0 and quantizer="uniform") or "product" (1- or 2-bit K against the bundle's codebooks,
            :mod:`oscar_hf.codebooks`; needs k_clip=1.0). V is per token either way.
        backend: "auto" (triton on CUDA when triton is installed, else torch), "torch" (dequantize + SDPA,
            the reference) or "triton" (fused INT2 write and decode kernels; calls they do not cover, such as
            fp32 models or queries of several tokens, fall back to the torch path).
        quantize_sliding: store the sliding-window layers the same way (sink, INT2 body, recent window; tokens
            that leave the window are dropped) instead of in transformers' own layer in the model dtype. Models
            whose every layer is sliding (Mistral-7B v0.1) are always stored so. Growing caches only.
        sliding_recent_tokens: the recent window of those sliding-window layers; ``None`` means ``recent_tokens``.
            The INT2 body is what the window leaves: about 250 tokens of Gemma-3's 512 with the default 256.
    """

    bits: int = 2
    key_bits: int | None = None
    key_bits_layers: list[int] | None = None
    group_size: int | None = None
    sink_tokens: int = 64
    recent_tokens: int = 256
    flush_tokens: int = 8
    k_clip: float = 0.96
    v_clip: float = 0.92
    scale_dtype: str = "float16"
    quantizer: str = "uniform"
    centering: bool = True
    key_quantization: str = "per-token"
    backend: str = "auto"
    quantize_sliding: bool = False
    sliding_recent_tokens: int | None = None

    def __post_init__(self):
        if isinstance(self.scale_dtype, torch.dtype):
            names = {v: k for k, v in SCALE_DTYPES.items()}
            self.scale_dtype = names.get(self.scale_dtype, str(self.scale_dtype))
        if self.bits not in (2, 4) or not _is_int(self.bits):
            self._fail("bits", "2 or 4")
        if self.key_bits is not None and (self.key_bits not in (1, 2, 4) or not _is_int(self.key_bits)):
            self._fail("key_bits", "None (same as bits), 2 or 4 (1 or 2 with key_quantization='product')")
        if self.key_bits_layers is not None:
            layers = self.key_bits_layers
            if not (isinstance(layers, (list, tuple)) and all(_is_int(i) and i >= 0 for i in layers)
                    and len(set(layers)) == len(layers)):
                self._fail("key_bits_layers", "None (every layer) or a list of distinct layer indices >= 0")
            if self.key_bits is None:
                self._fail("key_bits_layers", "None unless key_bits is set (the listed layers' K bits)")
            self.key_bits_layers = sorted(layers)
        if self.group_size is not None and not (
            _is_int(self.group_size) and self.group_size > 0 and self.group_size & (self.group_size - 1) == 0
        ):
            self._fail("group_size", "None (head_dim) or a positive power of two")
        for name in ("sink_tokens", "recent_tokens"):
            value = getattr(self, name)
            if not (_is_int(value) and value >= 0):
                self._fail(name, "an integer >= 0")
        if self.sliding_recent_tokens is not None and not (_is_int(self.sliding_recent_tokens)
                                                           and self.sliding_recent_tokens >= 0):
            self._fail("sliding_recent_tokens", "None (recent_tokens) or an integer >= 0")
        if not (_is_int(self.flush_tokens) and self.flush_tokens >= 1):
            self._fail("flush_tokens", "an integer >= 1")
        for name in ("k_clip", "v_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
                self._fail(name, "a number in (0, 1]; 1.0 means no clipping")
            setattr(self, name, float(value))
        for name, choices in (("scale_dtype", SCALE_DTYPES), ("quantizer", QUANTIZERS),
                              ("key_quantization", KEY_LAYOUTS), ("backend", BACKENDS)):
            if not isinstance(getattr(self, name), str) or getattr(self, name) not in choices:
                self._fail(name, " or ".join(map(repr, choices)))
        if 4 in self.side_bits.values() and 4 not in self.grid.bits:
            self._fail("quantizer", f"'uniform' with 4-bit K or V ({self.quantizer!r} has 2-bit levels only)")
        for name in ("centering", "quantize_sliding"):
            if not isinstance(getattr(self, name), bool):
                self._fail(name, "True or False")
        for name, (needed, why) in self.key_layout.needs.items():
            if getattr(self, name) != needed:
                self._fail(name, f"{needed!r} when key_quantization={self.key_quantization!r} ({why})")
        key_bits = {self.side_bits["key"]} | ({self.bits} if self.key_bits_layers is not None else set())
        if not key_bits <= set(self.key_layout.key_bits):
            wrong_key_bits = self.key_bits is not None and self.key_bits not in self.key_layout.key_bits
            field = "key_bits" if wrong_key_bits else "bits"
            allowed = " or ".join(map(str, self.key_layout.key_bits))
            self._fail(field, f"such that K takes {allowed} bits with key_quantization={self.key_quantization!r}")

    def _fail(self, field: str, allowed: str):
        raise ValueError(f"OscarConfig.{field} must be {allowed}; got {getattr(self, field)!r}")

    @property
    def side_bits(self) -> dict[str, int]:
        """Bits per code of each side in a layer that ``key_bits_layers`` lists: ``{"key": key_bits or bits,
        "value": bits}`` (see :meth:`for_layer`)."""
        return {"key": self.bits if self.key_bits is None else self.key_bits, "value": self.bits}

    @property
    def side_clip(self) -> dict[str, float]:
        """The clip ratio of each side's rows at :attr:`side_bits` (a layer's, after :meth:`for_layer`): ``k_clip``
        and ``v_clip`` where the side has 2 bits or fewer, 1.0 (none) at 4 bits. Clipping trades a row's few largest
        values for a finer 2-bit grid; 16 levels already resolve them, and clipping them costs retrieval (needles
        at 8K tokens on SmolLM2-135M)."""
        ratios = {"key": self.k_clip, "value": self.v_clip}
        return {side: ratios[side] if bits <= 2 else 1.0 for side, bits in self.side_bits.items()}

    def for_layer(self, layer_idx: int) -> "OscarConfig":
        """The config of one layer: ``key_bits_layers`` resolved (``key_bits`` if it lists the layer, else
        ``bits``), so that ``side_bits`` is that layer's."""
        if self.key_bits_layers is None:
            return self
        return self.replace(key_bits=self.key_bits if layer_idx in self.key_bits_layers else None,
                            key_bits_layers=None)

    def mean_key_bits(self, num_layers: int | None) -> float:
        """K's bits averaged over a model's ``num_layers`` quantized layers (needed with ``key_bits_layers``)."""
        if self.key_bits_layers is None:
            return self.side_bits["key"]
        if num_layers is None:
            raise ValueError("OscarConfig.key_bits_layers is set: bits per element need the model's num_layers")
        high = sum(i < num_layers for i in self.key_bits_layers)
        return (high * self.key_bits + (num_layers - high) * self.bits) / num_layers

    @property
    def grid(self) -> Grid:
        """The per-token quantizer (:data:`oscar_hf.quantizer.QUANTIZERS`)."""
        return QUANTIZERS[self.quantizer]

    @property
    def torch_scale_dtype(self) -> torch.dtype:
        return SCALE_DTYPES[self.scale_dtype]

    @property
    def meta_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """The stored dtypes of a per-token row's scale and zero (``scale_dtype``'s, or the compact quantizer's
        uint8 and int8)."""
        return self.grid.meta_dtypes(self.torch_scale_dtype)

    def resolved_group_size(self, head_dim: int) -> int:
        """The group size for a given head_dim; raises ValueError if it cannot be used."""
        if not head_dim > 0:
            raise ValueError(f"head_dim must be positive; got {head_dim!r}")
        group = self.group_size or head_dim
        bits = min(self.side_bits.values())
        if head_dim % group:
            raise ValueError(f"OscarConfig.group_size={group} must divide head_dim={head_dim}")
        if head_dim % (8 // bits):
            raise ValueError(f"head_dim={head_dim} must be a multiple of {8 // bits} to pack {bits}-bit codes")
        return group

    @property
    def key_layout(self) -> KeyLayout:
        """The K layout strategy that ``key_quantization`` names."""
        return KEY_LAYOUTS[self.key_quantization]

    @property
    def centered_sides(self) -> tuple[str, ...]:
        """The sides whose history is stored centered: both, V alone where the K layout is not centered, or none."""
        if not self.centering:
            return ()
        return ("key", "value") if self.key_layout.centered else ("value",)

    @property
    def demotion_unit(self) -> int:
        """The history grows by multiples of this many tokens (the K layout's)."""
        return self.key_layout.demotion_unit(self)

    def bits_per_element(
        self, head_dim: int, seq_len: int | None = None, model_bits: int = 16, num_layers: int | None = None
    ) -> float:
        """Analytic bits per stored K/V element, for a sequence of ``seq_len`` tokens (None: the history alone),
        averaged over ``num_layers`` layers (needed only with ``key_bits_layers``).

        A history element costs its side's bits plus its share of a scale and a zero: V (and per-token K) has one pair
        per token and group of ``group_size`` channels (the symmetric quantizer a scale alone, the compact one a byte
        each), per-channel K one pair per channel and group of ``flush_tokens`` tokens. The windows hold what a
        prefill of ``seq_len`` tokens leaves in them.
        """
        if seq_len is not None and not seq_len > 0:
            raise ValueError(f"seq_len must be None (the history alone) or positive; got {seq_len!r}")
        group = self.resolved_group_size(head_dim)
        key_group = self.key_layout.values_per_scale(self, group)
        # the mean over K and V of the code bits and a scale (and a zero) per group
        meta = self.grid.meta_bits(self.torch_scale_dtype) / 2
        history = (self.mean_key_bits(num_layers) + self.bits) / 2 + meta / key_group + meta / group
        if seq_len is None:
            return history
        past_windows = max(seq_len - self.sink_tokens - self.recent_tokens, 0)
        quantized = past_windows // self.demotion_unit * self.demotion_unit
        center = 16 * len(self.centered_sides) if quantized else 0  # one fp32 mean per head and centered side
        return ((seq_len - quantized) * model_bits + quantized * history + center) / seq_len

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "OscarConfig":
        if not isinstance(data, dict):
            raise ValueError(f"an OscarConfig is read from a dict of its fields; got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown OscarConfig field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "OscarConfig":
        return cls.from_dict(json.loads(text))

    def replace(self, **overrides) -> "OscarConfig":
        """A copy with some fields changed (validated like the constructor)."""
        return self.from_dict({**self.to_dict(), **overrides})
