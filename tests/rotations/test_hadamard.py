"""hadamard_matrix at every head_dim: the Sylvester matrix at powers of two, Paley-based Hadamard matrices where a
Paley order divides head_dim (48, 80, 96, 112, 192), a Hartley block elsewhere; and the bit-reversal order."""

import pytest
import torch

from oscar_hf.hadamard import bit_reversal_order, hadamard_matrix

POWERS_OF_TWO = [1, 2, 4, 64, 128, 256, 512]
REAL_HEAD_DIMS = [48, 80, 96, 112, 192]  # 16·3, 16·5, 32·3, 16·7, 64·3
HARTLEY = [3, 6, 7, 10, 14, 18]  # 2^k·m with k < 2, or no Paley order 2^j·m (j >= 2) up to n


def sylvester(n: int) -> torch.Tensor:
    """The natural-order Sylvester matrix divided by √n, by its recursion H_2n = [[H, H], [H, -H]]."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


@pytest.mark.parametrize("n", POWERS_OF_TWO + REAL_HEAD_DIMS + HARTLEY + [12, 20, 28, 100, 320], ids=lambda n: f"n{n}")
def test_orthonormal_float64_and_deterministic(n):
    h = hadamard_matrix(n)
    assert h.shape == (n, n) and h.dtype == torch.float64
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(h, hadamard_matrix(n))


@pytest.mark.parametrize("n", POWERS_OF_TWO, ids=lambda n: f"n{n}")
def test_powers_of_two_give_the_sylvester_matrix(n):
    assert torch.equal(hadamard_matrix(n), sylvester(n))


@pytest.mark.parametrize("n", [12, 20, 24, 28, 40, *REAL_HEAD_DIMS], ids=lambda n: f"n{n}")
def test_paley_orders_spread_every_channel_evenly(n):
    """Every entry ±1/√n: each rotated channel takes an equal share of every input channel's energy."""
    torch.testing.assert_close(hadamard_matrix(n).abs(), torch.full((n, n), n**-0.5, dtype=torch.float64),
                               rtol=1e-14, atol=0)


@pytest.mark.parametrize("n", HARTLEY, ids=lambda n: f"n{n}")
def test_hartley_blocks_leave_no_channel_out(n):
    """No Hadamard matrix of order n: no entry is zero, none above √2/√n."""
    h = hadamard_matrix(n).abs() * n**0.5
    assert h.min() > 0.1 and h.max() <= 2**0.5 + 1e-12


@pytest.mark.parametrize("n", [0, -4, 96.0], ids=repr)
def test_rejects_what_is_not_a_positive_integer(n):
    with pytest.raises(ValueError, match="head_dim"):
        hadamard_matrix(n)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 12, 80, 96, 192, 7], ids=lambda n: f"n{n}")
def test_bit_reversal_order(n):
    order = bit_reversal_order(n)
    assert torch.equal(order.sort().values, torch.arange(n))
    if n & (n - 1) == 0:
        bits = n.bit_length() - 1
        assert order.tolist() == [int(f"{i:0{bits}b}"[::-1] or "0", 2) for i in range(n)]


def test_bit_reversal_order_reverses_mixed_radix_digits():
    """12 = 4·3: i = 3a + b goes to 4b + bitrev(a)."""
    assert bit_reversal_order(12).tolist() == [0, 4, 8, 2, 6, 10, 1, 5, 9, 3, 7, 11]
