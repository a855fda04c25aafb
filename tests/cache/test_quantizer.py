"""oscar_hf.quantizer: packing layout, the uniform error bound, clipping, constant rows, Lloyd-Max, errors, shapes,
and per-channel (KIVI key) quantization."""

import pytest
import torch

from oscar_hf.quantizer import (
    BYTE_META,
    BYTE_SCALE_MAX,
    clip_rows,
    decode_byte_scale,
    dequantize,
    dequantize_per_channel,
    pack,
    quantize,
    quantize_per_channel,
    unpack,
)

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SCALE_DTYPES = list(DTYPE_IDS)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rows_with_outliers(*shape: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows in which every 16th channel is 20× larger, like the outlier channels of real keys."""
    x = randn(*shape, seed=seed)
    x[..., ::16] *= 20
    return x


# ---------------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"D{d}")
def test_pack_unpack_round_trip(bits, d):
    generator = torch.Generator().manual_seed(d + bits)
    codes = torch.randint(0, 2**bits, (3, 5, d), generator=generator, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, d * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
@pytest.mark.parametrize("d", [64, 128, 256], ids=lambda d: f"D{d}")
def test_pack_puts_channel_in_its_byte_and_offset(bits, d):
    """Channel j + k·D/n lands in byte j at bit offset k·bits (n = 8 / bits codes per byte)."""
    stride = d * bits // 8
    for channel in range(d):
        codes = torch.zeros(d, dtype=torch.uint8)
        codes[channel] = 2**bits - 1
        expected = torch.zeros(stride, dtype=torch.uint8)
        expected[channel % stride] = (2**bits - 1) << (channel // stride * bits)
        assert torch.equal(pack(codes, bits), expected), f"channel {channel}"


@pytest.mark.parametrize(
    "bits, codes, packed",
    [
        # D=8, INT2: byte 0 = channels 0, 2, 4, 6 and byte 1 = channels 1, 3, 5, 7 at bits 0, 2, 4, 6.
        pytest.param(2, [1, 2, 3, 0, 2, 1, 0, 3], [1 | 3 << 2 | 2 << 4, 2 | 1 << 4 | 3 << 6], id="int2"),
        # D=4, INT4: byte 0 = channels 0, 2 and byte 1 = channels 1, 3 at bits 0, 4.
        pytest.param(4, [1, 2, 15, 9], [1 | 15 << 4, 2 | 9 << 4], id="int4"),
    ],
)
def test_pack_hand_built_example(bits, codes, packed):
    codes, packed = torch.tensor(codes, dtype=torch.uint8), torch.tensor(packed, dtype=torch.uint8)
    assert torch.equal(pack(codes, bits), packed)
    assert torch.equal(unpack(packed, bits), codes)


# ------------------------------------------------------------------------------------- uniform quantizer
@pytest.mark.parametrize("clip", [1.0, 0.96], ids=lambda c: f"clip{c}")
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=lambda t: f"scale-{DTYPE_IDS[t]}")
@pytest.mark.parametrize("x_dtype", SCALE_DTYPES, ids=lambda t: f"x-{DTYPE_IDS[t]}")
@pytest.mark.parametrize("group", [32, 64, 128], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
def test_uniform_error_within_half_a_step_of_clipped_row(bits, group, x_dtype, scale_dtype, clip):
    x = rows_with_outliers(2, 3, 16, 128, seed=bits * group).to(x_dtype)
    q = quantize(x, bits=bits, group_size=group, clip=clip, scale_dtype=scale_dtype)
    assert q.scale.dtype == q.zero.dtype == scale_dtype
    target = clip_rows(x.float(), clip)
    error = (dequantize(q, bits) - target).abs().unflatten(-1, (128 // group, group))
    half_step = q.scale.float()[..., None] / 2
    assert bool((error <= half_step * (1 + 1e-5)).all()), float((error / half_step).max())


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=lambda t: DTYPE_IDS[t])
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
def test_uniform_range_is_rounded_outward(bits, scale_dtype):
    """zero <= group min and zero + levels·scale >= group max (up to fp32 arithmetic) in the scale dtype."""
    x = rows_with_outliers(64, 128, seed=5).unflatten(-1, (4, 32))
    q = quantize(x.flatten(-2), bits=bits, group_size=32, scale_dtype=scale_dtype)
    zero, scale = q.zero.float(), q.scale.float()
    fp32_slack = 4 * torch.finfo(torch.float32).eps * x.abs().amax(-1)
    assert bool((zero <= x.amin(-1)).all())
    assert bool((zero + (2**bits - 1) * scale >= x.amax(-1) - fp32_slack).all())


def test_quantize_clips_before_quantizing():
    x = rows_with_outliers(4, 128, seed=1)
    clipped, direct = quantize(clip_rows(x, 0.92)), quantize(x, clip=0.92)
    assert all(torch.equal(a, b) for a, b in zip(clipped, direct))
    assert not torch.equal(quantize(x).scale, direct.scale)


@pytest.mark.parametrize(
    "d, ratio, clamped",
    [
        pytest.param(64, 0.96, 2, id="D64-c0.96"),
        pytest.param(64, 0.92, 5, id="D64-c0.92"),
        pytest.param(128, 0.96, 5, id="D128-c0.96"),
        pytest.param(128, 0.92, 10, id="D128-c0.92"),
    ],
)
def test_clip_clamps_the_largest_entries_to_the_threshold(d, ratio, clamped):
    x = randn(8, d, seed=d)  # distinct |values| with probability 1
    assert x.abs().unique().numel() == x.numel()
    tau = x.abs().sort(-1).values[:, d - 1 - clamped, None]  # sort(|x|)[floor(ratio * D)]
    changed = clip_rows(x, ratio) != x
    assert changed.sum(-1).tolist() == [clamped] * 8
    assert torch.equal(changed, x.abs() > tau)
    assert torch.equal(clip_rows(x, ratio)[changed], (x.sign() * tau)[changed])


def test_clip_one_is_a_no_op():
    x = randn(8, 128)
    assert torch.equal(clip_rows(x, 1.0), x)


CONSTANT_ROWS = torch.tensor([[0.0] * 128, [300.0] * 128, [-1.5] * 128])
CONSTANT_GROUPS = torch.tensor([[0.0] * 32 + [300.0] * 32 + [-1.5] * 32 + [7.25] * 32])


@pytest.mark.parametrize(
    "rows, group", [pytest.param(CONSTANT_ROWS, None, id="rows"), pytest.param(CONSTANT_GROUPS, 32, id="groups")]
)
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=lambda t: DTYPE_IDS[t])
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
def test_constant_rows_and_groups_dequantize_exactly(bits, scale_dtype, rows, group):
    out = dequantize(quantize(rows, bits=bits, group_size=group, scale_dtype=scale_dtype), bits)
    assert torch.equal(out, rows)


# ----------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_non_finite_input_raises(bad):
    x = randn(2, 64)
    x[1, 5] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(x)


def test_value_too_large_for_float16_scale():
    x = randn(2, 64)
    x[0, :2] = torch.tensor([1e6, -1e6])
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize(x, scale_dtype=torch.float16)
    q = quantize(x, scale_dtype=torch.float32)
    assert torch.isfinite(q.scale).all() and torch.isfinite(q.zero).all()
    assert bool(((dequantize(q, 2) - x).abs() <= q.scale / 2 * (1 + 1e-5)).all())  # one group per row


def test_unknown_method_raises():
    with pytest.raises(ValueError, match="kmeans"):
        quantize(randn(2, 64), method="kmeans")


# ------------------------------------------------------------------------------------------- symmetric
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=lambda t: DTYPE_IDS[t])
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
def test_symmetric_grid_stores_no_zero_and_stays_within_half_a_step(bits, scale_dtype):
    """Scale ``2·max|x|/levels`` rounded up, zero implied ``-scale·levels/2``: every element within scale/2."""
    x = rows_with_outliers(3, 16, 128, seed=bits)
    q = quantize(x, bits=bits, group_size=32, clip=0.96, scale_dtype=scale_dtype, method="symmetric")
    assert q.zero.shape == (3, 16, 0) and q.scale.shape == (3, 16, 4) and q.implied_zero
    levels = 2**bits - 1
    torch.testing.assert_close(q.zeros(bits), -q.scale.float() * levels / 2, rtol=0, atol=0)
    target = clip_rows(x, 0.96)
    error = (dequantize(q, bits) - target).abs().unflatten(-1, (4, 32))
    assert bool((error <= q.scale.float()[..., None] / 2 * (1 + 1e-5)).all())
    half = target.unflatten(-1, (4, 32)).abs().amax(-1)
    assert bool((q.scale.float() * levels / 2 >= half * (1 - 1e-6)).all())


def test_symmetric_grid_is_the_min_max_grid_on_rows_clipped_both_ways():
    """A row whose clip threshold is reached on both sides has range [-τ, τ]: both grids give the same levels."""
    x = torch.cat([randn(8, 62, seed=7), torch.full((8, 1), 9.0), torch.full((8, 1), -9.0)], dim=-1)
    sym, uni = (dequantize(quantize(x, clip=0.9, method=m), 2) for m in ("symmetric", "uniform"))
    torch.testing.assert_close(sym, uni, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------------------- compact
def test_byte_scales_span_their_range_exactly():
    """Code ``e·8 + m`` is ``(1 + m/8)·2^(e - 18)``: increasing, from 2^-18 to BYTE_SCALE_MAX, exact in fp32."""
    codes = torch.arange(256, dtype=torch.int32)
    scales = decode_byte_scale(codes.to(torch.uint8))
    want = (1 + (codes % 8).double() / 8) * torch.pow(2.0, (codes // 8).double() - 18)
    assert torch.equal(scales.double(), want)
    assert float(scales[0]) == 2.0**-18 and float(scales[-1]) == BYTE_SCALE_MAX and bool((scales.diff() > 0).all())


@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
@pytest.mark.parametrize("offset", [0.0, 5.0, -300.0, 1e-4], ids=["centred", "offset", "far-negative", "tiny"])
def test_compact_grid_stays_within_half_a_step_with_the_least_byte_scale(bits, offset):
    """Byte scale and int8 zero: every element within scale/2 of its clipped value, whatever the rows' offset and
    magnitude; the scale is the least byte scale that covers the group (or its next one up where the zero's
    rounding leaves the top short) and the zero within int8."""
    scale_of_rows = 1e-6 if offset == 1e-4 else 1.0
    x = rows_with_outliers(3, 16, 128, seed=bits) * scale_of_rows + offset
    q = quantize(x, bits=bits, group_size=32, clip=0.96, method="compact")
    assert (q.scale.dtype, q.zero.dtype, q.meta) == (torch.uint8, torch.int8, BYTE_META)
    assert q.scale.shape == q.zero.shape == (3, 16, 4)
    target = clip_rows(x, 0.96)
    s = q.scales()
    error = (dequantize(q, bits) - target).abs().unflatten(-1, (4, 32))
    assert bool((error <= s[..., None] / 2 * (1 + 1e-5)).all())
    groups = target.unflatten(-1, (4, 32))
    levels = 2**bits - 1
    need = torch.maximum((groups.amax(-1) - groups.amin(-1)) / levels, groups.amin(-1).abs() / 15.875)
    need = need.clamp_min(2.0**-18)
    below = decode_byte_scale((q.scale.to(torch.int32) - 1).clamp_min(0).to(torch.uint8))
    assert bool((s >= need).all())
    bumped = (below >= need) & (q.scale > 0)  # the next byte up: the least one's zero would leave the top short
    zero_below = torch.floor(groups.amin(-1) * 8 / below).clamp(-128, 127) * (below / 8)
    assert bool((zero_below + levels * below < groups.amax(-1))[bumped].all())
    torch.testing.assert_close(q.zeros(bits), q.zero.float() * s / 8, rtol=0, atol=0)


def test_compact_grid_halves_the_metadata_at_most_a_few_percent_noisier():
    """Centred Gaussian rows (the cache's ``x - μ``): 16 bits per group instead of 32, for a mean squared error
    within 25% of fp16's (the scale's 3-bit mantissa rounds up by 4% on average)."""
    x = randn(4096, 64, seed=11)
    errors = {m: float((dequantize(quantize(x, method=m), 2) - x).pow(2).mean()) for m in ("uniform", "compact")}
    assert errors["uniform"] < errors["compact"] < 1.25 * errors["uniform"]


def test_compact_grid_rejects_steps_past_its_largest_byte_scale():
    x = randn(2, 64, seed=3)
    x[0, 0] = 1e6
    with pytest.raises(ValueError, match="compact quantizer's scale range"):
        quantize(x, method="compact")
    assert quantize(x, method="compact", clip=0.5).scale.dtype == torch.uint8  # clipped back into range


# ------------------------------------------------------------------------------------------- lloyd-max
def test_lloyd_max_uses_all_four_codes():
    codes = unpack(quantize(randn(64, 128, seed=2), method="lloyd-max").codes, 2)
    assert all(sorted(row.unique().tolist()) == [0, 1, 2, 3] for row in codes)


def test_lloyd_max_levels_are_mean_plus_multiples_of_sigma():
    x = 0.5 + 2 * randn(16, 128, seed=3)
    mean, sigma = x.mean(-1, keepdim=True), x.std(-1, unbiased=False, keepdim=True)
    expected = mean + sigma * torch.tensor([-1.751, -0.584, 0.584, 1.751])
    out = dequantize(quantize(x, method="lloyd-max"), 2)
    levels = torch.stack([row.unique() for row in out])  # sorted, 4 per row
    torch.testing.assert_close(levels, expected, atol=1e-2, rtol=2e-3)


def test_lloyd_max_beats_uniform_on_gaussian_rows():
    x = randn(1024, 128, seed=4)
    mse = {m: float(((dequantize(quantize(x, method=m), 2) - x) ** 2).mean()) for m in ("uniform", "lloyd-max")}
    assert mse["lloyd-max"] < 0.7 * mse["uniform"], mse  # about 0.146 vs 0.252


def test_lloyd_max_rejects_four_bits():
    with pytest.raises(ValueError, match="lloyd-max"):
        quantize(randn(2, 64), bits=4, method="lloyd-max")


# ----------------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=lambda t: DTYPE_IDS[t])
@pytest.mark.parametrize("group", [None, 32], ids=lambda g: f"g{g or 'D'}")
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
def test_shapes_and_dtypes_on_4d_input(bits, group, scale_dtype):
    b, h, t, d = 2, 3, 5, 128
    x = randn(b, h, t, d).to(torch.bfloat16)
    q = quantize(x, bits=bits, group_size=group, scale_dtype=scale_dtype)
    groups = d // (group or d)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (b, h, t, d * bits // 8)
    assert q.scale.shape == q.zero.shape == (b, h, t, groups)
    assert q.scale.dtype == q.zero.dtype == scale_dtype
    out = dequantize(q, bits, dtype=torch.bfloat16)
    assert out.shape == x.shape and out.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ per channel
def channels_with_offsets(*shape: int, seed: int = 0) -> torch.Tensor:
    """Gaussian tokens ``[..., N, D]`` whose channels carry large constant offsets, like the channels of real keys."""
    x = randn(*shape, seed=seed)
    return x + 10 * randn(shape[-1], seed=seed + 1)


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=lambda t: DTYPE_IDS[t])
@pytest.mark.parametrize("x_dtype", SCALE_DTYPES, ids=lambda t: f"x-{DTYPE_IDS[t]}")
@pytest.mark.parametrize("token_group", [8, 32], ids=lambda g: f"G{g}")
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
def test_per_channel_error_within_half_a_step(bits, token_group, x_dtype, scale_dtype):
    x = channels_with_offsets(2, 3, 64, 128, seed=bits + token_group).to(x_dtype)
    q = quantize_per_channel(x, token_group=token_group, bits=bits, scale_dtype=scale_dtype)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 3, 64, 128 * bits // 8)
    assert q.scale.shape == q.zero.shape == (2, 3, 64 // token_group, 128)
    assert q.scale.dtype == q.zero.dtype == scale_dtype
    out = dequantize_per_channel(q, bits, dtype=x_dtype)
    assert out.shape == x.shape and out.dtype == x_dtype
    error = (dequantize_per_channel(q, bits) - x.float()).abs().unflatten(-2, (64 // token_group, token_group))
    half_step = q.scale.float()[..., None, :] / 2
    fp32_slack = 4 * torch.finfo(torch.float32).eps * x.float().abs().unflatten(-2, error.shape[-3:-1])  # offsets
    assert bool((error <= half_step * (1 + 1e-5) + fp32_slack).all()), float((error / half_step).max())


@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES, ids=lambda t: DTYPE_IDS[t])
@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
def test_per_channel_range_is_rounded_outward(bits, scale_dtype):
    """Per channel and token group: zero <= min and zero + levels·scale >= max (up to fp32 arithmetic)."""
    x = channels_with_offsets(96, 128, seed=6)
    q = quantize_per_channel(x, token_group=32, bits=bits, scale_dtype=scale_dtype)
    blocks = x.unflatten(0, (3, 32))  # [N/G, G, D]
    zero, scale = q.zero.float(), q.scale.float()
    fp32_slack = 4 * torch.finfo(torch.float32).eps * blocks.abs().amax(1)
    assert bool((zero <= blocks.amin(1)).all())
    assert bool((zero + (2**bits - 1) * scale >= blocks.amax(1) - fp32_slack).all())


@pytest.mark.parametrize("bits", [2, 4], ids=lambda b: f"int{b}")
def test_per_channel_is_per_token_quantization_of_the_transposed_block(bits):
    """Same min-max rules: the scale, zero and codes of a per-channel block are the per-token quantizer's on its
    transpose with group_size = token_group, and the codes stay packed per token (byte j: channels j, j + D/n...)."""
    x = channels_with_offsets(2, 64, 128, seed=7)
    q = quantize_per_channel(x, token_group=16, bits=bits)
    transposed = quantize(x.transpose(-1, -2), bits=bits, group_size=16)  # rows = channels, groups of 16 tokens
    assert torch.equal(q.scale, transposed.scale.transpose(-1, -2))
    assert torch.equal(q.zero, transposed.zero.transpose(-1, -2))
    assert torch.equal(unpack(q.codes, bits), unpack(transposed.codes, bits).transpose(-1, -2))
    assert torch.equal(q.codes, pack(unpack(q.codes, bits), bits))


def test_per_channel_constant_channels_and_empty_blocks_dequantize_exactly():
    x = torch.tensor([0.0, 300.0, -1.5, 7.25]).repeat(64, 16)  # [64 tokens, 64 channels], each channel constant
    assert torch.equal(dequantize_per_channel(quantize_per_channel(x, token_group=32), 2), x)
    empty = quantize_per_channel(randn(2, 0, 64), token_group=32)  # an empty history
    assert empty.scale.shape == (2, 0, 64) and dequantize_per_channel(empty, 2).shape == (2, 0, 64)


def test_per_channel_errors():
    with pytest.raises(ValueError, match="multiple of token_group=32"):
        quantize_per_channel(randn(40, 64), token_group=32)
    x = randn(32, 64)
    x[3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_per_channel(x, token_group=32)
    x[3, 5] = 1e6
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_per_channel(-x, token_group=32, scale_dtype=torch.float16)
