"""eval/bench_calibrate.py on a tiny shape on the CPU: one timed calibration with the on-demand settings, its CSV."""

import csv
import importlib.util
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("bench_calibrate", ROOT / "eval" / "bench_calibrate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_run_times_the_on_demand_calibration(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = load_script().main(["--model", "qwen3-tiny", "--device", "cpu", "--num-tokens", "256", "--repeats", "1",
                                   "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert "256 tokens in chunks of 2048, qqt/sst (2 passes), recipe none" in capsys.readouterr().out
    with open(tmp_path / "bench_calibrate_cpu.csv") as f:
        [row] = list(csv.DictReader(f))
    assert (row["model"], row["tokens"], row["passes"]) == ("qwen3-tiny", "256", "2")
    assert float(row["seconds"]) > 0 and math.isnan(float(row["peak_mem_gb"])) and len(rows) == 1
