"""eval/bench_decode.py: the --smoke run end to end on the CPU under TRITON_INTERPRET=1 (about 90 s): the script that
times the decode kernel on a GPU runs through every step (checks, timings, CSV) without one."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "eval" / "bench_decode.py"


def test_smoke_run_checks_the_kernels_and_writes_finite_timings(tmp_path):
    """The write and decode checks pass, and the one row, of the smoke point, has finite timings, the history
    layout's read-only time among them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "write kernel: bit-identical" in run.stdout and "decode kernel: matches the torch twin" in run.stdout
    with open(tmp_path / "bench_decode_cpu-interpreter.csv") as f:
        rows = list(csv.DictReader(f))
    assert [row["shape"] for row in rows] == ["smoke-4q1kv"]
    for column in ("kernel_ms", "steady_kernel_ms", "steady_read_ms", "steady_layout_read_ms", "sdpa_ms"):
        assert math.isfinite(float(rows[0][column])) and float(rows[0][column]) > 0, column
