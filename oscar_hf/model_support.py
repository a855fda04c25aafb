"""What oscar_hf needs to know about a model: its KV shape, and whether its attention can be served."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
import transformers
from transformers import cache_utils

# transformers' layer types by what the cache holds for them: a KV cache of full, sliding-window or chunked attention,
# with a linear-attention / state-space state beside it ("hybrid", "hybrid_sliding": Falcon-H1, Zamba), a state alone
# (Gated DeltaNet, Mamba, short convolutions), or nothing (MLP-only layers)
ATTENTION_OF = {"full_attention": "full_attention", "hybrid": "full_attention",
                "sliding_attention": "sliding_attention", "hybrid_sliding": "sliding_attention",
                "chunked_attention": "chunked_attention"}
WITH_STATE = ("hybrid", "hybrid_sliding", "linear_attention", "conv")
NO_CACHE = ("moe", "mlp")
SUPPORTED_LAYER_TYPES = (*ATTENTION_OF, "linear_attention", "conv", *NO_CACHE)

# Why a family is refused, by model_type: decoders without attention, and decoders whose attention cannot meet the
# cache (it touches K/V between the cache update and the attention call, or caches something other than per-head K/V)
_STATE_SPACE = "a pure state-space model: it has no attention, so no K/V to quantize"
_RECURRENT = "a recurrent model: it has no attention, so no K/V to quantize"
UNSUPPORTED_MODEL_TYPES = {
    "mamba": _STATE_SPACE,
    "mamba2": _STATE_SPACE,
    "falcon_mamba": _STATE_SPACE,
    "rwkv": _RECURRENT,
    "xlstm": _RECURRENT,
    "minimax": "its modeling code accepts no cache but its own MiniMaxCache (it refuses any other Cache type)",
    "deepseek_v32": "DeepSeek Sparse Attention (a lightning indexer with a key cache of its own) is not supported",
    "jetmoe": "its K/V are reshaped after the cache update",
    "diffllama": "its K/V are reshaped after the cache update",
}


class UnsupportedModelError(ValueError):
    """The model's attention cannot be served by OscarQuantizedCache."""


