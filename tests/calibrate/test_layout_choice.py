"""Calibration's layout choice (oscar_hf.layout_choice): candidates scored end to end on held-out tokens, the best
within the bit budget kept in the bundle's config, 4-bit K where the budget allows, shown by `oscar-hf info`."""

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import build_family, make_model, quick_calibrate, token_ids

from oscar_hf import OscarConfig, OscarQuantizedCache, OscarRotations, layout_choice
from oscar_hf.cli import cmd_info
from oscar_hf.layout_choice import LAYOUTS, choose_layout, history_bits, quantized_layers

ARCH = "qwen2-gqa-bias-d64"
WINDOWS = OscarConfig(sink_tokens=4, recent_tokens=16)  # held-out chunks of 256 tokens: 236 scored positions


def outlier_model():
    """Keys with large near-constant channels, as Qwen2's: K biases on the lowest RoPE frequency (channels 30, 31 of
    each head rotate by ~1e-4 rad per token)."""
    model = make_model(ARCH)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(2, 64)
            bias[:, 31], bias[:, 30] = 30.0, -20.0
    return model


@pytest.fixture(scope="module")
def planted():
    model = outlier_model()
    rotations = quick_calibrate(model, token_ids(3, 64), num_tokens=192, config=WINDOWS)
    return model, rotations, list(token_ids(2, 256, seed=1))


def test_the_choice_is_the_candidate_of_least_error_and_avoids_the_planted_failure(planted):
    model, rotations, held_out = planted
    chosen = choose_layout(model, rotations, held_out)
    layout = chosen.calibration["layout"]
    scores = layout["candidates"]
    assert set(scores) == {c.name for c in LAYOUTS}
    assert layout["chosen"] == min(scores, key=lambda name: scores[name]["held_out_kl"])
    # uncentered per-token keys carry the constant channels in every token's grid: the choice leaves them
    assert layout["chosen"] != "per-token K, uncentered" and scores[layout["chosen"]]["held_out_kl"] > 1e-4
    assert scores["per-token K, uncentered"]["held_out_kl"] > 1.2 * scores[layout["chosen"]]["held_out_kl"]
    winner = next(c for c in LAYOUTS if c.name == layout["chosen"])
    for field, value in winner.overrides.items():
        assert getattr(chosen.config, field) == value
    # the default budget, 2.6 bits, holds the 2.5-bit layouts and no 4-bit K layer (one of two layers: 3.0 bits)
    assert layout["budget_bits"] == 2.6 and layout["history_bits"] == 2.5 and layout["key_bits_layers"] == []
    assert chosen.config.key_bits is None and chosen.diagnostics and rotations.calibration.get("layout") is None


def test_a_per_channel_choice_stores_keys_unrotated_and_generates(planted, monkeypatch):
    model, rotations, held_out = planted
    monkeypatch.setattr(layout_choice, "LAYOUTS", LAYOUTS[2:3])
    chosen = choose_layout(model, rotations, held_out)
    assert chosen.config.key_quantization == "per-channel" and chosen.config.flush_tokens == 64
    for rotation in chosen.key_rotation:
        torch.testing.assert_close(rotation, torch.eye(64))
    torch.testing.assert_close(chosen.value_rotation[0], rotations.value_rotation[0])
    cache = OscarQuantizedCache.from_pretrained(chosen, model=model, sink_tokens=4, recent_tokens=16)
    out = model.generate(token_ids(1, 150), past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 154) and cache.layers[0].n_history > 0


def test_a_larger_budget_buys_4_bit_keys_in_the_layers_of_largest_score_kl(planted):
    model, rotations, held_out = planted
    chosen = choose_layout(model, rotations, held_out, bit_budget=3.2)
    layout = chosen.calibration["layout"]
    assert chosen.config.key_bits == 4 and len(chosen.config.key_bits_layers) == 1  # 3.0 bits; both layers: 3.5
    assert layout["history_bits"] == history_bits(chosen.config, chosen, [0, 1]) == 3.0
    winner = layout["candidates"][layout["chosen"]]
    base = choose_layout(model, rotations, held_out)
    ranked = sorted(base.diagnostics, key=lambda row: row["score_kl"], reverse=True)
    assert chosen.config.key_bits_layers == [ranked[0]["layer"]] and winner["history_bits"] == 2.5


def test_a_budget_below_every_layout_is_refused(planted):
    model, rotations, held_out = planted
    with pytest.raises(ValueError, match="no layout fits a budget of 2.000"):
        choose_layout(model, rotations, held_out, bit_budget=2.0)


