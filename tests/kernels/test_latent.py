"""The absorbed multi-head latent attention (``kernels.latent.reference``) against attention over the latent
expanded through kv_b_proj, as the model computes it."""

import pytest
import torch

from oscar_hf.kernels.latent.reference import absorbed_attention


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("q_len, rotated, masked", [(1, False, False), (1, True, True), (3, True, False)],
                         ids=["step", "rotated-history-padded", "verify-3-causal"])
def test_absorbed_attention_equals_attention_over_the_expanded_latent(q_len, rotated, masked):
    batch, heads, nope, rope_dim, v_dim, rank = 2, 3, 8, 4, 6, 16
    total = 17
    latent = randn(batch, 1, total, rank, seed=1)  # in the basis kv_b_proj reads
    rope = randn(batch, 1, total, rope_dim, seed=2)
    weight = randn(heads * (nope + v_dim), rank, seed=3) / 4
    query = randn(batch, heads, q_len, nope + rope_dim, seed=4)
    basis = torch.linalg.qr(randn(rank, rank, seed=5)).Q if rotated else None
    stored = latent @ basis if rotated else latent
    mask = None
    if masked:
        mask = torch.ones(batch, 1, q_len, total + 3, dtype=torch.bool)  # (longer than the sequence, as padded)
        mask[1, :, :, :4] = False  # left padding: the second row's first tokens
    got = absorbed_attention(query.float(), rope.float(), stored.float(), weight.float(), nope_dim=nope,
                             attention_mask=mask, scaling=0.3, basis=None if basis is None else basis.float())
    # the model's way: K = [c·W_UKᵀ ‖ k_rope], V = c·W_UVᵀ per head, softmax attention (fp64)
    expanded = (latent @ weight.T).view(batch, total, heads, nope + v_dim).transpose(1, 2)
    key = torch.cat([expanded[..., :nope], rope.expand(-1, heads, -1, -1)], dim=-1)
    value = expanded[..., nope:]
    logits = 0.3 * query @ key.mT
    allowed = (torch.ones(q_len, total, dtype=torch.bool).tril(total - q_len) if mask is None
               else mask[..., :total])
    want = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ value
    assert got.shape == (batch, q_len, heads, v_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)
