"""Tensor parallelism (transformers' ``tp_plan``): which KV heads this process holds, and gathering them.

Under ``from_pretrained(..., tp_plan="auto")`` run with torchrun, the K and V projections are split by output rows
across the ranks of the model's tensor-parallel mesh, so rank ``r`` of ``n`` computes, caches and attends over KV
heads ``[r·H/n, (r+1)·H/n)`` of each layer (and their query groups). The cache keeps those heads, with their slice of
per-head rotations; calibration gathers all the heads on every rank, so every rank computes the whole bundle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a model's tensor-parallel mesh: ``rank`` of ``size``, and the mesh's process group
    (None where nothing is gathered, as in a cache built from a plain ``(rank, size)``)."""

    rank: int
    size: int
    group: object = None

    def __post_init__(self):
        if not (isinstance(self.size, int) and isinstance(self.rank, int) and 0 <= self.rank < self.size):
            raise ValueError(f"tensor parallelism needs 0 <= rank < size; got rank {self.rank!r} of {self.size!r}")

    @classmethod
    def of(cls, model: torch.nn.Module) -> "TensorParallel | None":
        """The tensor-parallel place of a model loaded with ``tp_plan`` (None for a model on one process or on a
        ``device_map``)."""
        mesh, size = getattr(model, "_device_mesh", None), getattr(model, "_tp_size", None)
        if mesh is None or not size or size == 1:
            return None
        if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
            mesh = mesh["tp"]
        if mesh.ndim != 1:
            raise ValueError(f"the model's device mesh {mesh} has no 1-D 'tp' dimension")
        return cls(mesh.get_local_rank(), mesh.size(), mesh.get_group())

    def heads(self, total: int) -> slice:
        """The slice of ``total`` KV heads this rank holds (contiguous, as a column-wise split of the projection)."""
        if total % self.size:
            raise ValueError(f"{total} KV heads do not split evenly over {self.size} tensor-parallel ranks")
        per_rank = total // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def is_split(self, local: int, total: int) -> bool:
        """Whether a layer whose process holds ``local`` of its ``total`` heads has them split over the ranks (False:
        each rank computes them all, as where a plan replicates the attention)."""
        if local == total:
            return False
        if local * self.size != total:
            raise ValueError(f"this rank holds {local} of {total} heads, neither all nor a 1/{self.size} share")
        return True

    def all_heads(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """``x [B, h, ...]`` with all ``total`` heads: every rank's share joined along dim 1 in rank order where the
        heads are split (:meth:`is_split`), else ``x`` itself."""
        if not self.is_split(x.shape[1], total):
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of ``x`` over the ranks (a mean over each rank's equal share of heads is the mean over all)."""
        x = x.clone()
        torch.distributed.all_reduce(x, group=self.group)
        return x / self.size
