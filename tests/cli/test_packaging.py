"""Packaging: every subpackage ships, the README's first two commands stay what CI runs, the optional packages
stay optional (never imported by ``import oscar_hf``; a missing one names the extra that installs it), and a wheel
makes ``lm_eval --model hf-oscar`` work."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import tomllib

from oscar_hf._extras import EXTRAS

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = ("lm_eval", "matplotlib", "gguf", "datasets")


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter on this checkout; it prints one JSON object as its last line."""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "oscar_hf").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"


def test_the_version_has_one_source():
    """pyproject reads oscar_hf.__version__ (it keys the rotations made on demand); CITATION.cff and the installed
    metadata say the same."""
    import importlib.metadata

    import oscar_hf

    assert "version" in PYPROJECT["dynamic"] and "version" not in PYPROJECT
    citation = re.search(r"^version: (\S+)$", (ROOT / "CITATION.cff").read_text(), re.M).group(1)
    assert citation == oscar_hf.__version__ == importlib.metadata.version("oscar-hf")


def test_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = [b.split("```")[0].strip() for b in readme.split("```bash\n")[1:3]]
    assert blocks[0].endswith("oscar-hf demo") and "pip install" in blocks[0]
    assert blocks[1].endswith("pytest") and blocks[1] in ci


def test_import_oscar_hf_loads_no_optional_package():
    """``import oscar_hf`` in a fresh interpreter, then the command's modules (cli, demo, the eval runner, the
    PyPI model loader): none of them imports lm_eval, matplotlib, gguf or datasets."""
    loaded = run_python(
        "import json, sys\n"
        f"optional = {OPTIONAL + ('optimum', 'hqq')!r}\n"
        "import oscar_hf\n"
        "core = [m for m in optional if m in sys.modules]\n"
        "import oscar_hf.cli, oscar_hf.demo, oscar_hf.evaluation.runner, oscar_hf.models\n"
        "commands = [m for m in optional if m in sys.modules]\n"
        "print(json.dumps({'import oscar_hf': core, 'commands': commands}))\n"
    )
    assert loaded == {"import oscar_hf": [], "commands": []}


def test_without_optional_packages_the_core_runs_and_each_feature_names_its_extra():
    """With every optional package unimportable, a quantized cache still generates and ``oscar-hf``'s parser
    builds; each feature that needs one fails, before doing any work, naming ``pip install "oscar-hf[<extra>]"``."""
    result = run_python(
        "import json, sys, tempfile\n"
        f"for name in {tuple(EXTRAS)!r}:\n"
        "    sys.modules[name] = None  # import fails as if it were not installed\n"
        "import torch, transformers\n"
        "import oscar_hf\n"
        "from oscar_hf import cli, models\n"
        "from oscar_hf.evaluation import METHODS, make_cache, runner\n"
        "config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,\n"
        "                                  num_attention_heads=2, num_key_value_heads=1, head_dim=32)\n"
        "torch.manual_seed(0)\n"
        "model = transformers.AutoModelForCausalLM.from_config(config).eval()\n"
        "model.generation_config.eos_token_id = None  # a random model would stop at random\n"
        "cache = make_cache('quarot-int2', model, recent_tokens=4, sink_tokens=4)\n"
        "ids = torch.arange(1, 25)[None]\n"
        "out = model.generate(ids, max_new_tokens=3, do_sample=False, **oscar_hf.cache_kwargs(model, cache))\n"
        "assert out.shape == (1, 27) and isinstance(cache, oscar_hf.OscarQuantizedCache)\n"
        "assert cli.build_parser().parse_args(['demo']).command == 'demo'\n"
        "errors = {}\n"
        "def error(key, call):\n"
        "    try:\n"
        "        call()\n"
        "    except Exception as err:\n"
        "        errors[key] = f'{type(err).__name__}: {err}'\n"
        "out_dir = tempfile.mkdtemp()\n"
        "error('plots', lambda: runner.run_eval(None, None, 'm', ['bf16'], ['perplexity'], out_dir, text='x'))\n"
        "error('demo', lambda: models._convert(models.SMOLLM2, models.Path(out_dir) / 'smollm2'))\n"
        "error('datasets', lambda: cli.load_texts('org/some-dataset'))\n"
        "error('lm-eval', lambda: __import__('oscar_hf.lm_eval_model'))\n"
        "error('baselines', lambda: make_cache('quanto-int2', model))\n"
        "print(json.dumps(errors))\n"
    )
    assert set(result) == {"plots", "demo", "datasets", "lm-eval", "baselines"}, result
    for extra, message in result.items():
        assert f'pip install "oscar-hf[{extra}]"' in message, message
        assert message.startswith("ValueError" if extra == "baselines" else "MissingExtraError"), message


