"""OscarQuantizedCache: the transformers Cache whose layers OSCAR builds, model layer by model layer."""

from __future__ import annotations

import contextlib

import torch
from transformers import cache_utils
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..config import OscarConfig
from ..kernels import WRITE_BACKENDS
from ..model_support import ModelShape, check_model_supported
from ..parallel import TensorParallel
from ..rotations import OscarRotations
from .hybrid import NoKVLayer, state_bytes, with_state
from .latent import LATENT_ABSORBED, LatentOscarLayer, absorb_expand_kv, absorbs
from .layer import DynamicOscarLayer, KVOscarLayer, OscarLayer
from .segments import tensor_bytes
from .sliding import SlidingOscarLayer
from .static import StaticOscarLayer

ATTN_IMPLEMENTATION = "oscar"


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
        kwargs = self._codebook(i, args[0]) if isinstance(cls, type) and issubclass(cls, KVOscarLayer) else {}
        if shape.has_state(i):
            hybrid = (cache_utils.LinearAttentionLayer if cls is None else
                      cache_utils.LinearAttentionAndSlidingWindowAttentionLayer if cls is DynamicSlidingWindowLayer
                      else with_state(cls))
            return hybrid(*args, number_of_states=shape.states[i], **kwargs)
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
            layout = self.config.key_layout
            if layout.uses_codebook or layout.token_group(self.config) is not None:
                raise ValueError(f"key_quantization={self.config.key_quantization!r} is not available for multi-head "
                                 "latent attention layers (their history is the latent, stored per token)")
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
        out = model.generate(**inputs, cache=cache)

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

    # ``(model, tokenizer, texts) -> OscarRotations`` for ``from_pretrained`` without a bundle: set by ``oscar_hf``
    # (its on-demand calibration, :mod:`oscar_hf.autocalibrate`, sits above the cache)
    rotations_on_demand = None

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
            if isinstance(layer, KVOscarLayer):
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
            if cls.rotations_on_demand is None:
                raise ValueError("no rotation bundle given: pass a folder, a Hub repo or an OscarRotations")
            rotations = cls.rotations_on_demand(model, tokenizer, calibration_texts)
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
        implementation = self._text_config._attn_implementation
        if implementation != ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"the model's attention implementation is {implementation!r}, but OscarQuantizedCache needs "
                f"{ATTN_IMPLEMENTATION!r}: call oscar_hf.enable(model) or use OscarQuantizedCache.from_pretrained"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @contextlib.contextmanager
    def host_reads_deferred(self):
        """Within the block, static layers report their length as a device tensor (no synchronisation per step: the
        overlapped decoding loop reads it a step late); what the device flagged meanwhile is raised at its end."""
        layers = [layer for layer in self.layers if isinstance(layer, StaticOscarLayer)]
        for layer in layers:
            layer.defers_host_reads = True
        try:
            yield
        finally:
            for layer in layers:
                layer.defers_host_reads = False
        for layer in layers:
            layer.check_flags()

    def _accounting(self) -> tuple[int, int, int, int, int]:
        """(bytes held, bits stored, elements stored, history bits, history elements) over every layer."""
        held = stored = elements = history = history_elements = 0
        for layer in self.layers:
            held += state_bytes(layer)
            if isinstance(layer, OscarLayer):
                held += layer.nbytes
                bits, count = layer.stored_bits_and_elements()
                hbits, hcount = layer.history_bits_and_elements()
                stored, elements, history, history_elements = (stored + bits, elements + count, history + hbits,
                                                                history_elements + hcount)
            else:
                dense, count = dense_layer_bytes(layer)
                held, stored, elements = held + dense, stored + 8 * dense, elements + count
        return held, stored, elements, history, history_elements

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (capacity included, linear-attention and state-space layers' states
        too), read from the tensors; under tensor parallelism, this rank's."""
        return self._accounting()[0]

    @property
    def bits_per_element(self) -> float:
        """Bits of stored data over the number of elements stored (K and V, or latent and RoPE key; 0.0 when
        empty)."""
        _, bits, elements, _, _ = self._accounting()
        return bits / elements if elements else 0.0

    @property
    def history_bits_per_element(self) -> float:
        """Bits per element of the quantized history alone (what a token costs once it leaves the windows; 0.0
        while nothing is quantized)."""
        *_, bits, elements = self._accounting()
        return bits / elements if elements else 0.0


def dense_layer_bytes(layer) -> tuple[int, int]:
    """(bytes, elements) of a transformers cache layer's K and V: the bytes include a QuantizedLayer's codes, the
    elements count its dense K/V only (0, 0 where it holds none)."""
    keys = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", False) or keys is None:
        return 0, 0
    held = tensor_bytes(keys, layer.values, getattr(layer, "_quantized_keys", None),
                        getattr(layer, "_quantized_values", None))
    return held, keys.numel() + layer.values.numel()


def cache_nbytes(cache: Cache) -> int:
    """Bytes of every tensor a transformers cache holds: an OscarQuantizedCache's :attr:`~OscarQuantizedCache.nbytes`,
    or a baseline's (DynamicCache, StaticCache, QuantizedCache) K/V and states."""
    if isinstance(cache, OscarQuantizedCache):
        return cache.nbytes
    return sum(dense_layer_bytes(layer)[0] + state_bytes(layer) for layer in cache.layers)


def enable(model: torch.nn.Module) -> torch.nn.Module:
    """Check that ``model`` can be served, and route its attention through oscar_hf ("oscar"); multi-head latent
    attention modules pass the cache's latent handle on to it (their ``expand_kv`` patched:
    :func:`~oscar_hf.cache.latent.absorb_expand_kv`), so that decode steps attend the latent absorbed."""
    check_model_supported(model)
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for module in model.modules():
        if absorbs(module):
            absorb_expand_kv(module)
    return model
