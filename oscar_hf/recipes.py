"""Per-model recipes: calibration settings and OscarConfig, one YAML file per model family (recipes/)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from .config import OscarConfig

# Installed wheels carry recipes/ as oscar_hf/_recipes; a source checkout has it beside the package.
RECIPE_DIRS = (Path(__file__).parent / "_recipes", Path(__file__).parent.parent / "recipes")
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
