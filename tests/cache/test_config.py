"""oscar_hf.config.OscarConfig: defaults, serialization, validation, group size and bits per element."""

import json

import pytest
import torch

from oscar_hf.config import OscarConfig

NON_DEFAULT = dict(
    bits=4,
    key_bits=2,
    key_bits_layers=[0, 3],
    group_size=32,
    sink_tokens=4,
    recent_tokens=128,
    flush_tokens=16,
    k_clip=1.0,
    v_clip=0.9,
    scale_dtype="bfloat16",
    quantizer="uniform",
    centering=False,
    key_quantization="per-channel",
    backend="torch",
    quantize_sliding=True,
    sliding_recent_tokens=64,
)
PER_CHANNEL = dict(key_quantization="per-channel", k_clip=1.0, centering=False)


def test_defaults_match_the_spec():
    assert OscarConfig().to_dict() == dict(
        bits=2,
        key_bits=None,
        key_bits_layers=None,
        group_size=None,
        sink_tokens=64,
        recent_tokens=256,
        flush_tokens=8,
        k_clip=0.96,
        v_clip=0.92,
        scale_dtype="float16",
        quantizer="uniform",
        centering=True,
        key_quantization="per-token",
        backend="auto",
        quantize_sliding=False,
        sliding_recent_tokens=None,
    )
    assert OscarConfig().torch_scale_dtype == torch.float16


def test_json_round_trip():
    config = OscarConfig(**NON_DEFAULT)
    assert json.loads(config.to_json()) == NON_DEFAULT
    assert OscarConfig.from_json(config.to_json()) == config
    assert OscarConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    "dtype, name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")], ids=str
)
def test_scale_dtype_accepts_torch_dtypes(dtype, name):
    config = OscarConfig(scale_dtype=dtype)
    assert config.scale_dtype == name and config.torch_scale_dtype == dtype
    assert json.loads(config.to_json())["scale_dtype"] == name


@pytest.mark.parametrize(
    "overrides, field",
    [
        pytest.param(dict(bits=3), "bits", id="bits-3"),
        pytest.param(dict(bits=True), "bits", id="bits-True"),
        pytest.param(dict(bits=2.0), "bits", id="bits-2.0"),
        pytest.param(dict(group_size=48), "group_size", id="group_size-48"),
        pytest.param(dict(group_size=0), "group_size", id="group_size-0"),
        pytest.param(dict(group_size=-64), "group_size", id="group_size--64"),
        pytest.param(dict(sink_tokens=-1), "sink_tokens", id="sink_tokens--1"),
        pytest.param(dict(recent_tokens=2.5), "recent_tokens", id="recent_tokens-2.5"),
        pytest.param(dict(flush_tokens=0), "flush_tokens", id="flush_tokens-0"),
        pytest.param(dict(k_clip=0), "k_clip", id="k_clip-0"),
        pytest.param(dict(k_clip=1.5), "k_clip", id="k_clip-1.5"),
        pytest.param(dict(v_clip=-0.1), "v_clip", id="v_clip--0.1"),
        pytest.param(dict(v_clip="a"), "v_clip", id="v_clip-str"),
        pytest.param(dict(scale_dtype="int8"), "scale_dtype", id="scale_dtype-int8"),
        pytest.param(dict(scale_dtype=torch.int8), "scale_dtype", id="scale_dtype-torch.int8"),
        pytest.param(dict(quantizer="kmeans"), "quantizer", id="quantizer-kmeans"),
        pytest.param(dict(backend="cuda"), "backend", id="backend-cuda"),
        pytest.param(dict(centering="yes"), "centering", id="centering-str"),
        pytest.param(dict(quantizer="lloyd-max", bits=4), "quantizer", id="lloyd-max-bits-4"),
        pytest.param(dict(quantizer="lloyd-max", key_bits=4), "quantizer", id="lloyd-max-key-bits-4"),
        pytest.param(dict(key_bits=3), "key_bits", id="key_bits-3"),
        pytest.param(dict(key_bits=4.0), "key_bits", id="key_bits-4.0"),
        pytest.param(dict(key_bits_layers=[1, 2]), "key_bits_layers", id="key_bits_layers-without-key_bits"),
        pytest.param(dict(key_bits=4, key_bits_layers=[1, 1]), "key_bits_layers", id="key_bits_layers-repeated"),
        pytest.param(dict(key_bits=4, key_bits_layers=[-1]), "key_bits_layers", id="key_bits_layers-negative"),
        pytest.param(dict(key_bits=4, key_bits_layers="1-3"), "key_bits_layers", id="key_bits_layers-str"),
        pytest.param(dict(key_quantization="per-head"), "key_quantization", id="key_quantization-per-head"),
        pytest.param(dict(key_quantization="per-channel", centering=False), "k_clip", id="per-channel-clipped"),
        pytest.param({**PER_CHANNEL, "quantizer": "lloyd-max"}, "quantizer", id="per-channel-lloyd-max"),
        # choices given as lists (a JSON file's) are named, not a TypeError (unhashable)
        pytest.param(dict(scale_dtype=["float16"]), "scale_dtype", id="scale_dtype-list"),
        pytest.param(dict(key_quantization=["per-token"]), "key_quantization", id="key_quantization-list"),
    ],
)
def test_invalid_values_raise_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"OscarConfig\.{field}\b"):
        OscarConfig(**overrides)
    with pytest.raises(ValueError, match=rf"OscarConfig\.{field}\b"):
        OscarConfig().replace(**overrides)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="colour"):
        OscarConfig.from_dict({**OscarConfig().to_dict(), "colour": "red"})
    with pytest.raises(ValueError, match="dict of its fields; got list"):
        OscarConfig.from_json("[2]")


