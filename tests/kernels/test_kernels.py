"""Triton kernels against their pure-torch oracles: on the CPU under TRITON_INTERPRET=1 (set here), or compiled
on CUDA tensors when a GPU is present and TRITON_INTERPRET is not set.

Write kernel vs ``quantizer.quantize`` (bit for bit), decode kernel vs its torch twin (``decode.reference.attend``)
and an fp32 reference,
the "triton" backend's dispatch, and ``model.generate`` with backend="triton" vs "torch".
"""

import math
import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
pytest.importorskip("triton")

from helpers import make_model  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from oscar_hf import (  # noqa: E402
    DynamicOscarLayer,
    OscarConfig,
    OscarQuantizedCache,
    OscarRotations,
    StaticOscarLayer,
    cache_kwargs,
)
from oscar_hf.cache import LatentOscarLayer  # noqa: E402
from oscar_hf.kernels import ATTENTION_BACKENDS, WRITE_BACKENDS, quantize_kv  # noqa: E402
from oscar_hf.kernels import flags as kernel_flags  # noqa: E402
from oscar_hf.kernels.decode import launch  # noqa: E402
from oscar_hf.kernels.decode import reference as decode_reference  # noqa: E402
from oscar_hf.kernels.decode import triton as decode_triton  # noqa: E402
from oscar_hf.kernels.decode.launch import DecodeConfig  # noqa: E402
from oscar_hf.kernels.decode.triton import _decode_stage2_kernel, decode  # noqa: E402
from oscar_hf.kernels.dequantize import triton as dequantize_triton  # noqa: E402
from oscar_hf.kernels.write.triton import quantize_pack, quantize_pack_kv  # noqa: E402
from oscar_hf.kernels.write.triton import supports as write_supports  # noqa: E402
from oscar_hf.quantizer import QuantizedRows, quantize, unpack  # noqa: E402
from oscar_hf.rotations import hadamard_matrix  # noqa: E402

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def assert_same_rows(got: QuantizedRows, want: QuantizedRows) -> None:
    for name, a, b in zip(want._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name}: {(a != b).sum().item()} of {a.numel()} differ"


def naive_attend(module, query, key, value, mask, scaling):
    """The torch twin over the handles' layer, the handles' tokens read at full precision."""
    return decode_reference.attend(module, query, key.layer.packed(), key.new, value.new, mask, scaling)


def triton_attend(module, query, key, value, mask, scaling):
    """The "triton" backend over the handles' layer (the kernel where it serves the call, else the twin)."""
    layer = key.layer
    return ATTENTION_BACKENDS["triton"](module, query, layer.packed(), key.new, value.new, mask, scaling,
                                        layer.config.recent_tokens)


def kernel_serves(query, layer, mask) -> bool:
    return launch.supports_call(query, layer.packed(), mask, layer.config.recent_tokens,
                                layer.max_cache_len or layer.length)


def bf16_model():
    """The tiny bf16 Qwen3 (GQA, D = 128) that the tests through a model run: on a GPU with 2 layers, under the
    interpreter (which runs every program of every launch in Python) with 1, each layer taking the same kernels."""
    layers = 2 if DEVICE == "cuda" else 1
    return make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16, num_hidden_layers=layers).to(DEVICE)


def test_backends_registered():
    assert "triton" in ATTENTION_BACKENDS and "triton" in WRITE_BACKENDS


# ------------------------------------------------------------------------------------------ write kernel
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


