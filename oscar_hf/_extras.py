"""Optional packages: each is imported where it is used, never by ``import oscar_hf``, and a missing one fails
naming the pip extra that installs it."""

from __future__ import annotations

import importlib
import importlib.util

# top-level module -> (its pip package, the oscar-hf extra that installs it); pyproject.toml must agree
EXTRAS = {
    "matplotlib": ("matplotlib", "plots"),
    "gguf": ("gguf", "demo"),
    "lm_eval": ("lm-eval", "lm-eval"),
    "datasets": ("datasets", "datasets"),
    "optimum": ("optimum-quanto", "baselines"),
    "hqq": ("hqq", "baselines"),
}


class MissingExtraError(ImportError):
    """An optional package is not installed; the message names the extra that installs it."""


def install_hint(module: str, purpose: str) -> str:
    """``"<purpose> needs <package>: pip install "oscar-hf[<extra>]""`` for ``module`` (dotted names allowed)."""
    package, extra = EXTRAS[module.split(".")[0]]
    return f'{purpose} needs {package}: pip install "oscar-hf[{extra}]"'


def require(module: str, purpose: str):
    """``importlib.import_module(module)``, or a MissingExtraError naming the extra if the package is absent (an
    installed package that fails to import raises its own error)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        parts = module.split(".")
        if err.name not in {".".join(parts[: i + 1]) for i in range(len(parts))}:
            raise
        raise MissingExtraError(install_hint(module, purpose)) from err


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (its parent packages may be)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):  # a parent package missing, or blocked (None in sys.modules)
        return False


def pyplot(purpose: str):
    """``matplotlib.pyplot`` on the Agg backend (files, no display), or a MissingExtraError naming "plots"."""
    require("matplotlib", purpose).use("Agg")
    return importlib.import_module("matplotlib.pyplot")
