"""The append kernel (one token into a static layer's storage: store, rotate and demote the oldest window rows,
advance the device counts) against its torch twin, over PackedKVs built without a cache: on the CPU under
TRITON_INTERPRET=1 (set by conftest.py), or compiled on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from helpers import signed_hadamard  # noqa: E402
from packed_inputs import DEVICE  # noqa: E402

from oscar_hf.kernels import PackedKV  # noqa: E402
from oscar_hf.kernels import flags as kernel_flags  # noqa: E402
from oscar_hf.kernels.append import reference as append_reference  # noqa: E402
from oscar_hf.kernels.append import triton as append_triton  # noqa: E402


@pytest.mark.parametrize("dim, key_bits, centered, clips, per_head, quantizer",
                         [(64, 2, True, (0.96, 0.92), False, "uniform"), (256, 4, False, (1.0, 1.0), False, "uniform"),
                          (64, 2, True, (0.96, 0.92), True, "uniform"), (64, 4, True, (0.96, 0.92), False, "symmetric"),
                          (64, 2, True, (0.96, 0.92), False, "compact")],
                         ids=["D64-centered-clipped", "D256-k4", "D64-per-head", "D64-k4-symmetric", "D64-compact"])
def test_append_kernel_equals_its_torch_twin(dim, key_bits, centered, clips, per_head, quantizer):
    """The append kernel and its twin over PackedKVs built without a cache: the same windows, history, means,
    counts, flags and rotated queries after every step, through sink, window, demotions and a full cache, with a
    shared rotation or one per KV head. K/V and q are multiples of 1/4 below 64 and the rotations signed Hadamard
    permutations, so every sum is exact."""
    batch, heads, groups, sink, recent, flush, max_len = 2, 2, 2, 2, 3, 2, 14
    generator = torch.Generator().manual_seed(5)
    rotation = signed_hadamard(dim, heads if per_head else None, seed=5).to(torch.bfloat16).to(DEVICE)

    def storage():
        packed = PackedKV.empty(batch, heads, dim, sink=sink, history=max_len - sink - recent, recent=recent + flush,
                                device=DEVICE, key_bits=key_bits, centered=centered, quantizer=quantizer)
        for t in (*packed.windows, *packed.history, *packed.centers):
            t.zero_()
        packed.counts = torch.tensor([0, 0, 0, 0, -1, -1, -1, -1], dtype=torch.int32, device=DEVICE)
        return packed, torch.zeros(2, dtype=torch.int32, device=DEVICE)

    (got, got_flags), (want, want_flags) = storage(), storage()
    ints = torch.randint(-255, 256, (3, max_len + 2, batch, heads * groups, 1, dim), generator=generator)
    steps = (ints / 4).to(torch.bfloat16).to(DEVICE)
    kwargs = dict(max_len=max_len, sink_tokens=sink, limit=recent + flush - 1, flush=flush, k_clip=clips[0],
                  v_clip=clips[1], key_rotation=rotation, value_rotation=rotation.mT.contiguous())
    for key, value, query in zip(*steps):
        key, value = key[:, :heads], value[:, :heads]
        q_got = append_triton.append(got, key, value, flags=got_flags, query=query, **kwargs)
        q_want = append_reference.append(want, key, value, flags=want_flags, query=query, **kwargs)
        assert torch.equal(q_got, q_want)
        assert torch.equal(got.counts, want.counts) and torch.equal(got_flags, want_flags)
        for a, b in zip((*got.windows, *got.history, *got.centers), (*want.windows, *want.history, *want.centers)):
            assert torch.equal(a, b)
    assert got.lengths()[1] > 0 and got_flags[0].item() == kernel_flags.FULL  # demoted, and ended full
