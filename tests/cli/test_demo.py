"""``oscar-hf demo`` on a tiny local model: its four steps and its summary, the bundle in the Hugging Face cache
folder (made on the first run, read back on the next), nothing written into the working directory."""

import re
from pathlib import Path

import pytest
import torch
from helpers import char_tokenizer

from oscar_hf import demo
from oscar_hf.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ["demo", "--context-tokens", "400", "--score-tokens", "6", "--max-new-tokens", "4", "--calibration-tokens",
        "256", "--dtype", "float32", "--threads", "1"]


def test_demo_writes_nothing_into_the_working_directory(model_dir, tmp_path, monkeypatch, capsys):
    threads = torch.get_num_threads()
    work, home = tmp_path / "work", tmp_path / "hf"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HF_HOME", str(home))
    try:
        main([*DEMO, "--model", model_dir])
        first = capsys.readouterr().out
        main([*DEMO, "--model", model_dir, "--verbose"])
        second = capsys.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert list(work.iterdir()) == []
    [bundle] = [path for path in (home / "oscar-hf" / "rotations").glob("*/*") if path.is_dir()]  # (and a lock)
    assert f"; the model lives in {model_dir}" in first and f"the bundle lives in {bundle}" in first
    assert "calibrated in" in first and "calibrated on an earlier run (256 tokens, the default settings)" in second
    for step in ("[1/4]", "[2/4]", "[3/4]", "[4/4]"):
        assert step in first
    assert first.count("identical for the first 4 of 4 generated tokens") == len(demo.SHORT_PROMPTS)
    summary = first[first.index("Summary:"):]
    for name in demo.SUMMARY_METHODS.values():
        row = next(line for line in summary.splitlines() if line.strip().startswith(name))
        assert re.search(r"MiB +\d+\.\d\d +\d+\.\d\d +\d+\.\d{4} +\d+%$", row), row
    assert "default cache" in summary and "32.00" in summary  # float32 here
    assert f"{demo.SPEED_HERE['cpu']} {demo.SPEED}" in summary
    assert "Diagnostics on" in second and "Diagnostics on" not in first


@pytest.mark.parametrize("native", [True, False], ids=["native-bf16", "emulated-bf16"])
def test_demo_runs_in_bfloat16_only_where_it_is_native(model_dir, tmp_path, monkeypatch, capsys, native):
    """By default the demo's dtype is bfloat16 where the CPU runs its products natively and float32 elsewhere (an
    AVX2-only CPU emulates bf16, several times slower); the summary then measures OSCAR against that dtype's bits."""
    monkeypatch.setattr(demo, "native_bfloat16", lambda: native)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    threads = torch.get_num_threads()
    try:
        main([arg for arg in DEMO if arg not in ("--dtype", "float32")] + ["--model", model_dir])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    dtype, bits = ("bfloat16", 16) if native else ("float32", 32)
    assert f"bfloat16 products {'native' if native else 'emulated'})" in out.splitlines()[0]
    assert f"Summary: {model_dir} in {dtype}," in out and f"stay in {dtype}" in out
    default = next(line for line in out.splitlines() if line.strip().startswith("default cache") and "MiB" in line)
    assert f"{bits}.00" in default and f"less than {bits})" in out


def test_the_quoted_speed_numbers_are_on_the_results_page():
    results = (ROOT / "eval" / "results" / "README.md").read_text() + (ROOT / "README.md").read_text()
    numbers = re.findall(r"\d+\.\d+", demo.SPEED)
    assert numbers and all(n in results for n in numbers), numbers
    for row in ("| decode kernel, Qwen3-8B's shape, batch 1, 128K | 35.7 µs (**5.08×**) | bf16 SDPA 181.6 µs | H100 |",
                "| `generate` step, Qwen3-8B, batch 1, 128K, compiled | 7.13 ms (**1.72×**) | compiled bf16 static "
                "cache 12.29 ms | H100 |"):
        assert row in results


def test_held_out_segment_is_the_end_of_the_text():
    tokenizer = char_tokenizer(bos=True)
    text = "Emma Woodhouse, handsome, clever, and rich. " * 40
    segment = demo.held_out_segment(tokenizer, text, 50)
    assert segment.shape == (1, 50) and segment[0, 0] == tokenizer.bos_token_id
    assert tokenizer.decode(segment[0, 1:]) == text[-49:]
    with pytest.raises(ValueError, match="fewer than"):
        demo.held_out_segment(tokenizer, "short", 50)


@pytest.mark.parametrize("load, threads", [(0.1, 2), (0.6, 2), (1.0, 1), (1.9, 1), (7.0, 1)])
def test_demo_threads_leave_the_busy_cores(monkeypatch, load, threads):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (load, 0.0, 0.0))
    assert demo.cpu_threads() == (threads, load)
