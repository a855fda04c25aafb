"""`oscar-hf eval`: run tasks for several methods, print a table, write results.csv and plots."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from .._extras import pyplot, require
from ..tokens import bos_prefix
from .gsm8k import evaluate_gsm8k, load_gsm8k
from .methods import check_methods
from .niah import evaluate_niah, misses_where_reference_found, plot_niah
from .perplexity import evaluate_perplexity, text_segments
from .recall import evaluate_recall

TASKS = ("perplexity", "niah", "recall", "gsm8k")
COLUMNS = ("model", "method", "task", "context", "metric", "value", "bits_per_element", "history_bits", "depth",
           "needle")


def run_eval(
    model,
    tokenizer,
    model_name: str,
    methods: list[str],
    tasks: list[str],
    out_dir: str | Path,
    *,
    calibrated=None,
    text: str | None = None,
    contexts=(512, 1024),
    score_tokens: int = 128,
    segments: int = 8,
    niah_lengths=(1024, 2048),
    niah_depths=(0.0, 0.25, 0.5, 0.75, 1.0),
    niah_needles: int = 1,
    recall_depths=(64, 512, 1024),
    recall_items: int = 6,
    recall_after: int = 1024,
    recall_trials: int = 2,
    recall_step: int = 1,
    gsm8k_path: str | None = None,
    gsm8k_limit: int | None = None,
) -> list[dict]:
    """Evaluate ``methods`` on ``tasks``; returns the rows and writes ``out_dir/results.csv`` (NIAH rows also give
    the needle's depth and index in its cell) and PNG plots (perplexity, NIAH: they need matplotlib, the "plots"
    extra). Every method is checked against ``calibrated`` before anything runs."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; known: {list(TASKS)}")
    check_methods(methods, calibrated)
    if {"perplexity", "niah", "recall"} & set(tasks):
        require("matplotlib", "oscar-hf eval's plots")  # fail now, not after the evaluation
    if {"perplexity", "niah", "recall"} & set(tasks) and not text:
        raise ValueError("the perplexity, niah and recall tasks need an evaluation text (--text)")
    if "gsm8k" in tasks and not gsm8k_path:
        raise ValueError("the gsm8k task needs the GSM8K test jsonl (--gsm8k)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    if "perplexity" in tasks:
        longest = max(contexts)
        batch = text_segments(tokenizer, text, segments, longest + score_tokens)
        bos = len(bos_prefix(tokenizer))  # a shorter context keeps the segments' BOS, then their last tokens
        for context in contexts:
            segment = torch.cat([batch[:, :bos], batch[:, longest - context + bos :]], dim=1)
            rows += evaluate_perplexity(model, segment, [context], methods, calibrated, progress=print)
    if "niah" in tasks:
        rows += evaluate_niah(
            model, tokenizer, text, list(niah_lengths), list(niah_depths), methods, calibrated, needles=niah_needles,
            progress=print,
        )
        plot_niah(rows, out / "niah.png")
    if "recall" in tasks:
        rows += evaluate_recall(
            model, tokenizer, text, list(recall_depths), methods, calibrated, items=recall_items, after=recall_after,
            trials=recall_trials, step=recall_step, progress=print,
        )
    if "gsm8k" in tasks:
        rows += evaluate_gsm8k(model, tokenizer, load_gsm8k(gsm8k_path, gsm8k_limit), methods, calibrated,
                               progress=print)
    for row in rows:
        row["model"] = model_name
    write_csv(rows, out / "results.csv")
    if "perplexity" in tasks:
        plot_perplexity(rows, out / "perplexity.png")
    if {"perplexity", "niah", "recall"} & set(tasks):
        plot_frontier(rows, out / "frontier.png")
    print(format_results(rows))
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def format_results(rows: list[dict]) -> str:
    """Method × (task, metric, context) table, NIAH as the fraction of needles found (and, with bf16 in the run,
    the needles bf16 found that the method missed), recall by depth (text tokens before the list), then bits per
    element."""
    summary: dict[tuple, dict[str, list[float]]] = {}
    bits: dict[str, float] = {}
    history: dict[str, float] = {}
    for r in rows:
        where = {"niah": "all", "recall": f"depth {r.get('depth')}"}.get(r["task"], r["context"])
        key = (r["task"], r["metric"], where)
        summary.setdefault(key, {}).setdefault(r["method"], []).append(r["value"])
        bits[r["method"]] = r["bits_per_element"]
        history[r["method"]] = r.get("history_bits", float("nan"))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [f"{'task / metric / context':<34}" + "".join(f"{m:>17}" for m in methods)]
    for key, values in summary.items():
        cells = [f"{sum(values[m]) / len(values[m]):.4g}" if m in values else "-" for m in methods]
        lines.append(f"{' / '.join(map(str, key)):<34}" + "".join(f"{c:>17}" for c in cells))
    if any(r["task"] == "niah" and r["method"] == "bf16" for r in rows):
        misses = misses_where_reference_found(rows)
        cells = [str(misses[m]) if m in misses else "-" for m in methods]
        lines.append(f"{'niah / missed where bf16 found':<34}" + "".join(f"{c:>17}" for c in cells))
    lines.append(f"{'bits per element (last run)':<34}" + "".join(f"{bits[m]:>17.3f}" for m in methods))
    lines.append(f"{'history bits per element':<34}" + "".join(f"{history[m]:>17.3f}" for m in methods))
    return "\n".join(lines)


def plot_perplexity(rows: list[dict], path: Path) -> None:
    """Perplexity gap to bf16 against context, one line per method (bits per element in the legend)."""
    plt = pyplot("the perplexity plot")
    ppl = [r for r in rows if r["metric"] == "perplexity"]
    reference = {r["context"]: r["value"] for r in ppl if r["method"] == "bf16"}
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in dict.fromkeys(r["method"] for r in ppl):
        points = sorted(
            (r["context"], r["value"] - reference.get(r["context"], 0.0), r["bits_per_element"])
            for r in ppl
            if r["method"] == method
        )
        ax.plot(
            [p[0] for p in points], [p[1] for p in points], marker="o", label=f"{method} ({points[-1][2]:.2f} bits)"
        )
    ax.set_xlabel("context tokens before the scored ones")
    ax.set_ylabel("perplexity − bf16" if reference else "perplexity")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


FRONTIER_PANELS = (  # (task, metric, axis label, higher is better)
    ("perplexity", "kl_to_bf16", "KL to the default cache (longest context)", False),
    ("niah", "needle_found", "needles found", True),
    ("recall", "recall_exact", "items recalled exactly", True),
)


def frontier_points(rows: list[dict], task: str, metric: str) -> dict[str, tuple[float, float]]:
    """Per method, (history bits per element, the metric's mean): over the longest context for perplexity, over
    every cell for NIAH and recall. Bits are the mean of the rows' (each run's cache's own count of what a token
    costs once quantized: the windows, the same for every method, are left out); runs that quantized nothing are
    left out."""
    rows = [r for r in rows if r["task"] == task and r["metric"] == metric]
    if task == "perplexity" and rows:
        longest = max(r["context"] for r in rows)
        rows = [r for r in rows if r["context"] == longest]
    points: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if r["history_bits"] == r["history_bits"]:  # (NaN: that run quantized nothing)
            points.setdefault(r["method"], []).append((r["history_bits"], r["value"]))
    return {m: (sum(b for b, _ in p) / len(p), sum(v for _, v in p) / len(p)) for m, p in points.items()}


def pareto(points: dict[str, tuple[float, float]], higher_is_better: bool) -> list[str]:
    """The methods no other method beats at equal or fewer bits, by bits."""
    sign = -1 if higher_is_better else 1
    front, best = [], float("inf")
    for method, (bits, value) in sorted(points.items(), key=lambda item: (item[1][0], sign * item[1][1])):
        if sign * value < best:
            front.append(method)
            best = sign * value
    return front


def plot_frontier(rows: list[dict], path: Path, reference: str = "bf16") -> None:
    """Quality against history bits per element, one point per method and a line through the Pareto frontier: KL
    to the default cache (log scale), needles found, and items recalled, one panel for each task in ``rows``. The
    ``reference`` method (the default cache) is a horizontal line: its bits would squeeze the 2–5 bit range."""
    plt = pyplot("the bits-versus-quality plot")
    panels = [(task, metric, label, up, frontier_points(rows, task, metric))
              for task, metric, label, up in FRONTIER_PANELS]
    panels = [p for p in panels if p[4]]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, (task, metric, label, up, points) in zip(axes[0], panels):
        if reference in points:
            ax.axhline(points.pop(reference)[1], color="black", lw=0.8, ls=":", label=f"{reference} (the bar)")
            ax.legend(fontsize=7, loc="best")
        for method, (bits, value) in points.items():
            ax.scatter(bits, value, s=18)
            ax.annotate(method, (bits, value), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if not up:
            ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xlabel("history bits per K/V element")
        ax.set_ylabel(label)
        ax.set_title(task, fontsize=9)
        front = pareto(points, up)
        ax.plot([points[m][0] for m in front], [points[m][1] for m in front], color="gray", lw=0.8, ls="--")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