# ------------------------------------------------------------------------------------------ decode kernel
class Attn(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def filled_layer(batch, heads, dim, n_history, dtype, *, sink=4, recent=8, pads=(), seed=0, key_ramp=0.0, spike=None,
                 **config):
    """An OscarLayer holding ``sink ‖ n_history quantized ‖ recent`` tokens after a prefill and one decode step,
    the returned handles being those of the decode step. Left-padded positions hold huge K/V, so any leak shows;
    ``key_ramp`` scales the keys up along the sequence (to ``1 + key_ramp`` times), so the logits' max keeps rising;
    ``spike``: (position, keys ``[B, H, D]``) replaces the keys there."""
    cfg = OscarConfig(sink_tokens=sink, recent_tokens=recent, flush_tokens=1, backend="torch", **config)
    layer = DynamicOscarLayer(cfg, torch.eye(dim), torch.eye(dim))
    total = sink + n_history + recent  # flush_tokens=1: every token past the windows is demoted at once
    kv = randn(2, batch, heads, total, dim, seed=seed)
    kv[0] *= 1 + key_ramp * torch.linspace(0, 1, total, device=kv.device)[:, None]
    if spike is not None:
        kv[0, :, :, spike[0]] = spike[1]
    for row, pad in enumerate(pads):
        kv[:, row, :, :pad] = 30.0
    key, value = kv.to(dtype).unbind(0)
    layer.update(key[:, :, :-1], value[:, :, :-1])
    handles = layer.update(key[:, :, -1:], value[:, :, -1:])
    assert (layer.n_sink, layer.n_history, layer.n_recent) == (sink, n_history, recent)
    mask = None
    if pads:
        mask = torch.ones(batch, 1, 1, total, dtype=torch.bool, device=DEVICE)
        for row, pad in enumerate(pads):
            mask[row, ..., :pad] = False
    return layer, handles, mask


def fp32_reference(query, layer, mask, groups):
    """Attention in fp32 over exactly what the layer stores (history dequantized in fp32)."""
    key, value = (layer.materialize(side, dtype=torch.float32) for side in ("key", "value"))
    out, _ = sdpa_attention_forward(Attn(groups), query.float(), key, value, mask, scaling=None)
    return out


TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def check_decode(batch, heads, groups, dim, n_history, dtype, config=None, seed=0, spike=None, **kwargs):
    """Checks ``decode`` on :func:`filled_layer` against the torch twin and fp32; returns the query and the layer.
    ``spike``: (position, factor): the key there is ``factor`` times the sum of its group's queries."""
    query = randn(batch, heads * groups, 1, dim, seed=seed + 1).to(dtype)
    if spike is not None:
        kwargs["spike"] = spike[0], spike[1] * query.float().reshape(batch, heads, groups, dim).sum(2)
    layer, (key, value), mask = filled_layer(batch, heads, dim, n_history, dtype, seed=seed, **kwargs)
    got = decode(query, layer.packed(), mask, None, config)
    want = naive_attend(Attn(groups), query, key, value, mask, None)
    exact = fp32_reference(query, layer, mask, groups)
    assert got.shape == want.shape == (batch, 1, heads * groups, dim) and got.dtype == dtype
    # As close to the fp32 result as the torch twin is, up to one more rounding: the kernel feeds p (p·s for the
    # history, whose rounding then weighs a code's distance from the middle one, at most 1.5 steps of s) to the
    # tensor cores in the model dtype, as flash attention does; the twin's CPU SDPA keeps p in fp32
    err, naive_err = (got.float() - exact).abs().max().item(), (want.float() - exact).abs().max().item()
    scales = layer.history["value_scale"][:, :, : layer.n_history]  # V steps: the rounding bound
    step = scales.float().abs().max().item() if scales.numel() else 0.0
    rounding = torch.finfo(dtype).eps * (exact.abs().max().item() + 0.75 * step)
    assert err <= 2 * naive_err + rounding, (err, naive_err, rounding)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    return query, layer


@pytest.mark.parametrize("dim, n_history", [(128, n) for n in (1, 7, 63, 64, 65, 300, 1000)]
                         + [(64, n) for n in (1, 7, 65, 1000)])  # D = 64: code rows of two tokens, odd ends
def test_decode_history_lengths(dim, n_history):
    check_decode(2, 2, 4, dim, n_history, torch.bfloat16, pads=(0, 9))


@pytest.mark.parametrize(
    "groups, dim, dtype",
    [(1, 64, torch.float16), (4, 64, torch.bfloat16), (8, 64, torch.float16), (8, 128, torch.float16),
     (16, 128, torch.bfloat16),
     (2, 256, torch.bfloat16), (8, 256, torch.float16), (2, 512, torch.bfloat16)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_decode_gqa_head_dims_dtypes(groups, dim, dtype):
    check_decode(1, 2, groups, dim, 70, dtype)


def test_decode_left_padding_reaches_into_history():
    """Pads of 0, 3 (sink only), 11 (sink and history) and 40 tokens; the padded K/V are huge."""
    check_decode(4, 1, 4, 64, 40, torch.float16, pads=(0, 3, 11, 40))


def test_decode_windows_only_and_no_sink():
    check_decode(2, 2, 4, 128, 0, torch.bfloat16, pads=(0, 2))  # empty history: sink and recent only
    check_decode(2, 2, 4, 64, 50, torch.bfloat16, sink=0, pads=(0, 7))  # empty sink


@pytest.mark.parametrize("dim, dtype, split_bytes, splits", [
    (128, torch.float16, 1024, 10), (64, torch.bfloat16, 1024, 10),  # one tile per split
    (128, torch.float16, 6000, 3), (64, torch.bfloat16, 3000, 4),  # the partial tile not the last split's
], ids=lambda v: DTYPE_IDS.get(v, str(v)))
def test_decode_many_splits_and_partial_tiles(dim, dtype, split_bytes, splits):
    """Small tiles and tiny splits: many history, sink and recent chunks, merged by LSE. History split s of S reads
    tiles s, s + S, ... of the 10 (the tenth partial: 301 tokens), so with 3 or 4 splits split 0 or 1 owns the
    partial tile among whole ones."""
    config = DecodeConfig(block_n=32, min_split_bytes=split_bytes)
    hist_bytes = 2 * (dim // 4 + 4)  # K and V codes, scale and zero per token
    assert math.ceil(301 / launch.plan_splits(2 * 2, 301, hist_bytes, config, 132)) == splits
    check_decode(2, 2, 4, dim, 301, dtype, config=config, sink=40, recent=70, pads=(0, 45))


@pytest.mark.parametrize("dtype, dim", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64)],
                         ids=lambda v: DTYPE_IDS.get(v, str(v)))
def test_decode_running_max_rises_along_one_split(dtype, dim):
    """One history split of 32 tiles whose logits' max keeps rising (keys up to 25x larger), so the lazily rescaled
    running max moves mid-split, by more and by less than its slack (bf16: 8 in log2 units; fp16: 0); at D = 64 each
    token of a pair row in its own columns."""
    config = DecodeConfig(block_n=32, min_split_bytes=1 << 30)
    check_decode(1, 1, 4, dim, 1000, dtype, config=config, key_ramp=24.0, pads=(5,))


@pytest.mark.parametrize("factor, rises", [(1.5, (8, 64)), (12.0, (130, 1000))])
def test_decode_a_key_far_above_the_running_max(factor, rises):
    """One key mid-split (token 500 of one split's 1000, 32-token tiles, bf16) whose logit rises above the running
    max of the tiles before it by more than the lazy rescaling's slack (8, log2 units), and by more than fp32's
    range (130: the running max must move before that tile's weights); the rise is checked on the fp32 logits of
    what the layer stores."""
    config = DecodeConfig(block_n=32, min_split_bytes=1 << 30)
    sink, position = 4, 500
    query, layer = check_decode(1, 2, 4, 128, 1000, torch.bfloat16, config=config, spike=(sink + position, factor))
    history = layer.materialize("key", dtype=torch.float32)[:, :, sink:sink + 1000]
    logits = torch.einsum("bhgd,bhnd->bhgn", query.float().reshape(1, 2, 4, 128), history) * 128**-0.5 / math.log(2)
    before = logits[..., :position // 32 * 32].amax(-1)  # the running max of the tiles before the key's
    rise = (logits[..., position] - before).amax().item()
    assert rises[0] < rise < rises[1], rise


@pytest.mark.parametrize("q_len, groups, dim, dtype, masked", [
    (2, 4, 128, torch.bfloat16, False), (4, 4, 64, torch.float16, True), (7, 2, 128, torch.float16, True),
    (3, 8, 256, torch.bfloat16, True), (2, 4, 64, torch.bfloat16, True),  # D = 64: 8 query rows in pair rows
], ids=lambda v: DTYPE_IDS.get(v, str(v)))
def test_decode_several_query_tokens(q_len, groups, dim, dtype, masked):
    """A verify step: the q newest tokens (in the recent window) against sink, history and recent, causal among
    themselves; a left-padded row; equal to the torch twin over the same handles."""
    batch, heads, total = 2, 2, 260
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8, flush_tokens=1, backend="torch")
    layer = DynamicOscarLayer(cfg, torch.eye(dim), torch.eye(dim))
    kv = randn(2, batch, heads, total, dim, seed=21)
    if masked:
        kv[:, 1, :, :13] = 30.0  # padding of row 1: huge K/V, a leak would show
    key, value = kv.to(dtype).unbind(0)
    layer.update(key[:, :, :-q_len], value[:, :, :-q_len])
    handles = layer.update(key[:, :, -q_len:], value[:, :, -q_len:])
    mask = None
    if masked:
        mask = torch.ones(batch, 1, q_len, total, dtype=torch.bool, device=DEVICE).tril(total - q_len)
        mask[1, ..., :13] = False
    query = randn(batch, heads * groups, q_len, dim, seed=22).to(dtype)
    assert kernel_serves(query, layer, mask)
    got = decode(query, layer.packed(), mask, None)
    want = naive_attend(Attn(groups), query, *handles, mask, None)
    assert got.shape == want.shape == (batch, q_len, heads * groups, dim)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    # causal among the query tokens: changing the newest token's K and V changes the last output only
    layer._unroll_recent()
    for side in ("key", "value"):
        layer.recent[side][:, :, layer.n_recent - 1] += 3.0
    changed = decode(query, layer.packed(), mask, None)
    assert torch.equal(changed[:, :-1], got[:, :-1]) and not torch.equal(changed[:, -1], got[:, -1])
    too_many = query.new_zeros(batch, heads * groups, 9, dim)
    assert not kernel_serves(too_many, layer, None)  # more than the recent window


@pytest.mark.parametrize("batch, tokens, per_sm, windows_in_wave", [
    (1, 131072, 8, True), (1, 4096, 8, True), (8, 4096, 8, False), (8, 32768, 10, False), (32, 32768, 12, False),
    (32, 4096, 12, False)])
def test_history_chunks_fill_one_wave(batch, tokens, per_sm, windows_in_wave):
    """Qwen3-8B shapes on 132 SMs: whole-tile chunks whose programs fit one wave of ``per_sm`` programs per SM: 12
    where programs are long, 2 fewer at a time (down to 8) while they would cover fewer than 24 tiles, unless the
    window programs (5 per head) are more than half as many (batch 32 at 4K). The window programs share the wave
    when that costs at most a tenth of the splits, else the history programs alone fill it (without the cap on
    history programs per SM: test_history_programs_capped_where_windows_are_few)."""
    cfg = DecodeConfig(**{**vars(launch.default_config(batch, 128)), "max_history_programs_per_sm": 0.0})
    heads, n_hist = batch * 8, tokens - 320
    slots, windows = per_sm * 132, batch * 8 * 5
    chunk = launch.plan_splits(heads, n_hist, 2 * (32 + 4), cfg, 132, windows)
    fixed = DecodeConfig(**{**vars(cfg), "programs_per_sm": per_sm, "min_program_tiles": 0})
    assert chunk == launch.plan_splits(heads, n_hist, 2 * (32 + 4), fixed, 132, windows)
    programs = math.ceil(n_hist / chunk) * heads
    assert chunk >= cfg.min_program_tiles * cfg.block_n or per_sm == 8 or 2 * windows > programs
    assert chunk % cfg.block_n == 0 and programs <= slots
    assert (programs + windows <= slots) == windows_in_wave
    assert programs >= 0.8 * (slots - windows if windows_in_wave else slots) or chunk * 72 < 4 * cfg.min_split_bytes


@pytest.mark.parametrize("batch, tokens, splits, uncapped", [
    (1, 32768, 127, 127), (1, 131072, 121, 121), (2, 131072, 76, 76), (4, 16384, 28, 32), (4, 131072, 31, 49),
    (8, 32768, 15, 20), (8, 131072, 15, 24), (16, 131072, 12, 12), (32, 32768, 6, 6)])
def test_history_programs_capped_where_windows_are_few(batch, tokens, splits, uncapped):
    """Qwen3-8B shapes on 132 SMs: at most 7.7 history programs per SM (1016) where the window programs (5 per head)
    are at least one per SM and at most half as many, i.e. at batches 4 and 8; batches 1 and 2 (fewer window
    programs) and 16 and 32 (more) keep their splits."""
    cfg, heads, n_hist = launch.default_config(batch, 128), batch * 8, tokens - 320
    chunk = launch.plan_splits(heads, n_hist, 72, cfg, 132, heads * 5)
    free = DecodeConfig(**{**vars(cfg), "max_history_programs_per_sm": 0.0})
    assert math.ceil(n_hist / chunk) == splits and chunk % cfg.block_n == 0
    assert math.ceil(n_hist / launch.plan_splits(heads, n_hist, 72, free, 132, heads * 5)) == uncapped
    assert splits * heads <= 1016 or splits == uncapped


def test_decode_config_rejects_a_negative_cap():
    with pytest.raises(ValueError, match="max_history_programs_per_sm >= 0"):
        DecodeConfig(max_history_programs_per_sm=-1.0)
    with pytest.raises(ValueError, match="window_tiles >= 1"):
        DecodeConfig(window_tiles=0)
    with pytest.raises(ValueError, match="programs_per_sm >= 1"):
        DecodeConfig(programs_per_sm=0)


def test_window_programs_share_the_wave_when_cheap():
    """Batch 8 at 4K, 12 programs per SM: 20 splits per head would spill 16 programs into a second wave behind the
    320 window programs; 15 splits (whole 4-tile chunks) leave them room."""
    cfg = DecodeConfig(block_n=64, programs_per_sm=12, min_split_bytes=8 * 1024)
    chunk = launch.plan_splits(64, 4096 - 320, 72, cfg, 132, 320)
    assert math.ceil((4096 - 320) / chunk) == 15 and 15 * 64 + 320 <= 12 * 132


@pytest.mark.parametrize("batch, tokens, prefetch", [(1, 32768, True), (1, 4096, True), (1, 131072, False),
                                                     (8, 32768, False), (32, 4096, False)])
def test_window_programs_prefetch_where_few_and_last(batch, tokens, prefetch):
    """Qwen3-8B shapes on 132 SMs: the 5 window programs per head prefetch their rows where they are at most one per
    two SMs (batch 1) and the history chunks are at most 8 tiles (so the window programs would finish last); a
    config's explicit choice wins."""
    cfg, n_hist = launch.default_config(batch, 128), tokens - 320
    hist_splits = math.ceil(n_hist / launch.plan_splits(batch * 8, n_hist, 72, cfg, 132, batch * 8 * 5))
    splits, cpu = [hist_splits, 1, hist_splits + 5, 2], torch.device("cpu")
    assert launch.window_prefetch(cfg, batch * 8, n_hist, splits, cpu) == prefetch
    forced = DecodeConfig(**{**vars(cfg), "window_prefetch": not prefetch})
    assert launch.window_prefetch(forced, batch * 8, n_hist, splits, cpu) == (not prefetch)


@pytest.mark.parametrize("batch, tokens, tiles", [(1, 4096, 1), (1, 16384, 1), (1, 131072, 2), (8, 4096, 1),
                                                  (8, 32768, 2), (32, 4096, 2)])
def test_window_chunks_of_one_tile_where_history_programs_are_short(batch, tokens, tiles):
    """A static Qwen3-8B-shaped layer planned for its capacity on 132 SMs: one tile per sink/recent chunk where the
    history programs, planned for chunks of two, read at most 8 tiles each (twice the window programs, each half as
    long), else two; a config's window_tiles wins."""
    config = OscarConfig(sink_tokens=64, recent_tokens=256, backend="torch")
    layer = StaticOscarLayer(config, torch.eye(128), torch.eye(128), tokens)
    x = torch.zeros(batch, 8, 1, 128, dtype=torch.bfloat16)
    layer.lazy_initialization(x, x)
    hist_splits, sink_splits, total, window_tiles = launch.plan(layer.packed(), batch)
    chunk = window_tiles * launch.WINDOW_BLOCK[128]
    assert window_tiles == tiles
    assert sink_splits == math.ceil(layer.sink.capacity / chunk)
    assert total - hist_splits - sink_splits == math.ceil(layer.recent.capacity / chunk)
    two = launch.plan(layer.packed(), batch, config=DecodeConfig(**{**vars(launch.default_config(batch, 128)),
                                                                   "window_tiles": 2}))
    assert two[3] == 2 and (tiles == 2) == (two == [hist_splits, sink_splits, total, window_tiles])
    assert (layer.history.capacity <= 8 * 64 * two[0]) == (tiles == 1)


@pytest.mark.parametrize("centered, apart, sinks", [(False, False, False), (True, False, False), (True, True, False),
                                                     (True, True, True), (False, False, True)],
                         ids=["plain", "centered", "centered-apart", "centered-apart-sinks", "sinks"])
def test_decode_merge_of_many_splits(centered, apart, sinks):
    """Stage 2 over more splits than one step holds (300 > 128), with empty splits and a row with no valid key;
    centered, the history splits (from 120 on) get q·μ_K on their lse and the output μ_V times their weight; apart
    (a V rotation), the windows' and the history's shares of the output are written to two buffers; sinks, a learned
    logit per head joins the weights (with no value)."""
    rows, splits, dim, hist_from, qk_scale = 3, 300, 64, 120, 0.5
    part_o = randn(rows, splits, dim, seed=3)
    part_lse = randn(rows, splits, seed=4) * 4
    part_lse[0, ::3] = float("-inf")  # empty splits (stage 1 writes 0 there: their weight must be 0)
    part_o[0, ::3] = 1e4
    part_lse[2] = float("-inf")
    query = randn(1, rows, 1, dim, seed=5).to(torch.bfloat16)  # one KV head per query head
    mu_k, mu_v = randn(1, rows, dim, seed=6), randn(1, rows, dim, seed=7)
    out, out_hist = (torch.empty(rows, dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    sink_logits = randn(rows, seed=8) * 4
    _decode_stage2_kernel[(rows, dim // 32)](part_o, part_lse, out, out_hist, splits, hist_from, query,
                                             *query.stride()[:3], mu_k, mu_v, *mu_k.stride()[:2], rows, qk_scale,
                                             sink_logits, G_Q=1, Q_LEN=1, D=dim, BLOCK_D=32, BLOCK_S=128,
                                             CENTERED=centered, APART=apart, PDL=False, HAS_SINKS=sinks)
    hist = torch.arange(splits, device=DEVICE) >= hist_from
    shift = (query[0, :, 0].float() * mu_k[0]).sum(-1, keepdim=True) * qk_scale if centered else 0.0
    lse = torch.where(hist, part_lse + shift, part_lse)[:2] * math.log(2)
    if sinks:  # natural units (part_lse is base 2)
        lse = torch.cat([lse, sink_logits[:2, None]], dim=-1)
    weights = torch.softmax(lse, dim=-1)[:, :splits]
    windows = torch.einsum("rs,rsd->rd", weights * ~hist, part_o[:2])
    history = torch.einsum("rs,rsd->rd", weights * hist, part_o[:2])
    if centered:
        history += (weights * hist).sum(-1, keepdim=True) * mu_v[0, :2]
    if apart:
        torch.testing.assert_close(out[:2].float(), windows, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out_hist[:2].float(), history, rtol=1e-2, atol=1e-2)
        assert torch.equal(out_hist[2], torch.zeros_like(out_hist[2]))
    else:
        torch.testing.assert_close(out[:2].float(), windows + history, rtol=1e-2, atol=1e-2)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("group, bits", [(32, 2), (None, 4)], ids=["int2-g32", "int4"])
def test_decode_groups_and_int4(group, bits):
    check_decode(2, 2, 4, 128, 90, torch.float16, group_size=group, bits=bits, pads=(0, 6))


@pytest.mark.parametrize(
    "key_bits, bits, dim, group, dtype",
    [(4, 2, 128, None, torch.bfloat16), (4, 2, 64, None, torch.float16), (2, 4, 128, 64, torch.float16),
     (2, 4, 64, None, torch.bfloat16)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_decode_key_bits(key_bits, bits, dim, group, dtype):
    """K and V codes of different widths (K's own sub-tiles for q, V's for the output), centered and not."""
    check_decode(2, 2, 4, dim, 150, dtype, key_bits=key_bits, bits=bits, group_size=group, pads=(0, 5))
    check_decode(1, 2, 2, dim, 70, dtype, key_bits=key_bits, bits=bits, group_size=group, centering=False)


def test_attend_dispatches_everything_else_to_the_torch_twin():
    """More query tokens than the recent window holds (a prefill chunk: the torch twin over the dequantize kernel's
    buffer), fp32 models and a newest token already quantized (recent_tokens=0) run the torch twin."""
    cases = [dict(q_len=10), dict(dtype=torch.float32), dict(recent=0)]
    for case in cases:
        dtype = case.get("dtype", torch.bfloat16)
        cfg = OscarConfig(sink_tokens=4, recent_tokens=case.get("recent", 8), flush_tokens=1, backend="torch")
        layer = DynamicOscarLayer(cfg, torch.eye(64), torch.eye(64))
        kv = randn(2, 1, 2, 40, 64, seed=8).to(dtype)
        layer.update(kv[0, :, :, :27], kv[1, :, :, :27])
        q_len = case.get("q_len", 1)
        key, value = layer.update(kv[0, :, :, 27 : 27 + q_len], kv[1, :, :, 27 : 27 + q_len])
        query = randn(1, 4, q_len, 64, seed=9).to(dtype)
        got = triton_attend(Attn(2), query, key, value, None, None)
        exact = dtype == torch.float32  # (the interpreter rounds a dequantized bf16 history toward zero, see below)
        torch.testing.assert_close(got, naive_attend(Attn(2), query, key, value, None, None),
                                   rtol=0 if exact else 2e-2, atol=0 if exact else 2e-2)


@pytest.mark.parametrize(
    "dtype, bits, group, centering, key_bits",
    [(torch.float16, 2, None, True, None), (torch.float16, 4, 32, False, None), (torch.float32, 2, 64, True, None),
     (torch.bfloat16, 2, None, True, None), (torch.float16, 2, None, True, 4)],
    ids=lambda v: DTYPE_IDS.get(v, str(v)),
)
def test_dequantize_kernel_equals_materialize(dtype, bits, group, centering, key_bits):
    """Every split point of sink | history | recent; a recent window rolled by graph steps. fp16/fp32 bit-identical;
    bf16 within one ulp (TRITON_INTERPRET=1 rounds fp32 → bf16 toward zero; the GPU rounds to nearest even)."""
    cfg = OscarConfig(sink_tokens=8, recent_tokens=16, flush_tokens=4, centering=centering, bits=bits,
                      key_bits=key_bits, group_size=group, backend="torch")
    layer = DynamicOscarLayer(cfg, torch.eye(128), torch.eye(128))
    kv = randn(2, 2, 3, 203, 128, seed=11).to(dtype)
    layer.update(kv[0], kv[1])
    layer.recent_start = 5  # as after graph steps: the ring's oldest row is row 5
    for t in layer.recent.tensors.values():
        t.copy_(t.roll(5, dims=2))
    new = randn(2, 3, 5, 128, seed=12).to(dtype)
    sink, hist = layer.n_sink, layer.n_history
    assert (sink, layer.n_recent) == (8, 16) and hist > 100
    for past in (0, 3, sink, sink + 1, 100, sink + hist, sink + hist + 2, layer.length):
        for side in ("key", "value"):
            got = layer.materialize(side, past, new=new, fill=dequantize_triton.fill_history)
            want = torch.cat([layer.materialize(side)[:, :, :past], new], dim=2)  # the whole sequence, sliced
            assert got.shape == want.shape == (2, 3, past + 5, 128) and got.dtype == dtype
            if dtype == torch.bfloat16:
                torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
                assert (got != want).float().mean() < 0.5  # (not everything off by rounding)
            else:
                assert torch.equal(got, want), (past, side)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("centering", [True, False], ids=["centered", "uncentered"])
def test_latent_layer_reads_its_history_through_the_dequantize_kernel(dtype, centering):
    """A multi-head latent attention layer (latent 64 channels, rotated, groups of 32) with backend "triton" returns
    what the torch twin returns: fp32 within 1e-6, bf16 within one ulp of the dequantized rows' rounding."""
    rotation = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(3)))[0]
    latent, rope = randn(2, 2, 1, 90, 64, seed=13).to(dtype), randn(2, 1, 90, 16, seed=14).to(dtype)
    got = {}
    for backend in ("torch", "triton"):
        layer = LatentOscarLayer(OscarConfig(sink_tokens=4, recent_tokens=8, flush_tokens=4, group_size=32,
                                             centering=centering, backend=backend), rotation)
        layer.update(latent[0], rope)
        got[backend] = layer.update(latent[1, :, :, :3], rope[:, :, :3])[0]
        assert layer.n_history > 70
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got["triton"], got["torch"], rtol=2**-6, atol=2**-6)
    else:
        torch.testing.assert_close(got["triton"], got["torch"], rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------- generate
def teacher_forced_logits(model, ids, mask, cache, prompt_len):
    """Logits of the prompt's last token, then of every later token of ``ids`` fed one at a time."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, through = [], cache_kwargs(model, cache)
    with torch.no_grad():
        for start, stop in [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, ids.shape[1] - 1)]:
            out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                        position_ids=positions[:, start:stop], **through, use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


def test_generate_triton_matches_torch_with_int2_history():
    """Tiny bf16 model, sink 4 + recent 8, a left-padded row: the prompt and the flushes go through both triton
    kernels. Greedy generate runs on each backend; then both are teacher-forced through the torch run's tokens and
    agree step by step. (Free-running generations of a random bf16 model may part ways at a 1-ulp top-2 tie, as
    they did on an H100 with the kernel's error no larger than the torch path's.)"""
    model = bf16_model()
    ids = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)

    def cache(backend):
        return OscarQuantizedCache.from_pretrained(
            OscarRotations.hadamard(model.config), model=model, sink_tokens=4, recent_tokens=8, backend=backend
        )

    sequences = {}
    for backend in ("torch", "triton"):
        used = cache(backend)
        sequences[backend] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                            past_key_values=used, pad_token_id=0)
        assert all(layer.n_history > 0 for layer in used.layers)
    tokens = sequences["torch"]
    full_mask = torch.cat([mask, torch.ones_like(tokens[:, 30:])], 1)
    logits = {b: teacher_forced_logits(model, tokens, full_mask, cache(b), 30) for b in ("torch", "triton")}
    torch.testing.assert_close(logits["torch"].argmax(-1), tokens[:, 30:], rtol=0, atol=0)  # the replay is generate's
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0, atol=2e-2)


def test_chunks_of_several_tokens_through_the_model(monkeypatch):
    """Verify-step-sized chunks (3–5 tokens, within the recent window) through a tiny bf16 model with a left-padded
    row, as assisted decoding feeds them: the triton backend runs them in the decode kernel (with the model's own
    4-D masks) and its logits match the torch backend's (two layers: the one-layer model has a near tie)."""
    model = make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16).to(DEVICE)
    ids = torch.randint(3, 90, (2, 42), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    query_lengths = []
    decode_ = decode_triton.decode
    monkeypatch.setattr(decode_triton, "decode", lambda query, *a, **kw: query_lengths.append(query.shape[2]) or
                        decode_(query, *a, **kw))

    def chunked(backend):
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                    sink_tokens=4, recent_tokens=8, backend=backend)
        logits, through = [], cache_kwargs(model, cache)
        with torch.no_grad():
            for start, stop in [(0, 24), (24, 27), (27, 30), (30, 34), (34, 37), (37, 42)]:
                out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                            position_ids=positions[:, start:stop], **through, use_cache=True)
                logits.append(out.logits.float())
        assert all(layer.n_history > 0 for layer in cache.layers)
        return torch.cat(logits[1:], 1)

    want, got = chunked("torch"), chunked("triton")
    assert sorted(set(query_lengths)) == [3, 4, 5]  # every chunk after the prompt went to the decode kernel
    torch.testing.assert_close(got, want, rtol=0, atol=4e-2)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_cache_quantizes_through_the_triton_writer():
    cfg = dict(sink_tokens=2, recent_tokens=4, flush_tokens=2)
    layers = {b: DynamicOscarLayer(OscarConfig(backend=b, **cfg), torch.eye(64), torch.eye(64))
              for b in ("torch", "triton")}
    kv = randn(2, 2, 3, 25, 64, seed=10).to(torch.bfloat16)
    for layer in layers.values():
        layer.update(kv[0, :, :, :20], kv[1, :, :, :20])
        for t in range(20, 25):
            layer.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
    torch_layer, triton_layer = layers["torch"], layers["triton"]
    assert triton_layer.n_history == torch_layer.n_history > 0
    for name in torch_layer.history.tensors:
        a = triton_layer.history[name][:, :, : triton_layer.n_history]
        assert torch.equal(a, torch_layer.history[name][:, :, : torch_layer.n_history]), name
    assert unpack(triton_layer.history["key_codes"][:, :, :1], 2).max() <= 3


def test_decode_uncentered_history():
    check_decode(2, 2, 4, 128, 90, torch.bfloat16, centering=False, pads=(0, 6))


# ------------------------------------------------------------------------- graph step (static caches)
def signed_hadamard(dim, heads=None, seed=3):
    """Hadamard rows in a random order with random signs ``[D, D]``, or ``heads`` different ones ``[heads, D, D]``
    (per-KV-head rotations). On values that are multiples of 1/4 below 64, every sum of the rotation is exact in
    fp32."""
    generator = torch.Generator().manual_seed(seed)

    def one():
        signs = torch.randint(0, 2, (dim, 1), generator=generator) * 2 - 1
        return (hadamard_matrix(dim)[torch.randperm(dim, generator=generator)] * signs).float()

    return one() if heads is None else torch.stack([one() for _ in range(heads)])


def static_and_host_layers(dim, *, max_len=120, heads=None, **config):
    """A static (max_cache_len) layer, whose one-token steps run the device-only operators (rotating in the append
    kernel), and a growing layer (the host path, the oracle: a GEMM), with the same settings: Triton backend, bf16,
    :func:`signed_hadamard` rotations (K's; V's their transpose), one per KV head where ``heads`` is given. On K/V
    that are multiples of 1/4 below 64, every sum of the rotation is exact in fp32, so both paths round it alike."""
    cfg = OscarConfig(backend="triton", **config)
    rotation = signed_hadamard(dim, heads)
    return (StaticOscarLayer(cfg, rotation, rotation.mT, max_len), DynamicOscarLayer(cfg, rotation, rotation.mT))


@pytest.mark.parametrize(  # tokens: the prompt and the steps, 9 or more demotions, the ring wrapped 3 times or more
    "prompt, config",
    [(3, dict(sink_tokens=4, recent_tokens=5, flush_tokens=3, tokens=40)),  # sink filled by steps; means set by a step
     (40, dict(sink_tokens=4, recent_tokens=8, flush_tokens=4, k_clip=1.0, v_clip=1.0, centering=False, tokens=80)),
     (30, dict(sink_tokens=0, recent_tokens=6, flush_tokens=1, group_size=32, tokens=55)),
     (20, dict(sink_tokens=2, recent_tokens=6, flush_tokens=2, key_bits=4, centering=False, tokens=50)),
     (20, dict(sink_tokens=2, recent_tokens=6, flush_tokens=2, centering=False, dtype=torch.float16, tokens=50)),
     (8, dict(sink_tokens=2, recent_tokens=3, flush_tokens=1, centering=False, dim=512, tokens=12)),
     (20, dict(sink_tokens=2, recent_tokens=6, flush_tokens=2, centering=False, heads=3, tokens=40))],
    ids=["sink-first", "uncentered-unclipped", "no-sink-flush-1", "4-bit-keys", "fp16", "D512", "per-head"],
)
def test_graph_step_stores_what_the_host_path_stores(prompt, config):
    """Steps through the append operator (rotation, ring buffer, device counts) leave the same sequence as the host
    path: codes, scales and zeros bit for bit without centering; with it, the means are summed in another order."""
    config = dict(config)
    dtype, dim, tokens = config.pop("dtype", torch.bfloat16), config.pop("dim", 64), config.pop("tokens")
    static, host = static_and_host_layers(dim, **config)
    kv = ((randn(2, 2, 3, tokens, dim, seed=11) * 8).round() / 4).to(dtype)
    for layer in (static, host):
        layer.update(kv[0, :, :, :prompt], kv[1, :, :, :prompt])
    assert static.graph_step and static.counts_on_device and not host.graph_step
    # CUDA graphs would otherwise copy (or refuse to capture) every buffer the step mutates
    assert all(torch._dynamo.utils.get_static_address_type(t) for t in (*static._tensors(), static.counts))
    starts = set()
    for t in range(prompt, tokens):
        assert static.takes_graph_step(kv[0, :, :, t : t + 1])
        static.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        host.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        starts.add(static.recent_start)
    assert len(starts) > 2, "the ring buffer wrapped"
    assert static.counts.tolist()[:3] == [host.n_sink, host.n_history, host.n_recent] and host.n_history > 0
    assert static.flags.tolist() == [0, 0]  # no error; the append kernel's arrival count back at zero
    exact = not static.config.centering
    for side in ("key", "value"):
        torch.testing.assert_close(static.materialize(side), host.materialize(side), rtol=0,
                                   atol=0 if exact else 0.1)
    if exact:
        for name in host.history.tensors:
            assert torch.equal(static.history[name][:, :, : host.n_history], host.history[name][:, :, : host.n_history])


@pytest.mark.parametrize("heads", [None, 2, 6], ids=["shared", "per-head-g3", "per-head-g1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("dim, q_len", [(64, 1), (128, 3), (256, 1), (512, 1)])
def test_query_rotation_kernel_equals_the_rotate_gemm(dim, q_len, dtype, heads):
    """Stage 0 (q · R_K in the decode operator) stores what ``rotate_queries`` computes, bit for bit, from the strided
    q that attention receives (``[B, q, Hq, D]`` transposed), for rows that do not fill its row block; with per-head
    rotations each query head takes its KV head's. On values whose sums are exact in fp32 (multiples of 1/4 below 64
    times ±1: an unnormalised Hadamard), both round once."""
    from oscar_hf.kernels.append.reference import rotate_queries
    from oscar_hf.kernels.decode.triton import rotate_query

    rotation = (signed_hadamard(dim, heads, seed=1) * dim**0.5).to(dtype).to(DEVICE)
    query = ((randn(3, q_len, 6, dim, seed=2) * 8).round() / 4).to(dtype).transpose(1, 2)  # [B, Hq, q, D] strided
    got = rotate_query(query, rotation)
    assert got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, rotate_queries(query, rotation), rtol=0, atol=0)
    if heads is not None:  # query head h·g + r takes KV head h's rotation
        g = 6 // heads
        for head in (0, 5):
            torch.testing.assert_close(got[:, head], (query[:, head].float() @ rotation[head // g].float()).to(dtype),
                                       rtol=0, atol=0)


@pytest.mark.parametrize("dim, group_q, heads", [(64, 4, None), (128, 1, None), (128, 16, None), (64, 3, 2)],
                         ids=["64-4", "128-1", "128-16", "64-3-per-head"])
def test_append_kernel_rotates_the_step_query_like_the_rotate_gemm(dim, group_q, heads):
    """A graph step left to the attention (as OscarQuantizedCache.update leaves it) is stored by the append kernel
    that also rotates the step's query: q · R_K (its KV head's, per head) as ``rotate_queries`` computes it, bit for
    bit on exact sums, from the strided q that attention receives (17 rows at a group of 16); the layer then holds
    what steps stored at once hold, and the token is stored once."""
    from oscar_hf.kernels.append.reference import rotate_queries

    config = dict(sink_tokens=2, recent_tokens=4, flush_tokens=2, heads=heads)
    left, stored = (static_and_host_layers(dim, **config)[0] for _ in range(2))
    kv = ((randn(2, 2, 2, 14, dim, seed=5) * 8).round() / 4).to(torch.bfloat16)
    for layer in (left, stored):
        layer.update(kv[0, :, :, :9], kv[1, :, :, :9])
    for t in range(9, 14):
        query = ((randn(2, 1, 2 * group_q, dim, seed=t) * 8).round() / 4).to(torch.bfloat16).transpose(1, 2)
        left.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1], leave_to_attention=True)
        stored.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        rotated = left.store_pending(query)
        assert rotated.is_contiguous() and left.store_pending(query) is None
        torch.testing.assert_close(rotated, rotate_queries(query, left.key_rotation), rtol=0, atol=0)
    assert left.counts.tolist() == stored.counts.tolist() and left.n_history > 0
    for side in ("key", "value"):
        assert torch.equal(left.materialize(side), stored.materialize(side))


def test_a_token_left_to_the_attention_is_stored_by_the_layers_next_use():
    """A token that no attention function stored (another consumer of the handles) is stored before the layer is
    read or updated again."""
    left, stored = (static_and_host_layers(64, sink_tokens=2, recent_tokens=4, flush_tokens=2)[0] for _ in range(2))
    kv = ((randn(2, 1, 2, 9, 64, seed=6) * 8).round() / 4).to(torch.bfloat16)
    for layer in (left, stored):
        layer.update(kv[0, :, :, :6], kv[1, :, :, :6])
    for t in range(6, 9):
        stored.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
    left.update(kv[0, :, :, 6:7], kv[1, :, :, 6:7], leave_to_attention=True)
    assert left.get_seq_length() == 7
    left.update(kv[0, :, :, 7:8], kv[1, :, :, 7:8], leave_to_attention=True)
    left.update(kv[0, :, :, 8:9], kv[1, :, :, 8:9])  # stores the token left before it first
    assert left.get_seq_length() == 9 and left.counts.tolist() == stored.counts.tolist()
    for side in ("key", "value"):
        assert torch.equal(left.materialize(side), stored.materialize(side))
    left.update(kv[0, :, :, 8:9], kv[1, :, :, 8:9], leave_to_attention=True)
    left.reset()  # drops a token left pending
    assert left.get_seq_length() == 0


def test_a_layer_without_a_key_rotation_leaves_the_query_as_it_is():
    """With R_K the identity the pending token is stored and no rotated query is returned (the decode reads q)."""
    cfg = OscarConfig(backend="triton", sink_tokens=2, recent_tokens=4, flush_tokens=2)
    layer = StaticOscarLayer(cfg, torch.eye(64), torch.eye(64), 20)
    kv = ((randn(2, 1, 2, 7, 64, seed=7) * 8).round() / 4).to(torch.bfloat16)
    layer.update(kv[0, :, :, :6], kv[1, :, :, :6])
    layer.update(kv[0, :, :, 6:], kv[1, :, :, 6:], leave_to_attention=True)
    assert layer.store_pending(randn(1, 4, 1, 64, seed=8).to(torch.bfloat16)) is None
    assert layer.counts.tolist()[:3] == [2, 0, 5]
    torch.testing.assert_close(layer.materialize("key"), kv[0], rtol=0, atol=0)


@pytest.mark.parametrize("dim, key_bits, centered, clips, per_head",
                         [(64, 2, True, (0.96, 0.92), False), (256, 4, False, (1.0, 1.0), False),
                          (64, 2, True, (0.96, 0.92), True)],
                         ids=["D64-centered-clipped", "D256-k4", "D64-per-head"])
def test_append_kernel_equals_its_torch_twin(dim, key_bits, centered, clips, per_head):
    """The append kernel and its twin over PackedKVs built without a cache: the same windows, history, means,
    counts, flags and rotated queries after every step, through sink, window, demotions and a full cache, with a
    shared rotation or one per KV head. K/V and q are multiples of 1/4 below 64 and the rotations signed Hadamard
    permutations, so every sum is exact."""
    from oscar_hf.kernels import PackedKV
    from oscar_hf.kernels.append import reference as append_reference
    from oscar_hf.kernels.append import triton as append_triton

    batch, heads, groups, sink, recent, flush, max_len = 2, 2, 2, 2, 3, 2, 14
    generator = torch.Generator().manual_seed(5)
    rotation = signed_hadamard(dim, heads if per_head else None, seed=5).to(torch.bfloat16).to(DEVICE)

    def storage():
        packed = PackedKV.empty(batch, heads, dim, sink=sink, history=max_len - sink - recent, recent=recent + flush,
                                device=DEVICE, key_bits=key_bits, centered=centered)
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


def test_graph_step_decode_equals_the_host_decode():
    """The decode operator (planned once for the capacities, counts and ring start read on the device; q rotated by
    its stage 0) gives the host launch's output over the same tokens, a left-padded row included."""
    from oscar_hf.kernels.decode.triton import decode_static

    static, host = static_and_host_layers(128, max_len=400, sink_tokens=4, recent_tokens=8, flush_tokens=3)
    kv = randn(2, 2, 2, 300, 128, seed=12).to(torch.bfloat16)
    kv[:, 1, :, :5] = 30.0
    mask = torch.ones(2, 1, 1, 400, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :5] = False
    for layer in (static, host):
        layer.update(kv[0, :, :, :250], kv[1, :, :, :250])
    for t in range(250, 300):
        for layer in (static, host):
            layer.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        if t % 7 == 0:
            query = randn(2, 8, 1, 128, seed=t).to(torch.bfloat16)
            got = decode_static(query, static.packed(), mask, None, static.decode_splits)
            want = decode(query, host.packed(), mask[..., :301], None)
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert static.recent_start != 0


def test_graph_step_decode_with_per_head_rotations_equals_the_host_decode():
    """Per-KV-head rotations through the graph step (the append kernel rotating q by its KV head's R_K, the decode's
    history share taken back by each KV head's R_V in one batched GEMM) give the host launch's output, whose stage 0
    rotates q itself, and the torch twin's."""
    from oscar_hf.kernels.decode.triton import decode_static

    static, host = static_and_host_layers(64, max_len=120, heads=2, sink_tokens=4, recent_tokens=8, flush_tokens=3)
    kv = randn(2, 2, 2, 100, 64, seed=16).to(torch.bfloat16)
    mask = torch.ones(2, 1, 1, 120, dtype=torch.bool, device=DEVICE)
    for layer in (static, host):
        layer.update(kv[0, :, :, :90], kv[1, :, :, :90])
    for t in range(90, 100):
        query = randn(2, 6, 1, 64, seed=t).to(torch.bfloat16)
        key, value = host.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        static.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1], leave_to_attention=True)
        if t % 4 == 1:
            rotated = static.store_pending(query)
            got = decode_static(query, static.packed(), mask, None, static.decode_splits, rotated)
            want = decode(query, host.packed(), mask[..., : t + 1], None)
            twin = naive_attend(Attn(3), query, key, value, mask[..., : t + 1], None)
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(got.float(), twin.float(), rtol=2e-2, atol=2e-2)
    static.check_flags()  # stores the last token left pending; no flag raised
    assert host.n_history > 0 and static.counts.tolist()[:3] == [host.n_sink, host.n_history, host.n_recent]


@pytest.mark.parametrize("batch, heads, groups, dim, q_len", [(2, 2, 4, 64, 1), (1, 3, 3, 128, 1), (2, 2, 2, 64, 3)],
                         ids=["B2-g4-D64", "B1-g3-D128", "B2-g2-D64-q3"])
def test_decode_with_per_head_rotations_equals_the_torch_twin(batch, heads, groups, dim, q_len):
    """Random per-KV-head rotations (each head's own R_K and R_V) over windows and a centered history, with a
    left-padded row: the kernel (stage 0 rotating each query head by its KV head's R_K, the output's history share
    taken back by its R_V) equals the torch twin, and is as close to fp32 as the twin is."""
    generator = torch.Generator().manual_seed(17)
    rotations = [torch.linalg.qr(torch.randn(heads, dim, dim, generator=generator)).Q for _ in range(2)]
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8, flush_tokens=2, backend="torch")
    layer = DynamicOscarLayer(cfg, *rotations)
    total = 120
    kv = randn(2, batch, heads, total, dim, seed=18).to(torch.bfloat16)
    kv[:, -1, :, :5] = 30.0  # left padding of the last row: huge K/V, a leak would show
    layer.update(kv[0, :, :, :-q_len], kv[1, :, :, :-q_len])
    key, value = layer.update(kv[0, :, :, -q_len:], kv[1, :, :, -q_len:])
    mask = torch.ones(batch, 1, q_len, total, dtype=torch.bool, device=DEVICE).tril(total - q_len)
    mask[-1, ..., :5] = False
    query = randn(batch, heads * groups, q_len, dim, seed=19).to(torch.bfloat16)
    assert layer.n_history > 0 and layer.rotation("key").shape == (heads, dim, dim)
    assert kernel_serves(query, layer, mask)
    got = decode(query, layer.packed(), mask, None)
    want = naive_attend(Attn(groups), query, key, value, mask, None)
    exact = fp32_reference(query, layer, mask, groups)
    assert got.shape == want.shape == (batch, q_len, heads * groups, dim)
    err, twin_err = (got.float() - exact).abs().max().item(), (want.float() - exact).abs().max().item()
    assert err <= 2 * twin_err + 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max().item(), (err, twin_err)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[torch.bfloat16],
                               atol=TOLERANCE[torch.bfloat16])
    shared = DynamicOscarLayer(cfg, rotations[0][0], rotations[1][0])  # every head with head 0's rotations
    shared.update(kv[0], kv[1])
    assert (decode(query, shared.packed(), mask, None).float() - got.float()).abs().max() > 1e-2


