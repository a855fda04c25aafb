"""What oscar_hf needs to know about a model: its KV shape, and whether its attention can be served."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

# Decoders that route attention through AttentionInterface but touch K/V between the cache update
# and the attention call, or cache something other than per-head K and V.
UNSUPPORTED_MODEL_TYPES = {
    "deepseek_v2": "multi-head latent attention (MLA)",
    "deepseek_v3": "multi-head latent attention (MLA)",
    "deepseek_v32": "multi-head latent attention (MLA)",
    "kimi_linear": "multi-head latent attention (MLA)",
    "minicpm3": "multi-head latent attention (MLA)",
    "longcat_flash": "multi-head latent attention (MLA)",
    "glm4_moe_lite": "multi-head latent attention (MLA)",
    "gemma3n": "KV shared across layers",
    "gemma4": "KV shared across layers",
    "jetmoe": "K/V reshaped after the cache update",
    "diffllama": "K/V reshaped after the cache update",
}


class UnsupportedModelError(ValueError):
    """The model's attention cannot be served by OscarQuantizedCache."""


@dataclass(frozen=True)
class ModelShape:
    """KV geometry of a decoder, read from its (text) config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    attention_chunk_size: int | None = None

    def window(self, layer_type: str) -> int | None:
        """Tokens a ``layer_type`` layer keeps (transformers' own layer holds them): the sliding window, the attention
        chunk, or None for full attention."""
        return {"sliding_attention": self.sliding_window, "chunked_attention": self.attention_chunk_size}.get(
            layer_type)

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        sliding_window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is None:
            if sliding_window is not None:
                kind = "sliding_attention"
            elif getattr(cfg, "attention_chunk_size", None) is not None:
                kind = "chunked_attention"
            else:
                kind = "full_attention"
            layer_types = [kind] * cfg.num_hidden_layers
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            layer_types=tuple(layer_types),
            sliding_window=sliding_window,
            attention_chunk_size=getattr(cfg, "attention_chunk_size", None),
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
        raise UnsupportedModelError(f"{name} ({model_type}): {UNSUPPORTED_MODEL_TYPES[model_type]} is not supported")
    if hasattr(type(model), "is_backend_compatible") and not type(model).is_backend_compatible():
        raise UnsupportedModelError(f"{name} does not route attention through transformers' AttentionInterface")
    if getattr(cfg, "kv_lora_rank", None) is not None or getattr(cfg, "q_lora_rank", None) is not None:
        raise UnsupportedModelError(f"{name}: multi-head latent attention (MLA) is not supported")
    if getattr(cfg, "num_kv_shared_layers", 0) or getattr(cfg, "kv_sharing_modes", None) is not None:
        raise UnsupportedModelError(f"{name}: KV shared across layers is not supported")
    shape = ModelShape.from_config(config)
    v_head_dim = getattr(cfg, "v_head_dim", None)
    if v_head_dim is not None and v_head_dim != shape.head_dim:
        raise UnsupportedModelError(f"{name}: value head_dim {v_head_dim} differs from key head_dim {shape.head_dim}")
    unknown = sorted(set(shape.layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(f"{name}: layer types {unknown} are not supported (only {SUPPORTED_LAYER_TYPES})")
    if "full_attention" not in shape.layer_types:
        raise UnsupportedModelError(
            f"{name}: every layer is sliding-window or chunked attention (sliding_window={shape.sliding_window}, "
            f"attention_chunk_size={shape.attention_chunk_size}), so there is nothing to quantize"
        )
    return shape
