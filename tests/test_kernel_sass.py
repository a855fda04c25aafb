"""eval/kernel_sass.py: the decode kernel compiled for sm_90 on the CPU (Triton's bundled ptxas), its history loop
as the design has it: pipelined with cp.async, the dots it should have, no spills (with the installed Triton, whose
register allocation can differ from the GPU machines' 3.6)."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
    pytest.skip("this Triton has no bundled ptxas", allow_module_level=True)


def load_script():
    spec = importlib.util.spec_from_file_location("kernel_sass", ROOT / "eval" / "kernel_sass.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("head_dim, dots", [(128, 64), (64, 32)])
def test_history_loop_is_pipelined_has_its_dots_and_no_spills(head_dim, dots):
    """D=128: 8 code positions x 4 blocks of 16 tokens for K's logits and for V's output; D=64 (pair rows: 32
    tokens per 64-token tile) half of that."""
    usage, _, found, history = load_script().analyse(head_dim, torch.bfloat16, 2)
    ops = found[history][1]
    assert any(op.startswith("LDGSTS") for op in ops), ops  # the codes stream through cp.async
    assert sum(n for op, n in ops.items() if op.startswith("HMMA")) == dots, ops
    assert not {"LDL", "STL"} & {op.split(".")[0] for op in ops}, ops  # registers suffice inside the loop
    assert int(re.search(r"REG:(\d+)", usage).group(1)) <= 168