def test_replace_returns_a_changed_copy():
    config = OscarConfig()
    changed = config.replace(bits=4, group_size=64)
    assert (changed.bits, changed.group_size, changed.k_clip) == (4, 64, 0.96)
    assert config == OscarConfig()


@pytest.mark.parametrize(
    "group_size, head_dim, expected",
    [
        pytest.param(None, 64, 64, id="None-D64"),
        pytest.param(None, 128, 128, id="None-D128"),
        pytest.param(32, 64, 32, id="g32-D64"),
        pytest.param(128, 128, 128, id="g128-D128"),
    ],
)
def test_resolved_group_size(group_size, head_dim, expected):
    assert OscarConfig(group_size=group_size).resolved_group_size(head_dim) == expected


def test_group_larger_than_head_dim_raises():
    with pytest.raises(ValueError, match="group_size"):
        OscarConfig(group_size=128).resolved_group_size(64)


@pytest.mark.parametrize(
    "fields, seq_len, expected",
    [
        pytest.param(dict(group_size=128), None, 2.25, id="g128-fp16-history"),
        pytest.param(dict(), None, 2.25, id="gNone-fp16-history"),
        pytest.param(dict(group_size=128), 131072, 2.2838, id="g128-fp16-128k"),
        pytest.param(dict(group_size=128, centering=False), 131072, 2.2836, id="g128-fp16-128k-uncentered"),
        pytest.param(dict(group_size=128), 32768, 2.3853, id="g128-fp16-32k"),
        pytest.param(dict(group_size=128), 300, 16.0, id="g128-fp16-all-window"),
        pytest.param(dict(group_size=64), None, 2.5, id="g64-fp16-history"),
        pytest.param(dict(bits=4, group_size=128), None, 4.25, id="int4-g128-history"),
        pytest.param(dict(key_bits=4, group_size=128), None, 3.25, id="k4v2-g128-history"),
        pytest.param(dict(key_bits=4, group_size=64), None, 3.5, id="k4v2-g64-history"),
        pytest.param(dict(bits=4, key_bits=2, group_size=128), None, 3.25, id="k2v4-g128-history"),
        pytest.param(dict(group_size=128, scale_dtype="float32"), None, 2.5, id="g128-fp32-history"),
        pytest.param(dict(group_size=128, scale_dtype="bfloat16"), None, 2.25, id="g128-bf16-history"),
        # the symmetric grid stores a scale alone: 16 bits per group
        pytest.param(dict(group_size=64, quantizer="symmetric"), None, 2.25, id="g64-symmetric-history"),
        pytest.param(dict(group_size=64, quantizer="symmetric", key_bits=4), None, 3.25, id="g64-symmetric-k4"),
        # the compact grid stores a byte scale and a byte zero: 16 bits per group, whatever scale_dtype says
        pytest.param(dict(group_size=64, quantizer="compact"), None, 2.25, id="g64-compact-history"),
        pytest.param(dict(group_size=128, quantizer="compact", scale_dtype="float32"), None, 2.125,
                     id="g128-compact-fp32-scale-dtype"),
        pytest.param(dict(group_size=64, quantizer="compact", key_bits=4), None, 3.25, id="g64-compact-k4"),
        # per-channel K: one fp16 scale and zero per channel and 32 tokens (0.5 bits); V per token and group
        pytest.param(dict(group_size=32, flush_tokens=32, **PER_CHANNEL), None, 3.0, id="per-channel-g32-history"),
        pytest.param(dict(group_size=128, flush_tokens=32, **PER_CHANNEL), None, 2.625, id="per-channel-g128-history"),
        pytest.param(dict(group_size=32, flush_tokens=32, **PER_CHANNEL), 131072, 3.0317, id="per-channel-128k"),
        pytest.param(dict(group_size=32, flush_tokens=32, **{**PER_CHANNEL, "centering": True}), 131072,
                     3.0317 + 16 / 131072, id="per-channel-128k-centered-v"),
        # windows hold what the whole token groups leave: 1000 - 64 - 256 = 680 = 21·32 + 8
        pytest.param(dict(group_size=32, flush_tokens=32, **PER_CHANNEL), 1000, 7.264, id="per-channel-1000"),
        pytest.param(
            dict(group_size=32, flush_tokens=32, sink_tokens=0, recent_tokens=112, **PER_CHANNEL),
            1000,
            (136 * 16 + 864 * 3) / 1000,
            id="kivi-2-1000",
        ),
    ],
)
def test_bits_per_element(fields, seq_len, expected):
    assert OscarConfig(**fields).bits_per_element(128, seq_len) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("head_dim, seq_len, field", [(64, 0, "seq_len"), (64, -5, "seq_len"), (0, None, "head_dim")])
