"""The oscar-hf command (calibrate, info, generate) end to end on a tiny local model, and the shipped recipes."""

import argparse
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import austen, make_model

from oscar_hf import OscarConfig, OscarRotations, autocalibrate, calibrate, cli, load_recipe, models
from oscar_hf.calibrate import EIGEN_ORDERS, K_TARGETS, V_TARGETS
from oscar_hf.cli import main
from oscar_hf.recipes import available_recipes

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "emma.txt"
    path.write_text(austen(1200), encoding="utf-8")  # 300 calibration tokens + ~900 held out for diagnostics
    return str(path)


def run_calibrate(model_dir, data, out, *extra):
    main(["calibrate", model_dir, "--data", str(data), "--out", str(out), "--num-tokens", "300", "--max-length", "128",
          "--dtype", "float32", *extra])


def error_line(capsys, argv) -> str:
    """The line oscar-hf ends with on bad input: ``oscar-hf: error: ...``, exit status 2, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]  # (after any progress bar)
    assert line.startswith("oscar-hf: error: "), err
    return line.removeprefix("oscar-hf: error: ")


@pytest.fixture(scope="module")
def bundle_dir(model_dir, data_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "rotations"
    run_calibrate(model_dir, data_file, out)
    return out


def test_calibrate_writes_a_bundle(bundle_dir, model_dir, data_file):
    assert sorted(p.name for p in bundle_dir.iterdir()) == [
        "README.md", "diagnostics.json", "oscar_config.json", "rotations.safetensors"]
    metadata = json.loads((bundle_dir / "oscar_config.json").read_text())
    assert (metadata["source_model"], metadata["num_layers"], metadata["head_dim"]) == (model_dir, 2, 64)
    assert metadata["calibration"] | {"data": data_file} == {
        "tokens": 300, "max_length": 128, "k_target": "qqt", "v_target": "sst", "composition": "UHP",
        "eigen_order": "ascending", "per_head": False, "data": data_file, "recipe": None}
    card = (bundle_dir / "README.md").read_text()
    assert "OSCAR KV-cache rotations" in card and "(oscar)" in card and "k_target: qqt" in card
    diagnostics = json.loads((bundle_dir / "diagnostics.json").read_text())
    assert [row["layer"] for row in diagnostics] == [0, 1] and diagnostics[0]["tokens"] > 800
    bundle = OscarRotations.from_pretrained(bundle_dir)
    assert bundle.key_rotation.shape == (2, 64, 64) and bundle.method == "oscar"


def test_calibrate_prints_the_table(model_dir, data_file, tmp_path, capsys):
    run_calibrate(model_dir, data_file, tmp_path / "out")
    out = capsys.readouterr().out
    bundle = (f"OscarRotations(method='oscar', layers=2, head_dim=64, num_kv_heads=2, per_head=False, "
              f"source_model={model_dir!r})")
    assert f"saved {bundle} to {tmp_path / 'out'}" in out
    assert "k_error" in out and "mean" in out


def test_calibrate_chooses_the_layout_of_a_model_without_a_recipe(model_dir, tmp_path, capsys):
    """By default a model without a recipe has its layout chosen where the held-out tokens reach the quantized history
    (a 512-token held-out chunk against the default 64 + 256 windows); --no-choose-layout keeps the default config;
    the 1,024-character text of the other tests leaves chunks too short, and no choice is made there."""
    data = tmp_path / "long.txt"
    data.write_text(austen(2000), encoding="utf-8")
    main(["calibrate", model_dir, "--data", str(data), "--out", str(tmp_path / "chosen"), "--num-tokens", "300",
          "--max-length", "512", "--diagnostic-tokens", "512", "--dtype", "float32"])
    assert "the layout chosen on the held-out tokens" in capsys.readouterr().out
    chosen = OscarRotations.from_pretrained(tmp_path / "chosen")
    assert chosen.calibration["layout"]["chosen"] in chosen.calibration["layout"]["candidates"]
    main(["calibrate", model_dir, "--data", str(data), "--out", str(tmp_path / "kept"), "--num-tokens", "300",
          "--max-length", "512", "--diagnostic-tokens", "512", "--dtype", "float32", "--no-choose-layout"])
    kept = OscarRotations.from_pretrained(tmp_path / "kept")
    assert "layout" not in kept.calibration and kept.config == OscarConfig()


@pytest.mark.parametrize("extra, message", [
    (["--bit-budget", "3", "--no-choose-layout"], "--bit-budget is the budget of --choose-layout"),
    (["--choose-layout", "--key-bits", "4"], "chooses K's bits itself"),
])
def test_calibrate_refuses_contradicting_layout_options(model_dir, data_file, tmp_path, capsys, extra, message):
    assert message in error_line(capsys, ["calibrate", model_dir, "--data", data_file, *extra])


def test_calibrate_recommends_key_bits_for_the_most_sensitive_layers(model_dir, data_file, tmp_path, capsys):
    run_calibrate(model_dir, data_file, tmp_path / "half", "--key-bits", "4", "--key-bits-fraction", "0.5")
    bundle = OscarRotations.from_pretrained(tmp_path / "half")
    kl = [row["score_kl"] for row in bundle.diagnostics]
    assert bundle.config.key_bits == 4 and bundle.config.key_bits_layers == [kl.index(max(kl))]
    assert "needs --key-bits" in error_line(capsys, ["calibrate", model_dir, "--key-bits-fraction", "0.5"])


def test_calibrate_per_head_from_the_flag_or_the_recipe(model_dir, data_file, tmp_path, capsys):
    """--per-head: one rotation per layer and KV head (format_version 2); a recipe's ``per_head: true`` does the
    same, and --no-per-head overrides it."""
    run_calibrate(model_dir, data_file, tmp_path / "flag", "--per-head")
    bundle = OscarRotations.from_pretrained(tmp_path / "flag")
    assert bundle.per_head and bundle.key_rotation.shape == bundle.value_rotation.shape == (2, 2, 64, 64)
    assert json.loads((tmp_path / "flag" / "oscar_config.json").read_text())["format_version"] == 2
    capsys.readouterr()
    main(["info", str(tmp_path / "flag")])
    assert "2 layers, rotations (2, 64, 64) each (one per layer and KV head, K and V alike)" in (
        capsys.readouterr().out)
    recipe = tmp_path / "per-head.yaml"
    recipe.write_text("model: tiny\ncalibration:\n  per_head: true\n")
    run_calibrate(model_dir, data_file, tmp_path / "recipe", "--recipe", str(recipe))
    assert OscarRotations.from_pretrained(tmp_path / "recipe").per_head
    run_calibrate(model_dir, data_file, tmp_path / "shared", "--recipe", str(recipe), "--no-per-head")
    assert not OscarRotations.from_pretrained(tmp_path / "shared").per_head


def test_info(bundle_dir, capsys):
    main(["info", str(bundle_dir)])
    out = capsys.readouterr().out
    assert "2 layers, rotations (64, 64) each (one per layer, K and V alike)" in out
    assert f"config: {json.dumps(OscarConfig().to_dict())}" in out  # calibrate stores the config it diagnosed with
    for length, label in ((4096, "4K"), (32768, "32K"), (131072, "128K")):
        assert f"bits per element at {label} tokens: {OscarConfig().bits_per_element(64, length):.3f}" in out
    assert "score_kl" in out and "k_clip_rate" in out
    assert len([line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["mean"])]) == 3
    assert "no per-layer diagnostics" not in out


def test_info_says_when_a_bundle_has_no_diagnostics(tmp_path, capsys):
    OscarRotations.hadamard(make_model("llama-mha-d64").config).save_pretrained(tmp_path / "hadamard")
    main(["info", str(tmp_path / "hadamard")])
    out = capsys.readouterr().out
    assert "no per-layer diagnostics in the bundle" in out and "--diagnostic-tokens" in out
    assert "score_kl" not in out


def test_generate_prints_both_caches(model_dir, bundle_dir, capsys):
    main(["generate", model_dir, "--rotations", str(bundle_dir), "--prompt", "Emma was", "--max-new-tokens", "5",
          "--dtype", "float32"])
    out = capsys.readouterr().out
    assert ">>> Emma was" in out
    assert "[default cache]" in out and "[OSCAR INT2" in out
    assert "identical for the first 5 of 5 generated tokens" in out  # the prompt fits in the windows


def test_recipe_supplies_the_cache_config(model_dir, data_file, tmp_path):
    run_calibrate(model_dir, data_file, tmp_path / "out", "--recipe", "smollm2-135m")
    metadata = json.loads((tmp_path / "out" / "oscar_config.json").read_text())
    assert metadata["config"] == load_recipe("smollm2-135m").cache.to_dict()
    assert metadata["calibration"]["tokens"] == 300  # the command line overrides the recipe's 30000


def test_jsonl_data(model_dir, tmp_path):
    text = austen(1200)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": text[i:i + 400], "id": i}) for i in range(0, 1200, 400)) + "\n\n")
    run_calibrate(model_dir, data, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "oscar_config.json").read_text())["calibration"]["tokens"] == 300


def test_folder_of_txt_data(model_dir, tmp_path, capsys):
    (tmp_path / "texts").mkdir()
    for i in range(3):
        (tmp_path / "texts" / f"{i}.txt").write_text(austen(1200)[i * 400:(i + 1) * 400])
    run_calibrate(model_dir, tmp_path / "texts", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "oscar_config.json").read_text())["calibration"]["tokens"] == 300
    (tmp_path / "empty").mkdir()
    assert error_line(capsys, ["calibrate", model_dir, "--data", tmp_path / "empty"]) == (
        f"{tmp_path / 'empty'} has no .txt files")


def test_jsonl_line_without_text_exits(model_dir, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "Emma"}\n{"content": "Woodhouse"}\n')
    assert error_line(capsys, ["calibrate", model_dir, "--data", data]) == (
        f"{data}, line 2: every line must be a JSON object with a 'text' string")


def test_bad_k_target_exits_2(model_dir, data_file, tmp_path, capsys):
    argv = ["calibrate", model_dir, "--data", data_file, "--out", tmp_path / "out", "--k-target", "kkt"]
    assert error_line(capsys, argv).startswith("k_target must be one of")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("which", ["missing", "empty"])
def test_info_without_a_bundle_exits_2(tmp_path, capsys, which):
    if which == "empty":
        (tmp_path / which).mkdir()
    assert str(tmp_path / which) in error_line(capsys, ["info", tmp_path / which])


def test_info_of_a_truncated_bundle_is_one_line_naming_the_file(bundle_dir, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(bundle_dir, broken)
    weights = broken / "rotations.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    assert error_line(capsys, ["info", broken]).startswith(f"{weights} is not a readable safetensors file")


# ----------------------------------------------------------------------------------- bad input: one line
def test_a_model_neither_a_folder_nor_in_the_hub_cache_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """Offline (tests/conftest.py), with an empty Hugging Face cache: the model, and the ways to get it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    line = error_line(capsys, ["generate", "nobody/no-such-model"])
    assert line.startswith("nobody/no-such-model is neither a model folder nor a model transformers could get")
    assert "hf download nobody/no-such-model" in line and "smollm2" in line
    assert error_line(capsys, ["generate", tmp_path / "missing" / "model"]) == (
        f"{tmp_path / 'missing' / 'model'}: no such model folder")


