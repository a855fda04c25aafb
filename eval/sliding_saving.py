"""What storing the sliding-window layers in INT2 saves (``OscarConfig.quantize_sliding``), on Gemma-3-270M.

    PYTHONPATH=. python eval/sliding_saving.py [--lengths 4096,32768] [--check-length 4096] [--out DIR]
    PYTHONPATH=. python eval/sliding_saving.py --quality [--segments 4] [--out DIR]

For each length, the bytes the cache holds (``nbytes``: every tensor, capacity included) and the bits per stored
K/V element after a prefill of that many tokens and 16 decode steps, for four caches: the default (transformers'
DynamicCache), OSCAR (sliding layers in transformers' layer, bf16), OSCAR with ``quantize_sliding``, and that with a
64-token recent window in the sliding layers (``sliding_recent_tokens``); the model's recipe settings, bf16. The K/V
written are random (the bytes do not depend on them) and go straight into the cache's layers, as the model's
attention hands them over: a prefill in chunks of 2,048 tokens, then one token per step. At ``--check-length`` the
model itself runs the same prefill and steps on text, and its caches' bytes must be the same (else the script
exits). Writes ``sliding_saving.csv`` in ``--out``.

``--quality``: what it costs instead. WikiText-2's test text from one third in, ``--segments`` segments of a
2,048-token context then 64 tokens scored one at a time (``oscar_hf.evaluation.evaluate_perplexity``), fp32, with
the model's rotations made on demand (its recipe, 2,048 calibration tokens): perplexity, KL to the default cache and
top-1 agreement for the default cache, the ``oscar`` preset, and that preset with ``quantize_sliding`` (and a
64-token sliding recent window). Writes ``sliding_quality.csv``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from oscar_hf import OscarQuantizedCache, OscarRotations, cache_kwargs, enable
from oscar_hf.evaluation.environment import environment
from oscar_hf.model_support import ModelShape
from oscar_hf.models import load_gemma3_270m
from oscar_hf.recipes import recipe_for_model

CHUNK, STEPS = 2048, 16


def caches(model) -> dict:
    """name -> a fresh cache builder: the recipe's settings, and rotations shaped as its bundle's (V rotated, K not:
    the bytes depend on which sides rotate, not on the matrices)."""
    config = recipe_for_model(model).cache
    rotations = OscarRotations.hadamard(model.config).with_identity_keys()
    return {
        "default": lambda: DynamicCache(config=model.config),
        "oscar": lambda: OscarQuantizedCache(model.config, rotations, config),
        "oscar-sliding": lambda: OscarQuantizedCache(model.config, rotations, config, quantize_sliding=True),
        "oscar-sliding-recent64": lambda: OscarQuantizedCache(model.config, rotations, config, quantize_sliding=True,
                                                              sliding_recent_tokens=64),
    }


def nbytes(cache) -> int:
    if isinstance(cache, OscarQuantizedCache):
        return cache.nbytes
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


def bits(cache) -> float:
    if isinstance(cache, OscarQuantizedCache):
        return cache.bits_per_element
    return 16.0  # bf16, every element


def synthetic(cache, shape: ModelShape, length: int) -> None:
    """The K/V updates of a ``length``-token prefill (chunks of CHUNK) and STEPS decode steps, random bf16."""
    generator = torch.Generator().manual_seed(0)
    sizes = [CHUNK] * (length // CHUNK) + ([length % CHUNK] if length % CHUNK else []) + [1] * STEPS
    for size in sizes:
        for i, (heads, dim) in enumerate(zip(shape.kv_heads, shape.head_dims)):
            k, v = torch.randn(2, 1, heads, size, dim, generator=generator, dtype=torch.bfloat16)
            cache.update(k, v, i)


@torch.no_grad()
def real(model, tokenizer, cache, length: int) -> None:
    """The model's own prefill of ``length`` tokens of text (chunks of CHUNK), then STEPS greedy steps."""
    text = Path(ARGS.text).read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        sys.exit(f"{ARGS.text} has only {ids.shape[1]} tokens; --check-length needs {length}")
    for start in range(0, length, CHUNK):
        out = model(input_ids=ids[:, start:start + CHUNK], **cache_kwargs(model, cache), use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(STEPS):
        token = model(input_ids=token, **cache_kwargs(model, cache), use_cache=True).logits[:, -1:].argmax(-1)


def quality(out: Path) -> None:
    import dataclasses

    from oscar_hf.autocalibrate import rotations_for_model
    from oscar_hf.evaluation import METHODS
    from oscar_hf.evaluation.perplexity import evaluate_perplexity

    model, tokenizer = load_gemma3_270m(torch.float32)
    rotations = rotations_for_model(model.eval(), tokenizer, None)
    oscar = METHODS["oscar"]
    variants = {"oscar-sliding": {"quantize_sliding": True},
                "oscar-sliding-recent64": {"quantize_sliding": True, "sliding_recent_tokens": 64}}
    for name, fields in variants.items():  # the oscar preset with the sliding layers quantized (this run only)
        METHODS[name] = dataclasses.replace(oscar, name=name, config={**oscar.config, **fields})
    ids = tokenizer(Path(ARGS.text).read_text(), return_tensors="pt").input_ids[0]
    start, length = len(ids) // 3, 2048 + 64
    segments = torch.stack([torch.cat([torch.tensor([tokenizer.bos_token_id]),
                                       ids[start + i * length: start + (i + 1) * length - 1]])
                            for i in range(ARGS.segments)])
    rows = evaluate_perplexity(model, segments, [2048], ["bf16", "oscar", *variants], calibrated=rotations)
    env = environment("cpu")
    rows = [{"model": "gemma-3-270m", **row, **env} for row in rows]
    for row in rows:
        print(f"{row['method']:<24} {row['metric']:<15} {row['value']:8.4f}  {row['bits_per_element']:6.2f} bits")
    with open(out / "sliding_quality.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out / 'sliding_quality.csv'}")


def main() -> None:
    if ARGS.quality:
        Path(ARGS.out).mkdir(parents=True, exist_ok=True)
        return quality(Path(ARGS.out))
    model, tokenizer = load_gemma3_270m(torch.bfloat16)
    enable(model.eval())  # the "oscar" attention: the OSCAR caches need it (the default cache's K/V go to sdpa)
    shape = ModelShape.from_config(model.config)
    env = environment("cpu")
    builders = caches(model)
    rows = []
    for length in [int(t) for t in ARGS.lengths.split(",")]:
        for name, build in builders.items():
            cache = build()
            synthetic(cache, shape, length)
            rows.append({"model": "gemma-3-270m", "tokens": length + STEPS, "cache": name, "nbytes": nbytes(cache),
                         "bits_per_element": round(bits(cache), 3), **env})
        base = next(r for r in rows if r["tokens"] == length + STEPS and r["cache"] == "default")["nbytes"]
        for row in rows[-len(builders):]:
            row["vs_default"] = round(row["nbytes"] / base, 4)
            print(f"{length + STEPS:>6} tokens  {row['cache']:<14} {row['nbytes'] / 2**20:8.2f} MiB  "
                  f"{row['bits_per_element']:6.3f} bits/element  {row['vs_default']:.3f} of the default cache")
    if ARGS.check_length:
        for name, build in builders.items():
            cache = build()
            real(model, tokenizer, cache, ARGS.check_length)
            cache_synthetic = build()
            synthetic(cache_synthetic, shape, ARGS.check_length)
            if nbytes(cache) != nbytes(cache_synthetic):
                sys.exit(f"{name}: the model's own run holds {nbytes(cache)} bytes, the synthetic one "
                         f"{nbytes(cache_synthetic)}")
            print(f"check at {ARGS.check_length}: {name} holds {nbytes(cache)} bytes after the model's own run, as "
                  "after the synthetic one")
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sliding_saving.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {out / 'sliding_saving.csv'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,32768", help="prefill tokens, comma-separated")
    parser.add_argument("--check-length", type=int, default=4096,
                        help="also run the model itself at this length and check the bytes (0: no)")
    parser.add_argument("--text", default="../shared/data/wikitext-2-raw/wiki.test.raw", help="text for the check")
    parser.add_argument("--out", default="eval/results/sliding", help="folder for the CSV")
    parser.add_argument("--quality", action="store_true", help="measure perplexity and KL instead of bytes")
    parser.add_argument("--segments", type=int, default=4, help="text segments for --quality")
    ARGS = parser.parse_args()
    main()
