"""Per-model recipes: calibration settings and OscarConfig, one YAML file per model family (recipes/)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from .config import OscarConfig

# Installed wheels carry recipes/ as oscar_hf/_recipes; a source checkout has it beside the package.
RECIPE_DIRS = (Path(__file__).parent / "_recipes", Path(__file__).parent.parent / "recipes")
# model_type -> the recipe for a model of that family that no recipe names (recipe_for_model)
FAMILY_RECIPES = {"gemma3": "gemma-3", "gemma3_text": "gemma-3"}
CALIBRATION_KEYS = ("data", "num_tokens", "max_length", "k_target", "v_target", "composition", "eigen_order",
                    "per_head")


@dataclasses.dataclass
class Recipe:
    """A model family's recipe: the model id, calibration settings and cache config."""

    name: str
    model: str
    calibration: dict
    cache: OscarConfig
    notes: str = ""

    def calibrate_kwargs(self) -> dict:
        """The calibration settings that ``oscar_hf.calibrate`` takes as keyword arguments."""
        return {k: v for k, v in self.calibration.items() if k != "data"}


def _recipe_file(name: str) -> Path | None:
    return next((d / f"{name}.yaml" for d in RECIPE_DIRS if (d / f"{name}.yaml").is_file()), None)


def available_recipes() -> list[str]:
    return sorted({p.stem for d in RECIPE_DIRS if d.is_dir() for p in d.glob("*.yaml")})


def recipe_for_model(model) -> Recipe | None:
    """The shipped recipe for ``model`` (a model, a config, or a name or path), or None.

    A recipe fits a model whose name is the recipe's ``model`` (e.g. "Qwen/Qwen3-8B"), ignoring case, or whose
    folder or repo name starts with the last part of it (a local "/models/Qwen3-8B", the converted
    "smollm2-135m-instruct-<hash>" of oscar_hf.models); the longest such match wins. Else a model of a family in
    ``FAMILY_RECIPES`` (by its text config's ``model_type``) gets that family's recipe.
    """
    name = model if isinstance(model, str) else model_name(model)
    recipe = _recipe_by_name(name) if name else None
    if recipe is None and not isinstance(model, str):
        config = getattr(model, "config", model)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        family = FAMILY_RECIPES.get(getattr(text, "model_type", None))
        recipe = load_recipe(family) if family else None
    return recipe


def _recipe_by_name(name: str) -> Recipe | None:
    name = name.rstrip("/").lower()
    base = name.rsplit("/", 1)[-1]
    best, best_length = None, 0
    for recipe in map(load_recipe, available_recipes()):
        wanted = recipe.model.lower()
        if name == wanted:
            return recipe
        stem = wanted.rsplit("/", 1)[-1]
        if base.startswith(stem) and len(stem) > best_length:
            best, best_length = recipe, len(stem)
    return best


def model_name(model) -> str:
    """The name or path a model (or config) was loaded from ("" when it records none)."""
    config = getattr(model, "config", model)
    return getattr(model, "name_or_path", None) or getattr(config, "_name_or_path", None) or ""


def load_recipe(name_or_path: str) -> Recipe:
    """Load a shipped recipe by name (e.g. "qwen3-8b") or a YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        text, name = path.read_text(), path.stem
    else:
        file = _recipe_file(name_or_path)
        if file is None:
            raise ValueError(f"unknown recipe {name_or_path!r}; shipped recipes: {available_recipes()}")
        text, name = file.read_text(), name_or_path
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"recipe {name!r} must be a YAML mapping with at least a 'model' key")
    unknown = sorted(set(data.get("calibration") or {}) - set(CALIBRATION_KEYS))
    if unknown:
        raise ValueError(f"recipe {name!r}: unknown calibration key(s) {unknown}; known: {list(CALIBRATION_KEYS)}")
    return Recipe(
        name=name,
        model=data["model"],
        calibration=dict(data.get("calibration") or {}),
        cache=OscarConfig.from_dict(data.get("cache") or {}),
        notes=str(data.get("notes", "")).strip(),
    )
