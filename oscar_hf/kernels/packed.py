"""PackedKV: one layer's packed K/V storage, the one type every kernel and every torch twin reads and writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..quantizer import QuantizedRows, grid_for

if TYPE_CHECKING:
    from ..codebooks import KeyCodebook


@dataclass
class PackedKV:
    """The sequence ``sink ‖ history ‖ recent`` of one layer, per batch row and KV head.

    The windows hold K and V as the model produced them; the history holds them rotated (``x @ R``, the basis the
    quantizer works in), so that attention over tokens that never reach the history is the model's own.

    Attributes:
        sink_k, sink_v: the first tokens, model dtype ``[B, H, S, D]`` (``S`` rows of capacity).
        recent_k, recent_v: the newest tokens, model dtype ``[B, H, R, D]``: a ring buffer whose oldest token is
            row ``counts[3]``.
        key, value: the rotated history as ``QuantizedRows``: codes uint8 ``[B, H, N, D·bits/8]``; scale and zero
            ``[B, H, N, D/group_size]`` per token (zero ``[B, H, N, 0]`` where the symmetric quantizer implies it),
            ``[B, H, ⌈N/key_token_group⌉, D]`` for per-channel K, or ``[B, H, N, 0]`` for product-quantized K (whose
            codes are one byte per subspace of its codebook).
        counts: sink, history and recent tokens and the ring start: an int32 tensor ``[4]`` or ``[8]`` (a static
            layer's, on the device; ``[4:8]`` the counts before its last graph step), or a tuple of ints.
        key_bits, value_bits: code widths (2 or 4; product-quantized K: 1 or 2 bits per element).
        group_size: channels per scale and zero of a per-token row.
        key_center, value_center: fp32 ``[B, H, 1, D]`` where the history stores ``x − μ``, else None.
        key_token_group: None for per-token K; for per-channel K, the tokens that share a K scale row.
        key_rotation, value_rotation: the history's bases in the model dtype: ``R [D, D]`` (every KV head's) or
            ``[H, D, D]`` (one per KV head; query head ``h·g + r`` reads KV head ``h``'s), or None (identity).
        key_codebook: the codebook of product-quantized K, else None.
    """

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    recent_k: torch.Tensor
    recent_v: torch.Tensor
    key: QuantizedRows
    value: QuantizedRows
    counts: torch.Tensor | tuple[int, ...]
    key_bits: int
    value_bits: int
    group_size: int
    key_center: torch.Tensor | None = None
    value_center: torch.Tensor | None = None
    key_token_group: int | None = None
    key_rotation: torch.Tensor | None = None
    value_rotation: torch.Tensor | None = None
    key_codebook: KeyCodebook | None = None

    @property
    def windows(self) -> list[torch.Tensor]:
        """``[sink K, sink V, recent K, recent V]``, the order the kernels take them in."""
        return [self.sink_k, self.sink_v, self.recent_k, self.recent_v]

    @property
    def history(self) -> list[torch.Tensor]:
        """``[K codes, K scale, K zero, V codes, V scale, V zero]``."""
        return [*self.key, *self.value]

    @property
    def centers(self) -> list[torch.Tensor]:
        """``[μ_K, μ_V]`` where both sides are centered, else ``[]``: the kernels center both sides or neither
        (ValueError where only one side is)."""
        if self.key_center is None and self.value_center is None:
            return []
        if self.key_center is None or self.value_center is None:
            raise ValueError("the kernels center both K and V or neither; this storage centers one side only")
        return [self.key_center, self.value_center]

    def side(self, side: str) -> tuple[torch.Tensor, torch.Tensor, QuantizedRows, torch.Tensor | None, int]:
        """``(sink, recent, history rows, center, bits)`` of ``side`` ("key" or "value")."""
        if side not in ("key", "value"):
            raise ValueError(f"side must be 'key' or 'value'; got {side!r}")
        if side == "key":
            return self.sink_k, self.recent_k, self.key, self.key_center, self.key_bits
        return self.sink_v, self.recent_v, self.value, self.value_center, self.value_bits

    def rotation(self, side: str) -> torch.Tensor | None:
        """The history basis of ``side`` (None: identity)."""
        return self.key_rotation if side == "key" else self.value_rotation

    def lengths(self) -> tuple[int, int, int, int]:
        """``(sink, history, recent, ring start)`` as ints (reading device counts synchronises)."""
        counts = self.counts.tolist() if isinstance(self.counts, torch.Tensor) else self.counts
        return tuple(int(c) for c in counts[:4])

    def device_counts(self) -> torch.Tensor:
        """The counts as an int32 tensor on the storage's device (the tensor itself where it is one)."""
        if isinstance(self.counts, torch.Tensor):
            return self.counts
        return torch.tensor(self.counts[:4], dtype=torch.int32, device=self.device)

    @property
    def per_token_keys(self) -> bool:
        """Whether K is stored per token with a scale and zero (what the kernels read)."""
        return self.key_token_group is None and self.key_codebook is None

    @property
    def head_dim(self) -> int:
        return self.sink_k.shape[-1]

    @property
    def heads(self) -> int:
        return self.sink_k.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.sink_k.dtype

    @property
    def device(self) -> torch.device:
        return self.sink_k.device

    @property
    def history_bytes_per_token(self) -> int:
        """Bytes of K and V codes, scales and zeros per history token."""
        key_group = self.key_token_group or 1
        return sum(rows.codes.shape[-1] + (rows.scale.shape[-1] * rows.scale.element_size()
                                           + rows.zero.shape[-1] * rows.zero.element_size()) // group
                   for rows, group in ((self.key, key_group), (self.value, 1)))

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, *, sink: int, history: int, recent: int,
              dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu", key_bits: int = 2,
              value_bits: int = 2, group_size: int | None = None, scale_dtype: torch.dtype = torch.float16,
              centered: bool = False, key_token_group: int | None = None,
              key_rotation: torch.Tensor | None = None, value_rotation: torch.Tensor | None = None,
              quantizer: str = "uniform") -> "PackedKV":
        """Uninitialised storage of the given capacities (tokens) with zero counts: for kernels and benchmarks
        that need no cache. ``quantizer``: the per-token rows' (``OscarConfig.quantizer``), which decides how they
        store scale and zero; per-channel K stores them in ``scale_dtype``."""
        group = group_size or head_dim
        grid = grid_for(quantizer)

        def rows(bits: int, tokens_per_row: int, columns: int) -> QuantizedRows:
            meta = (batch, heads, -(-history // tokens_per_row), columns)
            per_token = tokens_per_row == 1
            scale_dt, zero_dt = grid.meta_dtypes(scale_dtype) if per_token else (scale_dtype, scale_dtype)
            zeros = columns * (grid.stores_zero or not per_token)
            return QuantizedRows(torch.empty(batch, heads, history, head_dim * bits // 8, dtype=torch.uint8,
                                             device=device),
                                 torch.empty(meta, dtype=scale_dt, device=device),
                                 torch.empty(*meta[:3], zeros, dtype=zero_dt, device=device))

        key_columns = head_dim // group if key_token_group is None else head_dim
        window = [torch.empty(batch, heads, n, head_dim, dtype=dtype, device=device) for n in (sink, sink, recent,
                                                                                                recent)]
        center = [torch.zeros(batch, heads, 1, head_dim, device=device) if centered else None for _ in range(2)]
        return cls(*window, rows(key_bits, key_token_group or 1, key_columns), rows(value_bits, 1, head_dim // group),
                   (0, 0, 0, 0), key_bits, value_bits, group, *center, key_token_group, key_rotation,
                   value_rotation)
