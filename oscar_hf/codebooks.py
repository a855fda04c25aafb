"""Product-quantized keys: per-layer codebooks trained offline on rotated, centered keys (1 or 2 bits per element).

A history key ``x [D]`` (in the layer's rotated basis, centered) is first turned into ``z = (x @ B) · w``: ``B`` the
eigenvectors of the keys' second moment (descending), so that each subspace holds correlated channels, and ``w`` the
root of the queries' mean square along each channel of that basis (``diag(Bᵀ E[qqᵀ] B)``), so that the nearest
centroid is, channel by channel, the one that changes the logits ``q·x`` least. ``z`` is cut into ``S = D / sub``
subspaces of ``sub`` channels, and each is stored as the one byte index of its nearest of 256 centroids: ``8 / sub``
bits per element (sub 8: 1 bit, sub 4: 2 bits), with no scale or zero. The key is read back as ``(c / w) @ Bᵀ``.

Keys are quantized per token, so any number of tokens can reach the history at once; the codebooks are fixed, so a
key far outside the calibration keys' range is read back at the nearest centroid.
:func:`oscar_hf.calibrate.train_key_codebooks` captures the keys on calibration text and runs a weighted k-means per
subspace.
"""

from __future__ import annotations

import torch

CENTROIDS = 256  # one byte per subspace
CODEBOOK_BITS = (1, 2)  # bits per element: subspaces of 8 or 4 channels
ENCODE_ELEMENTS = 1 << 24  # distances computed at once while encoding (bounds the temporary's memory)


class KeyCodebook:
    """One layer's product-quantization codebook.

    Args:
        centroids: fp32 ``[Hc, S, 256, D/S]`` in the weighted basis (``Hc`` = 1, shared by the KV heads, or one per
            KV head).
        basis: fp32 orthogonal ``[Hc, D, D]``: the codebook's channels in the layer's rotated basis.
        weight: fp32 ``[Hc, D]``, positive: each basis channel's weight ``w``.
    """

    def __init__(self, centroids: torch.Tensor, basis: torch.Tensor, weight: torch.Tensor):
        if centroids.ndim != 4 or centroids.shape[2] != CENTROIDS:
            raise ValueError(f"centroids must be [heads, subspaces, {CENTROIDS}, channels]; got "
                             f"{tuple(centroids.shape)}")
        heads, subspaces, _, sub = centroids.shape
        dim = subspaces * sub
        if tuple(basis.shape) != (heads, dim, dim) or tuple(weight.shape) != (heads, dim):
            raise ValueError(f"a codebook of centroids {tuple(centroids.shape)} needs basis {(heads, dim, dim)} and "
                             f"weight {(heads, dim)}; got {tuple(basis.shape)} and {tuple(weight.shape)}")
        if 8 % sub or 8 // sub not in CODEBOOK_BITS:
            raise ValueError(f"codebook subspaces of {sub} channels: expected 8 or 4 (1 or 2 bits per element)")
        if not bool((weight > 0).all()):
            raise ValueError("codebook weights must be positive")
        self.centroids, self.basis, self.weight = centroids.float(), basis.float(), weight.float()

    @property
    def heads(self) -> int:
        return self.centroids.shape[0]

    @property
    def head_dim(self) -> int:
        return self.basis.shape[-1]

    @property
    def subspaces(self) -> int:
        return self.centroids.shape[1]

    @property
    def bits(self) -> int:
        """Bits per element: 8 bits per subspace of ``D / S`` channels."""
        return 8 * self.subspaces // self.head_dim

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"centroids": self.centroids, "basis": self.basis, "weight": self.weight}

    def to(self, device: torch.device | str) -> "KeyCodebook":
        return KeyCodebook(*(t.to(device) for t in self.tensors().values()))

    def clone(self) -> "KeyCodebook":
        return KeyCodebook(*(t.detach().clone() for t in self.tensors().values()))

    def select_heads(self, index: torch.Tensor | slice) -> "KeyCodebook":
        """The codebook of some KV heads (a per-head codebook's; a shared one is returned as is)."""
        if self.heads == 1:
            return self
        return KeyCodebook(*(t[index] for t in self.tensors().values()))

    def _check(self, heads: int, dim: int) -> None:
        if dim != self.head_dim or self.heads not in (1, heads):
            raise ValueError(f"a codebook of {self.heads} head(s) and head_dim {self.head_dim} does not fit keys of "
                             f"{heads} heads and head_dim {dim}")

    def _weighted(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, H, N, D]`` → ``z [B, H, N, S, sub]``, fp32."""
        z = (x.float() @ self.basis.to(x.device)) * self.weight.to(x.device)[:, None, :]
        return z.unflatten(-1, (self.subspaces, -1))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rotated, centered keys ``[B, H, N, D]`` (any float dtype) → codes uint8 ``[B, H, N, S]``: each subspace's
        nearest centroid in the weighted basis. Raises ValueError on NaN or inf."""
        batch, heads, tokens, dim = x.shape
        self._check(heads, dim)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("cannot quantize K rows that contain NaN or inf")
        codes = torch.empty(batch, heads, tokens, self.subspaces, dtype=torch.uint8, device=x.device)
        centroids = self.centroids.to(x.device)[None]  # [1, Hc, S, C, sub]
        squared = (centroids**2).sum(-1)  # [1, Hc, S, C]
        step = max(1, ENCODE_ELEMENTS // max(1, batch * heads * self.subspaces * CENTROIDS))
        for start in range(0, tokens, step):
            z = self._weighted(x[:, :, start : start + step])  # [B, H, n, S, sub]
            # |z - c|² less |z|²: [B, H, n, S, C]
            distance = squared[:, :, None] - 2 * torch.einsum("bhnsd,bhscd->bhnsc", z, centroids.expand(
                batch, heads, -1, -1, -1))
            codes[:, :, start : start + step] = distance.argmin(-1).to(torch.uint8)
        return codes

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes uint8 ``[B, H, N, S]`` → keys fp32 ``[B, H, N, D]`` in the layer's rotated basis (still centered)."""
        batch, heads, tokens, subspaces = codes.shape
        self._check(heads, self.head_dim)
        if subspaces != self.subspaces:
            raise ValueError(f"codes of {subspaces} subspaces for a codebook of {self.subspaces}")
        head = torch.arange(heads, device=codes.device)[:, None, None] if self.heads > 1 else 0
        space = torch.arange(subspaces, device=codes.device)
        z = self.centroids.to(codes.device)[head, space, codes.long()]  # [B, H, N, S, sub]
        return (z.flatten(-2) / self.weight[:, None, :].to(codes.device)) @ self.basis.mT.to(codes.device)

    def __repr__(self) -> str:
        return f"KeyCodebook({self.bits}-bit, heads={self.heads}, head_dim={self.head_dim})"


def _kmeans(z: torch.Tensor, generator: torch.Generator, iterations: int) -> torch.Tensor:
    """Centroids ``[256, sub]`` of the points ``z [N, sub]`` (Lloyd's iterations from random points; an empty
    cluster restarts at a random point)."""
    n = z.shape[0]
    pick = torch.randint(n, (CENTROIDS,), generator=generator, device="cpu").to(z.device)
    centroids = z[pick].clone()
    for _ in range(iterations):
        assign = torch.cdist(z, centroids).argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, z)
        counts = torch.bincount(assign, minlength=CENTROIDS)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None].float()
        empty = int((~filled).sum())
        if empty:
            centroids[~filled] = z[torch.randint(n, (empty,), generator=generator, device="cpu").to(z.device)]
    return centroids