def test_graph_step_flags_a_full_cache_and_non_finite_rows():
    static, _ = static_and_host_layers(64, max_len=20, sink_tokens=2, recent_tokens=2, flush_tokens=2)
    kv = randn(2, 1, 2, 21, 64, seed=13).to(torch.bfloat16)
    static.update(kv[0, :, :, :19], kv[1, :, :, :19])
    static.update(kv[0, :, :, 19:20], kv[1, :, :, 19:20])
    static.update(kv[0, :, :, 20:21], kv[1, :, :, 20:21])  # the 21st token: flagged on the device, not stored
    with pytest.raises(ValueError, match="full"):
        static.get_seq_length()
    for side, flag in ((0, 1), (1, 4)):  # K's and V's programs flag their own bits (the flag layout of kernels.flags)
        static.reset()
        assert static.get_seq_length() == 0 and static.flags.tolist() == [0, 0]
        bad = kv.clone()
        bad[side, 0, 1, 3] = float("nan")  # stored by the first step, demoted by the third
        static.update(bad[0, :, :, :3], bad[1, :, :, :3])
        for t in range(3, 6):  # the NaN row reaches the history on a step
            static.update(bad[0, :, :, t : t + 1], bad[1, :, :, t : t + 1])
        assert static.flags.tolist() == [flag, 0]
        with pytest.raises(ValueError, match="NaN"):
            static.materialize("key")


