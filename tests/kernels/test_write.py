"""The write kernel (clip, center, quantize, pack K/V rows) against the quantizer and the torch writer, bit for bit:
on the CPU under TRITON_INTERPRET=1 (set by conftest.py), or compiled on a GPU."""

import pytest
import torch

pytest.importorskip("triton")

from packed_inputs import DEVICE, DTYPE_IDS, assert_same_rows, randn  # noqa: E402

from oscar_hf.kernels import quantize_kv  # noqa: E402
from oscar_hf.kernels.write.triton import quantize_pack, quantize_pack_kv  # noqa: E402
from oscar_hf.kernels.write.triton import supports as write_supports  # noqa: E402
from oscar_hf.quantizer import BYTE_META, quantize  # noqa: E402

WRITE_SHAPES = {
    "D128-int2": (128, 2, None, 0.96, 0.92), "D64-int2-g32": (64, 2, 32, 0.96, 1.0),
    "D256-int2-g64": (256, 2, 64, 0.9, 0.92), "D128-int4-g64": (128, 4, 64, 1.0, 0.96),
    "D128-int2-low-clips": (128, 2, None, 97 / 128, 0.75),
}


def pairwise_dtypes(shapes: dict) -> list:
    """Each shape with each input dtype, the scale dtype cycling so that every (shape, scale dtype) and every
    (input dtype, scale dtype) pair occurs too: 15 cases covering every pair of the 45 of the full product."""
    dtypes = list(DTYPE_IDS)
    return [pytest.param(*shape, x, dtypes[(i + j) % 3], id=f"{name}-{DTYPE_IDS[x]}-{DTYPE_IDS[dtypes[(i + j) % 3]]}")
            for i, (name, shape) in enumerate(shapes.items()) for j, x in enumerate(dtypes)]


@pytest.mark.parametrize("d, bits, group, k_clip, v_clip, x_dtype, scale_dtype", pairwise_dtypes(WRITE_SHAPES))
def test_write_kernel_equals_quantizer(d, bits, group, k_clip, v_clip, x_dtype, scale_dtype):
    """Codes, scale and zero are bit-identical: τ is the sort's (low clips: K's 30 values above τ are the most the
    kernel takes in turn, V's 31 go to bisection), every fp32 operation is the same."""
    x = randn(2, 2, 2, 37, d, seed=d + bits)
    x[..., ::16] *= 20  # outlier channels, as in real keys
    key, value = x.to(x_dtype).unbind(0)
    kwargs = dict(bits=bits, group_size=group, scale_dtype=scale_dtype)
    got_k, got_v = quantize_pack_kv(key, value, k_clip=k_clip, v_clip=v_clip, **kwargs)
    assert_same_rows(got_k, quantize(key, clip=k_clip, **kwargs))
    assert_same_rows(got_v, quantize(value, clip=v_clip, **kwargs))


@pytest.mark.parametrize("key_bits, bits, group", [(4, 2, None), (2, 4, 64)], ids=["k4v2", "k2v4-g64"])
def test_write_kernel_key_bits(key_bits, bits, group):
    """K and V at different bits in one launch: each side equals the quantizer at its own bits."""
    key, value = randn(2, 3, 2, 29, 128, seed=key_bits).to(torch.bfloat16).unbind(0)
    kwargs = dict(group_size=group, scale_dtype=torch.float16)
    got_k, got_v = quantize_pack_kv(key, value, bits=bits, key_bits=key_bits, k_clip=0.96, v_clip=0.92, **kwargs)
    assert got_k.codes.shape[-1] == 128 * key_bits // 8 and got_v.codes.shape[-1] == 128 * bits // 8
    assert_same_rows(got_k, quantize(key, bits=key_bits, clip=0.96, **kwargs))
    assert_same_rows(got_v, quantize(value, bits=bits, clip=0.92, **kwargs))


def test_write_kernel_ties_strides_and_edge_rows():
    """Rows full of ties (values on a 1/4 grid), constant rows, a strided [B, H, n, D] view, zero rows."""
    ties = (randn(64, 128, seed=1) * 4).round() / 4
    constant = torch.tensor([[0.0] * 128, [300.0] * 128, [-1.5] * 128], device=DEVICE)
    for x in (ties, constant):
        assert_same_rows(quantize_pack(x, clip=0.9), quantize(x, clip=0.9))
    window = randn(2, 3, 40, 64, seed=2).to(torch.bfloat16)
    key, value = window[:, :, 5:30], window[:, :, 11:36]  # the cache's demoted slices are views like these
    got_k, got_v = quantize_pack_kv(key, value, k_clip=0.96, v_clip=0.92)
    assert_same_rows(got_k, quantize(key, clip=0.96))
    assert_same_rows(got_v, quantize(value, clip=0.92))
    assert quantize_pack(torch.empty(2, 0, 64, device=DEVICE)).codes.shape == (2, 0, 16)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_write_kernel_centers_rows_as_the_torch_writer(x_dtype):
    """``key_center``/``value_center``: the kernel subtracts the fp32 means from the loaded rows, bit for bit what
    the torch writer stores (``x.float() - μ``), on strided views, with one side centered or both."""
    window = (randn(2, 2, 3, 50, 128, seed=8) * 3 + 1).to(x_dtype)
    key, value = window[0, :, :, 4:41], window[1, :, :, 9:46]
    centers = [x.mean(dim=2, keepdim=True, dtype=torch.float32) for x in (key, value)]
    kwargs = dict(k_clip=0.96, v_clip=0.92, scale_dtype=torch.float16)
    for key_center, value_center in ((centers[0], centers[1]), (None, centers[1])):
        got = quantize_pack_kv(key, value, key_center=key_center, value_center=value_center, **kwargs)
        want = quantize_kv(key, value, key_center=key_center, value_center=value_center, **kwargs)
        for g, w in zip(got, want):
            assert_same_rows(g, w)
    assert_same_rows(got[1], quantize(value.float() - centers[1], clip=0.92))
    with pytest.raises(ValueError, match="center must be float32 of shape"):
        quantize_pack_kv(key, value, key_center=centers[0][:, :1], **kwargs)


