"""OscarRotations: the K and V rotations a cache applies, per layer or per layer and KV head, saved as a small
Hub-ready bundle.

A bundle is a folder with ``oscar_config.json`` (metadata, and optionally the recommended
OscarConfig), ``rotations.safetensors`` (float32 ``key_rotation``/``value_rotation``: ``[layers, D, D]``, one
rotation per layer shared by its KV heads, or ``[layers, H, D, D]``, one per KV head; their eigenvalues
``[layers, D]`` or ``[layers, H, D]``), a ``README.md`` model card and, after calibration, ``diagnostics.json``;
with product-quantized key codebooks (:mod:`oscar_hf.codebooks`), ``codebooks.safetensors``
(``key_codebook.{bits}.{layer}.{centroids,basis,weight}``, listed by ``key_codebook_bits`` in the config file).
Rows are rotated on the right: ``k_rot = k @ key_rotation[layer]`` (``[B, H, T, D] @ [H, D, D]`` broadcasts).

``format_version`` 1 holds shared rotations only; 2 adds per-KV-head ones; 3 holds models whose layers differ in
head_dim or KV heads, one tensor per layer (``key_rotation.0``, ``key_rotation.1``, ...). A bundle is written with
the lowest version that holds it (older oscar-hf keeps reading what it can); all load.

A bundle is saved whole or not at all: into a hidden folder beside its own (``.<name>.oscar-tmp-<random>``) that
then takes its place, so that readers see the old bundle or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import reprlib
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .codebooks import KeyCodebook
from .config import OscarConfig
from .hadamard import hadamard_matrix
from .model_support import ModelShape

CONFIG_NAME = "oscar_config.json"
WEIGHTS_NAME = "rotations.safetensors"
CODEBOOKS_NAME = "codebooks.safetensors"
DIAGNOSTICS_NAME = "diagnostics.json"
CARD_NAME = "README.md"
BUNDLE_FILES = (CONFIG_NAME, WEIGHTS_NAME, CODEBOOKS_NAME, DIAGNOSTICS_NAME, CARD_NAME)
TEMPORARY_MARK = ".oscar-tmp-"  # in the hidden folder a save writes into: ".<name>.oscar-tmp-<random>"
FORMAT_VERSION = 3  # the newest: layers of differing geometry, one tensor per layer
PER_HEAD_FORMAT_VERSION = 2  # per-KV-head rotations, stacked
SHARED_FORMAT_VERSION = 1  # shared (per-layer) rotations only, stacked
ORTHOGONALITY_TOLERANCE = 1e-4
TENSOR_NAMES = ("key_rotation", "value_rotation", "key_eigenvalues", "value_eigenvalues")

logger = logging.getLogger(__name__)


def _count(value) -> bool:
    return type(value) is int and value > 0


def _counts(value) -> bool:
    """One positive integer, or a non-empty list of them (one per layer)."""
    return _count(value) or isinstance(value, list) and bool(value) and all(map(_count, value))


# The fields of oscar_config.json: name -> (required, test, what the value must be).
CONFIG_FIELDS = {
    "format_version": (True, lambda v: type(v) is int, "an integer"),
    "num_kv_heads": (True, _counts, "a positive integer, or a list of one per layer"),
    "head_dim": (False, _counts, "a positive integer, or a list of one per layer"),
    "num_layers": (False, _count, "a positive integer"),
    "per_head": (False, lambda v: type(v) is bool, "true or false"),
    "source_model": (False, lambda v: v is None or isinstance(v, str), "a string or null"),
    "method": (False, lambda v: isinstance(v, str), "a string"),
    "calibration": (False, lambda v: v is None or isinstance(v, dict), "a JSON object or null"),
    "config": (False, lambda v: v is None or isinstance(v, dict), "a JSON object (OscarConfig fields) or null"),
    "key_codebook_bits": (False, lambda v: isinstance(v, list) and all(map(_count, v)), "a list of bit widths"),
}
# The fields of a row of diagnostics.json: "layer", and the metrics and "tokens" (any other field)
DIAGNOSTICS_LAYER = (True, lambda v: type(v) is int and v >= 0, "an integer >= 0")
DIAGNOSTICS_VALUE = (False, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number")


def _json(path: Path):
    """The JSON value in the file ``path``; ValueError naming the file where it is not JSON."""
    try:
        return json.loads(Path(path).read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None


def _check_fields(where: str, data, fields: dict) -> dict:
    """``data`` (read from JSON) where it is an object whose ``fields`` pass their tests; else ValueError naming
    ``where`` (the file) and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object; got {type(data).__name__} {reprlib.repr(data)}")
    for name, (required, valid, must) in fields.items():
        if name not in data and required:
            raise ValueError(f"{where} lacks the field {name!r} ({must})")
        if name in data and not valid(data[name]):
            raise ValueError(f"{where}: the field {name!r} must be {must}; got {reprlib.repr(data[name])}")
    return data


