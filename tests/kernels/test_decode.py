"""The decode kernel (split-K attention over a PackedKV) against its torch twin (``decode.reference.attend``) and
an fp32 reference, over storage built from plain tensors by the torch writer; its launch plan; and the "triton"
backend's dispatch: on the CPU under TRITON_INTERPRET=1 (set by conftest.py), or compiled on a GPU."""

import math

import pytest
import torch

pytest.importorskip("triton")

from helpers import signed_hadamard  # noqa: E402
from packed_inputs import DEVICE, DTYPE_IDS, Attn, pack, randn  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from oscar_hf.kernels import ATTENTION_BACKENDS, WRITE_BACKENDS, PackedKV  # noqa: E402
from oscar_hf.kernels.decode import launch  # noqa: E402
from oscar_hf.kernels.decode import reference as decode_reference  # noqa: E402
from oscar_hf.kernels.decode.launch import DecodeConfig  # noqa: E402
from oscar_hf.kernels.decode.triton import decode, decode_stage2_kernel  # noqa: E402
from oscar_hf.kernels.dequantize.reference import materialize  # noqa: E402
from oscar_hf.quantizer import QUANTIZERS  # noqa: E402


def test_backends_registered():
    assert "triton" in ATTENTION_BACKENDS and "triton" in WRITE_BACKENDS


def filled(batch, heads, dim, n_history, dtype, *, sink=4, recent=8, pads=(), seed=0, key_ramp=0.0, spike=None,
           q_len=1, **config):
    """Storage holding ``sink ‖ n_history quantized ‖ recent`` tokens (:func:`packed_inputs.pack`) as a layer holds
    them after a prefill of all but the newest token and one decode step (with one-token demotions: the prefill's
    history rows set the means), its ``q_len`` newest K and V ``[B, H, q, D]`` (the twin reads them at full
    precision) and the mask. Left-padded positions hold
    huge K/V, so any leak shows; ``key_ramp`` scales the keys up along the sequence (to ``1 + key_ramp`` times), so
    the logits' max keeps rising; ``spike``: (position, keys ``[B, H, D]``) replaces the keys there."""
    total = sink + n_history + recent
    kv = randn(2, batch, heads, total, dim, seed=seed)
    kv[0] *= 1 + key_ramp * torch.linspace(0, 1, total, device=kv.device)[:, None]
    if spike is not None:
        kv[0, :, :, spike[0]] = spike[1]
    for row, pad in enumerate(pads):
        kv[:, row, :, :pad] = 30.0
    key, value = kv.to(dtype).unbind(0)
    packed = pack(key, value, sink=sink, recent=recent, center_tokens=max(1, n_history - 1), **config)
    mask = None
    if pads:
        mask = torch.ones(batch, 1, 1, total, dtype=torch.bool, device=DEVICE)
        for row, pad in enumerate(pads):
            mask[row, ..., :pad] = False
    return packed, (key[:, :, -q_len:], value[:, :, -q_len:]), mask


def fp32_reference(query, packed, mask, groups):
    """Attention in fp32 over exactly what the storage holds (history dequantized in fp32)."""
    key, value = (materialize(packed, side, dtype=torch.float32) for side in ("key", "value"))
    out, _ = sdpa_attention_forward(Attn(groups), query.float(), key, value, mask, scaling=None)
    return out


def kernel_serves(query, packed, mask, recent_tokens: int) -> bool:
    return launch.supports_call(query, packed, mask, recent_tokens, sum(packed.lengths()[:3]))


TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def check_decode(batch, heads, groups, dim, n_history, dtype, config=None, seed=0, spike=None, **kwargs):
    """Checks ``decode`` on :func:`filled` against the torch twin and fp32; returns the query and the storage.
    ``spike``: (position, factor): the key there is ``factor`` times the sum of its group's queries."""
    query = randn(batch, heads * groups, 1, dim, seed=seed + 1).to(dtype)
    if spike is not None:
        kwargs["spike"] = spike[0], spike[1] * query.float().reshape(batch, heads, groups, dim).sum(2)
    packed, (key, value), mask = filled(batch, heads, dim, n_history, dtype, seed=seed, **kwargs)
    got = decode(query, packed, mask, None, config)
    want = decode_reference.attend(Attn(groups), query, packed, key, value, mask, None)
    exact = fp32_reference(query, packed, mask, groups)
    assert got.shape == want.shape == (batch, 1, heads * groups, dim) and got.dtype == dtype
    # As close to the fp32 result as the torch twin is, up to one more rounding: the kernel feeds p (p·s for the
    # history, whose rounding then weighs a code's distance from the middle one, at most 1.5 steps of s) to the
    # tensor cores in the model dtype, as flash attention does; the twin's CPU SDPA keeps p in fp32
    err, naive_err = (got.float() - exact).abs().max().item(), (want.float() - exact).abs().max().item()
    scales = packed.value.scale  # V steps: the rounding bound
    step = scales.float().abs().max().item() if scales.numel() else 0.0
    rounding = torch.finfo(dtype).eps * (exact.abs().max().item() + 0.75 * step)
    assert err <= 2 * naive_err + rounding, (err, naive_err, rounding)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    return query, packed


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


@pytest.mark.parametrize("dim, key_bits, dtype", [(64, 2, torch.bfloat16), (128, 4, torch.float16)],
                         ids=["D64-paired", "D128-k4"])
@pytest.mark.parametrize("quantizer", ["symmetric", "compact"])
def test_decode_metadata_formats(dim, key_bits, dtype, quantizer):
    """Histories with implied zeros (``-s·(2^bits - 1)/2``, the symmetric quantizer: no zero rows are read) and with
    byte scales and zeros (the compact quantizer), paired tiles and byte tiles."""
    _, packed = check_decode(2, 2, 4, dim, 200, dtype, pads=(0, 9), quantizer=quantizer, key_bits=key_bits)
    assert packed.key.meta == packed.value.meta == QUANTIZERS[quantizer].meta


def test_decode_left_padding_reaches_into_history():
    """Pads of 0, 3 (sink only), 11 (sink and history) and 40 tokens; the padded K/V are huge."""
    check_decode(4, 1, 4, 64, 40, torch.float16, pads=(0, 3, 11, 40))