def test_bits_per_element_of_no_tokens_or_no_channels_raises(head_dim, seq_len, field):
    with pytest.raises(ValueError, match=rf"{field} must be"):
        OscarConfig().bits_per_element(head_dim, seq_len)


def test_per_channel_error_says_why():
    with pytest.raises(ValueError, match=r"k_clip must be 1.0 when key_quantization='per-channel' \(clipping is per"):
        OscarConfig(key_quantization="per-channel")
    assert OscarConfig(key_quantization="per-channel", k_clip=1.0).centered_sides == ("value",)
    assert OscarConfig().centered_sides == ("key", "value") and OscarConfig(centering=False).centered_sides == ()
    assert OscarConfig(flush_tokens=16, **PER_CHANNEL).demotion_unit == 16
    assert OscarConfig(flush_tokens=16).demotion_unit == 1


def test_key_bits_layers_resolve_per_layer():
    config = OscarConfig(key_bits=4, key_bits_layers=[3, 1], group_size=128)
    assert config.key_bits_layers == [1, 3]
    assert config.for_layer(1).side_bits == {"key": 4, "value": 2} and config.for_layer(1).key_bits_layers is None
    assert config.for_layer(2).side_bits == {"key": 2, "value": 2}
    assert OscarConfig(key_bits=4).for_layer(2).side_bits == {"key": 4, "value": 2}  # no list: every layer
    # K at 4 bits in 2 of 4 layers: 3 bits on average, plus 0.25 for the scale and zero
    assert config.bits_per_element(128, num_layers=4) == pytest.approx(2.75)
    with pytest.raises(ValueError, match="num_layers"):
        config.bits_per_element(128)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param({}, {"key": 0.96, "value": 0.92}, id="int2"),
        pytest.param({"key_bits": 4}, {"key": 1.0, "value": 0.92}, id="k4v2"),
        pytest.param({"bits": 4}, {"key": 1.0, "value": 1.0}, id="int4"),
        pytest.param({"bits": 4, "key_bits": 2}, {"key": 0.96, "value": 1.0}, id="k2v4"),
    ],
)
def test_side_clip_clips_only_two_bit_rows(fields, expected):
    assert OscarConfig(k_clip=0.96, v_clip=0.92, **fields).side_clip == expected


def test_side_clip_follows_each_layers_key_bits():
    cfg = OscarConfig(key_bits=4, key_bits_layers=[1])
    assert [cfg.for_layer(i).side_clip["key"] for i in range(3)] == [cfg.k_clip, 1.0, cfg.k_clip]