@pytest.mark.parametrize("prompt, steps", [(2, 0), (9, 0), (11, 0), (11, 9)],
                         ids=["sink", "recent", "first-demotion-sets-the-means", "demotion-ring-wrapped"])
def test_crop_of_one_undoes_a_graph_step_exactly(prompt, steps):
    """After a prompt and some graph steps, a step is undone (crop(-1)), taken again and followed by one more: the
    layer then holds, bit for bit, what a layer that took those two steps once holds. crop(0) touches nothing."""
    config = dict(sink_tokens=4, recent_tokens=5, flush_tokens=3)  # a window of 7 tokens, a ring of 8 rows
    undone, straight = (static_and_host_layers(64, **config)[0] for _ in range(2))
    kv = ((randn(2, 2, 3, 40, 64, seed=14) * 8).round() / 4).to(torch.bfloat16)

    def step(layer, t):
        layer.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])

    for layer in (undone, straight):
        layer.update(kv[0, :, :, :prompt], kv[1, :, :, :prompt])
        for t in range(prompt, prompt + steps):
            step(layer, t)
    t = prompt + steps
    assert undone.is_croppable
    before = undone.counts.tolist()
    step(undone, t)
    assert undone.counts.tolist()[:4] != before[:4]
    undone.crop(0)
    undone.crop(-1)
    assert undone.counts.tolist()[:4] == before[:4] and undone.counts.tolist()[4] == -1
    for layer in (undone, straight):
        step(layer, t)
        step(layer, t + 1)
    assert undone.counts.tolist() == straight.counts.tolist()
    assert straight.n_history == (0 if prompt + steps < 11 else 3 + steps // 3 * 3)
    for side in ("key", "value"):
        assert torch.equal(undone.materialize(side), straight.materialize(side))
        assert torch.equal(undone.center[side], straight.center[side])
    for name, t in straight.history.tensors.items():
        assert torch.equal(undone.history[name][:, :, : straight.n_history], t[:, :, : straight.n_history]), name


def test_crop_of_one_after_host_side_changes_removes_the_newest_token():
    """Once host-side code has changed a static layer since its last graph step (here: two tokens at once), crop(-1)
    no longer restores the counts before that step; it drops the newest token as any crop does."""
    static, host = static_and_host_layers(64, sink_tokens=2, recent_tokens=4, flush_tokens=2)
    kv = randn(2, 1, 2, 12, 64, seed=15).to(torch.bfloat16)
    for layer in (static, host):
        for chunk in (slice(0, 8), slice(8, 9), slice(9, 11)):  # a prompt, a (graph) step, two tokens
            layer.update(kv[0, :, :, chunk], kv[1, :, :, chunk])
        layer.crop(-1)
    assert static.counts.tolist()[4] == -1
    assert static.get_seq_length() == host.get_seq_length() == 10
    torch.testing.assert_close(static.materialize("key"), host.materialize("key"), rtol=0, atol=0)


class _ImmediateEvent:
    """torch.Event for the CPU, which has none (and computes before the host reads anyway)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass


@pytest.mark.parametrize("stop", ["eos", "max-length"])
def test_overlapped_generate_equals_generate_and_leaves_the_same_cache(monkeypatch, stop):
    """overlapped_sample with the stop check deferred (let onto the CPU here): the same tokens as generate, the extra
    step of an EOS stop undone (crop(-1)), so that the cache holds what generate's holds and continues alike."""
    from oscar_hf import generation, overlapped_sample

    model = bf16_model()
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(5)).to(DEVICE)

    def run(eos, **kwargs):
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, sink_tokens=4,
                                                    recent_tokens=8, flush_tokens=3, backend="triton",
                                                    max_cache_len=60)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             past_key_values=cache, eos_token_id=eos, pad_token_id=0, disable_compile=True, **kwargs)
        more = torch.cat([out, out[:, -1:]], dim=1)  # one more turn from the cache
        again = model.generate(input_ids=more, attention_mask=torch.ones_like(more), max_new_tokens=3,
                               do_sample=False, past_key_values=cache, pad_token_id=0, disable_compile=True)
        return out, again, cache

    plain, _, _ = run(None)
    new = plain[0, 30:].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 4 and t not in new[:i]) if stop == "eos" else None
    want, want_again, want_cache = run(eos)
    finished = []
    if DEVICE == "cpu":
        monkeypatch.setattr(torch, "Event", _ImmediateEvent)
        rule = generation.deferred_stop_check().is_supported  # its rule, as if on an accelerator
        monkeypatch.setattr(generation.deferred_stop_check(), "is_supported",
                            staticmethod(lambda device, *args, **kwargs: rule(torch.device("meta"), *args, **kwargs)))
    finish = generation.deferred_stop_check().finish
    monkeypatch.setattr(generation.deferred_stop_check(), "finish",
                        lambda self: finished.append(finish(self)) or finished[-1])
    got, got_again, got_cache = run(eos, custom_generate=overlapped_sample)
    assert finished == [1 if stop == "eos" else 0], "the stop check was deferred; an EOS stop undid a step"
    assert got.shape[1] < 40 if stop == "eos" else got.shape[1] == 40
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_again, want_again, rtol=0, atol=0)
    assert got_cache.layers[0].counts.tolist()[:4] == want_cache.layers[0].counts.tolist()[:4]
    assert not got_cache.layers[0].defers_host_reads


