"""Storage segments: preallocated rows of one layer's K/V (or latent) tensors, and how they grow."""

from __future__ import annotations

import torch

HISTORY_GROWTH = 1024  # tokens; a growing history grows by at least this much, or by an eighth of itself
# A growing history's capacities are multiples of this many tokens, so that growing cannot change whether the
# per-token scale/zero strides are divisible by 16, on which Triton specializes (and recompiles) the decode kernel.
HISTORY_ALIGN = 16


class Segment:
    """Preallocated rows of named tensors, along dim 2 of ``[B, H, rows, ...]``.

    Positions and capacities are in tokens. A tensor named in ``tokens_per_row`` has one row per that many tokens
    (per-channel K scales and zeros: one per token group); writes to it start at a multiple of that width.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], tokens_per_row: dict[str, int] | None = None):
        self.tensors = tensors
        self.tokens_per_row = tokens_per_row or {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def _width(self, name: str) -> int:
        return self.tokens_per_row.get(name, 1)

    def _rows(self, name: str, tokens: int) -> int:
        """Rows of tensor ``name`` that the first ``tokens`` tokens touch."""
        return -(-tokens // self._width(name))

    @property
    def capacity(self) -> int:
        return min(t.shape[2] * self._width(name) for name, t in self.tensors.items())

    def write(self, start: int, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            row = start // self._width(name)
            self.tensors[name][:, :, row : row + value.shape[2]] = value

    def read(self, stop: int, start: int = 0) -> dict[str, torch.Tensor]:
        """Every tensor's rows of tokens ``[start, stop)``."""
        return {name: t[:, :, start // self._width(name) : self._rows(name, stop)] for name, t in self.tensors.items()}

    def grow(self, used: int, capacity: int) -> None:
        for name, old in self.tensors.items():
            new = old.new_empty(*old.shape[:2], self._rows(name, capacity), *old.shape[3:])
            rows = self._rows(name, used)
            new[:, :, :rows] = old[:, :, :rows]
            self.tensors[name] = new

    def grow_history(self, used: int, needed: int) -> None:
        """Hold ``needed`` tokens, growing by at least HISTORY_GROWTH tokens or an eighth, to a multiple of
        HISTORY_ALIGN (a growing history, or a latent layer's RoPE key rows)."""
        capacity = self.capacity
        if needed > capacity:
            self.grow(used, aligned(max(needed, capacity + max(HISTORY_GROWTH, capacity // 8))))

    def grow_window(self, used: int, needed: int, limit: int) -> None:
        """Hold ``needed`` tokens, doubling, at most to ``limit`` (a sink or recent window)."""
        if needed > self.capacity:
            self.grow(used, min(limit, max(needed, 2 * self.capacity, 16)))

    def drop_front(self, used: int, tokens: int) -> None:
        """Drop the first ``tokens`` of the ``used`` ones (a multiple of every width), moving the rest to the front."""
        for name, t in self.tensors.items():
            start, stop = tokens // self._width(name), self._rows(name, used)
            t[:, :, : stop - start] = t[:, :, start:stop].clone()

    def map(self, fn) -> None:
        self.tensors = {name: fn(t) for name, t in self.tensors.items()}

    def used_bytes(self, used: int) -> int:
        return sum(t[:, :, : self._rows(name, used)].numel() * t.element_size() for name, t in self.tensors.items())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def aligned(tokens: int) -> int:
    """``tokens`` rounded up to a multiple of HISTORY_ALIGN."""
    return -(-tokens // HISTORY_ALIGN) * HISTORY_ALIGN


def tensor_bytes(*objects) -> int:
    """Bytes held by the tensors in ``objects``: tensor subclasses (quanto's) by their inner tensors; tuples, lists
    and dicts searched; anything else (None) counts nothing."""
    total = 0
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            inner = obj.__tensor_flatten__()[0] if hasattr(obj, "__tensor_flatten__") else None
            total += obj.numel() * obj.element_size() if inner is None else tensor_bytes(*(getattr(obj, n)
                                                                                           for n in inner))
        elif isinstance(obj, (tuple, list)):
            total += tensor_bytes(*obj)
        elif isinstance(obj, dict):
            total += tensor_bytes(*obj.values())
    return total
