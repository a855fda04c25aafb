"""Rotations without a bundle: calibrate a model once, on text shipped with oscar-hf or on the user's, and keep the
bundle in the Hugging Face cache folder for every later call.

``OscarQuantizedCache.from_pretrained(model=model)`` (no bundle), ``oscar-hf generate`` / ``eval`` without
``--rotations``, and ``oscar-hf demo`` come here. A bundle lives in
``$HF_HOME/oscar-hf/rotations/<model>/<revision>-<key>`` (``HF_HOME`` as huggingface_hub reads it, by default
``~/.cache/huggingface``): ``<model>`` is the model's Hub id (``/`` written ``--``) or its folder's name,
``<revision>`` its Hub commit (``config._commit_hash``) or ``local``, and ``<key>`` a hash of the model's config (its
architecture, not its dtype or name), the calibration settings, the cache config, the calibration tokens and the
oscar-hf version. Another model, revision, config, text, budget or oscar-hf release gets its own folder (a new release
calibrates again rather than reuse rotations an older calibration made); deleting a folder makes the next call
calibrate again. Processes (or threads) that ask for one bundle at once calibrate it once: one holds the file lock
``<folder>.lock`` while it reads or makes the bundle, the others wait and then read it.

The settings come from the model's recipe (:func:`oscar_hf.recipes.recipe_for_model`: targets, eigenvector order,
cache config) with a budget of ``DEFAULT_TOKENS`` calibration tokens, else from :func:`oscar_hf.calibrate`'s
defaults (the paper's targets); a model without a recipe has its layout chosen on ``CHOICE_TOKENS`` held-out tokens
after the calibration ones (:mod:`oscar_hf.layout_choice`), from ``OscarConfig()``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock, Timeout

from .calibrate import calibrate, calibration_token_ids, first_held_out_length
from .config import OscarConfig
from .model_support import ModelShape
from .recipes import Recipe, load_recipe, model_name, recipe_for_model
from .rotations import OscarRotations, remove_stale_temporaries
from .version import __version__

logger = logging.getLogger(__name__)

SHIPPED_TEXT = Path(__file__).parent / "data" / "austen_emma.txt"
SHIPPED_TEXT_NAME = "oscar_hf/data/austen_emma.txt"  # as a bundle records it
# Calibration tokens when no budget is given: one chunk, one forward pass per target pass. On SmolLM2-135M it gives
# the attention-score KL and perplexity of 30K tokens (docs/design.md) and takes seconds on a 2-core CPU.
DEFAULT_TOKENS = 2048
CHOICE_TOKENS = 1024  # held-out tokens on which a model without a recipe has its layout chosen
STALE_BUILD_SECONDS = 300  # a save's hidden folder older than this is a killed save's leftover
SETTINGS = ("num_tokens", "max_length", "k_target", "v_target", "composition", "eigen_order")
# config fields that say how a model was loaded or runs, not what it computes: left out of the bundle's key
VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "dtype", "torch_dtype", "use_cache", "output_attentions", "output_hidden_states",
    "return_dict", "attn_implementation", "experts_implementation",
})

CALIBRATE_DEFAULTS = {name: p.default for name, p in inspect.signature(calibrate).parameters.items()
                      if name in SETTINGS}
_reused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {settings: CachedRotations}


def shipped_text() -> str:
    """The public-domain Austen excerpt shipped with oscar-hf (Emma, about 60K SmolLM2 tokens)."""
    return SHIPPED_TEXT.read_text(encoding="utf-8")


def rotations_cache_dir() -> Path:
    """Where bundles made on demand live: ``$HF_HOME/oscar-hf/rotations`` (read when called)."""
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HOME") or constants.HF_HOME).expanduser() / "oscar-hf" / "rotations"


@dataclass
class CachedRotations:
    """A bundle made on demand: the rotations, their folder, and whether this call calibrated them."""

    rotations: OscarRotations
    path: Path
    calibrated: bool  # made by this call (else read from ``path``)
    seconds: float  # this call's calibration time (0 when read)
    recipe: str | None  # the recipe whose settings it used (None: calibrate's defaults)
    settings: dict  # the calibration settings


def calibration_settings(model, num_tokens: int | None = None, recipe: str | Recipe | None = "auto"
                         ) -> tuple[Recipe | None, dict, OscarConfig]:
    """(the recipe, the calibration settings, the cache config) for a bundle made on demand for ``model``.

    ``recipe``: "auto" (the model's recipe, if any), None (calibrate's defaults), a recipe name or file, or a Recipe.
    ``num_tokens``: the budget; default ``DEFAULT_TOKENS`` (or the recipe's, if smaller).
    """
    if recipe == "auto":
        recipe = recipe_for_model(model)
    elif isinstance(recipe, str):
        recipe = load_recipe(recipe)
    settings = {**CALIBRATE_DEFAULTS, **(recipe.calibrate_kwargs() if recipe else {})}
    settings["num_tokens"] = num_tokens or min(settings["num_tokens"], DEFAULT_TOKENS)
    return recipe, settings, (recipe.cache if recipe else OscarConfig())


def config_fingerprint(config) -> dict:
    """``config.to_dict()`` without what says how the model was loaded (its name, dtype, attention, versions)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()
                    if not str(k).startswith("_") and k not in VOLATILE_CONFIG_KEYS}
        return value

    return strip(config.to_dict())


