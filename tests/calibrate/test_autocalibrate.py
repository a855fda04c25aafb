"""Rotations made on demand (oscar_hf.autocalibrate): ``OscarQuantizedCache.from_pretrained(model=model)`` with no
bundle calibrates once, saves the bundle in the Hugging Face cache folder, and reuses it; the folder's key follows
the model's config, revision, the text and the settings; the recipe comes from the model."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
import transformers
from helpers import austen, build_family, char_tokenizer, make_model

import oscar_hf
from oscar_hf import OscarConfig, OscarQuantizedCache, cache_kwargs, rotations_for_model
from oscar_hf import autocalibrate as auto
from oscar_hf.calibrate import calibration_token_ids, token_chunks
from oscar_hf.recipes import recipe_for_model

ARCH = "llama-mha-d64"
BUDGET = 128  # calibration tokens: the shipped text's first 128 characters with the character tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """The Hugging Face cache folder, moved to a temporary one."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    return home


@pytest.fixture
def calibrations(monkeypatch):
    """Counts the calibrations the on-demand path runs (at a small budget)."""
    count = []
    real = auto.calibrate

    def counting(*args, **kwargs):
        count.append(kwargs["num_tokens"])
        return real(*args, **kwargs)

    monkeypatch.setattr(auto, "calibrate", counting)
    monkeypatch.setattr(auto, "DEFAULT_TOKENS", BUDGET)
    return count


def load(model_dir) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def bundles(hf_home) -> list:
    return sorted(p.relative_to(hf_home) for p in hf_home.glob("oscar-hf/rotations/*/*") if p.is_dir())


def test_no_bundle_calibrates_once_into_the_hf_cache_and_reuses_it(model_dir, hf_home, calibrations, capsys):
    model = load(model_dir)
    cache = OscarQuantizedCache.from_pretrained(model=model)
    assert calibrations == [BUDGET]
    [folder] = bundles(hf_home)
    assert folder.parts[:3] == ("oscar-hf", "rotations", Path(model_dir).name) and folder.name.startswith("local-")
    saved = json.loads((hf_home / folder / "oscar_config.json").read_text())
    assert saved["calibration"]["data"] == auto.SHIPPED_TEXT_NAME and saved["calibration"]["tokens"] == BUDGET
    assert saved["source_model"] == str(model_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                         **cache_kwargs(model, cache))
    assert out.shape == (1, 8)

    OscarQuantizedCache.from_pretrained(model=model)  # the same model: remembered in this process
    OscarQuantizedCache.from_pretrained(model=load(model_dir))  # a fresh one: read back from the folder
    assert calibrations == [BUDGET] and len(bundles(hf_home)) == 1
    again = rotations_for_model(load(model_dir))
    torch.testing.assert_close(again.key_rotation, cache.rotations.key_rotation, rtol=0, atol=0)


