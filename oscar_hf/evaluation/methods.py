"""The methods registry: each KV-cache method is a named preset of OscarConfig plus rotations.

``rotations`` says where a method's rotations come from: None (the default cache, no OSCAR at
all), "identity", "hadamard" (data-free), "calibrated" (the bundle given to the harness), or
"calibrated-values" (that bundle's V rotations, identity for K).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import DynamicCache

from ..cache import OscarQuantizedCache
from ..config import OscarConfig
from ..diagnostics import most_sensitive_layers
from ..rotations import OscarRotations

NO_CLIP = {"k_clip": 1.0, "v_clip": 1.0}
# the baselines, without our additions; K as many bits as V whatever the calibrated bundle's config says
AS_PUBLISHED = {"quantizer": "uniform", "centering": False, "key_bits": None, "key_bits_layers": None, **NO_CLIP}
INT2 = {"bits": 2, "key_bits": None, "key_bits_layers": None}


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    rotations: str | None
    config: dict = field(default_factory=dict)
    key_bits_fraction: float | None = None  # key_bits for this fraction of the layers, the most sensitive ones

    def runs_with(self, calibrated: OscarRotations | None) -> bool:
        """Whether the method can run with this calibrated bundle (or None): calibrated rotations need one, and
        ``key_bits_fraction`` its diagnostics."""
        if self.rotations is None or not self.rotations.startswith("calibrated"):
            return True
        return calibrated is not None and (self.key_bits_fraction is None or bool(calibrated.diagnostics))

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
            {"bits": 4, "group_size": "min(128, head_dim)", **AS_PUBLISHED},
        ),
        Method(
            "naive-int2",
            "INT2 per token, identity rotation, no clipping",
            "identity",
            AS_PUBLISHED,
        ),
        Method(
            "quarot-int2",
            "INT2 per token, Hadamard rotation, no clipping",
            "hadamard",
            AS_PUBLISHED,
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
            "oscar-k4-half",
            "as oscar, with 4-bit K in the half of the layers where 2-bit K changes attention most (the bundle's "
            "calibration score KL)",
            "calibrated",
            {"quantizer": "uniform", "centering": True, "bits": 2, "key_bits": 4},
            key_bits_fraction=0.5,
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
            "as oscar, with Lloyd-Max levels",
            "calibrated",
            {"quantizer": "lloyd-max", "centering": True, **INT2},
        ),
    )
}


def stored_bits(cache, model) -> float:
    """Bits per stored K/V element: the OSCAR cache's own count, else the model dtype's width (default cache)."""
    bits = getattr(cache, "bits_per_element", None)
    return bits if bits else 8.0 * next(model.parameters()).element_size()


def make_cache(method: str | Method, model, calibrated: OscarRotations | None = None, **overrides):
    """A fresh cache for ``method``: a DynamicCache for "bf16", else an OscarQuantizedCache."""
    method = METHODS[method] if isinstance(method, str) else method
    if method.rotations is None:
        return DynamicCache(config=model.config)
    if method.rotations.startswith("calibrated"):
        if calibrated is None:
            raise ValueError(f"method {method.name!r} needs calibrated rotations (--rotations)")
        rotations = calibrated if method.rotations == "calibrated" else calibrated.with_identity_keys()
    else:
        rotations = getattr(OscarRotations, method.rotations)(model.config)
    base = calibrated.config if calibrated is not None else None
    head_dim = rotations.head_dim
    diagnostics = calibrated.diagnostics if calibrated is not None else None
    config = method.oscar_config(base, head_dim, diagnostics).replace(**overrides)
    return OscarQuantizedCache.from_pretrained(rotations, model=model, config=config)
