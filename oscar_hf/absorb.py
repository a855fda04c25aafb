"""Fold rotations into the model's weights, so they cost nothing at run time.

:func:`absorb_value_rotation`: per KV head block of ``v_proj`` (rows ``[h·D, (h+1)·D)``): ``W ← R_Vᵀ·W`` and
``b ← b·R_V``, so v_proj already emits ``v·R_V``; per query head block of ``o_proj``'s input columns:
``W_o ← W_o·R_V``, so o_proj takes the attention output in the rotated basis. ``R_V`` is the layer's, or with
per-KV-head rotations each block's KV head's (query head ``h·g + r``: KV head ``h``'s). Exact
in real arithmetic (computed in float64, cast back to the weight dtype).

:func:`absorb_latent_rotation` (multi-head latent attention): ``kv_b_proj``'s weight ``W [H·(d_nope + d_v), r]``
becomes ``W·R``, so that the model expands the latent from the rotated basis (``(c·R)(W·R)ᵀ = c·Wᵀ``): the cache
hands back the stored latent without rotating the history back every step.
"""

from __future__ import annotations

import torch

from .cache import LATENT_ABSORBED
from .model_support import ModelShape
from .parallel import TensorParallel
from .rotations import OscarRotations


@torch.no_grad()
def absorb_value_rotation(model: torch.nn.Module, rotations: OscarRotations) -> OscarRotations:
    """Fold ``rotations.value_rotation`` into every full-attention layer's v_proj and o_proj, in place.

    Returns the bundle to use with the modified model: the same K rotations and identity V
    rotations on the absorbed layers.
    """
    shape = ModelShape.from_config(model.config)
    rotations.check_compatible(model.config)
    if TensorParallel.of(model) is not None:
        raise ValueError("V absorption folds whole weights, and a tensor-parallel model (tp_plan) holds a share of "
                         "each on every rank: absorb before sharding, or use the bundle as it is")
    if not all(shape.reads_own_kv(i) for i in range(shape.num_layers)):
        raise ValueError("V absorption cannot serve a model whose layers share K/V (the layers that read another "
                         "layer's V would need its rotation folded into their o_proj too)")
    attentions = [
        m for m in model.modules() if hasattr(m, "v_proj") and hasattr(m, "o_proj") and hasattr(m, "layer_idx")
    ]
    if len(attentions) != shape.num_layers:
        raise ValueError(
            f"V absorption needs attention modules with v_proj, o_proj and layer_idx; found {len(attentions)} "
            f"for {shape.num_layers} layers"
        )
    value_rotation = [r.clone() for r in rotations.value_rotation]
    for attention in attentions:
        i = attention.layer_idx
        if shape.attention(i) != "full_attention":
            continue
        if attention.v_proj is None:
            raise ValueError(f"V absorption needs a v_proj in layer {i}; its values come from k_proj (K = V "
                             "attention), so R_V cannot be folded into them")
        d, heads = shape.head_dims[i], shape.kv_heads[i]
        r = rotations.value_rotation[i].double().to(attention.v_proj.weight.device)
        r = r.expand(heads, d, d)  # [H, D, D]: each KV head's (the layer's, where they share it)
        v_weight = attention.v_proj.weight  # [H·D, hidden]
        blocks = v_weight.double().reshape(heads, d, -1)
        v_weight.copy_((r.mT @ blocks).reshape_as(v_weight))
        if attention.v_proj.bias is not None:
            bias = attention.v_proj.bias
            bias.copy_((bias.double().reshape(heads, 1, d) @ r).reshape_as(bias))
        o_weight = attention.o_proj.weight  # [hidden, Hq·D]
        columns = o_weight.double().reshape(o_weight.shape[0], heads, shape.num_heads // heads, d)
        o_weight.copy_(torch.einsum("ohgd,hde->ohge", columns, r).reshape_as(o_weight))
        value_rotation[i] = torch.eye(d).expand_as(value_rotation[i])
    return _absorbed(rotations, value_rotation, "value_rotation_absorbed")


@torch.no_grad()
def absorb_latent_rotation(model: torch.nn.Module, rotations: OscarRotations) -> OscarRotations:
    """Fold each multi-head latent attention layer's latent rotation (``rotations.key_rotation[i]``, ``[r, r]``)
    into its ``kv_b_proj``, in place.

    Returns the bundle to use with the modified model: the same rotations, marked ``latent_rotation_absorbed`` in
    its calibration record, so that the cache returns the latent in the rotated basis (the windows rotated, the
    history as stored). The model's config is marked too: from then on the model reads its latent right only through
    an OSCAR cache built from that bundle (not with ``use_cache=False``, nor with transformers' caches);
    :class:`OscarQuantizedCache` refuses a bundle that does not match the model, and a second absorption is
    refused.
    """
    shape = ModelShape.from_config(model.config)
    rotations.check_compatible(model.config)
    if shape.latent is None:
        raise ValueError("latent absorption needs multi-head latent attention (a kv_b_proj expanding a latent); "
                         f"{type(model.config).__name__} has none")
    if rotations.calibration.get(LATENT_ABSORBED) or getattr(model.config, LATENT_ABSORBED, False):
        raise ValueError("the " + ("bundle's" if rotations.calibration.get(LATENT_ABSORBED) else "model's")
                         + " latent rotation is already absorbed (folding it twice would rotate the latent twice)")
    attentions = [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(m, "layer_idx")]
    full = [i for i in range(shape.num_layers) if shape.attention(i) == "full_attention"]
    if sorted(a.layer_idx for a in attentions) != full:
        raise ValueError(f"latent absorption needs a kv_b_proj and layer_idx in every latent attention layer; found "
                         f"them in layers {sorted(a.layer_idx for a in attentions)} of {full}")
    for attention in attentions:
        weight = attention.kv_b_proj.weight  # [H·(d_nope + d_v), r]
        r = rotations.key_rotation[attention.layer_idx].double().to(weight.device)
        weight.copy_(weight.double() @ r)
    setattr(model.config, LATENT_ABSORBED, True)
    return _absorbed(rotations, rotations.value_rotation, LATENT_ABSORBED)


def _absorbed(rotations: OscarRotations, value_rotation, flag: str) -> OscarRotations:
    """``rotations`` with ``value_rotation`` and ``flag`` set in its calibration record."""
    return OscarRotations(
        rotations.key_rotation,
        value_rotation,
        key_eigenvalues=rotations.key_eigenvalues,
        value_eigenvalues=rotations.value_eigenvalues,
        num_kv_heads=rotations.kv_heads,
        source_model=rotations.source_model,
        method=rotations.method,
        calibration={**rotations.calibration, flag: True},
        config=rotations.config,
        diagnostics=rotations.diagnostics,
        key_codebooks=rotations.key_codebooks,
    )
