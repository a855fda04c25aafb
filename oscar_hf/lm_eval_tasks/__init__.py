"""lm-eval tasks shipped with oscar-hf, runnable offline: ``lm_eval --tasks oscar_demo --include_path TASKS_DIR``
(``oscar-hf lm-eval-tasks`` prints the folder)."""

import json
from pathlib import Path

TASKS_DIR = Path(__file__).parent


def load_demo(**_):
    """oscar_demo's documents (``oscar_demo.jsonl``) as the test split of a datasets.DatasetDict; lm-eval passes the
    task's metadata as keyword arguments, unused here."""
    import datasets  # an lm-eval dependency

    path = TASKS_DIR / "oscar_demo.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