def bundle_folder(model, settings: dict, config: OscarConfig, token_ids: torch.Tensor,
                  cache_dir: str | os.PathLike | None = None, diagnostic_tokens: int = 0,
                  choose_layout: bool = False, key_codebook_bits: Sequence[int] = ()) -> Path:
    """``<cache_dir>/<model>/<revision>-<key>`` (module docstring); ``cache_dir`` defaults to
    :func:`rotations_cache_dir`."""
    name = model_name(model)
    label = Path(name).name if name and Path(name).expanduser().is_dir() else name.replace("/", "--")
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", label).strip("._") or "unnamed"
    revision = re.sub(r"[^A-Za-z0-9._-]+", "_", str(getattr(model.config, "_commit_hash", None) or "local"))


    payload = {
        "format": 1,
        "oscar_hf": __version__,
        "model": config_fingerprint(model.config),
        "calibration": {**settings, "diagnostic_tokens": diagnostic_tokens,
                        **({"choose_layout": True} if choose_layout else {}),
                        **({"key_codebook_bits": sorted(key_codebook_bits)} if key_codebook_bits else {})},
        "cache": config.to_dict(),
        "tokens": hashlib.sha256(token_ids.to(torch.int64).numpy().tobytes()).hexdigest(),
    }
    key = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return Path(cache_dir or rotations_cache_dir()).expanduser() / label / f"{revision}-{key}"


def load_tokenizer(model):
    """The tokenizer saved with ``model`` (loaded from its name or path), or a ValueError saying to pass one."""
    from transformers import AutoTokenizer

    name = model_name(model)
    if not name:
        raise ValueError("calibrating needs a tokenizer: pass tokenizer= (the model records no name to load one from)")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ValueError(f"calibrating needs a tokenizer, and none loads from {name!r} ({err}); pass tokenizer=") \
            from None