def fit_codebook(keys: torch.Tensor, query_moment: torch.Tensor, bits: int, *, iterations: int = 20,
                 seed: int = 0) -> KeyCodebook:
    """A codebook for keys ``[Hc, N, D]`` (rotated, centered; ``Hc`` = 1 pools every KV head) whose queries have the
    second moment ``query_moment [Hc, D, D]`` in the rotated basis."""
    if bits not in CODEBOOK_BITS:
        raise ValueError(f"product-quantized keys take {' or '.join(map(str, CODEBOOK_BITS))} bits; got {bits!r}")
    heads, n, dim = keys.shape
    sub = 8 // bits
    if dim % sub:
        raise ValueError(f"head_dim {dim} is not a multiple of {sub} ({bits}-bit codebook subspaces)")
    if n < CENTROIDS:
        raise ValueError(f"a codebook needs at least {CENTROIDS} keys per head; got {n}")
    generator = torch.Generator().manual_seed(seed)
    keys = keys.double()
    centroids, bases, weights = [], [], []
    for h in range(heads):
        _, vectors = torch.linalg.eigh(keys[h].mT @ keys[h])
        basis = vectors.flip(-1)  # descending: each subspace holds channels of similar variance
        power = (basis * (query_moment[h].double() @ basis)).sum(0)  # diag(Bᵀ M B): queries' mean square per channel
        weight = (power / power.mean()).clamp_min(1e-6).sqrt()
        z = ((keys[h] @ basis) * weight).float()
        centroids.append(torch.stack([_kmeans(part.contiguous(), generator, iterations) for part in z.split(sub, -1)]))
        bases.append(basis.float())
        weights.append(weight.float())
    return KeyCodebook(torch.stack(centroids), torch.stack(bases), torch.stack(weights))