def test_overlapped_sample_refuses_beams_and_a_cache_too_small():
    from oscar_hf import overlapped_sample

    model = bf16_model()
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                backend="triton", max_cache_len=38)
    with pytest.raises(ValueError, match="beam"):
        model.generate(input_ids=ids, max_new_tokens=4, num_beams=2, custom_generate=overlapped_sample)
    with pytest.raises(ValueError, match=r"max_cache_len=38\) cannot hold the 39 tokens"):
        model.generate(input_ids=ids, max_new_tokens=10, past_key_values=cache, custom_generate=overlapped_sample)
    assert cache.get_seq_length() == 0  # refused before the prefill


def per_head_bundle(config) -> OscarRotations:
    """Per-KV-head rotations for ``config``: :func:`signed_hadamard` ones, different per layer and head (V's: K's
    transposed)."""
    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    key = torch.stack([signed_hadamard(dim, heads, seed=layer) for layer in range(layers)])
    return OscarRotations(key, key.mT, num_kv_heads=heads)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_compiled_generate_is_one_graph_with_a_static_cache(per_head):
    """With max_cache_len and the Triton backend, generate's compiled decode step traces whole (update and attention
    included: no graph break, one graph for every step) and gives the eager static cache's tokens, which equal
    the growing cache's; with shared rotations and with one per KV head."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = bf16_model()
    bundle = per_head_bundle(model.config) if per_head else OscarRotations.hadamard(model.config)
    ids = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    compile_config = CompileConfig(backend="aot_eager", mode=None)  # inductor works too, but compiles C++ slowly
    compile_config._compile_all_devices = True

    def run(max_cache_len=None, **kwargs):
        cache = OscarQuantizedCache.from_pretrained(bundle, model=model, sink_tokens=4, recent_tokens=8,
                                                    flush_tokens=3, backend="triton", max_cache_len=max_cache_len)
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              past_key_values=cache, pad_token_id=0, **kwargs), cache

    growing, _ = run()
    eager, _ = run(50, disable_compile=True)
    torch._dynamo.reset()
    counters.clear()
    compiled, cache = run(50, compile_config=compile_config)
    assert cache.layers[0].graph_step and cache.layers[0].n_history > 0
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, growing, rtol=0, atol=0)


@pytest.mark.parametrize("dim, groups, centering", [(64, 4, True), (128, 2, True), (128, 1, False)])
@pytest.mark.parametrize("extra", ["softcap", "sinks", "both"])
def test_decode_soft_capping_and_learned_sinks_equal_the_torch_twin(dim, groups, centering, extra):
    """Gemma-2's capped logits (the history's with q·μ_K included) and gpt-oss's sink logits in the decode kernel,
    over windows, a centered history and a left-padded row, with random rotations (the output's two shares)."""
    batch, heads = 2, 2
    generator = torch.Generator().manual_seed(11)
    rotations = [torch.linalg.qr(torch.randn(dim, dim, generator=generator)).Q for _ in range(2)]
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8, flush_tokens=2, backend="torch", centering=centering)
    layer = DynamicOscarLayer(cfg, *rotations)
    kv = randn(2, batch, heads, 150, dim, seed=12).to(torch.bfloat16)
    kv[:, 1, :, :5] = 30.0
    layer.update(kv[0, :, :, :-1], kv[1, :, :, :-1])
    key, value = layer.update(kv[0, :, :, -1:], kv[1, :, :, -1:])
    mask = torch.ones(batch, 1, 1, 150, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :5] = False
    query = randn(batch, heads * groups, 1, dim, seed=13).to(torch.bfloat16)
    kwargs = {"softcap": 0.8 if extra != "sinks" else None,
              "sinks": randn(heads * groups, seed=14) + 6 if extra != "softcap" else None}
    got = decode(query, layer.packed(), mask, None, **kwargs)
    want = decode_reference.attend(Attn(groups), query, layer.packed(), key.new, value.new, mask, None, **kwargs)
    k32, v32 = (layer.materialize(side, dtype=torch.float32) for side in ("key", "value"))
    exact = decode_reference.dense_attention(Attn(groups), query.float(), k32, v32, mask, None, **kwargs)
    # as close to fp32 as the torch twin (which computes the logits in bf16, as the models' eager attention does),
    # up to the kernel's own roundings (p in bf16 for the tensor cores)
    err, twin_err = (got.float() - exact).abs().max().item(), (want.float() - exact).abs().max().item()
    assert err <= 2 * twin_err + 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max().item(), (err, twin_err)
    plain = decode(query, layer.packed(), mask, None)
    assert (got.float() - plain.float()).abs().max() > 0.1, "the cap or the sinks change the output"