def cached_rotations(
    model: torch.nn.Module,
    tokenizer=None,
    texts=None,
    *,
    num_tokens: int | None = None,
    recipe: str | Recipe | None = "auto",
    diagnostic_tokens: int = 0,
    cache_dir: str | os.PathLike | None = None,
    show_progress: bool = True,
    key_codebook_bits: Sequence[int] = (),
) -> CachedRotations:
    """The rotations for ``model`` from its folder in the cache (module docstring), calibrated first if there is none.

    Args:
        tokenizer: the model's tokenizer; default: loaded from the model's name or path.
        texts: calibration text (strings, a ``datasets.Dataset`` with a "text" column, or token-id tensors);
            default: the Austen excerpt shipped with oscar-hf.
        num_tokens, recipe: see :func:`calibration_settings`.
        diagnostic_tokens: held-out tokens for the bundle's per-layer diagnostics (0: none).
        cache_dir: the folder that holds the bundles; default :func:`rotations_cache_dir`.
        key_codebook_bits: product-quantized key codebooks the bundle must hold (:mod:`oscar_hf.codebooks`).
    """
    key_codebook_bits = tuple(sorted(set(key_codebook_bits)))
    memo_key = (num_tokens, recipe if not isinstance(recipe, Recipe) else recipe.name, diagnostic_tokens,
                str(Path(cache_dir or rotations_cache_dir()).expanduser()), key_codebook_bits)
    reused = _reused.get(model, {}).get(memo_key) if texts is None else None
    if reused is not None:
        return CachedRotations(reused.rotations, reused.path, False, 0.0, reused.recipe, reused.settings)
    recipe, settings, config = calibration_settings(model, num_tokens, recipe)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model)
    data = SHIPPED_TEXT_NAME if texts is None else "texts given to oscar_hf"
    # no hand-written layout: calibration chooses one (latent attention has one layout: one latent per token)
    choose = recipe is None and ModelShape.from_config(model.config).latent is None
    if choose:
        diagnostic_tokens = max(diagnostic_tokens, CHOICE_TOKENS)
    ids = calibration_token_ids(tokenizer, [shipped_text()] if texts is None else texts, settings["num_tokens"],
                                settings["max_length"], diagnostic_tokens)
    held_out = first_held_out_length(tokenizer, ids, settings["num_tokens"], settings["max_length"])
    if choose and held_out <= config.sink_tokens + config.recent_tokens:
        logger.warning("oscar-hf: the calibration text leaves %d held-out tokens, too few to choose a layout (more "
                       "than %d): the default layout", held_out, config.sink_tokens + config.recent_tokens)
        choose = False
    path = bundle_folder(model, settings, config, ids, cache_dir, diagnostic_tokens, choose, key_codebook_bits)
    name = model_name(model) or type(model).__name__
    recipe_name = recipe.name if recipe else None
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent, STALE_BUILD_SECONDS)
    with _lock(path, name):  # processes that start together: one calibrates, the others read its bundle
        rotations = _read(path)
        if rotations is None and path.exists():  # a broken bundle (or stray files): ours to replace
            shutil.rmtree(path)
        if rotations is not None:
            logger.warning("oscar-hf: rotations for %s from %s (calibrated earlier; delete the folder to recalibrate)",
                           name, path)
            found = CachedRotations(rotations, path, False, 0.0, recipe_name, settings)
        else:
            logger.warning(
                "oscar-hf: no rotation bundle given: calibrating %s once, on %d tokens of %s with %s; the bundle goes "
                "to %s", name, settings["num_tokens"], data,
                f"the recipe {recipe_name!r}" if recipe else "the default settings", path)
            start = time.perf_counter()
            rotations = calibrate(model, tokenizer, [ids], **settings, diagnostic_tokens=diagnostic_tokens,
                                  config=config, show_progress=show_progress, choose_layout=choose,
                                  key_codebook_bits=key_codebook_bits)
            seconds = time.perf_counter() - start
            rotations.source_model = model_name(model) or None
            rotations.calibration.update(data=data, recipe=recipe_name, tokens_sha256=hashlib.sha256(
                ids.to(torch.int64).numpy().tobytes()).hexdigest())
            rotations.save_pretrained(path)  # atomic; the lock keeps other processes out
            logger.warning("oscar-hf: calibrated in %.1f s; saved the bundle to %s", seconds, path)
            found = CachedRotations(rotations, path, True, seconds, recipe_name, settings)
    if texts is None:
        _reused.setdefault(model, {})[memo_key] = found
    return found


def rotations_for_model(model: torch.nn.Module, tokenizer=None, texts=None, **kwargs) -> OscarRotations:
    """The rotations for ``model``: read from the cache folder, or calibrated once and saved there
    (:func:`cached_rotations`, which takes the same arguments)."""
    return cached_rotations(model, tokenizer, texts, **kwargs).rotations


def _read(path: Path) -> OscarRotations | None:
    """The bundle in ``path``, or None where there is none (or a broken one, which is then made again)."""
    if not path.is_dir():
        return None
    try:
        return OscarRotations.from_pretrained(path)
    except (OSError, ValueError) as err:
        logger.warning("oscar-hf: the bundle in %s is unreadable (%s); calibrating again", path, err)
        return None


def _lock(path: Path, name: str):
    """``<path>.lock`` acquired, for a ``with`` (the wait logged where another process holds it)."""
    lock = FileLock(f"{path}.lock")
    try:
        return lock.acquire(timeout=0)
    except Timeout:
        logger.warning("oscar-hf: another process is calibrating %s into %s; waiting for its bundle", name, path)
        return lock.acquire()
