"""eval/bench_generate.py: the --smoke run end to end on the CPU (about 20 s), its model shapes, and its
out-of-memory handling with simulated errors."""

import csv
import importlib.util
import itertools
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import StaticCache

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "eval" / "bench_generate.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = load_script()


def test_smoke_run_writes_every_row_with_finite_numbers(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--out", str(tmp_path)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "bench_generate_cpu-smoke.csv") as f:
        rows = list(csv.DictReader(f))
    profile = bench.SMOKE
    grid = {(r["model"], r["method"], int(r["T"]), int(r["batch"])): r for r in rows if r["kind"] == "grid"}
    assert set(grid) == set(itertools.product(profile.models, bench.DEFAULT_METHODS, profile.lengths, profile.batches))
    prefilled = set(bench.prefill_cases(profile))
    for (_, method, length, batch), row in grid.items():
        if not bench.BenchMethod.parse(method).installed():
            assert row["status"] == "not-installed"
            continue
        assert row["status"] == "ok", row
        for key in ("decode_tok_s", "ms_per_step", "ms_per_step_median", "ms_per_step_max", "fill_s", "generate_s",
                    "cache_gb"):
            assert math.isfinite(float(row[key])) and float(row[key]) > 0, (key, row)
        median, mean, longest = (float(row[k]) for k in ("ms_per_step_median", "ms_per_step", "ms_per_step_max"))
        assert median <= longest and mean <= longest * (1 + 1e-9), row
        assert float(row["compile_s"]) >= 0 and row["compiled"] == "False" and row["graphs"] == "0"
        assert float(row["gc_ms"]) >= 0
        assert row["decoding"] == "generate" and row["stop_check"] == "every step"
        if (length, batch) in prefilled:
            assert row["prefill_status"] == "ok" and float(row["prefill_s"]) > 0 and row["prefill_chunk"] == "0"
        else:
            assert row["prefill_s"] == ""
    capacity = [r for r in rows if r["kind"] == "capacity"]
    assert [(r["model"], r["method"]) for r in capacity] == list(itertools.product(profile.models,
                                                                                   bench.CAPACITY_METHODS))
    for row in capacity:  # the CPU has no memory limit to find: the search stops at its largest batch
        assert row["status"].startswith("ok") and int(row["batch"]) == profile.max_batch, row
        assert float(row["decode_tok_s"]) > 0 and int(row["T"]) == max(profile.lengths)
    assert (tmp_path / "bench_generate_cpu-smoke.png").stat().st_size > 0
    log = (tmp_path / "bench_generate_cpu-smoke.log").read_text()
    assert "transformers=" in log and "commit=" in log and "decode_tok_s" in log
    for column, variable in (("inductor_pdl", "TORCHINDUCTOR_ENABLE_PDL"),
                             ("inductor_cdt", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING")):
        setting = str(os.environ.get(variable, "0") == "1")  # inductor's own switches, recorded per row
        assert f"{column}={setting}" in log and all(r[column] == setting for r in rows), column
    assert "tuning_timer=inductor" in log and all(r["tuning_timer"] == "inductor" for r in rows)  # steady: GPU only


def test_tensor_parallel_smoke_run_on_two_processes(tmp_path):
    """--tp 2 under torchrun (gloo on the CPU): each rank's cache holds half the KV heads, and rank 0 alone writes a
    row per case that says tp=2."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(SCRIPT), "--smoke", "--device", "cpu", "--tp", "2",
               "--no-capacity", "--no-prefill", "--models", "qwen3-tiny", "--methods", "oscar,bf16",
               "--lengths", "300", "--batches", "2", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "bench_generate_cpu-tp2-smoke.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"oscar", "bf16"}
    for row in rows.values():
        assert row["status"] == "ok" and row["tp"] == "2" and float(row["decode_tok_s"]) > 0, row
    # one KV head of qwen3-tiny's two per rank: bf16 holds 2 layers x K and V x 1 head x 64 x 2 bytes per token
    tokens = 300 + bench.SMOKE.warmup + bench.SMOKE.steps + 1
    assert float(rows["bf16"]["cache_gb"]) * bench.GIB == 2 * 2 * 2 * 64 * 2 * tokens


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_steady_tuning_timer_times_the_gpu_work_and_not_the_hosts(monkeypatch):
    """The steady timer times a call's GPU work as inductor's timer does (a ~50 µs spin), and a call whose host side
    takes 100 µs before a tiny kernel as that kernel: the host has queued each timed call before the GPU reaches it."""
    from torch._inductor.runtime import benchmarking

    timer = type(benchmarking.benchmarker)
    monkeypatch.setattr(timer, "benchmark_gpu", timer.benchmark_gpu)  # put back after the test
    x = torch.zeros(1024, device="cuda")

    def slow_host_call():
        start = time.perf_counter()
        while time.perf_counter() - start < 1e-4:
            pass
        x.add_(1)

    def gpu_spin():
        torch.cuda._sleep(100_000)  # cycles: ~50 µs at 2 GHz

    stock = benchmarking.benchmarker.benchmark_gpu(gpu_spin)
    load_script().steady_tuning_timer()
    steady = benchmarking.benchmarker.benchmark_gpu(gpu_spin)
    assert stock > 0.02 and abs(steady - stock) < 0.1 * stock, (stock, steady)  # ms
    assert benchmarking.benchmarker.benchmark_gpu(slow_host_call) < 0.03


def test_smoke_run_with_both_decodings(tmp_path):
    """--decodings generate,overlapped runs each case twice, the second with
    custom_generate=oscar_hf.overlapped_sample, and says so per row (on the CPU, which has no events, the stop check
    stays per step)."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--out", str(tmp_path),
                          "--decodings", "generate,overlapped", "--models", "qwen3-tiny", "--methods",
                          "oscar+compiled,bf16+compiled", "--lengths", "128", "--batches", "1",
                          "--no-capacity"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(tmp_path / "bench_generate_cpu-smoke.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "grid"]
    assert [(r["method"], r["decoding"]) for r in rows] == list(itertools.product(
        ["oscar+compiled", "bf16+compiled"], ["generate", "overlapped"]))
    assert all(r["status"] == "ok" and r["stop_check"] == "every step" for r in rows), rows
    assert [r["prefill_status"] for r in rows] == ["ok", "", "ok", ""]  # prefill once, in the first decoding's row


def test_undoable_static_cache_crops_by_lowering_its_length():
    model = bench.build_model("qwen3-tiny", torch.device("cpu"))
    cache = bench.undoable_static_cache(model, 16)
    assert cache.is_croppable and isinstance(cache, StaticCache)
    for _ in range(2):
        cache.update(torch.ones(1, 2, 3, 64), torch.ones(1, 2, 3, 64), 0)
    cache.crop(0)
    assert int(cache.get_seq_length()) == 6
    cache.crop(-2)
    assert int(cache.get_seq_length()) == 4


@pytest.mark.parametrize("name, parameters", [("qwen3-8b", 8_190_735_360), ("llama3.1-8b", 8_030_261_248)])
def test_models_have_the_published_parameter_counts(name, parameters):
    model = bench.build_model(name, torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) == parameters


class FakeDevice:
    """Decode runs that fit up to ``fits`` sequences, each taking 1 GiB above the weights; ``free_gib`` free."""

    def __init__(self, monkeypatch, fits: int, free_gib: float):
        self.fits, self.tried = fits, []
        monkeypatch.setattr(bench, "measure_decode", self.measure_decode)
        monkeypatch.setattr(bench, "free_gib", lambda model: free_gib)  # summed over the model's GPUs

    def measure_decode(self, model, method, length, batch, profile, decoding):
        self.tried.append(batch)
        if batch > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"peak_mem_gb": 16.0 + batch, "base_mem_gb": 16.0}


@pytest.mark.parametrize("free_gib, tried", [(3.5, [1, 3, 4, 5, 6]), (9.5, [1, 9, 8, 7, 6, 5])])
def test_capacity_search_starts_at_the_estimate_and_stops_at_the_first_oom(monkeypatch, free_gib, tried):
    device = FakeDevice(monkeypatch, fits=5, free_gib=free_gib)
    model = SimpleNamespace(device=torch.device("cpu"))  # so decode_case skips its memory pre-check
    profile = replace(bench.FULL, max_batch=64, budget_s=math.inf)
    result = bench.capacity_case(model, bench.BenchMethod.parse("oscar"), 131072, profile)
    assert device.tried == tried
    assert result["batch"] == 5 and result["status"] == "ok (batch 6: oom)"


def test_prefill_is_retried_in_chunks_after_an_oom(monkeypatch):
    chunks = []

    def measure_prefill(model, method, length, batch, chunk):
        chunks.append(chunk)
        if chunk is None:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"prefill_s": 1.5, "prefill_chunk": chunk}

    monkeypatch.setattr(bench, "measure_prefill", measure_prefill)
    profile = replace(bench.FULL, budget_s=math.inf)
    result = bench.prefill_case(None, bench.BenchMethod.parse("bf16+compiled"), 131072, 1, profile)
    assert chunks == [None, profile.prefill_chunk]
    assert result == {"prefill_s": 1.5, "prefill_chunk": profile.prefill_chunk, "prefill_status": "ok"}


@pytest.mark.parametrize("name, kernels", [("oscar+compiled", 0), ("bf16+compiled", 0), ("oscar+compiled", 3)])
def test_compiled_forward_is_replayed_without_generate(name, kernels, capsys, monkeypatch):
    """forward_ms: generate's compiled decode forward, called again with its last inputs (each call counts one more
    token in the cache), without recompiling; the recorder is removed afterwards. --kernels profiles more replays
    (the cache has room for them) and logs the longest kernels (ops, on the CPU)."""
    from transformers import CompileConfig

    model = bench.build_model("qwen3-tiny", torch.device("cpu"))
    config = CompileConfig(backend="aot_eager", mode=None)  # CPU: no CUDA graphs, same replay path
    config._compile_all_devices = True
    model.generation_config.compile_config = config
    profile = replace(bench.SMOKE, steps=2, warmup=2, kernels=kernels)
    made, make = [], bench.BenchMethod.make
    monkeypatch.setattr(bench.BenchMethod, "make", lambda self, model, tokens: made.append(make(self, model, tokens))
                        or made[-1])
    method = bench.BenchMethod.parse(name)
    bench.use_attention(model, method)
    row = bench.measure_decode(model, method, 96, 1, profile, "generate")
    assert row["compiled"] and row["forward_ms"] > 0 and "status" not in row, row.get("status")
    generated = 96 + profile.warmup + profile.steps + 1
    profiled = bench.KERNEL_CALLS if kernels else 0
    assert int(made[0].get_seq_length()) == generated + profile.steps + 1 + profiled
    assert not isinstance(model._compiled_call, bench.ForwardRecorder)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("    ")]
    steps = [line for line in lines if line.startswith("    steps ")]  # the timed steps in order, the GC pauses
    assert len(steps) == 1 and steps[0].startswith(f"    steps {profile.warmup + 1} to {generated - 96 - 1} (ms): ")
    assert len(steps[0].split(":")[1].split(";")[0].split()) == profile.steps and "garbage collections" in steps[0]
    table = [line for line in lines if line not in steps]
    assert len(table) == (1 + kernels if kernels else 0), table
    if kernels:
        assert "CPU time per forward" in table[0] and all(" ms x" in line for line in table[1:])


def test_critical_path_charges_each_kernel_the_time_its_end_adds():
    """Overlapped kernels (one launched early, waiting for the one before) share the span without counting twice: each
    is charged the busy time up to its end past the ends before it; gaps with no kernel are idle; the charges sum to
    the whole span."""
    kernels = [("gemv", 0.0, 10.0), ("stage1", 8.0, 30.0), ("stage2", 9.0, 32.0), ("tiny", 12.0, 13.0),
               ("gemv", 35.0, 45.0)]
    charged = bench.critical_path_us(kernels)
    assert charged == {"gemv": 20.0, "tiny": 3.0, "stage1": 17.0, "stage2": 2.0, "(idle)": 3.0}
    assert sum(charged.values()) == 45.0
    assert bench.idle_before_us(kernels) == {"gemv": 3.0}
    assert bench.idle_before_us(kernels + [("tiny", 47.0, 48.0), ("gemv", 50.0, 51.0)]) == {"gemv": 5.0, "tiny": 2.0}


def test_split_map_spreads_the_layers_evenly_in_order():
    device_map = bench.split_map(36, 2)
    layers = [device_map[f"model.layers.{i}"] for i in range(36)]
    assert layers == [0] * 18 + [1] * 18
    assert device_map["model.embed_tokens"] == 0 and device_map["lm_head"] == device_map["model.norm"] == 1
    assert [bench.split_map(32, 3)[f"model.layers.{i}"] for i in range(32)].count(2) == 10


def test_gqa_attention_gives_transformers_sdpa_logits_over_a_static_cache():
    """bf16+compiled+gqa's attention (SDPA's own GQA under the mask, no repeated K/V) against transformers'
    sdpa attention: a left-padded batch over a static cache with unused slots, prefill and four decode steps."""
    model = bench.build_model("qwen3-tiny", torch.device("cpu")).float()
    ids = torch.randint(1, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    logits = []
    for attention in ("sdpa", bench.GQA_ATTENTION):
        model.set_attn_implementation(attention)
        out = model.generate(ids, attention_mask=mask, past_key_values=StaticCache(config=model.config,
                             max_cache_len=32), max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, disable_compile=True)
        logits.append(torch.stack(out.logits))
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # GQA
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_methods_are_the_registrys_run_a_benchmark_way():
    """Every benchmarked method is a registry method (oscar_hf.evaluation.METHODS) with benchmark-only variants: its
    cache is the one make_cache builds (a Hadamard bundle standing in for a calibrated one), static for +compiled,
    and +absorbed folds that bundle's R_V into the model; combinations that cannot run are refused by name."""
    from oscar_hf import OscarRotations
    from oscar_hf.evaluation import METHODS, make_cache

    for spec in bench.DEFAULT_METHODS:
        method = bench.BenchMethod.parse(spec)
        assert method.name == spec and method.method is METHODS[spec.split("+")[0]]
    assert bench.BenchMethod.parse("oscar+compiled+absorbed").name == "oscar+absorbed+compiled"
    model = bench.build_model("qwen3-tiny", torch.device("cpu"))
    bundle = OscarRotations.hadamard(model.config)
    for spec in ("oscar", "oscar-k4+compiled", "kivi-2", "oscar-channel-k+compiled"):
        cache = bench.BenchMethod.parse(spec).make(model, 64)
        assert cache.config == make_cache(spec.split("+")[0], model, bundle).config, spec
        assert cache.is_compileable == spec.endswith("+compiled"), spec
    for spec, bits in (("oscar-pq1", 1), ("oscar-pq2+compiled", 2)):  # random codebooks stand in for trained ones
        cache = bench.BenchMethod.parse(spec).make(model, 64)
        assert cache.config.key_quantization == "product" and cache.config.side_bits["key"] == bits, spec
        book = cache.rotations.key_codebook(0, bits)
        assert book.bits == bits and book.head_dim == model.config.head_dim
    assert type(bench.BenchMethod.parse("bf16").make(model, 64)).__name__ == "DynamicCache"
    assert isinstance(bench.BenchMethod.parse("bf16+compiled").make(model, 64), StaticCache)
    weight = model.model.layers[0].self_attn.v_proj.weight.clone()
    absorbed = bench.BenchMethod.parse("oscar+absorbed+compiled").make(model, 64)
    assert torch.equal(absorbed.rotations.value_rotation[0], torch.eye(64))
    assert not torch.equal(model.model.layers[0].self_attn.v_proj.weight, weight)
    for spec, reason in (("int3", "unknown method"), ("oscar+fast", "unknown variant"),
                         ("oscar-k4-half", "diagnostics"), ("quanto-int2+compiled", "compile"),
                         ("quarot-int2+absorbed", "absorbed"), ("oscar+gqa", "gqa")):
        with pytest.raises(ValueError, match=reason):
            bench.BenchMethod.parse(spec)
