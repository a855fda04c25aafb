"""oscar_hf.diagnostics simulates the layout the cache stores: per-token or per-channel K (token groups of
flush_tokens), centering on OscarConfig.centered_sides only; checked against the quantizer on synthetic K/V with
outlier channels, and end to end on a tiny random model."""

import json
import math

import pytest
import torch
from helpers import VOCAB, make_model

from oscar_hf import OscarConfig, OscarRotations, diagnose
from oscar_hf.diagnostics import METRICS, DiagnosticsObserver, most_sensitive_layers
from oscar_hf.quantizer import dequantize, dequantize_per_channel, quantize, quantize_per_channel

B, H, G, T, D = 1, 2, 2, 128, 64  # batch, KV heads, query heads per KV head, tokens, head_dim
PER_TOKEN = OscarConfig(group_size=32, k_clip=1.0, flush_tokens=16, sink_tokens=0)
PER_CHANNEL = PER_TOKEN.replace(key_quantization="per-channel")


def outlier_keys(seed: int = 0) -> torch.Tensor:
    """K ``[B, H, T, D]`` with a few large channels, as Gemma's global layers have: an offset and a slow swing over
    the tokens (which centering does not take out), so a per-token 2-bit grid spends its levels on them while a
    per-channel one over a few consecutive tokens sees a narrow range."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=gen)
    phase = 2 * math.pi * torch.rand(4, generator=gen)
    swing = torch.cos(2 * math.pi * torch.arange(T)[:, None] / T + phase)  # [T, 4]
    k[..., :4] = 40.0 + 30.0 * swing + 0.5 * torch.randn(B, H, T, 4, generator=gen)
    return k


def observed(config: OscarConfig, key: torch.Tensor, seed: int = 1) -> dict:
    """One observe() of ``key`` (identity rotations) with random queries and values; that layer's metrics."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(B, H * G, T, D, generator=gen) / 8
    value = torch.randn(B, H, T, D, generator=gen) + 3.0
    eye = torch.eye(D).expand(1, D, D)
    observer = DiagnosticsObserver(OscarRotations(eye, eye, num_kv_heads=H), config)
    scaling = D**-0.5
    p = torch.einsum("bhgtd,bhsd->bhgts", query.reshape(B, H, G, T, D), key) * scaling
    p = p.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf).softmax(-1)
    output = torch.einsum("bhgts,bhsd->bhgtd", p, value).reshape(B, H * G, T, D)
    observer.observe(0, query, key, value, output, scaling)
    return observer.results()[0]


def relative_error(x_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x_hat - x) ** 2).sum() / (x**2).sum())


def test_per_channel_keys_are_quantized_per_channel_over_token_groups_uncentered():
    k = outlier_keys()
    row = observed(PER_CHANNEL, k)
    # the cache's layout: K per channel over groups of flush_tokens, not centered (centered_sides is V alone)
    assert PER_CHANNEL.centered_sides == ("value",)
    rows = quantize_per_channel(k, token_group=PER_CHANNEL.flush_tokens, bits=2, scale_dtype=torch.float16)
    assert row["k_error"] == pytest.approx(relative_error(dequantize_per_channel(rows, 2), k), rel=1e-6)
    centered = k - k.mean(dim=2, keepdim=True)
    rows = quantize_per_channel(centered, token_group=PER_CHANNEL.flush_tokens, bits=2, scale_dtype=torch.float16)
    assert row["k_error"] != pytest.approx(relative_error(dequantize_per_channel(rows, 2), centered), rel=1e-6)
    assert row["k_clip_rate"] == 0.0


def test_per_channel_keys_beat_per_token_on_outlier_channels():
    k = outlier_keys()
    token, channel = observed(PER_TOKEN, k), observed(PER_CHANNEL, k)
    assert channel["k_error"] < 0.2 * token["k_error"], (channel["k_error"], token["k_error"])
    assert channel["score_kl"] < 0.2 * token["score_kl"], (channel["score_kl"], token["score_kl"])
    assert channel["v_error"] == token["v_error"]  # V is per token and centered in both layouts


def test_per_token_keys_and_values_are_centered_and_quantized_per_token():
    k = outlier_keys()
    for config in (PER_TOKEN, PER_TOKEN.replace(centering=False), OscarConfig(group_size=32, sink_tokens=0)):
        row = observed(config, k)
        center = k.mean(dim=2, keepdim=True) if config.centering else 0.0
        rows = quantize(k - center, bits=2, group_size=32, clip=config.k_clip, scale_dtype=torch.float16)
        assert row["k_error"] == pytest.approx(relative_error(dequantize(rows, 2) + center, k), rel=1e-6)


def test_the_sink_stays_exact_and_the_errors_are_over_the_quantized_tokens():
    """As in the cache: the first sink_tokens are not quantized; centering and the relative errors see the rest."""
    k = outlier_keys()
    k[:, :, 0] *= 50  # an attention-sink token of large norm
    sink = PER_TOKEN.replace(sink_tokens=8)
    k_hat = DiagnosticsObserver(None, sink)._quantized(k, 1.0, "key")
    assert torch.equal(k_hat[:, :, :8], k[:, :, :8])
    rest = k[:, :, 8:]
    center = rest.mean(dim=2, keepdim=True)
    rows = quantize(rest - center, bits=2, group_size=32, clip=1.0, scale_dtype=torch.float16)
    torch.testing.assert_close(k_hat[:, :, 8:], dequantize(rows, 2) + center)
    assert observed(sink, k)["k_error"] == pytest.approx(relative_error(k_hat[:, :, 8:], rest), rel=1e-5)


