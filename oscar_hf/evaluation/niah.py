"""Needle in a haystack (RULER-style single needle) in real text, over a grid of depth × length."""

from __future__ import annotations

import random

import torch

from .._extras import pyplot
from ..model_support import cache_kwargs
from .methods import bit_columns, make_cache

NEEDLE = "The special magic number is {number}."
QUESTION = "What is the special magic number mentioned in the text above? Answer with the number only."


def needle_prompt(tokenizer, text: str, length: int, depth: float, number: int) -> torch.Tensor:
    """Chat-formatted input ids of about ``length`` tokens: ``text`` with the needle at ``depth`` (0..1)."""
    overhead = len(tokenizer(NEEDLE.format(number=number) + "\n\n" + QUESTION)["input_ids"]) + 16
    text = text[: 16 * length]  # plenty of characters for ``length`` tokens, without tokenizing a whole corpus
    haystack = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][: max(length - overhead, 1)])
    cut = int(len(haystack) * depth)
    sentence_end = haystack.rfind(". ", 0, cut)
    cut = sentence_end + 2 if sentence_end > 0 and depth > 0 else cut
    document = f"{haystack[:cut]} {NEEDLE.format(number=number)} {haystack[cut:]}".strip()
    messages = [{"role": "user", "content": f"{document}\n\n{QUESTION}"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]


@torch.no_grad()
def evaluate_niah(
    model,
    tokenizer,
    text: str,
    lengths: list[int],
    depths: list[float],
    methods: list[str],
    calibrated=None,
    seed: int = 0,
    needles: int = 1,
    progress=None,
) -> list[dict]:
    """Rows with metric "needle_found" (0 or 1) per method, length (context), depth and needle (``needles``
    different numbers per cell, drawn from ``random.Random(seed)``; the first is the same for any ``needles``)."""
    if needles < 1:
        raise ValueError(f"needles must be >= 1; got {needles}")
    rng = random.Random(seed)
    numbers = {(length, depth): [rng.randrange(1_000_000, 10_000_000)] for length in lengths for depth in depths}
    for cell in numbers.values():  # later needles after every cell's first: a 1-needle grid is a prefix
        cell += [rng.randrange(1_000_000, 10_000_000) for _ in range(needles - 1)]
    rows = []
    for (length, depth), cell in numbers.items():
        for needle, number in enumerate(cell):
            ids = needle_prompt(tokenizer, text, length, depth, number).to(model.device)
            for name in methods:
                cache = make_cache(name, model, calibrated)
                out = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    **cache_kwargs(model, cache),
                    max_new_tokens=32,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
                answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
                found = float(str(number) in answer.replace(",", ""))
                rows.append(
                    dict(
                        method=name,
                        task="niah",
                        context=ids.shape[1],
                        metric="needle_found",
                        value=found,
                        **bit_columns(cache, model),
                        depth=depth,
                        target_length=length,
                        needle=needle,
                    )
                )
                if progress:
                    state = "found" if found else f"missed ({answer.strip()[:60]!r})"
                    progress(f"niah length {length} depth {depth:.2f} needle {needle} {name}: {state}")
    return rows


def misses_where_reference_found(rows: list[dict], reference: str = "bf16") -> dict[str, int]:
    """Per method, the needles (length, depth, needle) that ``reference`` found and the method missed."""
    rows = [r for r in rows if r["task"] == "niah"]
    found = {(r["target_length"], r["depth"], r["needle"]) for r in rows if r["method"] == reference and r["value"]}
    misses: dict[str, int] = {}
    for r in rows:
        if r["method"] != reference:
            key = (r["target_length"], r["depth"], r["needle"])
            misses[r["method"]] = misses.get(r["method"], 0) + int(key in found and not r["value"])
    return misses


def plot_niah(rows: list[dict], path) -> None:
    """One heatmap (depth × length, the fraction of the cell's needles found) per method, side by side, saved as
    PNG."""
    plt = pyplot("the NIAH plot")
    rows = [r for r in rows if r["task"] == "niah"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lengths = sorted({r["target_length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(1, len(methods), figsize=(2.2 * len(methods) + 1, 3), squeeze=False)
    for ax, method in zip(axes[0], methods):
        found, total = torch.zeros(len(depths), len(lengths)), torch.zeros(len(depths), len(lengths))
        for r in rows:
            if r["method"] == method:
                cell = depths.index(r["depth"]), lengths.index(r["target_length"])
                found[cell] += r["value"]
                total[cell] += 1
        grid = found / total  # (NaN where a cell was not run)
        ax.imshow(grid.numpy(), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(method, fontsize=9)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_xlabel("length", fontsize=8)
    axes[0][0].set_ylabel("needle depth", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
