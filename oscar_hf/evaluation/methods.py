"""The methods registry: each KV-cache method is a named preset of OscarConfig plus rotations, or a baseline cache.

``rotations`` says where a method's rotations come from: None (no OSCAR: the model's default cache, or
transformers' QuantizedCache for ``quantized_cache``), "identity", "hadamard" (data-free), "calibrated" (the bundle
given to the harness), or "calibrated-values" (that bundle's V rotations, identity for K). ``Method.unmet`` is the one
rule for what a method needs (a calibrated bundle, its diagnostics, an optional package); the evaluation harness,
``oscar-hf eval``, the ``hf-oscar`` lm-eval model and eval/bench_generate.py all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import DynamicCache, QuantizedCache

from .._extras import install_hint, installed
from ..cache import OscarQuantizedCache
from ..config import OscarConfig
from ..diagnostics import most_sensitive_layers
from ..rotations import OscarRotations

NO_CLIP = {"k_clip": 1.0, "v_clip": 1.0}
# the baselines, without our additions; K as many bits as V whatever the calibrated bundle's config says
AS_PUBLISHED = {"quantizer": "uniform", "centering": False, "key_bits": None, "key_bits_layers": None, **NO_CLIP}
# the per-token baselines quantize K per token whatever K layout the calibrated bundle recommends
PER_TOKEN = {**AS_PUBLISHED, "key_quantization": "per-token"}
INT2 = {"bits": 2, "key_bits": None, "key_bits_layers": None}
PRODUCT_KEYS = {"key_quantization": "product", "k_clip": 1.0}
ROTATION_SOURCES = (None, "identity", "hadamard", "calibrated", "calibrated-values")
CALIBRATED = ("calibrated", "calibrated-values")  # the sources that read the calibrated bundle
QUANTIZED_CACHE_MODULES = {"quanto": "optimum.quanto", "hqq": "hqq"}  # QuantizedCache backend -> module it needs


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    rotations: str | None  # one of ROTATION_SOURCES
    config: dict = field(default_factory=dict)  # OscarConfig fields; for quantized_cache only "bits"
    key_bits_fraction: float | None = None  # key_bits for this fraction of the layers, the most sensitive ones
    quantized_cache: str | None = None  # instead of OSCAR: transformers' QuantizedCache with this backend
    key_codebook_bits: int | None = None  # the bundle's product-quantized key codebooks it reads

    def __post_init__(self):
        if self.rotations not in ROTATION_SOURCES:
            raise ValueError(f"method {self.name!r}: rotations={self.rotations!r}, not one of {ROTATION_SOURCES}")
        if self.quantized_cache is not None and (
            self.rotations is not None or self.quantized_cache not in QUANTIZED_CACHE_MODULES
        ):
            raise ValueError(f"method {self.name!r}: quantized_cache takes one of {list(QUANTIZED_CACHE_MODULES)}, "
                             "and no rotations")

    @property
    def needs_calibration(self) -> bool:
        """Whether the method reads a calibrated bundle (its rotations, or only their V half): it cannot run
        without one."""
        return self.rotations in CALIBRATED

    @property
    def needs_diagnostics(self) -> bool:
        """Whether the method also needs the bundle's calibration diagnostics (``key_bits_fraction`` ranks the
        layers by them)."""
        return self.key_bits_fraction is not None

    @property
    def is_oscar(self) -> bool:
        """Whether the method's cache is an OscarQuantizedCache (it then takes OscarConfig overrides)."""
        return self.rotations is not None

    @property
    def requires(self) -> str | None:
        """The optional module the method's cache needs, if any."""
        return QUANTIZED_CACHE_MODULES.get(self.quantized_cache)

    def installed(self) -> bool:
        return self.requires is None or installed(self.requires)

    def unmet(self, calibrated: OscarRotations | None) -> str | None:
        """Why the method cannot run with this calibrated bundle (or None): it needs one, or its diagnostics, or a
        package that is not installed; None when it can run."""
        if self.needs_calibration and calibrated is None:
            return (f"method {self.name!r} needs calibrated rotations (a bundle made by `oscar-hf calibrate`); the "
                    f"data-free methods are {', '.join(m.name for m in METHODS.values() if not m.needs_calibration)}")
        if self.needs_diagnostics and (calibrated is None or not calibrated.diagnostics):
            return f"method {self.name!r} needs a bundle with calibration diagnostics (to rank the layers)"
        bits = self.key_codebook_bits
        if bits is not None and (calibrated is None or not any(calibrated.key_codebooks.get(bits, []))):
            return (f"method {self.name!r} needs a bundle with {bits}-bit key codebooks (oscar-hf calibrate "
                    f"--key-codebooks {bits})")
        if not self.installed():
            return install_hint(self.requires, f"method {self.name!r}")
        return None

    def runs_with(self, calibrated: OscarRotations | None) -> bool:
        """Whether the method can run with this calibrated bundle (or None): :meth:`unmet` finds nothing."""
        return self.unmet(calibrated) is None

    def oscar_config(self, base: OscarConfig | None, head_dim: int, diagnostics: list[dict] | None = None
                     ) -> OscarConfig:
        """The method's OscarConfig on top of ``base`` (the calibrated bundle's or the defaults); ``diagnostics``
        (the bundle's) rank the layers for ``key_bits_fraction``."""
        overrides = dict(self.config)
        if overrides.get("group_size") == "min(128, head_dim)":
            overrides["group_size"] = min(128, head_dim)
        if self.key_bits_fraction is not None:  # (raises a ValueError naming the diagnostics when there are none)
            overrides["key_bits_layers"] = most_sensitive_layers(diagnostics, self.key_bits_fraction)
        return (base or OscarConfig()).replace(**overrides)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("bf16", "the default cache in the model dtype", None),
        Method(
            "int4",
            "INT4 per token, group 128 (or head_dim), identity rotation, no clipping",
            "identity",
            {"bits": 4, "group_size": "min(128, head_dim)", **PER_TOKEN},
        ),
        Method(
            "naive-int2",
            "INT2 per token, identity rotation, no clipping",
            "identity",
            PER_TOKEN,
        ),
        Method(
            "quarot-int2",
            "INT2 per token, Hadamard rotation, no clipping",
            "hadamard",
            PER_TOKEN,
        ),
        # KIVI keeps a full-precision residual of R = 128 tokens (its code: V's is exactly 128, K's 0..127, since
        # it quantizes K's residual whenever 128 have gathered). Here K and V share one window, which holds
        # recent_tokens .. recent_tokens + G - 1 tokens as it waits for a whole group: 112 makes it 112..143,
        # 127.5 on average, the nearest this layout gets to 128.
        Method(
            "kivi-2",
            "KIVI-2: INT2, K per channel in groups of 32 tokens, V per token in groups of 32 channels, identity "
            "rotation, no clipping, no sink, full-precision residual of 112 to 143 tokens (KIVI's R = 128)",
            "identity",
            {
                "bits": 2,
                "key_quantization": "per-channel",
                "flush_tokens": 32,
                "group_size": 32,
                "sink_tokens": 0,
                "recent_tokens": 112,
                "scale_dtype": "float16",
                **AS_PUBLISHED,
            },
        ),
        Method(
            "oscar",
            "INT2 per token, calibrated rotations, clipping, centering",
            "calibrated",
            {"quantizer": "uniform", "centering": True, **INT2},
        ),
        Method(
            "oscar-bundle",
            "the calibrated bundle's recommended config as it is: the layout its calibration chose "
            "(--choose-layout), or its recipe's",
            "calibrated",
        ),
        Method(
            "oscar-uncentered",
            "as oscar, without centering (the published method)",
            "calibrated",
            {"quantizer": "uniform", "centering": False, **INT2},
        ),
        # SmolLM2-135M (eval/results/smollm2-135m/niah-investigation): the 2-bit K history blurs which needle digit
        # a retrieval head points at; exact V fixes nothing, more bits on K fix every cell.
        Method(
            "oscar-k4",
            "as oscar, with 4-bit K (2-bit V)",
            "calibrated",
            {"quantizer": "uniform", "centering": True, **INT2, "key_bits": 4},
        ),
        Method(
            "oscar-int4",
            "as oscar, at 4 bits for K and V (4-bit rows are not clipped)",
            "calibrated",
            {"quantizer": "uniform", "centering": True, "bits": 4, "key_bits": None, "key_bits_layers": None},
        ),
        Method(
            "oscar-k4-half",
            "as oscar, with 4-bit K in the half of the layers where 2-bit K changes attention most (the bundle's "
            "calibration score KL)",
            "calibrated",
            {"quantizer": "uniform", "centering": True, "bits": 2, "key_bits": 4},
            key_bits_fraction=0.5,
        ),
        # head_dim 64: the zeros a centered history does not need pay for 4-bit K in half the layers (2.75 bits)
        Method(
            "oscar-k4-half-symmetric",
            "as oscar-k4-half, with the symmetric quantizer (a scale alone per group, zeros implied): 4-bit K in "
            "half the layers at the metadata of one scale",
            "calibrated",
            {"quantizer": "symmetric", "centering": True, "bits": 2, "key_bits": 4},
            key_bits_fraction=0.5,
        ),
        Method(
            "oscar-symmetric",
            "as oscar, with the symmetric quantizer (a scale alone per group, zeros implied)",
            "calibrated",
            {"quantizer": "symmetric", "centering": True, **INT2},
        ),
        # the same bits as the symmetric pair, spent on an asymmetric grid: a byte each for scale and zero
        Method(
            "oscar-k4-half-compact",
            "as oscar-k4-half, with the compact quantizer (a byte scale and a byte zero per group): 4-bit K in half "
            "the layers at the metadata of one fp16 scale",
            "calibrated",
            {"quantizer": "compact", "centering": True, "bits": 2, "key_bits": 4},
            key_bits_fraction=0.5,
        ),
        Method(
            "oscar-compact",
            "as oscar, with the compact quantizer (a byte scale and a byte zero per group)",
            "calibrated",
            {"quantizer": "compact", "centering": True, **INT2},
        ),
        # Gemma-3-270M (eval/results/gemma3-270m/investigation): 92% of OSCAR's KL comes from K, whose outlier
        # channels a per-token grid cannot hold; unrotated per-channel K (KIVI's layout, 64-token groups) fixes it.
        Method(
            "oscar-channel-k",
            "INT2: K per channel in groups of 64 tokens, unrotated; V as oscar (calibrated rotation, per token in "
            "groups of 128 channels or head_dim, clipping, centering)",
            "calibrated-values",
            {
                "key_quantization": "per-channel",
                "flush_tokens": 64,
                "group_size": "min(128, head_dim)",
                "k_clip": 1.0,
                "quantizer": "uniform",
                "centering": True,
                **INT2,
            },
        ),
        Method(
            "oscar-lloyd-max",
            "as oscar, with Lloyd-Max levels (K per token: the levels are per token)",
            "calibrated",
            {"quantizer": "lloyd-max", "centering": True, "key_quantization": "per-token", **INT2},
        ),
        # 1 and 2 bits per K element, no scales (oscar_hf.codebooks): 1.75 and 2.25 history bits at head_dim 64 with
        # 2-bit V in groups of 64 (1.625 and 2.125 at head_dim 128)
        Method(
            "oscar-pq1",
            "as oscar, with K product-quantized to 1 bit per element (a byte per 8 channels, the bundle's codebooks)",
            "calibrated",
            {"quantizer": "uniform", "centering": True, **INT2, **PRODUCT_KEYS, "key_bits": 1},
            key_codebook_bits=1,
        ),
        Method(
            "oscar-pq2",
            "as oscar, with K product-quantized to 2 bits per element (a byte per 4 channels, the bundle's codebooks)",
            "calibrated",
            {"quantizer": "uniform", "centering": True, **INT2, **PRODUCT_KEYS},
            key_codebook_bits=2,
        ),
        # transformers' own quantized cache, in its defaults but for the bits: INT2 codes in groups of 64 values, the
        # newest tokens (up to 128) in the model dtype; pip install "oscar-hf[baselines]"
        Method(
            "quanto-int2",
            "transformers' QuantizedCache with optimum-quanto: INT2 in groups of 64, a residual of up to 128 tokens",
            None,
            {"bits": 2},
            quantized_cache="quanto",
        ),
        Method(
            "hqq-int2",
            "transformers' QuantizedCache with HQQ: INT2 in groups of 64, a residual of up to 128 tokens",
            None,
            {"bits": 2},
            quantized_cache="hqq",
        ),
    )
}