def test_per_channel_partial_token_group_stays_exact():
    """A chunk whose length is not a multiple of flush_tokens: its last tokens stay exact, as in the recent window."""
    k = outlier_keys()[:, :, : 2 * PER_CHANNEL.flush_tokens + 5]
    k_hat = DiagnosticsObserver(None, PER_CHANNEL)._quantized(k, 1.0, "key")
    whole = 2 * PER_CHANNEL.flush_tokens
    assert torch.equal(k_hat[:, :, whole:], k[:, :, whole:])
    rows = quantize_per_channel(k[:, :, :whole], token_group=PER_CHANNEL.flush_tokens, scale_dtype=torch.float16)
    assert torch.equal(k_hat[:, :, :whole], dequantize_per_channel(rows, 2))


def test_diagnose_per_channel_on_a_tiny_model():
    model = make_model("qwen3-gqa-qknorm-d128")
    chunks = [torch.randint(3, VOCAB, (64,), generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    rotations = OscarRotations.identity(model.config)
    config = OscarConfig(k_clip=1.0, flush_tokens=16, sink_tokens=4)
    token = diagnose(model, rotations, chunks, config)
    channel = diagnose(model, rotations, chunks, config.replace(key_quantization="per-channel"))
    for row_t, row_c in zip(token, channel):
        assert row_c["tokens"] == 128 and all(math.isfinite(row_c[name]) for name in METRICS)
        assert row_c["k_error"] != row_t["k_error"] and row_c["v_error"] == row_t["v_error"]


def test_most_sensitive_layers_ranks_by_the_metric():
    rows = [{"layer": i, "score_kl": kl, "k_error": 1.0 - kl} for i, kl in enumerate([0.2, 0.9, 0.1, 0.5])]
    assert most_sensitive_layers(rows, 0.5) == [1, 3]
    assert most_sensitive_layers(rows, 0.5, metric="k_error") == [0, 2]
    assert most_sensitive_layers(rows, 0.0) == [] and most_sensitive_layers(rows, 1.0) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="fraction"):
        most_sensitive_layers(rows, 1.5)
    with pytest.raises(ValueError, match="output_error"):
        most_sensitive_layers(rows, 0.5, metric="output_error")


def test_diagnostics_quantize_each_layer_at_its_own_key_bits():
    """With key_bits_layers, the listed layer's K error is the 4-bit one, the other layer's the 2-bit one."""
    model = make_model("qwen3-gqa-qknorm-d128")
    chunks = [torch.randint(3, VOCAB, (64,), generator=torch.Generator().manual_seed(0))]
    rotations = OscarRotations.identity(model.config)
    two, four = (diagnose(model, rotations, chunks, OscarConfig(key_bits=bits, sink_tokens=4)) for bits in (2, 4))
    mixed = diagnose(model, rotations, chunks, OscarConfig(key_bits=4, key_bits_layers=[1], sink_tokens=4))
    assert mixed[0]["k_error"] == two[0]["k_error"] and mixed[1]["k_error"] == four[1]["k_error"]
    assert four[1]["k_error"] < two[1]["k_error"] / 4


def test_four_bit_keys_are_diagnosed_unclipped_as_the_cache_stores_them():
    k = outlier_keys()
    config = OscarConfig(group_size=32, sink_tokens=0, k_clip=0.9, key_bits=4)
    row = observed(config, k)
    assert row["k_clip_rate"] == 0.0 and row["v_clip_rate"] > 0.0
    center = k.mean(dim=2, keepdim=True)
    rows = quantize(k - center, bits=4, group_size=32, clip=1.0, scale_dtype=torch.float16)
    assert row["k_error"] == pytest.approx(relative_error(dequantize(rows, 4) + center, k), rel=1e-6)


@pytest.mark.parametrize("content, match", [
    pytest.param("[{\"layer\": 0,", r"diagnostics.json is not valid JSON", id="truncated"),
    pytest.param({"layer": 0}, r"diagnostics.json must be a JSON list of per-layer rows; got dict", id="an-object"),
    pytest.param([{"score_kl": 0.1}], r"diagnostics.json \(row 0\) lacks the field 'layer'", id="no-layer"),
    pytest.param([{"layer": "0"}], r"diagnostics.json \(row 0\): the field 'layer' must be an integer", id="str-layer"),
    pytest.param([dict.fromkeys(METRICS, 0.1) | {"layer": 0, "tokens": 64, "score_kl": None}],
                 r"diagnostics.json \(row 0\): the field 'score_kl' must be a number", id="null-metric"),
])
def test_a_bundles_diagnostics_file_is_checked_naming_the_file_and_field(tmp_path, content, match):
    """Rows as diagnose() writes them (or with some of its metrics) round-trip; a broken diagnostics.json raises a
    ValueError naming it and the field, not a bare JSON error or a KeyError later."""
    rows = [dict.fromkeys(METRICS, 0.5) | {"layer": 0, "tokens": 64}, {"layer": 1, "score_kl": 0.3}]
    eye = torch.eye(D).expand(2, D, D)
    bundle = OscarRotations(eye, eye, num_kv_heads=H)
    bundle.diagnostics = rows
    bundle.save_pretrained(tmp_path)
    assert OscarRotations.from_pretrained(tmp_path).diagnostics == rows
    (tmp_path / "diagnostics.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=match):
        OscarRotations.from_pretrained(tmp_path)