def test_extras_install_what_the_error_messages_name():
    """Every optional package is in the extra its error names, not in the core dependencies; matplotlib is its own
    extra; ``test`` installs every extra's packages but the benchmark baselines; the demo needs no plots."""
    extras = {name: requirement_names(listed) for name, listed in PYPROJECT["optional-dependencies"].items()}
    core = requirement_names(PYPROJECT["dependencies"])
    for module, (package, extra) in EXTRAS.items():
        assert package in extras[extra] and package not in core, (module, package, extra)
    assert extras["plots"] == {"matplotlib"}
    assert set().union(*(packages for name, packages in extras.items() if name not in ("test", "baselines"))) <= \
        extras["test"]
    demo_source = (ROOT / "oscar_hf" / "demo.py").read_text()
    assert "matplotlib" not in demo_source and "pyplot" not in demo_source


def test_the_wheel_makes_lm_eval_find_hf_oscar(tmp_path):
    """A regular (non-editable) wheel of this checkout ships oscar_hf_lm_eval.pth and its hook at the root (pip puts
    them in site-packages), the lm-eval task and the ``lm_eval.models`` entry point.
    Installed alone into a folder that a fresh interpreter reads as its site-packages (this environment's packages on
    its path, but none of its .pth files, so not this checkout's editable install), lm-eval's registry has "hf-oscar"
    from that folder."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests",
                                                                 "eval", "docs"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    # this environment's setuptools where it has one (a venv of Python 3.12+ has none: then pip fetches it)
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    subprocess.run([*pip, "wheel", "--no-deps", *isolation, "-w", tmp_path, source], check=True)
    (wheel,) = tmp_path.glob("*.whl")
    site_packages = tmp_path / "site-packages"
    subprocess.run([*pip, "install", "--no-deps", "--target", site_packages, wheel], check=True)
    assert (site_packages / "oscar_hf_lm_eval.pth").read_text().startswith("import _oscar_hf_lm_eval;")
    assert (site_packages / "oscar_hf" / "lm_eval_tasks" / "oscar_demo.jsonl").is_file()
    (entry_points,) = site_packages.glob("oscar_hf-*.dist-info/entry_points.txt")
    assert "[lm_eval.models]\nhf-oscar = oscar_hf.lm_eval_model:OscarHFLM" in entry_points.read_text()

    packages = sorted({sysconfig.get_paths()[key] for key in ("purelib", "platlib")})
    code = ("import site, sys\n"
            f"sys.path += {packages!r}\n"
            f"site.addsitedir({str(site_packages)!r})\n"
            "from lm_eval.api.registry import get_model\n"
            "from lm_eval.models.huggingface import HFLM\n"
            "assert get_model('hf-oscar').__name__ == 'OscarHFLM' and get_model('hf') is HFLM\n"
            "print(sys.modules['oscar_hf'].__file__)\n")
    # -I: neither the working directory nor PYTHONPATH on the path; -S: no site-packages but those added above
    run = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert Path(run.stdout.strip()).is_relative_to(site_packages)