def test_dequantize_backend_falls_back_to_the_twin_where_the_kernel_cannot_serve():
    """Rows of 48 channels at 2 bits are 12 bytes, not a power of two: the "triton" reader uses the twin."""
    from oscar_hf.kernels import dequantize_backend
    from oscar_hf.kernels.dequantize.triton import supports_rows

    assert supports_rows(64, 2) and supports_rows(512, 2) and not supports_rows(48, 2)
    rows = quantize(randn(1, 1, 9, 48, seed=5), bits=2, group_size=48)
    got, want = (torch.empty(1, 1, 9, 48, device=DEVICE) for _ in range(2))
    dequantize_backend("triton", torch.device(DEVICE))(rows, None, got, bits=2)
    dequantize_backend("torch", torch.device(DEVICE))(rows, None, want, bits=2)
    assert torch.equal(got, want)


def test_cuda_library_errors_name_the_call_and_the_error(monkeypatch):
    """An NVRTC or driver failure raises a RuntimeError naming the call and the library's error name, or its number
    where the driver cannot name it (stand-in libraries: the real ones need CUDA)."""
    import types

    from oscar_hf.kernels.decode import cuda

    def driver_name(result, name_ref):
        if result == 700:
            name_ref._obj.value = b"CUDA_ERROR_ILLEGAL_ADDRESS"
            return 0
        return 1  # CUDA_ERROR_INVALID_VALUE: no name for that number

    nvrtc = types.SimpleNamespace(nvrtcGetErrorString=lambda result: b"NVRTC_ERROR_COMPILATION")
    monkeypatch.setattr(cuda, "_libraries", lambda: (nvrtc, types.SimpleNamespace(cuGetErrorName=driver_name)))
    cuda._check(0, "cuLaunchKernel")  # success raises nothing
    with pytest.raises(RuntimeError, match="nvrtcCompileProgram failed with NVRTC_ERROR_COMPILATION"):
        cuda._check(6, "nvrtcCompileProgram")
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed with CUDA_ERROR_ILLEGAL_ADDRESS"):
        cuda._check(700, "cuLaunchKernel")
    with pytest.raises(RuntimeError, match="cuModuleLoadData failed with 999$"):
        cuda._check(999, "cuModuleLoadData")