def test_the_key_follows_config_revision_text_budget_and_release_but_not_dtype(model_dir, hf_home, calibrations,
                                                                              monkeypatch):
    tokenizer = char_tokenizer()
    base = load(model_dir)
    rotations_for_model(base, tokenizer)
    rotations_for_model(load(model_dir).to(torch.bfloat16), tokenizer)  # the dtype is no part of the key
    assert len(calibrations) == 1
    revised = load(model_dir)
    revised.config._commit_hash = "0123abcd" * 5
    rotations_for_model(revised, tokenizer)
    other = make_model(ARCH, num_hidden_layers=3)
    other.config._name_or_path = str(model_dir)  # the same name, another config
    rotations_for_model(other, tokenizer)
    rotations_for_model(load(model_dir), tokenizer, [austen(4000)[1000:]])  # other text
    rotations_for_model(load(model_dir), tokenizer, num_tokens=BUDGET // 2)  # another budget
    assert len(calibrations) == 5
    monkeypatch.setattr(oscar_hf.autocalibrate, "__version__", "99.0.0")  # another release calibrates again
    rotations_for_model(load(model_dir), tokenizer)
    assert len(calibrations) == 6
    folders = bundles(hf_home)
    assert len(folders) == 6 and {f.parent.name for f in folders} == {Path(model_dir).name}
    assert sum(f.name.startswith("0123abcd") for f in folders) == 1


def test_calibration_texts_and_tokenizer_arguments(hf_home, calibrations):
    model = make_model(ARCH)  # made from a config: no name to load a tokenizer from
    with pytest.raises(ValueError, match="pass tokenizer="):
        OscarQuantizedCache.from_pretrained(model=model)
    cache = OscarQuantizedCache.from_pretrained(model=model, tokenizer=char_tokenizer(),
                                                calibration_texts=[austen(2000)])
    assert cache.rotations.calibration["data"] == "texts given to oscar_hf" and calibrations == [BUDGET]
    assert [f.parent.name for f in bundles(hf_home)] == ["unnamed"]
    with pytest.raises(ValueError, match="go with no src"):
        OscarQuantizedCache.from_pretrained(cache.rotations, model=model, tokenizer=char_tokenizer())


def test_an_unreadable_bundle_is_made_again(model_dir, hf_home, calibrations):
    found = auto.cached_rotations(load(model_dir), char_tokenizer())
    (found.path / "rotations.safetensors").write_bytes(b"broken")
    again = auto.cached_rotations(load(model_dir), char_tokenizer())
    assert again.calibrated and again.path == found.path and len(calibrations) == 2
    assert not auto.cached_rotations(load(model_dir), char_tokenizer()).calibrated


def recipe_model() -> transformers.PreTrainedModel:
    """The tiny model under SmolLM2-135M's name: its recipe, so no layout to choose (a quick calibration)."""
    model = make_model(ARCH)
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    return model


@pytest.mark.parametrize("breakage", ["a JSON list", "no num_kv_heads"])
def test_a_malformed_oscar_config_is_made_again(hf_home, calibrations, breakage):
    found = auto.cached_rotations(recipe_model(), char_tokenizer())
    config = found.path / "oscar_config.json"
    metadata = json.loads(config.read_text())
    if breakage == "a JSON list":
        metadata = [metadata]
    else:
        del metadata["num_kv_heads"]
    config.write_text(json.dumps(metadata))
    again = auto.cached_rotations(recipe_model(), char_tokenizer())
    assert again.calibrated and again.path == found.path and len(calibrations) == 2
    assert not auto.cached_rotations(recipe_model(), char_tokenizer()).calibrated


def test_a_killed_saves_build_folder_is_removed_by_a_later_call(hf_home, calibrations):
    """Hidden folders (".<name>.oscar-tmp-<random>") that a killed save left beside a bundle are removed by a later
    call once older than STALE_BUILD_SECONDS (a younger one may be a save under way, and is kept)."""
    found = auto.cached_rotations(recipe_model(), char_tokenizer())
    stale, fresh = (found.path.parent / f".{found.path.name}.oscar-tmp-{tag}" for tag in ("stale", "fresh"))
    for folder in (stale, fresh):
        folder.mkdir()
        (folder / "rotations.safetensors").write_bytes(b"partial")
    old = time.time() - auto.STALE_BUILD_SECONDS - 60
    os.utime(stale, (old, old))
    assert not auto.cached_rotations(recipe_model(), char_tokenizer()).calibrated
    assert not stale.exists() and fresh.is_dir()


def test_the_cache_folder_is_under_hf_home(hf_home):
    assert auto.rotations_cache_dir() == hf_home / "oscar-hf" / "rotations"


def test_settings_come_from_the_models_recipe_with_the_default_budget():
    recipe, settings, config = auto.calibration_settings("/cache/smollm2-135m-instruct-bcc81830d10c")
    assert recipe.name == "smollm2-135m" and config == recipe.cache
    assert settings == {**recipe.calibrate_kwargs(), "num_tokens": auto.DEFAULT_TOKENS}
    recipe, settings, config = auto.calibration_settings(make_model(ARCH))
    assert recipe is None and config == OscarConfig()
    assert (settings["k_target"], settings["v_target"], settings["num_tokens"]) == ("qqt", "sst", auto.DEFAULT_TOKENS)


@pytest.mark.parametrize("name, recipe", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
    ("/root/.cache/oscar_hf/smollm2-135m-instruct-bcc81830d10c", "smollm2-135m"),
    ("Qwen/Qwen3-8B", "qwen3-8b"),
    ("/models/qwen3-8b/", "qwen3-8b"),
    ("google/gemma-3-270m", "gemma3-270m"),
    ("google/gemma-3-270m-it", "gemma-3"),
    ("/tmp/gemma-3-270m-2ce8a8889efc", "gemma3-270m"),
    ("org/some-other-model", None),
    ("", None),
])
def test_recipe_for_model_by_name(name, recipe):
    found = recipe_for_model(name)
    assert (found.name if found else None) == recipe


def test_recipe_for_model_by_family():
    config = transformers.Gemma3TextConfig(num_hidden_layers=2)
    config._name_or_path = "/models/my-finetune"
    assert recipe_for_model(config).name == "gemma-3"
    assert recipe_for_model(make_model(ARCH)) is None


def test_calibration_token_ids_make_the_same_chunks_as_the_texts():
    for tokenizer in (char_tokenizer(), char_tokenizer(bos=True)):
        texts = [austen(700), austen(1500)[700:]]
        ids = calibration_token_ids(tokenizer, texts, 500, 128, held_out_tokens=300)
        for got, expected in zip(token_chunks(tokenizer, [ids], 500, 128, 300), token_chunks(tokenizer, texts, 500,
                                                                                             128, 300)):
            assert [c.tolist() for c in got] == [c.tolist() for c in expected]


def test_a_model_without_a_recipe_has_its_layout_chosen_on_held_out_text(model_dir, hf_home, calibrations, caplog):
    """No recipe: the bundle's config is chosen (oscar_hf.layout_choice) on CHOICE_TOKENS held-out tokens after the
    calibration ones, with every candidate scored; a text too short for that keeps the default layout, and says so."""
    found = auto.cached_rotations(load(model_dir), char_tokenizer())
    layout = found.rotations.calibration["layout"]
    assert layout["chosen"] in layout["candidates"] and found.rotations.diagnostics
    assert all(score["held_out_kl"] > 0 for score in layout["candidates"].values())
    assert found.rotations.diagnostics[0]["tokens"] == auto.CHOICE_TOKENS
    with caplog.at_level("WARNING", logger="oscar_hf.autocalibrate"):
        short = auto.cached_rotations(load(model_dir), char_tokenizer(), [austen(BUDGET + 200)])
    assert "too few to choose a layout" in caplog.text and "layout" not in short.rotations.calibration
    assert short.rotations.config == OscarConfig()


def test_a_model_with_a_recipe_keeps_the_recipes_layout(hf_home, calibrations):
    model = recipe_model()  # the smollm2-135m recipe, by name
    found = auto.cached_rotations(model, char_tokenizer())
    assert found.recipe == "smollm2-135m" and "layout" not in found.rotations.calibration
    assert found.rotations.config == recipe_for_model(model).cache


def test_latent_attention_keeps_its_one_layout_on_demand(hf_home, calibrations):
    """Multi-head latent attention stores one latent per token: nothing to choose, even without a recipe."""
    model = build_family("deepseek-v3-mla")
    found = auto.cached_rotations(model, char_tokenizer())
    assert found.recipe is None and "layout" not in found.rotations.calibration
