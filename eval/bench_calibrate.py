"""How long rotations take to make on demand: the calibration ``OscarQuantizedCache.from_pretrained(model=model)``
runs the first time it meets a model, on a random-weight model of a real shape.

    PYTHONPATH=. python eval/bench_calibrate.py --model qwen3-8b [--device cuda] [--repeats 3] [--out DIR]
    PYTHONPATH=. python eval/bench_calibrate.py --model qwen3-tiny --device cpu   # a smoke run, seconds

Models: ``eval/bench_generate.py``'s (``MODELS``: qwen3-8b, llama3.1-8b, and tiny ones), built the same way (random
bf16 weights, directly on the device). Settings: ``oscar_hf.autocalibrate.calibration_settings`` for the recipe
``--recipe`` names (auto: the model name's recipe, e.g. qwen3-8b's two passes, query covariance for K and key-weighted
values for V; none: calibrate's defaults, the same targets) with the default budget (``DEFAULT_TOKENS``, or
``--num-tokens``). The tokens are random ids (a tokenizer and text cost nothing next to the forward passes, and random
weights have no text to prefer); no diagnostics, as on demand. Each repeat is timed from the first forward to the
finished bundle (CUDA synchronized); the first includes the device's warm-up (CUDA context, first kernel launches).
Prints a line per repeat and writes ``bench_calibrate_<device>.csv`` into ``--out`` (with the environment columns of
the other benchmarks).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import sys
import time
from pathlib import Path

import torch

from oscar_hf import calibrate
from oscar_hf.autocalibrate import DEFAULT_TOKENS, calibration_settings
from oscar_hf.evaluation.environment import device_slug, environment


def bench_generate():
    """eval/bench_generate.py as a module (its MODELS and build_model)."""
    path = Path(__file__).with_name("bench_generate.py")
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> list[dict]:
    generate = bench_generate()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="qwen3-8b", choices=list(generate.MODELS), help="the model's shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--recipe", default="auto",
                        help="a recipe name, auto (the model name's recipe) or none (calibrate's defaults)")
    parser.add_argument("--num-tokens", type=int, default=DEFAULT_TOKENS, help="calibration tokens")
    parser.add_argument("--repeats", type=int, default=2, help="timed calibrations")
    parser.add_argument("--out", help="folder for the CSV (default: none written)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    env = environment(device)
    model = generate.build_model(args.model, device)
    recipe, settings, config = calibration_settings(args.model, args.num_tokens,
                                                    None if args.recipe == "none" else args.recipe)
    settings["num_tokens"] = args.num_tokens
    ids = torch.randint(0, model.config.vocab_size, (args.num_tokens,), generator=torch.Generator().manual_seed(0))
    passes = 2 if settings["v_target"] == "sst" else 1
    print(f"{args.model} on {env['gpu']}: {args.num_tokens} tokens in chunks of "
          f"{settings['max_length']}, {settings['k_target']}/{settings['v_target']} ({passes} pass"
          f"{'es' if passes > 1 else ''}), recipe {recipe.name if recipe else 'none'}", flush=True)
    rows = []
    for repeat in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        calibrate(model, None, [ids], **settings, diagnostic_tokens=0, config=config, show_progress=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        print(f"  repeat {repeat}: {seconds:.2f} s ({args.num_tokens * passes / seconds:,.0f} tokens/s over the "
              f"passes)" + (f", peak memory {peak:.1f} GiB" if device.type == "cuda" else ""), flush=True)
        rows.append({**env, "model": args.model, "recipe": recipe.name if recipe else "none",
                     "tokens": args.num_tokens, "max_length": settings["max_length"], "passes": passes,
                     "repeat": repeat, "seconds": round(seconds, 4), "peak_mem_gb": round(peak, 3)})
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench_calibrate_{device_slug(env)}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