@dataclass(frozen=True)
class ModelShape:
    """KV geometry of a decoder, read from its (text) config, per layer where layers differ (Gemma-4's full layers
    have twice the sliding layers' head_dim, and their own KV-head count)."""

    num_layers: int
    num_heads: int
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_chunk_size: int | None = None
    # per layer: None, "store" (its K/V are read by later layers too) or "reuse" (it reads another layer's K/V and
    # stores none: transformers' KV sharing, Gemma-3n and Gemma-4)
    kv_sharing: tuple[str | None, ...] | None = None
    # multi-head latent attention (DeepSeek-V2/V3 and kin): (kv_lora_rank, qk_rope_head_dim): its attention layers
    # cache a latent of kv_lora_rank channels (head_dims holds it, one "KV head") and the RoPE part of the key
    latent: tuple[int, int] | None = None
    # per layer: the conv/recurrent states a linear-attention or state-space layer keeps (transformers'
    # number_of_conv_states; 1 by default)
    states: tuple[int, ...] | None = None

    @property
    def head_dim(self) -> int:
        """The head_dim of every layer; ValueError where layers differ (see ``head_dims``)."""
        return self._uniform("head_dim", self.head_dims)

    @property
    def num_kv_heads(self) -> int:
        """The KV-head count of every layer; ValueError where layers differ (see ``kv_heads``)."""
        return self._uniform("num_kv_heads", self.kv_heads)

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same head_dim and KV-head count."""
        return len(set(self.head_dims)) == 1 and len(set(self.kv_heads)) == 1

    @staticmethod
    def _uniform(name: str, values: tuple[int, ...]) -> int:
        if len(set(values)) != 1:
            raise ValueError(f"{name} differs between layers ({sorted(set(values))}); read it per layer")
        return values[0]

    def attention(self, layer: int) -> str | None:
        """The attention ``layer`` caches K/V for: "full_attention", "sliding_attention", "chunked_attention", or None
        (a linear-attention / state-space layer, or one without attention)."""
        return ATTENTION_OF.get(self.layer_types[layer])

    def has_state(self, layer: int) -> bool:
        """Whether ``layer`` keeps a linear-attention or state-space state (conv and recurrent) in the cache."""
        return self.layer_types[layer] in WITH_STATE

    @property
    def full_attention_layers(self) -> list[int]:
        """The layers whose K/V the cache quantizes by default."""
        return [i for i in range(self.num_layers) if self.attention(i) == "full_attention"]

    def reads_own_kv(self, layer: int) -> bool:
        """Whether ``layer`` stores K/V of its own (False for a KV-sharing layer that reads an earlier one's)."""
        return self.kv_sharing is None or self.kv_sharing[layer] != "reuse"

    def window(self, layer_type: str) -> int | None:
        """Tokens a ``layer_type`` layer keeps (transformers' own layer holds them): the sliding window, the attention
        chunk, or None for full attention."""
        return {"sliding_attention": self.sliding_window, "chunked_attention": self.attention_chunk_size}.get(
            layer_type)

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_heads = cfg.num_attention_heads
        layers = cfg.num_hidden_layers
        # per-layer configs (transformers' heterogeneous configs); the config itself for every layer where absent
        per_layer = list(getattr(cfg, "per_layer_config", None) or [cfg] * layers)
        head_dims = tuple(getattr(c, "head_dim", None) or c.hidden_size // num_heads for c in per_layer)
        kv_heads = tuple(getattr(c, "num_key_value_heads", None) or num_heads for c in per_layer)
        sliding_window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is None:
            if sliding_window is not None:
                kind = "sliding_attention"
            elif getattr(cfg, "attention_chunk_size", None) is not None:
                kind = "chunked_attention"
            else:
                kind = "full_attention"
            layer_types = [kind] * layers
        sharing = getattr(cfg, "kv_sharing_modes", None)
        latent = None
        if getattr(cfg, "kv_lora_rank", None) is not None:
            latent = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
            head_dims, kv_heads = (cfg.kv_lora_rank,) * layers, (1,) * layers
        return cls(
            num_layers=layers,
            num_heads=num_heads,
            head_dims=head_dims,
            kv_heads=kv_heads,
            layer_types=tuple(layer_types),
            sliding_window=sliding_window,
            attention_chunk_size=getattr(cfg, "attention_chunk_size", None),
            kv_sharing=tuple(sharing) if sharing is not None else None,
            latent=latent,
            states=tuple(getattr(c, "number_of_conv_states", 1) for c in per_layer),
        )


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for ``model(...)`` and ``model.generate(...)``: ``cache`` where the model's forward takes it
    so (transformers 5.24 renamed ``past_key_values``, which it accepts until 5.40 in forward and 6.0 in generate),
    else ``past_key_values``."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def check_model_supported(model: torch.nn.Module) -> ModelShape:
    """Raise UnsupportedModelError naming why ``model`` cannot use the OSCAR cache; else return its shape."""
    config = model.config
    name = type(model).__name__
    cfg = config.get_text_config(decoder=True)
    model_type = getattr(cfg, "model_type", "")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name}: encoder-decoder models are not supported, only decoders")
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"{name} ({model_type}): {UNSUPPORTED_MODEL_TYPES[model_type]}")
    modeling = sys.modules.get(type(model).__module__)
    if modeling is not None and not hasattr(modeling, "ALL_ATTENTION_FUNCTIONS"):
        raise UnsupportedModelError(f"{name} does not route attention through transformers' AttentionInterface")
    if getattr(cfg, "num_kv_shared_layers", 0) and getattr(cfg, "kv_sharing_modes", None) is None:
        raise UnsupportedModelError(f"{name}: KV shared across layers without transformers' kv_sharing_modes (the "
                                    "cache cannot tell which layers store K/V)")
    shape = ModelShape.from_config(config)
    if shape.latent is not None and modeling is not None and not any(
            hasattr(obj, "expand_kv") for obj in vars(modeling).values() if isinstance(obj, type)):
        raise UnsupportedModelError(f"{name}: multi-head latent attention whose modeling code caches expanded K/V "
                                    f"(transformers {transformers.__version__}); the cache needs the latent, which "
                                    "the versions whose MLA attention has expand_kv cache (5.17 and 5.24 do)")
    v_head_dim = getattr(cfg, "v_head_dim", None)
    if shape.latent is None and v_head_dim is not None and {v_head_dim} != set(shape.head_dims):
        raise UnsupportedModelError(f"{name}: value head_dim {v_head_dim} differs from key head_dim "
                                    f"{sorted(set(shape.head_dims))}")
    unknown = sorted(set(shape.layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"{name}: layer types {unknown} are not supported (only {SUPPORTED_LAYER_TYPES})")
    has_state = any(shape.has_state(i) for i in range(shape.num_layers))
    if has_state and not hasattr(cache_utils, "LinearAttentionLayer"):
        raise UnsupportedModelError(f"{name}: its linear-attention or state-space layers need a transformers whose "
                                    "Cache holds their state (LinearAttentionLayer); this is "
                                    f"{transformers.__version__}")
    kinds = {shape.attention(i) for i in range(shape.num_layers)}
    if not {"full_attention", "sliding_attention"} & kinds:
        raise UnsupportedModelError(
            f"{name}: no layer caches full or sliding-window attention (layer types {sorted(set(shape.layer_types))}),"
            " so there is nothing to quantize"
        )
    return shape
