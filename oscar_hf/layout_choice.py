"""The storage layout of a model, chosen by calibration on held-out tokens within a bit budget.

Each candidate of ``LAYOUTS`` is a 2-bit K layout (per token on the rotated keys, or per channel on the unrotated
ones: KIVI's grid, which gives large constant key channels scales of their own) with or without centering, on top of
the base config (its other fields kept). Per-channel K demotes ``flush_tokens = 64`` tokens at a time, so its recent
window is shortened by half the difference in flush sizes: both windows then hold the same number of exact tokens on
average, and every candidate is scored on the same positions (those after the base config's windows). Every candidate
within the budget is scored end to end: the mean KL between the model's next-token distributions with the default
cache and with an OSCAR cache of that layout, over held-out chunks fed in pieces (:func:`held_out_kl`), and the lowest
wins. (Per-layer diagnostics, which quantize each layer's K/V with exact inputs, can rank layouts otherwise than the
model's output does: on SmolLM2-135M they favour per-channel keys, which the output does not.) Then, as long as the
budget allows, the layers where the winner's keys change the attention most (the diagnostics' score KL) get
``key_bits``-bit K. The bundle keeps the winner's config, its diagnostics, and every candidate's score under
``calibration["layout"]``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .config import OscarConfig
from .diagnostics import diagnose
from .model_support import ModelShape, cache_kwargs
from .parallel import TensorParallel
from .rotations import OscarRotations

PIECE = 64  # tokens per forward when a held-out chunk is fed through a cache


@dataclass(frozen=True)
class Layout:
    """A candidate: OscarConfig fields, and whether K is stored rotated (per token) or in its own channels."""

    name: str
    overrides: dict
    rotated_keys: bool = True


PER_CHANNEL = {"key_quantization": "per-channel", "flush_tokens": 64, "k_clip": 1.0, "quantizer": "uniform"}
LAYOUTS = (
    Layout("per-token K, centered", {"key_quantization": "per-token", "centering": True}),
    Layout("per-token K, uncentered", {"key_quantization": "per-token", "centering": False}),
    Layout("per-channel K, V centered", {**PER_CHANNEL, "centering": True}, rotated_keys=False),
    Layout("per-channel K, V uncentered", {**PER_CHANNEL, "centering": False}, rotated_keys=False),
)
TWO_BITS = {"bits": 2, "key_bits": None, "key_bits_layers": None}
BUDGET = 2.6  # history bits per element: the default budget of a 2-bit cache


def quantized_layers(model_config, rotations: OscarRotations, config: OscarConfig) -> list[int]:
    """The layers an OscarQuantizedCache of ``config`` stores in INT2 (its OSCAR layers)."""
    from .cache import OscarLayer, OscarQuantizedCache

    cache = OscarQuantizedCache(model_config, rotations, config.replace(key_bits_layers=None))
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, OscarLayer)]


def history_bits(config: OscarConfig, rotations: OscarRotations, layers: list[int]) -> float:
    """Bits per history element of ``config`` over ``layers``, weighted by each layer's K/V elements: codes, scales
    and zeros (a centered side's per-sequence mean adds 32 bits per head over the history's length)."""
    weights = [rotations.kv_heads[i] * rotations.head_dims[i] for i in layers]
    bits = [config.for_layer(i).bits_per_element(rotations.head_dims[i]) for i in layers]
    return sum(w * b for w, b in zip(weights, bits)) / sum(weights)


def default_budget(base: OscarConfig, rotations: OscarRotations, layers: list[int]) -> float:
    """``BUDGET``, or what ``base`` costs with 2-bit K and V where that is more (small heads' scales)."""
    return max(BUDGET, history_bits(base.replace(**TWO_BITS), rotations, layers))


def _pieces(model, chunk: torch.Tensor, cache) -> list[torch.Tensor]:
    """Float32 next-token log-probabilities ``[PIECE, V]`` of ``chunk`` (1-D token ids) fed ``PIECE`` tokens per
    forward through ``cache``, piece by piece."""
    ids = chunk.to(model.device)[None]
    return [model(input_ids=ids[:, start:start + PIECE], **cache_kwargs(model, cache), use_cache=True).logits[0]
            .float().log_softmax(-1) for start in range(0, ids.shape[1], PIECE)]


@torch.no_grad()
def default_logprobs(model, chunks: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per held-out chunk, the default cache's log-probabilities piece by piece (:func:`held_out_kl`'s reference)."""
    return [_pieces(model, chunk, DynamicCache(config=model.config)) for chunk in chunks]


@torch.no_grad()
def held_out_kl(model, rotations: OscarRotations, config: OscarConfig, chunks: list[torch.Tensor],
                reference: list[list[torch.Tensor]] | None = None, first: int | None = None) -> float:
    """Mean ``KL(default cache ‖ OSCAR cache)`` of the next-token distributions over the held-out ``chunks`` (1-D
    token ids), each fed ``PIECE`` tokens per forward into a fresh cache, so that every piece attends to the earlier
    ones through the quantized history; ``reference``: :func:`default_logprobs` of the chunks, if computed already.
    Positions before ``first`` are left out (default ``sink_tokens + recent_tokens``: those with no quantized token
    before them). The model's attention becomes "oscar" (the model's own over plain tensors), as for any
    OscarQuantizedCache."""
    from .cache import OscarQuantizedCache, enable

    enable(model)
    total = count = 0.0
    first = config.sink_tokens + config.recent_tokens if first is None else first
    reference = reference if reference is not None else default_logprobs(model, chunks)
    for chunk, expected in zip(chunks, reference):
        oscar = OscarQuantizedCache(model.config, rotations, config, tensor_parallel=TensorParallel.of(model))
        for i, (p, q) in enumerate(zip(expected, _pieces(model, chunk, oscar))):
            kl = (p.exp() * (p - q)).sum(-1)[max(0, first - i * PIECE):]
            total, count = total + float(kl.sum()), count + kl.numel()
    if not count:
        raise ValueError(f"the held-out chunks ({max(c.numel() for c in chunks)} tokens at most) reach no quantized "
                         f"history (nothing scored before position {first}: sink {config.sink_tokens} + recent "
                         f"{config.recent_tokens} tokens): nothing to score")
    return total / count


def choose_layout(model, rotations: OscarRotations, chunks: list[torch.Tensor], base: OscarConfig | None = None,
                  bit_budget: float | None = None, key_bits: int = 4) -> OscarRotations:
    """``rotations`` with the layout that serves ``model`` best within ``bit_budget`` history bits per element over
    the layers the cache quantizes (default :func:`default_budget`), measured on held-out token ``chunks`` (module
    docstring). Per-channel winners get identity K rotations. ValueError when no candidate fits the budget, or the
    chunks reach no quantized history."""
    if not chunks:
        raise ValueError("choosing a layout needs held-out tokens (calibrate with diagnostic_tokens > 0)")
    if ModelShape.from_config(model.config).latent is not None:
        raise ValueError("layout choice serves K/V layers; multi-head latent attention stores one latent per token")
    base = (base or rotations.config or OscarConfig()).replace(**TWO_BITS)
    layers = quantized_layers(model.config, rotations, base)
    budget = default_budget(base, rotations, layers) if bit_budget is None else float(bit_budget)
    scores, runs, reference = {}, {}, None
    for layout in LAYOUTS:
        config = base.replace(**layout.overrides)
        if config.flush_tokens > base.flush_tokens:  # the same mean exact window as the base's
            config = config.replace(recent_tokens=max(1, base.recent_tokens
                                                      - (config.flush_tokens - base.flush_tokens) // 2))
        bits = history_bits(config, rotations, layers)
        if bits > budget + 1e-9:
            scores[layout.name] = {"history_bits": bits, "held_out_kl": None}
            continue
        bundle = rotations if layout.rotated_keys else rotations.with_identity_keys()
        if reference is None:
            reference = default_logprobs(model, chunks)
        kl = held_out_kl(model, bundle, config, chunks, reference, first=base.sink_tokens + base.recent_tokens)
        scores[layout.name] = {"history_bits": bits, "held_out_kl": kl}  # every candidate on the same positions
        runs[layout.name] = (config, bundle)
    if not runs:
        cheapest = min(score["history_bits"] for score in scores.values())
        raise ValueError(f"no layout fits a budget of {budget:.3f} history bits per element (the cheapest takes "
                         f"{cheapest:.3f})")
    name = min(runs, key=lambda n: scores[n]["held_out_kl"])
    config, bundle = runs[name]
    diagnostics = diagnose(model, bundle, chunks, config)
    config = _more_key_bits(config, rotations, [row for row in diagnostics if row["layer"] in layers], budget,
                            key_bits, layers)
    if config.key_bits_layers:
        diagnostics = diagnose(model, bundle, chunks, config)
    chosen = copy.copy(bundle)  # a new bundle (with_identity_keys made one already; this copies the other)
    chosen.config, chosen.diagnostics = config, diagnostics
    chosen.calibration = {**rotations.calibration, "layout": {
        "chosen": name, "budget_bits": budget, "history_bits": history_bits(config, rotations, layers),
        "key_bits_layers": config.key_bits_layers or [], "candidates": scores}}
    return chosen


def _more_key_bits(config: OscarConfig, rotations: OscarRotations, diagnostics: list[dict], budget: float,
                   key_bits: int, layers: list[int]) -> OscarConfig:
    """``config`` with ``key_bits``-bit K in the quantized ``layers`` of largest score KL (``diagnostics``: theirs),
    one by one while within ``budget``."""
    ranked = [row["layer"] for row in sorted(diagnostics, key=lambda row: row["score_kl"], reverse=True)]
    chosen: list[int] = []
    for layer in ranked:
        trial = config.replace(key_bits=key_bits, key_bits_layers=sorted([*chosen, layer]))
        if history_bits(trial, rotations, layers) > budget + 1e-9:
            break
        chosen.append(layer)
    return config.replace(key_bits=key_bits, key_bits_layers=sorted(chosen)) if chosen else config
