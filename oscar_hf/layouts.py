"""K layouts: how the history stores keys. One strategy object per layout owns the buffer shapes, quantize and
dequantize, the demotion unit and centering; ``OscarConfig.key_layout`` picks it by ``key_quantization``. V is always
stored per token. Product-quantized keys read a layer's :class:`~oscar_hf.codebooks.KeyCodebook` (``codebook=``);
the other layouts take none."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .kernels import quantize_kv, write_backend
from .kernels.write.reference import check_center
from .quantizer import QuantizedRows, dequantize, dequantize_per_channel, quantize, quantize_per_channel

if TYPE_CHECKING:
    from .codebooks import KeyCodebook


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
    key_bits: tuple[int, ...] = (2, 4)  # the K bits it stores
    uses_codebook = False

    def token_group(self, config) -> int | None:
        """Tokens that share one row of K's scale and zero: None where each token has its own
        (``PackedKV.key_token_group``)."""
        raise NotImplementedError

    def tokens_per_scale_row(self, config) -> int:
        """Tokens per row of K's scale and zero."""
        return self.token_group(config) or 1

    def scale_columns(self, head_dim: int, group_size: int) -> int:
        """Columns of K's scale and zero per row."""
        raise NotImplementedError

    def values_per_scale(self, config, group_size: int) -> int:
        """K elements that share one scale and zero (bits-per-element accounting)."""
        raise NotImplementedError

    def demotion_unit(self, config) -> int:
        """The history grows by multiples of this many tokens."""
        return self.tokens_per_scale_row(config)

    def quantize(self, key: torch.Tensor, *, bits: int, clip: float, group_size: int, config,
                 codebook: KeyCodebook | None = None) -> QuantizedRows:
        """K ``[..., N, D]`` (N a multiple of the demotion unit) in this layout."""
        raise NotImplementedError

    def dequantize(self, rows: QuantizedRows, bits: int, codebook: KeyCodebook | None = None) -> torch.Tensor:
        """:meth:`quantize`'s rows back to fp32 ``[..., N, D]``."""
        raise NotImplementedError

    def writer(self, config, device: torch.device, codebook: KeyCodebook | None = None):
        """The K/V writer of a layer on ``device`` (``kernels.write_backend``'s signature)."""
        raise NotImplementedError


class PerTokenKeys(KeyLayout):
    """K like V: one scale and zero per token and group of ``group_size`` channels; clipped and centered like V, and
    served by every kernel."""

    name = "per-token"
    centered = True

    def token_group(self, config) -> int | None:
        return None

    def scale_columns(self, head_dim: int, group_size: int) -> int:
        return head_dim // group_size

    def values_per_scale(self, config, group_size: int) -> int:
        return group_size

    def quantize(self, key, *, bits, clip, group_size, config, codebook=None):
        return quantize(key, bits=bits, group_size=group_size, clip=clip, scale_dtype=config.torch_scale_dtype,
                        method=config.quantizer)

    def dequantize(self, rows, bits, codebook=None):
        return dequantize(rows, bits)

    def writer(self, config, device, codebook=None):
        return write_backend(config.backend, device)


class PerChannelKeys(KeyLayout):
    """KIVI's key layout: one scale and zero per channel and group of ``flush_tokens`` consecutive tokens, which reach
    the history whole. Not clipped (clipping is per token) and not centered (each group takes out its channels'
    offsets); read by dequantizing before SDPA."""

    name = "per-channel"
    needs = {"k_clip": (1.0, "clipping is per token"), "quantizer": ("uniform", "its grid is min-max per channel")}
    centered = False

    def token_group(self, config):
        return config.flush_tokens

    def scale_columns(self, head_dim, group_size):
        return head_dim

    def values_per_scale(self, config, group_size):
        return config.flush_tokens

    def quantize(self, key, *, bits, clip, group_size, config, codebook=None):
        return quantize_per_channel(key, token_group=config.flush_tokens, bits=bits,
                                    scale_dtype=config.torch_scale_dtype)

    def dequantize(self, rows, bits, codebook=None):
        return dequantize_per_channel(rows, bits)

    def writer(self, config, device, codebook=None):
        def write(key, value, **kwargs):
            return quantize_kv(key, value, key_token_group=self.token_group(config), **kwargs)

        return write


class ProductKeys(KeyLayout):
    """Product-quantized K (:mod:`oscar_hf.codebooks`): per token, one byte per subspace of 8 (1 bit) or 4 (2 bits)
    channels against the layer's codebook (``D·bits/8`` bytes, as packed codes), no scale or zero; centered, never
    clipped. Read by dequantizing before SDPA; V is stored per token as in the other layouts (``quantizer.quantize``,
    as the torch writer does)."""

    name = "product"
    needs = {"k_clip": (1.0, "codebook keys are not clipped"),
             "centering": (True, "the codebooks are trained on centered keys")}
    centered = True
    key_bits = (1, 2)
    uses_codebook = True

    def token_group(self, config):
        return None

    def scale_columns(self, head_dim, group_size):
        return 0

    def values_per_scale(self, config, group_size):
        return math.inf  # no scale

    @staticmethod
    def _codebook(codebook, bits: int):
        if codebook is None:
            raise ValueError("product-quantized keys need the layer's codebook: calibrate the bundle with "
                             "key_codebook_bits (oscar-hf calibrate --key-codebooks)")
        if codebook.bits != bits:
            raise ValueError(f"a {codebook.bits}-bit codebook cannot store {bits}-bit keys")
        return codebook

    def quantize(self, key, *, bits, clip, group_size, config, codebook=None):
        codes = self._codebook(codebook, bits).encode(key)
        empty = torch.empty(*codes.shape[:-1], 0, dtype=config.meta_dtypes[0], device=codes.device)
        return QuantizedRows(codes, empty, empty)

    def dequantize(self, rows, bits, codebook=None):
        return self._codebook(codebook, bits).decode(rows.codes)

    def writer(self, config, device, codebook=None):
        codebook = self._codebook(codebook, config.side_bits["key"]).to(device)

        def write(key, value, *, bits, key_bits, group_size, k_clip, v_clip, scale_dtype, method, key_center=None,
                  value_center=None):
            if key_center is not None:
                key = key.float() - check_center(key, key_center)
            if value_center is not None:
                value = value.float() - check_center(value, value_center)
            keys = self.quantize(key, bits=key_bits, clip=k_clip, group_size=group_size, config=config,
                                 codebook=codebook)
            values = quantize(value, bits=bits, group_size=group_size, clip=v_clip, scale_dtype=scale_dtype,
                              method=method)
            return keys, values

        return write


KEY_LAYOUTS: dict[str, KeyLayout] = {layout.name: layout for layout in (PerTokenKeys(), PerChannelKeys(),
                                                                        ProductKeys())}
