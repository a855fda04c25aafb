"""The dequantize kernel (a PackedKV's history back to the model dtype, for attention over a prefill chunk)
against its torch twin, over storage built from plain tensors by the torch writer: on the CPU under
TRITON_INTERPRET=1 (set by conftest.py), or compiled on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from packed_inputs import DEVICE, DTYPE_IDS, pack, randn  # noqa: E402

from oscar_hf.kernels import dequantize_backend  # noqa: E402
from oscar_hf.kernels.dequantize import triton as dequantize_triton  # noqa: E402
from oscar_hf.kernels.dequantize.reference import materialize  # noqa: E402
from oscar_hf.kernels.dequantize.triton import supports_rows  # noqa: E402
from oscar_hf.quantizer import QUANTIZERS, quantize  # noqa: E402


@pytest.mark.parametrize(
    "dtype, bits, group, centering, key_bits",
    [(torch.float16, 2, None, True, None), (torch.float16, 4, 32, False, None), (torch.float32, 2, 64, True, None),
     (torch.bfloat16, 2, None, True, None), (torch.float16, 2, None, True, 4)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_dequantize_kernel_equals_materialize(dtype, bits, group, centering, key_bits):
    """Every split point of sink | history | recent; a recent window rolled by graph steps (its oldest row is row
    5). fp16/fp32 bit-identical; bf16 within one ulp (TRITON_INTERPRET=1 rounds fp32 → bf16 toward zero; the GPU
    rounds to nearest even)."""
    kv = randn(2, 2, 3, 203, 128, seed=11).to(dtype)
    packed = pack(kv[0], kv[1], sink=8, recent=16, ring_start=5, centering=centering, bits=bits, key_bits=key_bits,
                  group_size=group)
    new = randn(2, 3, 5, 128, seed=12).to(dtype)
    sink, hist, recent, _ = packed.lengths()
    assert (sink, recent) == (8, 16) and hist > 100
    for past in (0, 3, sink, sink + 1, 100, sink + hist, sink + hist + 2, sink + hist + recent):
        for side in ("key", "value"):
            got = materialize(packed, side, past, new=new, fill=dequantize_triton.fill_history)
            want = torch.cat([materialize(packed, side)[:, :, :past], new], dim=2)  # the whole sequence, sliced
            assert got.shape == want.shape == (2, 3, past + 5, 128) and got.dtype == dtype
            if dtype == torch.bfloat16:
                torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
                assert (got != want).float().mean() < 0.5  # (not everything off by rounding)
            else:
                assert torch.equal(got, want), (past, side)


def test_dequantize_backend_falls_back_to_the_twin_where_the_kernel_cannot_serve():
    """Rows of 48 channels at 2 bits are 12 bytes, not a power of two: the "triton" reader uses the twin."""
    assert supports_rows(64, 2) and supports_rows(512, 2) and not supports_rows(48, 2)
    rows = quantize(randn(1, 1, 9, 48, seed=5), bits=2, group_size=48)
    got, want = (torch.empty(1, 1, 9, 48, device=DEVICE) for _ in range(2))
    dequantize_backend("triton", torch.device(DEVICE))(rows, None, got, bits=2)
    dequantize_backend("torch", torch.device(DEVICE))(rows, None, want, bits=2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype, bits", [(torch.float16, 2), (torch.float32, 4)], ids=["fp16-int2", "fp32-int4"])
@pytest.mark.parametrize("quantizer", ["symmetric", "compact"])
def test_dequantize_kernel_metadata_formats(dtype, bits, quantizer):
    """Rows with implied zeros (the symmetric quantizer) or byte scales and zeros (the compact one) read as the
    twin reads them, bit for bit."""
    kv = randn(2, 1, 2, 90, 64, seed=3).to(dtype)
    packed = pack(kv[0], kv[1], sink=4, recent=8, bits=bits, quantizer=quantizer)
    assert packed.key.meta == packed.value.meta == QUANTIZERS[quantizer].meta
    for side in ("key", "value"):
        got = materialize(packed, side, fill=dequantize_triton.fill_history)
        assert torch.equal(got, materialize(packed, side)), side