def test_the_cuda_history_kernel_is_chosen_by_name_and_never_where_it_cannot_run():
    """``DecodeConfig.history_kernel`` names a registered kernel (ValueError listing them otherwise); the CUDA kernel
    names why it does not serve a call off CUDA, and a decode asking for it under the interpreter runs Triton's
    history programs."""
    from oscar_hf.kernels.decode import cuda

    with pytest.raises(ValueError, match="history_kernel must be one of"):
        DecodeConfig(history_kernel="gluon")
    query = torch.randn(1, 4, 1, 128, dtype=torch.bfloat16)
    history = [torch.zeros(1, 1, 64, 32, dtype=torch.uint8), *[torch.zeros(1, 1, 64, 1, dtype=torch.float16)] * 2] * 2
    assert "needs CUDA" in cuda.unserved(query, query, history, 2, 2, 128, None, 64, 3)
    assert cuda.unserved(query, query, history, 2, 2, 64, None, 64, 3) == "head_dim 128 with groups of 64 channels"
    assert cuda.block_shared_memory(256, 4, 4, 64, 4) > 227 * 1024  # more than an H100's or H200's block has
    if DEVICE == "cpu":
        check_decode(1, 2, 4, 128, 70, torch.bfloat16, config=DecodeConfig(history_kernel="cuda"), pads=(3,))