@pytest.fixture
def no_model(monkeypatch):
    """Bad --data must be refused before the model loads."""
    monkeypatch.setattr(cli, "load_model", lambda name, dtype: pytest.fail("the model loaded"))


@pytest.mark.parametrize("name", ["emma.txtt", "texts/emma.txt"])
def test_a_misspelled_data_path_says_the_file_does_not_exist(tmp_path, monkeypatch, capsys, no_model, name):
    """A name with a text file's suffix is a path; another one that is no file is tried as a datasets id (offline
    here), and the error says both."""
    monkeypatch.chdir(tmp_path)
    line = error_line(capsys, ["calibrate", "m", "--data", name])
    assert line.startswith(f"{name}: no such file or folder"), line
    if name == "emma.txtt":
        assert "no datasets id that loads (Couldn't reach 'emma.txtt'" in line


BINARY = b"\x89PNG\r\n\x1a\n\x00\xff"


@pytest.mark.parametrize("name, content, message", [
    ("data.txt", BINARY, "{path} is not UTF-8 text (byte 0: invalid start byte)"),
    ("data.jsonl", BINARY, "{path} is not UTF-8 text (byte 0: invalid start byte)"),
    ("data.jsonl", b'{"text": "Emma"}\n{"text": "Harriet"\n',
     "{path}, line 2: not JSON (Expecting ',' delimiter: line 1 column 19 (char 18))"),
    ("data.txt", b"\n  \n", "{path} holds no text"),
    ("data.jsonl", b'{"text": ""}\n\n', "{path} holds no text"),
])
def test_unreadable_or_empty_data_names_the_file(tmp_path, capsys, no_model, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    assert error_line(capsys, ["calibrate", "m", "--data", path]) == message.format(path=path)


def test_data_far_below_the_budget_is_calibrated_with_a_warning(model_dir, tmp_path, capsys):
    data = tmp_path / "one-line.txt"
    data.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home.\n")
    main(["calibrate", model_dir, "--data", str(data), "--out", str(tmp_path / "out"), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert (f"oscar-hf: warning: {data} gave 70 calibration tokens, under half the budget of 30,000 (--num-tokens)"
            in err)
    main(["calibrate", model_dir, "--data", str(data), "--out", str(tmp_path / "out"), "--num-tokens", "100"])
    assert "warning" not in capsys.readouterr().err


def test_a_malformed_bundle_is_one_line_in_every_command(model_dir, tmp_path, capsys):
    """Whatever a bundle's loader raises on a broken folder (here: a folder where its config file should be), each
    command that reads one ends in one line."""
    broken = tmp_path / "broken"
    (broken / "oscar_config.json").mkdir(parents=True)
    (broken / "rotations.safetensors").write_bytes(b"")
    for argv in (["info", broken], ["generate", model_dir, "--rotations", broken],
                 ["eval", "--model", model_dir, "--rotations", broken, "--out", tmp_path / "out"]):
        assert "oscar_config.json" in error_line(capsys, argv), argv


def test_main_turns_any_multi_line_error_into_one_line(monkeypatch, capsys):
    def info(args):
        raise OSError("first line\nsecond line")

    monkeypatch.setattr(cli, "cmd_info", info)
    assert error_line(capsys, ["info", "x"]) == "first line second line"


def test_calibrate_without_data_recipe_or_out(model_dir, tmp_path, monkeypatch, capsys):
    """--data defaults to the shipped text, --recipe to the model's (none for this one: it says so), --out to a
    folder in the Hugging Face cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    main(["calibrate", model_dir, "--num-tokens", "200", "--max-length", "100", "--diagnostic-tokens", "0",
          "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "recipe: none (calibrate's defaults: K target qqt, V target sst" in out
    [bundle] = (tmp_path / "hf" / "oscar-hf" / "rotations" / Path(model_dir).name).iterdir()
    assert f"to {bundle}" in out and bundle.name.startswith("local-")
    metadata = json.loads((bundle / "oscar_config.json").read_text())
    calibration = metadata["calibration"]
    assert (calibration["data"], calibration["tokens"]) == ("oscar_hf/data/austen_emma.txt", 200)


def test_calibrate_picks_the_recipe_from_the_model(model_dir, data_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "source_model_id", lambda name: "HuggingFaceTB/SmolLM2-135M-Instruct")
    run_calibrate(model_dir, data_file, tmp_path / "out", "--diagnostic-tokens", "0")
    assert "recipe: smollm2-135m (HuggingFaceTB/SmolLM2-135M-Instruct)" in capsys.readouterr().out
    metadata = json.loads((tmp_path / "out" / "oscar_config.json").read_text())
    assert metadata["calibration"]["k_target"] == "ktk" and metadata["calibration"]["recipe"] == "smollm2-135m"
    run_calibrate(model_dir, data_file, tmp_path / "none", "--diagnostic-tokens", "0", "--recipe", "none")
    assert json.loads((tmp_path / "none" / "oscar_config.json").read_text())["calibration"]["k_target"] == "qqt"


def test_generate_without_rotations_calibrates_once_and_reuses(model_dir, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(autocalibrate, "DEFAULT_TOKENS", 256)
    for run in range(2):
        caplog.clear()
        main(["generate", model_dir, "--prompt", "Emma was", "--max-new-tokens", "4"])
        assert "identical for the first 4 of 4 generated tokens" in capsys.readouterr().out
        assert ("calibrating" in caplog.text) == (run == 0), caplog.text
        assert ("calibrated earlier" in caplog.text) == (run == 1), caplog.text
    assert len([path for path in (tmp_path / "hf" / "oscar-hf" / "rotations").glob("*/*") if path.is_dir()]) == 1


def test_generate_default_dtype_is_exact_on_the_device(monkeypatch):
    args = cli.build_parser().parse_args(["generate", "m"])
    assert (args.dtype, args.rotations, args.prompt) == ("auto", "auto", None)
    assert models.resolve_dtype("auto") == torch.float32  # a CPU: fp32 (the windows then match the default cache)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert models.resolve_dtype("auto") == torch.bfloat16
    assert models.resolve_dtype("float16") == torch.float16


def help_entries(parser) -> dict[str, str]:
    """Each option of ``parser``'s help, with its (wrapped) help text joined into one line."""
    entries, current = {}, None
    for line in parser.format_help().splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            entries[current] = line
        elif current and line.startswith("      "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("command", ["demo", "calibrate", "info", "generate", "eval"])
def test_every_option_has_help_and_shows_its_default(command):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = {a.option_strings[0] for a in sub._actions if a.nargs == 0}
    entries = help_entries(sub)
    options = {a.option_strings[0] for a in sub._actions if a.option_strings}
    assert set(entries) == options
    for option, entry in entries.items():
        assert option in flags or "(default" in entry, entry
        assert len(entry.split()) > 2, f"{option} has no help"


def test_console_script():
    script = Path(sys.executable).parent / "oscar-hf"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert all(command in result.stdout for command in ("demo", "calibrate", "info", "generate"))


# ------------------------------------------------------------------------------------------ recipes
HEAD_DIMS = {"smollm2-135m": 64, "gemma-3": 256, "gemma3-270m": 256}


@pytest.mark.parametrize("name", available_recipes())
def test_shipped_recipe(name):
    recipe = load_recipe(name)
    assert recipe.name == name and "/" in recipe.model and recipe.notes
    head_dim = HEAD_DIMS.get(name, 128)
    assert recipe.cache.resolved_group_size(head_dim) <= head_dim
    assert 2 < recipe.cache.bits_per_element(head_dim, 131072) < 3
    kwargs = recipe.calibrate_kwargs()
    assert set(kwargs) <= set(inspect.signature(calibrate).parameters)
    assert kwargs["k_target"] in K_TARGETS and kwargs["v_target"] in V_TARGETS
    assert kwargs.get("eigen_order", "ascending") in EIGEN_ORDERS


def test_recipes_are_shipped():
    assert {"qwen3-8b", "smollm2-135m", "gemma-3"} <= set(available_recipes())


def test_unknown_recipe_lists_the_shipped_ones():
    with pytest.raises(ValueError, match=r"unknown recipe 'qwen9'.*'qwen3-8b'"):
        load_recipe("qwen9")


@pytest.mark.parametrize("text, match", [
    pytest.param("model: org/m\ncalibration:\n  num_token: 100\n", r"unknown calibration key\(s\) \['num_token'\]",
                 id="calibration-key"),
    pytest.param("model: org/m\ncache:\n  bitz: 2\n", r"unknown OscarConfig field\(s\) \['bitz'\]", id="cache-field"),
    pytest.param("calibration:\n  num_tokens: 100\n", "'model' key", id="no-model"),
])
def test_bad_recipe_file_raises(tmp_path, text, match):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_recipe(str(path))


def test_recipe_file_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("model: org/m\ncalibration:\n  num_tokens: 100\n  data: x.txt\ncache:\n  bits: 4\n")
    recipe = load_recipe(str(path))
    assert (recipe.name, recipe.model, recipe.calibrate_kwargs(), recipe.cache) == (
        "mine", "org/m", {"num_tokens": 100}, OscarConfig(bits=4))
