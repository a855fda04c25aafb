"""The decode kernel's machine code without a GPU: stage 1 compiled for sm_90 (H100/H200) by the installed Triton,
its registers, stack and the instruction mix of each loop (the history loop: the pipelined one with the most HMMA).

    python eval/kernel_sass.py [--head-dim 128] [--dtype bf16] [--key-bits 2] [--sass FILE]

The launch is the one ``kernels.decode.triton.decode`` makes for a layer of Qwen3-8B's GQA (4 query heads per KV head)
holding 64 sink, 1024 history and 256 recent tokens: the kernel is captured at its launch (nothing runs) and
compiled with the same arguments, specialized as Triton specializes them on a GPU (pointers and multiples of 16
aligned), and with programmatic dependent launch on, as on sm_90. Triton's bundled ptxas, cuobjdump
and nvdisasm do the rest. Counts depend on the Triton version: the GPU machines run 3.6 (``pip install --target DIR
triton==3.6.0`` and put DIR first on PYTHONPATH to match them). A loop's count includes its rarely taken branches
(the history loop's rescaling when the running max moves).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

if os.environ.get("TRITON_INTERPRET"):  # its kernels would be the interpreter's, with its launch parameters
    raise SystemExit("eval/kernel_sass.py compiles for a GPU: run it without TRITON_INTERPRET")

from oscar_hf import DynamicOscarLayer, OscarConfig  # noqa: E402
from oscar_hf.kernels.decode import triton as triton_decode  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*\.(L\w+):")
BACK_BRANCH = re.compile(r"BRA\s+`?\(?\.(L\w+)")


class _Capture:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the call instead of launching."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def captured_launch(head_dim: int, dtype: torch.dtype, key_bits: int) -> tuple[tuple, dict]:
    """Positional and keyword arguments of the stage-1 launch that ``decode`` makes (nothing runs)."""
    config = OscarConfig(sink_tokens=64, recent_tokens=256, flush_tokens=1, key_bits=key_bits, backend="torch")
    layer = DynamicOscarLayer(config, torch.eye(head_dim), torch.eye(head_dim))
    kv = torch.randn(2, 1, 8, 64 + 1024 + 256, head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    layer.update(kv[0], kv[1])
    query = torch.randn(1, 32, 1, head_dim).to(dtype)
    stage1, stage2 = triton_decode.decode_stage1_kernel, triton_decode.decode_stage2_kernel
    capture = _Capture()
    try:
        triton_decode.decode_stage1_kernel, triton_decode.decode_stage2_kernel = capture, _Capture()
        triton_decode.decode(query, layer.packed(), None, None)
    finally:
        triton_decode.decode_stage1_kernel, triton_decode.decode_stage2_kernel = stage1, stage2
    (args, kwargs), = capture.calls
    return args, kwargs


def compile_stage1(args: tuple, kwargs: dict) -> triton.compiler.CompiledKernel:
    """Stage 1 compiled for sm_90 from a captured launch, specialized as Triton does on a GPU."""
    kernel = triton_decode.decode_stage1_kernel
    values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k in kernel.arg_names}
    values["PDL"] = True  # sm_90: both stages are launched early (off for CPU tensors)
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[(i,)] = value
            continue
        signature[param.name] = mangle_type(value)  # "*bf16", "i32", "fp32", ...
        aligned = isinstance(value, torch.Tensor) or (isinstance(value, int) and value % 16 == 0)
        if aligned and not (param.do_not_specialize or param.do_not_specialize_on_alignment):
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def loops(sass: str) -> list[tuple[int, Counter]]:
    """(first instruction's index, opcode counts) of every loop: the instructions from a label to a branch back."""
    instructions, labels, found = [], {}, []
    for line in sass.splitlines():
        if label := LABEL.match(line):
            labels[label.group(1)] = len(instructions)
        elif match := INSTRUCTION.search(line):
            text = re.sub(r"^@!?U?P\w+\s+", "", match.group(2))  # drop the predicate
            instructions.append(text.split()[0])
            target = BACK_BRANCH.search(match.group(2))
            if target and labels.get(target.group(1), len(instructions)) < len(instructions) - 1:
                start = labels[target.group(1)]
                found.append((start, Counter(instructions[start:])))
    return found


def analyse(head_dim: int, dtype: torch.dtype, key_bits: int) -> tuple[str, str, list[tuple[int, Counter]], int]:
    """(registers and stack per thread, disassembly, loops, index of the history loop among them)."""
    compiled = compile_stage1(*captured_launch(head_dim, dtype, key_bits))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "stage1.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    found = loops(sass)
    history = max(range(len(found)), key=lambda i: (any(op.startswith("LDGSTS") for op in found[i][1]),  # pipelined
                                                    sum(n for op, n in found[i][1].items() if op.startswith("HMMA"))))
    return re.search(r"REG:\d+ STACK:\d+", usage).group(0), sass, found, history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=128, choices=sorted(triton_decode.WINDOW_BLOCK))
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--key-bits", type=int, default=2, choices=(2, 4))
    p.add_argument("--top", type=int, default=12, help="opcodes listed per loop")
    p.add_argument("--sass", type=Path, help="also write the disassembly here")
    a = p.parse_args()
    usage, sass, found, history = analyse(a.head_dim, DTYPES[a.dtype], a.key_bits)
    if a.sass:
        a.sass.write_text(sass)
    print(f"triton {triton.__version__}, sm_90, D={a.head_dim} {a.dtype}, {a.key_bits}-bit K: {usage}")
    for i, (start, ops) in enumerate(found):
        print(f"loop at instruction {start}: {sum(ops.values())} instructions{'  <- history tiles' * (i == history)}")
        print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(a.top)))


if __name__ == "__main__":
    main()
