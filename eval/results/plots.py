"""Draw the figures of eval/results/README.md from the CSVs beside this script.

    python eval/results/plots.py            # writes eval/results/figures/*.png

Needs matplotlib only (a dependency of oscar-hf); reads decode/, generate/ and quality/, and draws:

* decode-kernel.png: the decode kernel against bf16 SDPA, µs per call against context (Qwen3-8B's shape);
* generate-tok-s.png: decode tokens per second of ``model.generate`` against context, batch 1 (Qwen3-8B, H100);
* memory.png: the KV cache's size against context for the same runs;
* perplexity.png: perplexity by method at a 2048-token context (SmolLM2-135M, Gemma-3-270M);
* niah-smollm2-135m.png: needles found per length and depth, one heatmap per method (SmolLM2-135M).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "figures"
GENERATE_BATCH1 = ["h100-qwen3-8b-quantized-4k-32k.csv", "h100-qwen3-8b-quantized-128k.csv"]
LABELS = {
    "oscar+absorbed+compiled": "OSCAR (INT2, compiled)",
    "bf16+compiled+gqa": "bf16 static cache (compiled)",
    "quanto-int2": "QuantizedCache, quanto INT2",
    "hqq-int2": "QuantizedCache, HQQ INT2",
}


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def context_ticks(ax, lengths) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{t // 1024}K" for t in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens)")


def decode_kernel() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, gpu in zip(axes, ("h100", "h200")):
        data = [r for r in rows(HERE / "decode" / f"decode-{gpu}.csv") if r["shape"] == "qwen3-8b"]
        for batch, color in zip(("1", "8", "32"), ("C0", "C1", "C2")):
            points = sorted((int(r["T"]), r) for r in data if r["batch"] == batch)
            lengths = [t for t, _ in points]
            ax.plot(lengths, [1e3 * float(r["steady_kernel_ms"]) for _, r in points], "o-", color=color,
                    label=f"OSCAR INT2, batch {batch}")
            ax.plot(lengths, [1e3 * float(r["steady_sdpa_ms"]) for _, r in points], "s--", color=color,
                    label=f"bf16 SDPA, batch {batch}")
        context_ticks(ax, lengths)
        ax.set_yscale("log")
        ax.set_title(f"{data[0]['gpu']} (commit {data[0]['commit']})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("µs per call (CUDA graph, back to back)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Decode attention, Qwen3-8B's shape (32 query / 8 KV heads, head_dim 128)")
    fig.tight_layout()
    fig.savefig(OUT / "decode-kernel.png", dpi=110)
    plt.close(fig)


def generate_runs() -> dict[str, list[tuple[int, dict]]]:
    by_method = defaultdict(list)
    for name in GENERATE_BATCH1:
        for r in rows(HERE / "generate" / name):
            if r["batch"] == "1" and r["ms_per_step"]:
                by_method[r["method"]].append((int(r["T"]), r))
    return {m: sorted(points, key=lambda p: p[0]) for m, points in by_method.items()}


def generate_plots() -> None:
    runs = generate_runs()
    first = next(iter(runs.values()))[0][1]
    where = f"{first['gpu']}, torch {first['torch']}, transformers {first['transformers']}, commit {first['commit']}"
    for column, name, ylabel, title in (
        ("decode_tok_s", "generate-tok-s.png", "decode tokens / s", "model.generate, Qwen3-8B, batch 1"),
        ("cache_gb", "memory.png", "KV cache (GiB)", "KV cache size, Qwen3-8B, batch 1"),
    ):
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for method, points in runs.items():
            ax.plot([t for t, _ in points], [float(r[column]) for _, r in points], "o-",
                    label=LABELS.get(method, method))
        context_ticks(ax, [t for t, _ in next(iter(runs.values()))])
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}\n{where}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(OUT / name, dpi=110)
        plt.close(fig)


def perplexity() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, model in zip(axes, ("smollm2-135m", "gemma3-270m")):
        points = {}
        for r in rows(HERE / "quality" / f"{model}-perplexity.csv"):
            if r["metric"] == "perplexity" and r["context"] == "2048":
                label = r["method"] if r["method"] == "bf16" else f"{r['method']}\n{r['history_bits']} bits"
                if model == "gemma3-270m" and r["method"] in ("oscar", "oscar-k4"):
                    layout = "per-token K" if r["run"] == "gemma-baselines" else "recipe: per-channel K"
                    label = f"{r['method']} ({layout})\n{r['history_bits']} bits"
                if r["run"].endswith("reference-targets"):
                    if r["method"] == "bf16":
                        continue
                    label = f"{r['method']} (qqt/sst rotations)\n{r['history_bits']} bits"
                points[label] = float(r["value"])
        order = sorted(points, key=points.get)
        colors = ["C2" if k.startswith("oscar") else "C7" if k == "bf16" else "C0" for k in order]
        ax.barh(order, [points[k] for k in order], color=colors)
        ax.set_xscale("log")
        ticks = [t for t in (10, 15, 20, 50, 100, 200, 400) if t <= 1.2 * max(points.values())]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlim(0.8 * min(points.values()), 1.35 * max(points.values()))
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("WikiText-2 perplexity, 2048-token context")
        ax.set_title(model, fontsize=10)
        for y, k in enumerate(order):
            ax.text(points[k], y, f" {points[k]:.2f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "perplexity.png", dpi=110)
    plt.close(fig)


def niah() -> None:
    data = rows(HERE / "quality" / "smollm2-135m-niah.csv")
    methods = ["bf16", "oscar", "oscar-k4", "oscar-k4-half", "int4", "oscar-uncentered", "quarot-int2", "naive-int2"]
    lengths = sorted({int(r["length"]) for r in data})
    depths = sorted({float(r["depth"]) for r in data})
    fig, axes = plt.subplots(2, 4, figsize=(12, 5.6))
    for ax, method in zip(axes.flat, methods):
        cells = [r for r in data if r["method"] == method and (method != "bf16" or r["run"].endswith("key-bits"))]
        needles = len({r["needle"] for r in cells})
        grid = [[sum(int(r["found"]) for r in cells if int(r["length"]) == n and float(r["depth"]) == d) / needles
                 for d in depths] for n in lengths]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_yticks(range(len(lengths)), [f"{n // 1024}K" for n in lengths], fontsize=7)
        found = sum(int(r["found"]) for r in cells)
        ax.set_title(f"{method}: {found}/{len(cells)}", fontsize=9)
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{round(v * needles)}/{needles}", ha="center", va="center", fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct, needle in a haystack (WikiText-2): needles found per length (rows) and "
                 "depth (columns)", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "niah-smollm2-135m.png", dpi=110)
    plt.close(fig)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    decode_kernel()
    generate_plots()
    perplexity()
    niah()
    print(f"wrote {sorted(p.name for p in OUT.glob('*.png'))} to {OUT}")


if __name__ == "__main__":
    main()