def check_methods(names, calibrated: OscarRotations | None) -> None:
    """Raise ValueError for the first name that is not in METHODS or whose method cannot run with ``calibrated``
    (:meth:`Method.unmet`): before a run starts, not when it reaches that method."""
    for name in names:
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}")
        reason = METHODS[name].unmet(calibrated)
        if reason:
            raise ValueError(reason)


def stored_bits(cache, model) -> float:
    """Bits per stored K/V element: the OSCAR cache's own count; for transformers' QuantizedCache, its codes plus a
    scale and a zero per group in the model dtype for the quantized tokens and the model dtype for the residual,
    averaged over layers and tokens; else the model dtype's width (default cache)."""
    dtype_bits = 8.0 * next(model.parameters()).element_size()
    bits = getattr(cache, "bits_per_element", None)
    if bits:
        return bits
    if isinstance(cache, QuantizedCache):
        total = tokens = 0.0
        for layer in cache.layers:
            held = int(layer.get_seq_length())
            residual = layer.keys.shape[-2] if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4 else 0
            total += (held - residual) * (layer.nbits + 2 * dtype_bits / layer.q_group_size) + residual * dtype_bits
            tokens += held
        return total / tokens if tokens else dtype_bits
    return dtype_bits


def history_bits(cache, model) -> float:
    """Bits per K/V element of a token once it is quantized: the OSCAR cache's history count (NaN while it has
    quantized nothing); for transformers' QuantizedCache, its codes plus a scale and a zero per group in the model
    dtype; else (the default cache) the model dtype's width."""
    if isinstance(cache, QuantizedCache):
        layer = cache.layers[0]
        return layer.nbits + 2 * 8.0 * next(model.parameters()).element_size() / layer.q_group_size
    bits = getattr(cache, "history_bits_per_element", None)
    if bits is None:
        return 8.0 * next(model.parameters()).element_size()
    return bits or float("nan")


