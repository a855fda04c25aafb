"""oscar-hf: OSCAR 2-bit KV-cache quantization for Hugging Face Transformers.

Data flow: calibrate → OscarRotations → OscarQuantizedCache → "oscar" attention → kernels.
"""

from .attention import oscar_attention_forward, register
from .cache import OscarKV, OscarLayer, OscarQuantizedCache, enable
from .config import OscarConfig
from .model_support import ModelShape, UnsupportedModelError, check_model_supported
from .rotations import OscarRotations, hadamard_matrix

__version__ = "0.1.0"

register()

__all__ = [
    "ModelShape",
    "OscarConfig",
    "OscarKV",
    "OscarLayer",
    "OscarQuantizedCache",
    "OscarRotations",
    "UnsupportedModelError",
    "check_model_supported",
    "enable",
    "hadamard_matrix",
    "oscar_attention_forward",
    "register",
]
