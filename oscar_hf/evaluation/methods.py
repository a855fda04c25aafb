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
from ..rotations import OscarRotations

NO_CLIP = {"k_clip": 1.0, "v_clip": 1.0}
AS_PUBLISHED = {"quantizer": "uniform", "centering": False, **NO_CLIP}  # the baselines, without our additions


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    rotations: str | None
    config: dict = field(default_factory=dict)

    def oscar_config(self, base: OscarConfig | None, head_dim: int) -> OscarConfig:
        """The method's OscarConfig on top of ``base`` (the calibrated bundle's or the defaults)."""
        overrides = dict(self.config)
        if overrides.get("group_size") == "min(128, head_dim)":
            overrides["group_size"] = min(128, head_dim)
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
            {"quantizer": "uniform", "centering": True},
        ),
        Method(
            "oscar-uncentered",
            "as oscar, without centering (the published method)",
            "calibrated",
            {"quantizer": "uniform", "centering": False},
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
            },
        ),
        Method(
            "oscar-lloyd-max",
            "as oscar, with Lloyd-Max levels",
            "calibrated",
            {"quantizer": "lloyd-max", "centering": True},
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
    config = method.oscar_config(base, head_dim).replace(**overrides)
    return OscarQuantizedCache.from_pretrained(rotations, model=model, config=config)
