"""eval/kernel_sass.py: the decode kernel compiled for sm_90 on the CPU (Triton's bundled ptxas), its history loop
as the design has it: pipelined with cp.async, the dots it should have, no spills (with the installed Triton, whose
register allocation can differ from the GPU machines' 3.6)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
    pytest.skip("this Triton has no bundled ptxas", allow_module_level=True)


def history_loop(head_dim: int) -> tuple[dict, dict]:
    """Registers and stack, and the history loop's opcode counts, from a run of the script (a fresh process: the
    kernel tests set TRITON_INTERPRET=1 in this one)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "kernel_sass.py"), "--head-dim", str(head_dim),
                          "--top", "1000"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    usage = {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", lines[0])}
    ops_line = lines[next(i for i, line in enumerate(lines) if line.endswith("<- history tiles")) + 1]
    return usage, {op: int(n) for op, n in re.findall(r"(\S+) (\d+)", ops_line)}


@pytest.mark.parametrize("head_dim, dots", [(128, 64), (64, 32)])
def test_history_loop_is_pipelined_has_its_dots_and_no_spills(head_dim, dots):
    """D=128: 8 code positions x 4 blocks of 16 tokens for K's logits and for V's output; D=64 (pair rows: 32
    tokens per 64-token tile) half of that."""
    usage, ops = history_loop(head_dim)
    assert any(op.startswith("LDGSTS") for op in ops), ops  # the codes stream through cp.async
    assert sum(n for op, n in ops.items() if op.startswith("HMMA")) == dots, ops
    assert not {"LDL", "STL"} & {op.split(".")[0] for op in ops}, ops  # registers suffice inside the loop
    assert usage["REG"] <= 168