def bit_columns(cache, model) -> dict[str, float]:
    """A result row's ``bits_per_element`` (:func:`stored_bits`) and ``history_bits`` (:func:`history_bits`)."""
    return {"bits_per_element": stored_bits(cache, model), "history_bits": history_bits(cache, model)}


def make_cache(method: str | Method, model, calibrated: OscarRotations | None = None,
               max_cache_len: int | None = None, **overrides):
    """A fresh cache for ``method``: the default DynamicCache ("bf16"), transformers' QuantizedCache
    (``quantized_cache``), or an OscarQuantizedCache, whose buffers ``max_cache_len`` allocates up front (static)
    and whose method config ``overrides`` (OscarConfig fields) amend. Raises ValueError when the method cannot run
    with ``calibrated`` (:meth:`Method.unmet`)."""
    method = METHODS[method] if isinstance(method, str) else method
    reason = method.unmet(calibrated)
    if reason:
        raise ValueError(reason)
    if not method.is_oscar:
        if overrides or max_cache_len is not None:
            raise ValueError(f"method {method.name!r} is not an OSCAR cache: it takes no max_cache_len or "
                             f"OscarConfig overrides {sorted(overrides)}")
        if method.quantized_cache:
            return QuantizedCache(backend=method.quantized_cache, config=model.config, nbits=method.config["bits"])
        return DynamicCache(config=model.config)
    if method.needs_calibration:
        rotations = calibrated if method.rotations == "calibrated" else calibrated.with_identity_keys()
    else:
        rotations = getattr(OscarRotations, method.rotations)(model.config)
    base = calibrated.config if calibrated is not None else None
    diagnostics = calibrated.diagnostics if calibrated is not None else None
    # (a group the smallest head_dim holds fits every layer's: head_dims are powers of two)
    config = method.oscar_config(base, min(rotations.head_dims), diagnostics).replace(**overrides)
    return OscarQuantizedCache.from_pretrained(rotations, model=model, config=config, max_cache_len=max_cache_len)