def _diagnostics(path: Path) -> list[dict]:
    """The rows of a bundle's diagnostics.json (oscar_hf.diagnostics): objects with an integer ``layer`` and numbers
    (its metrics, ``tokens``) in every other field."""
    rows = _json(path)
    if not isinstance(rows, list):
        raise ValueError(f"{path} must be a JSON list of per-layer rows; got {type(rows).__name__}")
    for i, row in enumerate(rows):
        fields = dict.fromkeys(row if isinstance(row, dict) else (), DIAGNOSTICS_VALUE) | {"layer": DIAGNOSTICS_LAYER}
        _check_fields(f"{path} (row {i})", row, fields)
    return rows


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


def _stacked(layers: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Per-layer tensors as one ``[layers, ...]`` tensor where their shapes are alike, else as a tuple."""
    return torch.stack(layers) if len({tuple(t.shape) for t in layers}) == 1 else tuple(layers)


def _summary(values: tuple[int, ...]) -> str:
    """``64`` where every layer has 64, else ``256/512 by layer``."""
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, sorted(set(values)))) + " by layer"


def _shapes(rotations) -> list[tuple[int, ...]] | tuple[int, ...]:
    return tuple(rotations.shape) if isinstance(rotations, torch.Tensor) else [tuple(r.shape) for r in rotations]


class OscarRotations:
    """Rotations ``R_K`` and ``R_V`` per layer (float32 ``[D, D]``, shared by the layer's KV heads) or per layer and
    KV head (``[H, D, D]``: ``per_head``), their eigenvalues and metadata.

    Where every layer has the same geometry the rotations are one tensor ``[layers, (H,) D, D]``; a model whose
    layers differ in head_dim or KV heads (Gemma-4) has a tuple of per-layer tensors instead. Both index by layer.

    Args:
        key_rotation, value_rotation: orthogonal matrices ``[layers, (H,) D, D]``, or a sequence of one ``[(H,) D,
            D]`` per layer; both alike.
        key_eigenvalues, value_eigenvalues: alike without the last dim, or None (zeros) for data-free bundles.
        num_kv_heads: KV heads of the model the bundle was made for: one count, or one per layer.
        source_model: name or path of that model.
        method: how the rotations were made ("identity", "hadamard", "oscar", ...).
        calibration: free-form JSON-able details (data, token count, targets, ...).
        config: recommended OscarConfig for this model, or None.
        diagnostics: per-layer quantization diagnostics (see oscar_hf.diagnostics), or None.
        key_codebooks: product-quantized key codebooks ``{bits: [one KeyCodebook or None per layer]}``, in the
            basis of ``key_rotation`` (:mod:`oscar_hf.codebooks`), or None.
    """

    def __init__(
        self,
        key_rotation: torch.Tensor | Sequence[torch.Tensor],
        value_rotation: torch.Tensor | Sequence[torch.Tensor],
        *,
        num_kv_heads: int | Sequence[int],
        key_eigenvalues: torch.Tensor | Sequence[torch.Tensor] | None = None,
        value_eigenvalues: torch.Tensor | Sequence[torch.Tensor] | None = None,
        source_model: str | None = None,
        method: str = "custom",
        calibration: dict | None = None,
        config: OscarConfig | None = None,
        diagnostics: list[dict] | None = None,
        key_codebooks: dict[int, Sequence[KeyCodebook | None]] | None = None,
    ):
        self.key_rotation = self._checked_rotations("key_rotation", key_rotation)
        self.value_rotation = self._checked_rotations("value_rotation", value_rotation)
        shapes = [tuple(r.shape) for r in self.key_rotation]
        if [tuple(r.shape) for r in self.value_rotation] != shapes:
            raise ValueError(
                f"value_rotation shapes {_shapes(self.value_rotation)} differ from key_rotation shapes "
                f"{_shapes(self.key_rotation)}"
            )
        if len({len(s) for s in shapes}) != 1:
            raise ValueError(f"rotations must be per layer or per layer and KV head in every layer; got {shapes}")
        self.key_eigenvalues = self._checked_eigenvalues("key_eigenvalues", key_eigenvalues, self.key_rotation)
        self.value_eigenvalues = self._checked_eigenvalues("value_eigenvalues", value_eigenvalues,
                                                           self.key_rotation)
        kv_heads = [num_kv_heads] * self.num_layers if isinstance(num_kv_heads, int) else list(num_kv_heads)
        if len(kv_heads) != self.num_layers:
            raise ValueError(f"num_kv_heads has {len(kv_heads)} entries for {self.num_layers} layers")
        self.kv_heads = tuple(int(h) for h in kv_heads)
        for i, (rotation, heads) in enumerate(zip(self.key_rotation, self.kv_heads)):
            if rotation.ndim == 3 and rotation.shape[0] != heads:
                raise ValueError(f"per-KV-head rotations of layer {i} {tuple(rotation.shape)} have {rotation.shape[0]} "
                                 f"heads, but num_kv_heads is {heads}")
        self.source_model = source_model
        self.method = method
        self.calibration = dict(calibration or {})
        self.config = config
        self.diagnostics = diagnostics
        self.key_codebooks = self._checked_codebooks(key_codebooks or {})

    def _checked_codebooks(self, books: dict[int, Sequence[KeyCodebook | None]]) -> dict[int, list]:
        checked = {}
        for bits, layers in books.items():
            layers = list(layers)
            if len(layers) != self.num_layers:
                raise ValueError(f"{bits}-bit key codebooks: {len(layers)} entries for {self.num_layers} layers")
            for i, book in enumerate(layers):
                if book is None:
                    continue
                if book.bits != bits or book.head_dim != self.head_dims[i] or book.heads not in (1, self.kv_heads[i]):
                    raise ValueError(f"the {bits}-bit key codebook of layer {i} ({book!r}) does not fit the layer "
                                     f"(head_dim {self.head_dims[i]}, {self.kv_heads[i]} KV heads)")
            checked[int(bits)] = layers
        return checked

    def key_codebook(self, layer: int, bits: int) -> KeyCodebook:
        """Layer ``layer``'s ``bits``-bit key codebook; ValueError where the bundle has none."""
        book = self.key_codebooks.get(bits, [None] * self.num_layers)[layer]
        if book is None:
            held = sorted(self.key_codebooks) or "none"
            raise ValueError(f"the bundle has no {bits}-bit key codebook for layer {layer} (its codebook bits: "
                             f"{held}): calibrate with key_codebook_bits=[{bits}] (oscar-hf calibrate "
                             f"--key-codebooks {bits}), with the config's quantize_sliding where sliding-window layers "
                             "are to be stored so")
        return book

    @staticmethod
    def _checked_rotations(name: str, rotations) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """``rotations`` as float32 on the CPU: one tensor where every layer's shape is alike, else a tuple."""
        stacked = isinstance(rotations, torch.Tensor)
        if stacked and rotations.ndim not in (3, 4) or not stacked and not isinstance(rotations, (list, tuple)):
            shape = tuple(rotations.shape) if stacked else type(rotations).__name__
            raise ValueError(f"{name} must be a tensor [layers, (num_kv_heads,) head_dim, head_dim] or one tensor "
                             f"per layer; got {shape}")
        layers = [OscarRotations._checked_layer(name, i, r) for i, r in enumerate(rotations)]
        if not layers:
            raise ValueError(f"{name} has no layers")
        return _stacked(layers)

    @staticmethod
    def _checked_layer(name: str, layer: int, rotation) -> torch.Tensor:
        if (not isinstance(rotation, torch.Tensor) or rotation.ndim not in (2, 3)
                or rotation.shape[-1] != rotation.shape[-2]):
            shape = tuple(rotation.shape) if isinstance(rotation, torch.Tensor) else type(rotation).__name__
            raise ValueError(f"{name} of layer {layer} must be [head_dim, head_dim] or [num_kv_heads, head_dim, "
                             f"head_dim]; got {shape}")
        rotation = rotation.detach().to("cpu", torch.float32, copy=True).contiguous()
        if not bool(torch.isfinite(rotation).all()):
            raise ValueError(f"{name} of layer {layer} contains NaN or inf")
        eye = torch.eye(rotation.shape[-1], dtype=torch.float64)
        error = (rotation.double().mT @ rotation.double() - eye).abs().amax(dim=(-2, -1))
        if bool((error > ORTHOGONALITY_TOLERANCE).any()):
            head = int(error.argmax()) if error.ndim else None
            where = f"layer {layer}" + (f", KV head {head}" if head is not None else "")
            raise ValueError(
                f"{name} of {where} is not orthogonal: max |RᵀR - I| = {float(error.max()):.2e} "
                f"(tolerance {ORTHOGONALITY_TOLERANCE:g})"
            )
        return rotation

    @staticmethod
    def _checked_eigenvalues(name: str, values, rotations) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if values is None:
            return _stacked([torch.zeros(r.shape[:-1]) for r in rotations])
        if len(values) != len(rotations):
            raise ValueError(f"{name} has {len(values)} layers; the rotations have {len(rotations)}")
        layers = []
        for i, (v, r) in enumerate(zip(values, rotations)):
            if tuple(v.shape) != tuple(r.shape[:-1]):
                raise ValueError(f"{name} of layer {i} must have shape {tuple(r.shape[:-1])}; got {tuple(v.shape)}")
            layers.append(v.detach().to("cpu", torch.float32, copy=True).contiguous())
        return _stacked(layers)

    @property
    def num_layers(self) -> int:
        return len(self.key_rotation)

    @property
    def head_dims(self) -> tuple[int, ...]:
        """Each layer's head_dim."""
        return tuple(r.shape[-1] for r in self.key_rotation)

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same geometry (the rotations are then one stacked tensor)."""
        return isinstance(self.key_rotation, torch.Tensor) and len(set(self.kv_heads)) == 1

    @property
    def head_dim(self) -> int:
        """The head_dim of every layer; ValueError for a bundle whose layers differ (see ``head_dims``)."""
        return ModelShape._uniform("head_dim", self.head_dims)

    @property
    def num_kv_heads(self) -> int:
        """The KV heads of every layer; ValueError for a bundle whose layers differ (see ``kv_heads``)."""
        return ModelShape._uniform("num_kv_heads", self.kv_heads)

    @property
    def per_head(self) -> bool:
        """Whether each KV head has its own rotations (``[H, D, D]`` per layer), rather than its layer's."""
        return self.key_rotation[0].ndim == 3

    @property
    def format_version(self) -> int:
        """The ``format_version`` this bundle is saved with: the lowest that holds it."""
        if not self.uniform:
            return FORMAT_VERSION
        return PER_HEAD_FORMAT_VERSION if self.per_head else SHARED_FORMAT_VERSION

    def __repr__(self) -> str:
        return (
            f"OscarRotations(method={self.method!r}, layers={self.num_layers}, head_dim={_summary(self.head_dims)}, "
            f"num_kv_heads={_summary(self.kv_heads)}, per_head={self.per_head}, source_model={self.source_model!r})"
        )

    # ----------------------------------------------------------------- data-free baselines
    @classmethod
    def _data_free(cls, model_config, matrix, method: str) -> "OscarRotations":
        """``matrix(head_dim)`` (float64 ``[D, D]``) on every layer."""
        shape = ModelShape.from_config(model_config)
        layers = [matrix(d).float() for d in shape.head_dims]
        return cls(
            layers,
            [r.clone() for r in layers],
            num_kv_heads=shape.kv_heads,
            source_model=getattr(model_config, "_name_or_path", None) or None,
            method=method,
        )

    @classmethod
    def identity(cls, model_config) -> "OscarRotations":
        """No rotation (naive INT2 when used without clipping)."""
        return cls._data_free(model_config, lambda d: torch.eye(d, dtype=torch.float64), "identity")

    @classmethod
    def hadamard(cls, model_config) -> "OscarRotations":
        """:func:`hadamard_matrix` on every layer (QuaRot-style, data-free)."""
        return cls._data_free(model_config, hadamard_matrix, "hadamard")

    @classmethod
    def from_reference(
        cls,
        key_file: str | os.PathLike,
        value_file: str | os.PathLike,
        *,
        num_kv_heads: int | None = None,
        model_config=None,
        source_model: str | None = None,
    ) -> "OscarRotations":
        """Import the OSCAR reference's rotation files: ``torch.save``'d (``k_rotation_qqt_r_h_pbr.pt``,
        ``v_rotation_sst_r_h_pbr.pt``, read with ``torch.load(weights_only=True)``) or JSON (its per-head fitting
        script's, the arrays as nested lists).

        Each holds ``{"format_version": 1 or 2, "objective": ..., "layers": {layer_id: {"rotation", "eigenvalues"}}}``:
        v1 a ``[D, D]`` rotation and ``[D]`` eigenvalues per layer, v2 (per KV head) ``[kv_heads, D, D]`` and
        ``[kv_heads, D]``; eigenvalues may be absent (zeros, as in data-free bundles). A side with shared rotations
        beside a per-head one is repeated over the heads. Of the optional fields of a layer (or the file),
        ``q_rotation`` and ``o_rotation`` must be the identity (the cache rotates Q by K's rotation and the attention
        output back by V's, and applies no other), and ``k_mean`` (key centering on a fixed mean) becomes the
        recommended config's ``centering``, which centers each sequence's keys on their own mean.

        Layer ids are the model's: ``0 .. layers-1``, or, for models whose every layer is not full attention (hybrids,
        sliding-window interleaves), the global ids of the full-attention layers alone (Qwen3.5's 3, 7, 11, ...).
        Those need ``model_config``, which places them (the other layers get the identity: the cache does not
        quantize them) and refuses ids that are not the model's full-attention layers. ``num_kv_heads`` defaults to
        the config's.
        """
        from .model_support import ModelShape

        shape = ModelShape.from_config(model_config) if model_config is not None else None
        if num_kv_heads is None:
            if shape is None:
                raise ValueError("from_reference needs num_kv_heads= or model_config=")
            num_kv_heads = shape.kv_heads
        kv_heads = num_kv_heads if not isinstance(num_kv_heads, int) else None

        def array(path, where: str, value) -> torch.Tensor:
            try:
                return torch.as_tensor(value, dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError) as err:  # ragged or non-numeric nested lists
                raise ValueError(f"{path}: {where} is not a numeric array ({err})") from None

        def read(path) -> tuple[list[int], torch.Tensor, torch.Tensor, str, bool]:
            with open(path, "rb") as f:
                is_json = f.read(64).lstrip()[:1] == b"{"
            data = _json(path) if is_json else torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(data, dict) or not isinstance(data.get("layers"), dict) or not data["layers"]:
                raise ValueError(f"{path} is not an OSCAR reference rotation file (no 'layers' dict)")
            if data.get("format_version", 1) not in (1, 2):
                raise ValueError(f"{path}: unsupported format_version {data.get('format_version')!r} (1 or 2)")
            if not all(type(i) is int or isinstance(i, str) and i.isdigit() for i in data["layers"]):
                raise ValueError(f"{path}: layer ids must be integers; got {sorted(map(str, data['layers']))}")
            layers = sorted(((int(i), e) for i, e in data["layers"].items()), key=lambda item: item[0])
            if not all(isinstance(e, dict) and "rotation" in e for _, e in layers):
                raise ValueError(f"{path}: every layer entry needs a 'rotation'")
            holders = [("the file", data), *((f"layer {i}", e) for i, e in layers)]
            for (where, holder), name in itertools.product(holders, ("q_rotation", "o_rotation")):
                m = array(path, f"{where}'s {name}", holder[name]) if holder.get(name) is not None else None
                if m is not None and (m.ndim < 2 or m.shape[-1] != m.shape[-2] or not torch.allclose(
                        m, torch.eye(m.shape[-1], dtype=m.dtype), rtol=0, atol=ORTHOGONALITY_TOLERANCE)):
                    raise ValueError(f"{path}: {where}'s {name} is not the identity; the cache rotates Q by K's "
                                     "rotation and the attention output back by V's, and applies no other: import "
                                     f"rotations fitted without {name}")
            centered = [array(path, f"{where}'s k_mean", h["k_mean"]) for where, h in holders
                        if h.get("k_mean") is not None]
            rotations = [array(path, f"layer {i}'s rotation", e["rotation"]) for i, e in layers]
            if len({tuple(r.shape) for r in rotations}) != 1 or rotations[0].ndim not in (2, 3):
                raise ValueError(f"{path}: every layer's rotation must be [D, D] (v1) or [kv_heads, D, D] (v2), all "
                                 f"alike; got {sorted({tuple(r.shape) for r in rotations})}")
            eigenvalues = torch.stack([array(path, f"layer {i}'s eigenvalues", e["eigenvalues"])
                                       if e.get("eigenvalues") is not None else r.new_zeros(r.shape[:-1])
                                       for (i, e), r in zip(layers, rotations)])
            objective = str(data.get("objective", "unknown"))
            return [i for i, _ in layers], torch.stack(rotations), eigenvalues, objective, bool(centered)

        def heads_of(layer: int) -> int:
            return kv_heads[layer] if kv_heads is not None else num_kv_heads

        def placed(path, ids: list[int], rotation: torch.Tensor, eigenvalues: torch.Tensor, per_head: bool):
            """Per-layer (rotations, eigenvalues) at the model's layer positions: the file's where it has the layer,
            the identity (and zeros) of the layer's own geometry elsewhere; with ``per_head``, shared ones repeated
            over the layer's KV heads."""
            if ids == list(range(len(ids))) and (shape is None or len(ids) == shape.num_layers):
                where = dict(zip(ids, range(len(ids))))
                layers = range(len(ids))
            elif shape is None:
                raise ValueError(f"{path}: layer ids {ids} are not 0..{len(ids) - 1}; pass model_config= to place "
                                 "global layer ids (a hybrid's full-attention layers)")
            else:
                full = shape.full_attention_layers
                if ids != full:
                    raise ValueError(f"{path}: layer ids {ids} are neither the model's {shape.num_layers} layers nor "
                                     f"its full-attention layers {full}")
                where = dict(zip(ids, range(len(ids))))
                layers = range(shape.num_layers)
            out = []
            for i in layers:
                if i in where:
                    r, e = rotation[where[i]], eigenvalues[where[i]]
                    if shape is not None and r.shape[-1] != shape.head_dims[i]:
                        raise ValueError(f"{path}: layer {i}'s rotation is {r.shape[-1]}-dimensional; the model's "
                                         f"layer {i} has head_dim {shape.head_dims[i]}")
                else:
                    r, e = torch.eye(shape.head_dims[i]), torch.zeros(shape.head_dims[i])
                if per_head and r.ndim == 2:
                    r, e = r.expand(heads_of(i), -1, -1), e.expand(heads_of(i), -1)
                out.append((r, e))
            return [r for r, _ in out], [e for _, e in out]

        read_files = [read(path) for path in (key_file, value_file)]
        per_head = any(rotation.ndim == 4 for _, rotation, _, _, _ in read_files)
        centered = any(centered for *_, centered in read_files)
        sides = []
        for path, (ids, rotation, eigenvalues, objective, _) in zip((key_file, value_file), read_files):
            if rotation.ndim == 4:
                expected = sorted({heads_of(i) for i in ids if kv_heads is None or i < len(kv_heads)})
                if expected != [rotation.shape[1]]:
                    raise ValueError(f"{path}: per-head rotations for {rotation.shape[1]} KV heads; the model has "
                                     f"{'/'.join(map(str, expected))}")
            sides.append((*placed(path, ids, rotation, eigenvalues, per_head), objective))
        (key_rotation, key_eigenvalues, key_objective), (value_rotation, value_eigenvalues, value_objective) = sides
        return cls(
            key_rotation,
            value_rotation,
            key_eigenvalues=key_eigenvalues,
            value_eigenvalues=value_eigenvalues,
            num_kv_heads=num_kv_heads,
            source_model=source_model,
            method="oscar-reference",
            calibration={
                "imported_from": "OSCAR reference",
                "key_objective": key_objective,
                "value_objective": value_objective,
            } | ({"key_centering": "k_mean: each sequence's own mean (OscarConfig.centering)"} if centered else {}),
            config=OscarConfig(centering=True) if centered else None,
        )

    # ------------------------------------------------------------------- model compatibility
    def with_identity_keys(self) -> "OscarRotations":
        """This bundle with every K rotation the identity (for per-channel K, whose grid needs K's own channels:
        a rotation spreads the outlier channels it would give their own scales); V's rotations are kept."""
        eye = [torch.eye(r.shape[-1]).expand_as(r) for r in self.key_rotation]
        return OscarRotations(
            eye,
            self.value_rotation,
            num_kv_heads=self.kv_heads,
            value_eigenvalues=self.value_eigenvalues,
            source_model=self.source_model,
            method=f"{self.method}, identity K",
            calibration=self.calibration,
            config=self.config,
        )  # (key codebooks are left out: they live in the K rotation's basis)

    def check_compatible(self, model_config) -> None:
        """Raise ValueError naming the first field in which this bundle does not fit ``model_config``; warn (once)
        where the bundle was made for another model of the same shape, as both name them (two Hub ids or two local
        paths: a path may hold a Hub model's download or conversion)."""
        shape = ModelShape.from_config(model_config)
        model_name = getattr(model_config, "_name_or_path", None) or None
        fields = [("num_layers", self.num_layers, shape.num_layers)]
        if self.num_layers == shape.num_layers:
            fields += [(f"head_dim of layer {i}", ours, theirs)
                       for i, (ours, theirs) in enumerate(zip(self.head_dims, shape.head_dims))]
            fields += [(f"num_kv_heads of layer {i}", ours, theirs)
                       for i, (ours, theirs) in enumerate(zip(self.kv_heads, shape.kv_heads))]
        for field, ours, theirs in fields:
            if ours != theirs:
                made_for = self.source_model or "a model whose name it does not record"
                if shape.uniform and self.uniform:
                    field = field.split(" of layer")[0]
                raise ValueError(
                    f"rotation bundle does not fit the model: {field} is {ours} in the bundle (made for {made_for}) "
                    f"but {theirs} in {model_name or 'this model'}"
                )
        names = [str(name).rstrip("/") for name in (self.source_model, model_name) if name]
        if len(set(names)) == 2 and len({Path(name).expanduser().is_absolute() for name in names}) == 1:
            _warn_once(f"oscar-hf: the rotation bundle was made for {self.source_model}, not for {model_name}: its "
                       "shape fits, but its rotations follow the other model's K and V statistics")

    # ------------------------------------------------------------------------------- saving
    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Save the bundle as the folder ``save_directory`` (returned), atomically: into a hidden folder beside it
        (``.<name>.oscar-tmp-<random>``) that then replaces it whole, so that no file of a bundle saved there before
        stays, and an interrupted save leaves that bundle as it was (and the hidden folder:
        :func:`remove_stale_temporaries`); between the two renames that swap them, the earlier bundle is
        ``.<name>.oscar-old-<random>``. A folder holding anything but a bundle's files (a model's, say) is left
        untouched: FileExistsError."""
        path = Path(save_directory).expanduser().resolve()
        foreign = sorted(set(os.listdir(path)) - set(BUNDLE_FILES)) if path.exists() else []
        if foreign:
            raise FileExistsError(f"{path} holds files that are not a rotation bundle's ({', '.join(foreign)}): save "
                                  "the bundle into a new folder")
        build = path.parent / f".{path.name}{TEMPORARY_MARK}{secrets.token_hex(6)}"
        build.mkdir(parents=True)  # a plain mkdir's mode (the umask's), as huggingface_hub's cache has (not 0o700)
        aside = path.parent / f".{path.name}.oscar-old-{secrets.token_hex(6)}"  # not a leftover to remove
        try:
            self._write(build)
            mode = stat.S_IMODE((build / CONFIG_NAME).stat().st_mode)  # open()'s; safetensors writes 0o600
            for file in build.iterdir():
                file.chmod(mode)
            if path.exists():
                path.rename(aside)
            try:
                build.rename(path)
            except BaseException:
                if aside.exists():
                    aside.rename(path)
                raise
        except BaseException:
            shutil.rmtree(build, ignore_errors=True)
            raise
        shutil.rmtree(aside, ignore_errors=True)
        return path

    def _write(self, path: Path) -> None:
        """Write the bundle's files into the folder ``path``."""
        uniform = self.uniform
        metadata = {
            "format_version": self.format_version,
            "library": "oscar_hf",
            "method": self.method,
            "source_model": self.source_model,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads if uniform else list(self.kv_heads),
            "head_dim": self.head_dim if uniform else list(self.head_dims),
            "per_head": self.per_head,
            "calibration": self.calibration,
            "config": self.config.to_dict() if self.config is not None else None,
        }
        if self.key_codebooks:
            metadata["key_codebook_bits"] = sorted(self.key_codebooks)
        tensors = {}
        for name in TENSOR_NAMES:
            value = getattr(self, name)
            tensors |= {name: value} if uniform else {f"{name}.{i}": t for i, t in enumerate(value)}
        save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format_version": str(self.format_version)})
        if self.key_codebooks:
            books = {f"key_codebook.{bits}.{i}.{part}": t.contiguous() for bits, layers in self.key_codebooks.items()
                     for i, book in enumerate(layers) if book is not None for part, t in book.tensors().items()}
            save_file(books, str(path / CODEBOOKS_NAME))
        (path / CONFIG_NAME).write_text(json.dumps(metadata, indent=2) + "\n")
        (path / CARD_NAME).write_text(self.model_card())
        if self.diagnostics is not None:
            (path / DIAGNOSTICS_NAME).write_text(json.dumps(self.diagnostics, indent=2) + "\n")

    def model_card(self) -> str:
        """A short README for the bundle: what it is, how it was made, how to use it."""
        settings = "\n".join(f"- {k}: {v}" for k, v in self.calibration.items()) or "- data-free (no calibration)"
        config = self.config.to_json() if self.config is not None else "OscarConfig() defaults"
        return (
            f"---\nlibrary_name: oscar_hf\ntags: [oscar, kv-cache, quantization]\n---\n\n"
            f"# OSCAR KV-cache rotations for {self.source_model or 'an unnamed model'}\n\n"
            f"{'Per-layer and KV-head' if self.per_head else 'Per-layer'} K and V rotations ({self.method}) for "
            f"2-bit KV-cache quantization with "
            f"[oscar-hf](https://pypi.org/project/oscar-hf/): {self.num_layers} layers, head_dim "
            f"{_summary(self.head_dims)}, {_summary(self.kv_heads)} KV heads.\n\n## How it was made\n\n{settings}\n\n"
            f"## Recommended cache settings\n\n```json\n{config}\n```\n\n## Use\n\n```python\n"
            f"from oscar_hf import OscarQuantizedCache\n"
            f"cache = OscarQuantizedCache.from_pretrained(REPO_OR_DIR, subfolder=SUBFOLDER, model=model)\n"
            f"out = model.generate(**inputs, past_key_values=cache)\n```\n"
        )

    @classmethod
    def from_pretrained(
        cls,
        src: str | os.PathLike,
        *,
        subfolder: str | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
    ) -> "OscarRotations":
        """Load a bundle from a local folder or a Hub repo (``subfolder`` inside either).

        ``src`` is a folder where one exists; else it must be a Hub repo id (``org/name``), and a path that is
        neither raises FileNotFoundError ("no such folder"). With ``HF_HUB_OFFLINE=1`` (or ``local_files_only``) a
        repo is read from the local Hugging Face cache alone, failing at once where it is not there."""
        from huggingface_hub import constants, hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError
        from huggingface_hub.utils import validate_repo_id

        root = Path(src).expanduser()
        local = root / (subfolder or "")
        if local.is_dir():
            config_file, weights_file = local / CONFIG_NAME, local / WEIGHTS_NAME
            for file in (config_file, weights_file):
                if not file.is_file():
                    raise FileNotFoundError(f"{local} is not an OSCAR rotation bundle: {file.name} is missing")
            return cls._load(config_file, weights_file, lambda name: local / name)
        if root.is_dir():
            raise FileNotFoundError(f"no such folder: {local} (the folder {root} has no subfolder {subfolder!r})")
        try:
            validate_repo_id(str(src))
        except HFValidationError:
            raise FileNotFoundError(f"no such folder: {src} (and it is not a Hub repo id of the form 'org/name')") \
                from None
        offline = local_files_only or constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "0") not in (
            "", "0", "false", "False")
        where = f"{src!r}" + (f", subfolder {subfolder!r}" if subfolder else "") + (
            f", revision {revision!r}" if revision else "")

        def fetch(name: str) -> Path:
            try:
                return Path(hf_hub_download(str(src), name, subfolder=subfolder, revision=revision,
                                            cache_dir=cache_dir, local_files_only=offline, token=token))
            except LocalEntryNotFoundError:
                raise FileNotFoundError(
                    f"no such folder: {src}; and the Hub repo {where} has no {name} in the local Hugging Face cache"
                    + (" (offline: HF_HUB_OFFLINE=1)" if offline else "")) from None
            except EntryNotFoundError:
                raise FileNotFoundError(f"the Hub repo {where} has no {name}: not an OSCAR rotation bundle") \
                    from None

        config_file, weights_file = fetch(CONFIG_NAME), fetch(WEIGHTS_NAME)
        return cls._load(config_file, weights_file, fetch)

    @classmethod
    def _load(cls, config_file: Path, weights_file: Path, fetch) -> "OscarRotations":
        """The bundle of these files; ``fetch(name)`` gives the path of another of its files."""
        metadata = _check_fields(str(config_file), _json(config_file), CONFIG_FIELDS)
        version = metadata["format_version"]
        if not SHARED_FORMAT_VERSION <= version <= FORMAT_VERSION:
            raise ValueError(f"{config_file}: unsupported format_version {version!r} (this oscar-hf reads "
                             f"{SHARED_FORMAT_VERSION} to {FORMAT_VERSION}; a newer bundle needs a newer oscar-hf)")
        try:
            config = OscarConfig.from_dict(metadata["config"]) if metadata.get("config") else None
        except ValueError as err:
            raise ValueError(f"{config_file}: the field 'config': {err}") from None
        try:
            tensors = load_file(str(weights_file))
        except Exception as err:  # safetensors raises its own error type for a truncated or foreign file
            raise ValueError(f"{weights_file} is not a readable safetensors file ({err})") from None
        for key, value in tensors.items():
            if value.dtype != torch.float32:
                raise ValueError(f"{weights_file}: the tensor {key!r} is {value.dtype}; a bundle stores float32")
        if version == FORMAT_VERSION:  # one tensor per layer: "key_rotation.0", "key_rotation.1", ...
            per_layer = {}
            for key, value in tensors.items():
                name, _, layer = key.rpartition(".")
                if name in TENSOR_NAMES and layer.isdigit():
                    per_layer.setdefault(name, {})[int(layer)] = value
            for name, layers in per_layer.items():
                if sorted(layers) != list(range(len(layers))):
                    raise ValueError(f"{weights_file}: {name} has layers {sorted(layers)}, not 0..{len(layers) - 1}")
            tensors = {name: [layers[i] for i in range(len(layers))] for name, layers in per_layer.items()}
        missing = {"key_rotation", "value_rotation"} - set(tensors)
        if missing:
            raise ValueError(f"{weights_file} lacks tensor(s) {sorted(missing)}")
        if version == SHARED_FORMAT_VERSION and tensors["key_rotation"].ndim != 3:
            raise ValueError(f"{weights_file}: format_version 1 holds rotations [layers, D, D]; got "
                             f"{tuple(tensors['key_rotation'].shape)}")
        bundle = cls(
            tensors["key_rotation"],
            tensors["value_rotation"],
            key_eigenvalues=tensors.get("key_eigenvalues"),
            value_eigenvalues=tensors.get("value_eigenvalues"),
            num_kv_heads=metadata["num_kv_heads"],
            source_model=metadata.get("source_model"),
            method=metadata.get("method", "custom"),
            calibration=metadata.get("calibration"),
            config=config,
        )
        diagnostics_file = config_file.with_name(DIAGNOSTICS_NAME)
        if diagnostics_file.is_file():
            bundle.diagnostics = _diagnostics(diagnostics_file)
        if metadata.get("key_codebook_bits"):
            missing = FileNotFoundError(f"{config_file.name} lists key codebooks of {metadata['key_codebook_bits']} "
                                        f"bits, but the bundle has no {CODEBOOKS_NAME}")
            try:
                path = fetch(CODEBOOKS_NAME)
            except FileNotFoundError:
                raise missing from None
            if not Path(path).is_file():
                raise missing
            bundle.key_codebooks = bundle._checked_codebooks(
                _read_codebooks(path, metadata["key_codebook_bits"], bundle.num_layers))
        stored = {"num_layers": bundle.num_layers, "per_head": bundle.per_head,
                  "head_dim": bundle.head_dim if bundle.uniform else list(bundle.head_dims)}
        for field, value in stored.items():
            if field in metadata and metadata[field] != value:
                raise ValueError(
                    f"{config_file}: {field}={metadata[field]} disagrees with the tensors ({value})"
                )
        return bundle

    def push_to_hub(
        self,
        repo_id: str,
        *,
        subfolder: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        token: str | bool | None = None,
        commit_message: str | None = None,
    ) -> str:
        """Upload the bundle to the Hub model repo ``repo_id`` (created if needed), under ``subfolder``."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            info = api.upload_folder(
                repo_id=repo_id,
                folder_path=tmp,
                path_in_repo=subfolder or "",
                revision=revision,
                commit_message=commit_message or f"Upload OSCAR rotations ({self.method})",
            )
        return str(info)


def remove_stale_temporaries(parent: str | os.PathLike, older_than_s: float = 3600.0) -> list[Path]:
    """Remove the hidden folders (``.<name>.oscar-tmp-*``) that saves into ``parent`` left behind when killed, those
    untouched for ``older_than_s`` seconds (younger ones may be saves under way); return the paths removed."""
    cutoff, removed = time.time() - older_than_s, []
    for folder in Path(parent).glob(f".*{TEMPORARY_MARK}*"):
        with contextlib.suppress(FileNotFoundError):  # (a concurrent cleanup may take it first)
            if folder.is_dir() and folder.stat().st_mtime < cutoff:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def _read_codebooks(path: Path, bits: list[int], num_layers: int) -> dict[int, list[KeyCodebook | None]]:
    """The key codebooks of ``codebooks.safetensors`` at ``path``, for the listed bit widths."""
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error type for a truncated or foreign file
        raise ValueError(f"{path} is not a readable safetensors file ({err})") from None
    parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, width, layer, part = (key.split(".") + ["", "", "", ""])[:4]
        if name != "key_codebook" or not (width.isdigit() and layer.isdigit()) or int(width) not in bits \
                or int(layer) >= num_layers or part not in ("centroids", "basis", "weight"):
            raise ValueError(f"{path}: unexpected tensor {key!r}")
        parts.setdefault((int(width), int(layer)), {})[part] = value
    books = {int(b): [None] * num_layers for b in bits}
    for (width, layer), found in parts.items():
        try:
            books[width][layer] = KeyCodebook(found["centroids"], found["basis"], found["weight"])
        except KeyError as err:
            raise ValueError(f"{path}: the {width}-bit codebook of layer {layer} lacks {err.args[0]!r}") from None
    return books