def test_write_kernel_falls_back_to_the_oracle():
    x = randn(8, 128, seed=3)
    assert_same_rows(quantize_pack(x, method="lloyd-max"), quantize(x, method="lloyd-max"))
    x96 = randn(8, 96, seed=4)  # not a power of two
    assert_same_rows(quantize_pack(x96, clip=0.96), quantize(x96, clip=0.96))
    # a group narrower than a channel sub-tile (INT4 at D=128: W = 64 > 32)
    assert not write_supports(x, 32, "uniform", 4) and write_supports(x, 64, "uniform", 4)
    assert_same_rows(quantize_pack(x, bits=4, group_size=32), quantize(x, bits=4, group_size=32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy meets the NaN/inf in the interpreter
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_write_kernel_rejects_non_finite(bad):
    key, value = randn(2, 64, seed=5), randn(2, 64, seed=6)
    value[1, 5] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_pack_kv(key, value)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_write_kernel_rejects_scale_overflow():
    x = randn(2, 64, seed=7)
    x[0, :2] = torch.tensor([1e6, -1e6], device=DEVICE)
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_pack(x, scale_dtype=torch.float16)
    assert_same_rows(quantize_pack(x, scale_dtype=torch.float32), quantize(x, scale_dtype=torch.float32))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_write_kernel_rejects_a_byte_scale_overflow():
    """Steps past the compact quantizer's largest byte scale raise as the quantizer does, naming the fix."""
    x = randn(2, 64, seed=7)
    x[0, :2] = torch.tensor([1e6, -1e6], device=DEVICE)
    with pytest.raises(ValueError, match="compact quantizer's scale range.*quantizer='uniform'"):
        quantize_pack(x, method="compact")
    with pytest.raises(ValueError, match="compact quantizer's scale range"):
        quantize(x, method="compact")


@pytest.mark.parametrize("d, bits, group, clip, offset", [(128, 2, None, 0.96, 0.0), (64, 4, 32, 1.0, 3.0),
                                                          (256, 2, 64, 0.92, -40.0), (64, 2, None, 1.0, 1e-5)],
                         ids=["D128-int2", "D64-int4-g32-offset", "D256-int2-g64-offset", "D64-tiny"])
def test_write_kernel_compact_quantizer(d, bits, group, clip, offset):
    """The compact grid: byte scales and int8 zeros bit-identical to the quantizer's, codes alike, centred or not,
    rows offset far from 0 (zeros near int8's ends) and tiny ones (scales at the byte floor)."""
    scale = 1e-6 if offset == 1e-5 else 1.0
    key, value = (randn(2, 2, 3, 21, d, seed=d) * scale + offset).to(torch.bfloat16).unbind(0)
    center = randn(2, 3, 1, d, seed=1)
    kwargs = dict(bits=bits, group_size=group, scale_dtype=torch.float16, method="compact")
    assert write_supports(key, group or d, "compact", bits)
    got_k, got_v = quantize_pack_kv(key, value, k_clip=clip, v_clip=clip, key_center=center, **kwargs)
    want_k, want_v = quantize_kv(key, value, k_clip=clip, v_clip=clip, key_center=center, **kwargs)
    assert got_k.scale.dtype == torch.uint8 and got_v.zero.dtype == torch.int8 and got_k.meta == BYTE_META
    assert_same_rows(got_k, want_k)
    assert_same_rows(got_v, want_v)


@pytest.mark.parametrize("d, bits, group, clip", [(128, 2, None, 0.96), (64, 4, 32, 1.0), (256, 2, 64, 0.92)],
                         ids=["D128-int2", "D64-int4-g32", "D256-int2-g64"])
def test_write_kernel_symmetric_quantizer(d, bits, group, clip):
    """The symmetric grid: scales bit-identical to the quantizer's, no zeros stored, codes alike, centred or not."""
    key, value = randn(2, 2, 3, 21, d, seed=d).to(torch.bfloat16).unbind(0)
    center = randn(2, 3, 1, d, seed=1)
    kwargs = dict(bits=bits, group_size=group, scale_dtype=torch.float16, method="symmetric")
    assert write_supports(key, group or d, "symmetric", bits) and not write_supports(key, d, "lloyd-max", 2)
    got_k, got_v = quantize_pack_kv(key, value, k_clip=clip, v_clip=clip, key_center=center, **kwargs)
    want_k, want_v = quantize_kv(key, value, k_clip=clip, v_clip=clip, key_center=center, **kwargs)
    assert got_k.zero.shape == (2, 3, 21, 0) and got_k.implied_zero
    assert_same_rows(got_k, want_k)
    assert_same_rows(got_v, want_v)
