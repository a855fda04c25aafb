"""Hadamard rotations of any order, and the bit-reversal order calibration's permutation factor uses.

A head_dim ``n = 2^k·m`` (``m`` odd) gets ``H_{2^t} ⊗ B`` divided by √n: a Sylvester (natural-order) Hadamard matrix
of order ``2^t`` times a block ``B`` of order ``n / 2^t``, scaled so that ``B Bᵀ`` is its order times the identity:

- ``m = 1``: ``B = [1]``, the Sylvester matrix of order n alone;
- else, where one exists, a Paley Hadamard matrix of order ``2^j·m`` (the smallest ``j >= 2``): Paley I over the
  prime field GF(q), ``q = 2^j·m − 1`` ≡ 3 (mod 4) (orders 12, 20, 24, 44, ...), or Paley II, ``q = 2^(j−1)·m − 1``
  ≡ 1 (mod 4) (orders 12, 28, 36, 60, ...). Every entry of the result is then ±1/√n: 48, 80, 96 and 192 are
  ``H ⊗`` Paley 12 or 20, 112 is ``H_4 ⊗`` Paley 28;
- else the Hartley matrix of order m, ``B[i, j] = cos(2πij/m) + sin(2πij/m)``, a real orthogonal matrix from the
  DFT with no zero entry (|entries| at most √2/√n), which spreads every channel over all n.
"""

from __future__ import annotations

import math

import torch


def _sylvester(n: int) -> torch.Tensor:
    """The ±1 Sylvester Hadamard matrix of order ``n`` (a power of two), natural order, float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _paley(order: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of ``order`` (a multiple of 4) by Paley I or II over a prime field, or None."""
    for q, kind in ((order - 1, 1), (order // 2 - 1, 2)):
        if not (_is_prime(q) and q % 4 == (3 if kind == 1 else 1)):
            continue
        residues = {x * x % q for x in range(1, q)}
        chi = torch.tensor([0.0] + [1.0 if r in residues else -1.0 for r in range(1, q)], dtype=torch.float64)
        c = torch.ones(q + 1, q + 1, dtype=torch.float64)  # the conference matrix [[0, 1ᵀ], [χ(−1)·1, Q]]
        c[0, 0] = 0
        c[1:, 0] = chi[q - 1]
        c[1:, 1:] = chi[(torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q]  # Jacobsthal Q[i, j] = χ(j − i)
        if kind == 1:
            return c + torch.eye(q + 1, dtype=torch.float64)
        a, b = torch.tensor([[[1.0, -1.0], [-1.0, -1.0]], [[1.0, 1.0], [1.0, -1.0]]], dtype=torch.float64)
        return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)
    return None


def _block(n: int) -> torch.Tensor:
    """The block ``B`` of ``hadamard_matrix(n)`` (see the module docstring), unnormalized."""
    twos = n & -n
    m = n // twos
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    for order in (m << j for j in range(2, twos.bit_length())):
        paley = _paley(order)
        if paley is not None:
            return paley
    angle = 2 * math.pi * (torch.outer(torch.arange(m), torch.arange(m)) % m).double() / m
    return torch.cos(angle) + torch.sin(angle)


def hadamard_matrix(n: int) -> torch.Tensor:
    """An orthonormal Hadamard-type matrix ``[n, n]`` (float64) for any head_dim ``n``: the Sylvester
    (natural-order) Walsh–Hadamard matrix divided by √n where n is a power of two, else a Sylvester matrix times a
    Paley Hadamard block, or times a Hartley block where no Paley order fits (see the module docstring).
    Deterministic; symmetric where n is a power of two."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"a Hadamard matrix needs a positive integer size; got head_dim={n!r}")
    block = _block(n)
    return torch.kron(_sylvester(n // block.shape[0]), block) / n**0.5


def bit_reversal_order(n: int) -> torch.Tensor:
    """``rev [n]`` (int64), a permutation of ``range(n)`` that sends neighbours far apart: for n a power of two, i
    with its bits reversed; for ``n = 2^k·m`` (m odd), i's mixed-radix digits reversed: ``i = a·m + b`` (``b <
    m``) goes to ``b·2^k + bitrev(a)``."""
    twos = n & -n
    m, bits = n // twos, twos.bit_length() - 1
    a = torch.tensor([int(f"{x:0{bits}b}"[::-1], 2) if bits else 0 for x in range(twos)])
    return (torch.arange(m)[None, :] * twos + a[:, None]).flatten()
