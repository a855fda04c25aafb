"""K layouts: how the history stores keys. One strategy object per layout owns the buffer shapes, quantize and
dequantize, the demotion unit and centering; ``OscarConfig.key_layout`` picks it by ``key_quantization``. V is always
stored per token."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .kernels import quantize_kv, write_backend
from .quantizer import QuantizedRows, dequantize, dequantize_per_channel, quantize, quantize_per_channel

if TYPE_CHECKING:
    from .config import OscarConfig


class KeyLayout:
    """The storage of K's history.

    Attributes:
        name: the ``OscarConfig.key_quantization`` value.
        needs: what the layout needs of other config fields: ``{field: (value, why)}``.
        centered: whether K is centered (``x - μ``) when ``OscarConfig.centering`` is on.
    """

    name: str
    needs: dict[str, tuple[object, str]] = {}
    centered: bool

    def token_group(self, config: OscarConfig) -> int | None:
        """Tokens that share one row of K's scale and zero: None where each token has its own
        (``PackedKV.key_token_group``)."""
        raise NotImplementedError

    def tokens_per_scale_row(self, config: OscarConfig) -> int:
        """Tokens per row of K's scale and zero."""
        return self.token_group(config) or 1

    def scale_columns(self, head_dim: int, group_size: int) -> int:
        """Columns of K's scale and zero per row."""
        raise NotImplementedError

    def values_per_scale(self, config: OscarConfig, group_size: int) -> int:
        """K elements that share one scale and zero (bits-per-element accounting)."""
        raise NotImplementedError

    def demotion_unit(self, config: OscarConfig) -> int:
        """The history grows by multiples of this many tokens."""
        return self.tokens_per_scale_row(config)

    def quantize(self, key: torch.Tensor, *, bits: int, clip: float, group_size: int,
                 config: OscarConfig) -> QuantizedRows:
        """K ``[..., N, D]`` (N a multiple of the demotion unit) in this layout."""
        raise NotImplementedError

    def dequantize(self, rows: QuantizedRows, bits: int) -> torch.Tensor:
        """:meth:`quantize`'s rows back to fp32 ``[..., N, D]``."""
        raise NotImplementedError

    def writer(self, config: OscarConfig, device: torch.device):
        """The K/V writer of a layer on ``device`` (``kernels.write_backend``'s signature)."""
        raise NotImplementedError


class PerTokenKeys(KeyLayout):
    """K like V: one scale and zero per token and group of ``group_size`` channels; clipped and centered like V, and
    served by every kernel."""

    name = "per-token"
    centered = True

    def token_group(self, config: OscarConfig) -> int | None:
        return None

    def scale_columns(self, head_dim: int, group_size: int) -> int:
        return head_dim // group_size

    def values_per_scale(self, config: OscarConfig, group_size: int) -> int:
        return group_size

    def quantize(self, key, *, bits, clip, group_size, config):
        return quantize(key, bits=bits, group_size=group_size, clip=clip, scale_dtype=config.torch_scale_dtype,
                        method=config.quantizer)

    def dequantize(self, rows, bits):
        return dequantize(rows, bits)

    def writer(self, config, device):
        return write_backend(config.backend, device)


class PerChannelKeys(KeyLayout):
    """KIVI's key layout: one scale and zero per channel and group of ``flush_tokens`` consecutive tokens, which reach
    the history whole. Not clipped (clipping is per token) and not centered (each group takes out its channels'
    offsets); read by dequantizing before SDPA."""

    name = "per-channel"
    needs = {"k_clip": (1.0, "clipping is per token"), "quantizer": ("uniform", "Lloyd-Max levels are per token")}
    centered = False

    def token_group(self, config):
        return config.flush_tokens

    def scale_columns(self, head_dim, group_size):
        return head_dim

    def values_per_scale(self, config, group_size):
        return config.flush_tokens

    def quantize(self, key, *, bits, clip, group_size, config):
        return quantize_per_channel(key, token_group=config.flush_tokens, bits=bits,
                                    scale_dtype=config.torch_scale_dtype)

    def dequantize(self, rows, bits):
        return dequantize_per_channel(rows, bits)

    def writer(self, config, device):
        def write(key, value, **kwargs):
            return quantize_kv(key, value, key_token_group=self.token_group(config), **kwargs)

        return write


KEY_LAYOUTS: dict[str, KeyLayout] = {layout.name: layout for layout in (PerTokenKeys(), PerChannelKeys())}
