"""oscar-hf: OSCAR 2-bit KV-cache quantization for Hugging Face Transformers.

Data flow: calibrate → OscarRotations → OscarQuantizedCache → "oscar" attention → kernels. Importing the package
loads none of its calibration modules or Triton kernels (and works without triton): ``calibrate``, ``diagnose`` and
``rotations_for_model`` load theirs on first use, a kernel on its first launch.
"""

import importlib
import sys
import types

from .absorb import absorb_latent_rotation, absorb_value_rotation
from .attention import oscar_attention_forward, register
from .cache import DynamicOscarLayer, OscarKV, OscarLayer, OscarQuantizedCache, StaticOscarLayer, enable
from .config import OscarConfig
from .generation import overlapped_sample
from .kernels import PackedKV
from .model_support import ModelShape, UnsupportedModelError, cache_kwargs, check_model_supported
from .recipes import load_recipe
from .rotations import OscarRotations, hadamard_matrix
from .version import __version__


class _Package(types.ModuleType):
    """The package, whose calibration functions load their modules on first use."""


def _lazy(name: str, module: str) -> property:
    def get(self):
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)

    def keep(self, value) -> None:
        """The import system binds the submodule ``calibrate`` here: the function stays."""

    return property(get, keep)


_CALIBRATION = {"calibrate": "calibrate", "diagnose": "diagnostics", "rotations_for_model": "autocalibrate"}
for _name, _module in _CALIBRATION.items():
    setattr(_Package, _name, _lazy(_name, _module))
sys.modules[__name__].__class__ = _Package


def _rotations_on_demand(model, tokenizer, texts):
    from .autocalibrate import rotations_for_model

    return rotations_for_model(model, tokenizer, texts)


OscarQuantizedCache.rotations_on_demand = staticmethod(_rotations_on_demand)
register()

__all__ = [
    "__version__",
    "absorb_latent_rotation",
    "absorb_value_rotation",
    "cache_kwargs",
    "calibrate",
    "diagnose",
    "DynamicOscarLayer",
    "load_recipe",
    "ModelShape",
    "OscarConfig",
    "OscarKV",
    "OscarLayer",
    "OscarQuantizedCache",
    "OscarRotations",
    "PackedKV",
    "StaticOscarLayer",
    "UnsupportedModelError",
    "check_model_supported",
    "enable",
    "hadamard_matrix",
    "oscar_attention_forward",
    "overlapped_sample",
    "register",
    "rotations_for_model",
]