def test_decode_reads_the_recent_ring_from_its_start():
    """A recent window rolled as graph steps leave it (its oldest token at row 5 of 8), with a row whose padding
    reaches 3 tokens into it: the kernel reads the ring from the counts' start (else the mask would let padding
    through), as the twin does."""
    check_decode(2, 2, 4, 64, 40, torch.bfloat16, pads=(0, 47), ring_start=5)


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
    what the storage holds."""
    config = DecodeConfig(block_n=32, min_split_bytes=1 << 30)
    sink, position = 4, 500
    query, packed = check_decode(1, 2, 4, 128, 1000, torch.bfloat16, config=config, spike=(sink + position, factor))
    history = materialize(packed, "key", dtype=torch.float32)[:, :, sink:sink + 1000]
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
    themselves; a left-padded row; equal to the torch twin over the same tokens."""
    batch, heads, total = 2, 2, 260
    kv = randn(2, batch, heads, total, dim, seed=21)
    if masked:
        kv[:, 1, :, :13] = 30.0  # padding of row 1: huge K/V, a leak would show
    key, value = kv.to(dtype).unbind(0)
    packed = pack(key, value, sink=4, recent=8)
    mask = None
    if masked:
        mask = torch.ones(batch, 1, q_len, total, dtype=torch.bool, device=DEVICE).tril(total - q_len)
        mask[1, ..., :13] = False
    query = randn(batch, heads * groups, q_len, dim, seed=22).to(dtype)
    assert kernel_serves(query, packed, mask, 8)
    got = decode(query, packed, mask, None)
    want = decode_reference.attend(Attn(groups), query, packed, key[:, :, -q_len:], value[:, :, -q_len:], mask, None)
    assert got.shape == want.shape == (batch, q_len, heads * groups, dim)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    # causal among the query tokens: changing the newest token's K and V changes the last output only
    for recent in (packed.recent_k, packed.recent_v):
        recent[:, :, -1] += 3.0
    changed = decode(query, packed, mask, None)
    assert torch.equal(changed[:, :-1], got[:, :-1]) and not torch.equal(changed[:, -1], got[:, -1])
    too_many = query.new_zeros(batch, heads * groups, 9, dim)
    assert not kernel_serves(too_many, packed, None, 8)  # more than the recent window


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
    """Storage of a static Qwen3-8B-shaped layer (``tokens`` in all: 64 sink rows, a ring of 256 + 8 recent rows,
    the history the rest), planned for its capacities on 132 SMs: one tile per sink/recent chunk where the history
    programs, planned for chunks of two, read at most 8 tiles each (twice the window programs, each half as long),
    else two; a config's window_tiles wins."""
    sink, recent, history = 64, 264, tokens - 320
    packed = PackedKV.empty(batch, 8, 128, sink=sink, history=history, recent=recent)
    hist_splits, sink_splits, total, window_tiles = launch.plan(packed, batch)
    chunk = window_tiles * launch.WINDOW_BLOCK[128]
    assert window_tiles == tiles
    assert sink_splits == math.ceil(sink / chunk)
    assert total - hist_splits - sink_splits == math.ceil(recent / chunk)
    two = launch.plan(packed, batch, config=DecodeConfig(**{**vars(launch.default_config(batch, 128)),
                                                           "window_tiles": 2}))
    assert two[3] == 2 and (tiles == 2) == (two == [hist_splits, sink_splits, total, window_tiles])
    assert (history <= 8 * 64 * two[0]) == (tiles == 1)


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
    decode_stage2_kernel[(rows, dim // 32)](part_o, part_lse, out, out_hist, splits, hist_from, query,
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
        dtype, recent, q_len = case.get("dtype", torch.bfloat16), case.get("recent", 8), case.get("q_len", 1)
        kv = randn(2, 1, 2, 40, 64, seed=8).to(dtype)[..., : 27 + q_len, :]
        packed = pack(kv[0], kv[1], sink=4, recent=recent)
        key, value = kv[0, :, :, 27:], kv[1, :, :, 27:]
        query = randn(1, 4, q_len, 64, seed=9).to(dtype)
        got = ATTENTION_BACKENDS["triton"](Attn(2), query, packed, key, value, None, None, recent)
        exact = dtype == torch.float32  # (the interpreter rounds a dequantized bf16 history toward zero)
        torch.testing.assert_close(got, decode_reference.attend(Attn(2), query, packed, key, value, None, None),
                                   rtol=0 if exact else 2e-2, atol=0 if exact else 2e-2)


def test_decode_uncentered_history():
    check_decode(2, 2, 4, 128, 90, torch.bfloat16, centering=False, pads=(0, 6))


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


@pytest.mark.parametrize("batch, heads, groups, dim, q_len", [(2, 2, 4, 64, 1), (1, 3, 3, 128, 1), (2, 2, 2, 64, 3)],
                         ids=["B2-g4-D64", "B1-g3-D128", "B2-g2-D64-q3"])
def test_decode_with_per_head_rotations_equals_the_torch_twin(batch, heads, groups, dim, q_len):
    """Random per-KV-head rotations (each head's own R_K and R_V) over windows and a centered history, with a
    left-padded row: the kernel (stage 0 rotating each query head by its KV head's R_K, the output's history share
    taken back by its R_V) equals the torch twin, and is as close to fp32 as the twin is."""
    generator = torch.Generator().manual_seed(17)
    rotations = [torch.linalg.qr(torch.randn(heads, dim, dim, generator=generator)).Q for _ in range(2)]
    total = 120
    kv = randn(2, batch, heads, total, dim, seed=18).to(torch.bfloat16)
    kv[:, -1, :, :5] = 30.0  # left padding of the last row: huge K/V, a leak would show
    packed = pack(kv[0], kv[1], sink=4, recent=8, key_rotation=rotations[0], value_rotation=rotations[1])
    key, value = kv[0, :, :, -q_len:], kv[1, :, :, -q_len:]
    mask = torch.ones(batch, 1, q_len, total, dtype=torch.bool, device=DEVICE).tril(total - q_len)
    mask[-1, ..., :5] = False
    query = randn(batch, heads * groups, q_len, dim, seed=19).to(torch.bfloat16)
    assert packed.lengths()[1] > 0 and packed.key_rotation.shape == (heads, dim, dim)
    assert kernel_serves(query, packed, mask, 8)
    got = decode(query, packed, mask, None)
    want = decode_reference.attend(Attn(groups), query, packed, key, value, mask, None)
    exact = fp32_reference(query, packed, mask, groups)
    assert got.shape == want.shape == (batch, q_len, heads * groups, dim)
    err, twin_err = (got.float() - exact).abs().max().item(), (want.float() - exact).abs().max().item()
    assert err <= 2 * twin_err + 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max().item(), (err, twin_err)
    torch.testing.assert_close(got.float(), want.float(), rtol=TOLERANCE[torch.bfloat16],
                               atol=TOLERANCE[torch.bfloat16])
    shared = pack(kv[0], kv[1], sink=4, recent=8, key_rotation=rotations[0][0],  # every head with head 0's
                  value_rotation=rotations[1][0])
    assert (decode(query, shared, mask, None).float() - got.float()).abs().max() > 1e-2


@pytest.mark.parametrize("dim, groups, centering", [(64, 4, True), (128, 2, True), (128, 1, False)])
@pytest.mark.parametrize("extra", ["softcap", "sinks", "both"])
def test_decode_soft_capping_and_learned_sinks_equal_the_torch_twin(dim, groups, centering, extra):
    """Gemma-2's capped logits (the history's with q·μ_K included) and gpt-oss's sink logits in the decode kernel,
    over windows, a centered history and a left-padded row, with random rotations (the output's two shares)."""
    batch, heads = 2, 2
    generator = torch.Generator().manual_seed(11)
    rotations = [torch.linalg.qr(torch.randn(dim, dim, generator=generator)).Q for _ in range(2)]
    kv = randn(2, batch, heads, 150, dim, seed=12).to(torch.bfloat16)
    kv[:, 1, :, :5] = 30.0
    packed = pack(kv[0], kv[1], sink=4, recent=8, key_rotation=rotations[0], value_rotation=rotations[1],
                  centering=centering)
    key, value = kv[0, :, :, -1:], kv[1, :, :, -1:]
    mask = torch.ones(batch, 1, 1, 150, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :5] = False
    query = randn(batch, heads * groups, 1, dim, seed=13).to(torch.bfloat16)
    kwargs = {"softcap": 0.8 if extra != "sinks" else None,
              "sinks": randn(heads * groups, seed=14) + 6 if extra != "softcap" else None}
    got = decode(query, packed, mask, None, **kwargs)
    want = decode_reference.attend(Attn(groups), query, packed, key, value, mask, None, **kwargs)
    k32, v32 = (materialize(packed, side, dtype=torch.float32) for side in ("key", "value"))
    exact = decode_reference.dense_attention(Attn(groups), query.float(), k32, v32, mask, None, **kwargs)
    # as close to fp32 as the torch twin (which computes the logits in bf16, as the models' eager attention does),
    # up to the kernel's own roundings (p in bf16 for the tensor cores)
    err, twin_err = (got.float() - exact).abs().max().item(), (want.float() - exact).abs().max().item()
    assert err <= 2 * twin_err + 2 * torch.finfo(torch.bfloat16).eps * exact.abs().max().item(), (err, twin_err)
    plain = decode(query, packed, mask, None)
    assert (got.float() - plain.float()).abs().max() > 0.1, "the cap or the sinks change the output"
