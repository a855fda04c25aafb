"""oscar-hf: OSCAR 2-bit KV-cache quantization for Hugging Face Transformers.

Data flow: calibrate → OscarRotations → OscarQuantizedCache → "oscar" attention → kernels.
"""

from .absorb import absorb_latent_rotation, absorb_value_rotation
from .attention import oscar_attention_forward, register
from .autocalibrate import rotations_for_model
from .cache import DynamicOscarLayer, OscarKV, OscarLayer, OscarQuantizedCache, StaticOscarLayer, enable
from .calibrate import calibrate
from .config import OscarConfig
from .diagnostics import diagnose
from .generation import overlapped_sample
from .kernels import PackedKV
from .model_support import ModelShape, UnsupportedModelError, cache_kwargs, check_model_supported
from .recipes import load_recipe
from .rotations import OscarRotations, hadamard_matrix

__version__ = "0.1.0"

register()

__all__ = [
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