def test_held_out_tokens_that_reach_no_history_are_refused(planted):
    model, rotations, _ = planted
    with pytest.raises(ValueError, match="reach no quantized history"):
        choose_layout(model, rotations, list(token_ids(2, 20)))


def test_held_out_kl_is_far_smaller_at_4_bits_than_at_2(planted):
    model, rotations, held_out = planted
    exact = layout_choice.held_out_kl(model, OscarRotations.identity(model.config), WINDOWS.replace(bits=4, k_clip=1,
                                      v_clip=1), held_out)
    two = layout_choice.held_out_kl(model, rotations, WINDOWS, held_out)
    assert 0 < exact < two / 10
    assert model.config._attn_implementation == "oscar"  # as enable leaves it: the model's own attention


def test_calibrate_chooses_on_its_held_out_tokens_and_info_shows_the_choice(tmp_path, capsys):
    model = outlier_model()
    rotations = quick_calibrate(model, token_ids(4, 256), max_length=256, num_tokens=512, diagnostic_tokens=512,
                                choose_layout=True, bit_budget=3.2, config=WINDOWS)
    assert rotations.calibration["layout"]["budget_bits"] == 3.2 and rotations.config.key_bits_layers
    rotations.save_pretrained(tmp_path)
    assert OscarRotations.from_pretrained(tmp_path).config == rotations.config
    cmd_info(SimpleNamespace(bundle=str(tmp_path), subfolder=None))
    out = capsys.readouterr().out
    assert "layout chosen by calibration: " + rotations.calibration["layout"]["chosen"] in out
    assert "4-bit K in layers" in out and "held-out KL" in out
    assert json.loads(out.split("calibration: ")[1].splitlines()[0])["layout"]["budget_bits"] == 3.2


def test_plain_calibrate_chooses_the_layout_as_the_on_demand_path_does():
    """calibrate() with no config chooses the layout on its held-out tokens where they outlast the default windows
    (64 + 256 tokens), as the on-demand path and the CLI do; a given config, or held-out chunks no longer than the
    windows, keep the config as given (with its diagnostics)."""
    model = make_model(ARCH)
    chosen = quick_calibrate(model, token_ids(4, 512), max_length=512, num_tokens=1024, diagnostic_tokens=1024)
    assert "chosen" in chosen.calibration["layout"]
    kept = quick_calibrate(model, token_ids(4, 512), max_length=512, num_tokens=1024, diagnostic_tokens=1024,
                           config=OscarConfig())
    short = quick_calibrate(model, token_ids(8, 256), max_length=256, num_tokens=1024, diagnostic_tokens=1024)
    for rotations in (kept, short):
        assert "layout" not in rotations.calibration and rotations.diagnostics
        assert rotations.config == OscarConfig()


@pytest.mark.parametrize("kwargs, message", [
    (dict(choose_layout=True, diagnostic_tokens=0), "diagnostic_tokens > 0"),
    (dict(choose_layout=True, diagnostic_tokens=64), "the text left none after the 64 calibration tokens"),
    (dict(bit_budget=3.0, choose_layout=False), "bit_budget is the budget of choose_layout"),
    (dict(choose_layout="yes"), "choose_layout must be True or False"),
])
def test_calibrate_refuses_a_layout_choice_it_cannot_make(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quick_calibrate(make_model(ARCH), token_ids(1, 64), **kwargs)


def test_bits_and_4_bit_keys_count_only_the_layers_the_cache_quantizes():
    """Gemma-2 alternates sliding-window layers (model dtype, not quantized) with full ones: the budget is spent on the
    full layers alone, and the 4-bit K layers are among them."""
    model = build_family("gemma2-softcap")
    rotations = quick_calibrate(model, token_ids(2, 64), num_tokens=128, config=WINDOWS)
    layers = quantized_layers(model.config, rotations, WINDOWS)
    kinds = model.config.layer_types
    assert layers == [i for i, kind in enumerate(kinds) if kind == "full_attention"] and 0 < len(layers) < len(kinds)
    chosen = choose_layout(model, rotations, list(token_ids(2, 128, seed=1)), bit_budget=3.0 + 1 / len(layers))
    assert chosen.config.key_bits_layers and set(chosen.config.key_bits_layers) <= set(layers)
    assert chosen.calibration["layout"]["history_bits"] <= 3.0 + 1 / len(layers)
