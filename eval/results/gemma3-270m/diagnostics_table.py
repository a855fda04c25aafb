"""Compare rotation bundles for Gemma-3-270M on its global (quantized) layers: a markdown table of the
diagnostics each bundle stored at calibration (held-out Austen tokens) next to the same diagnostics on
held-out WikiText-2 test text, in chunks that start with <bos> as every real Gemma input does (or, with
--no-bos, without it, as the calibration's own chunks). With --sink-tokens N the first N tokens of every
chunk keep their exact K and V, as in the cache's sink window (the stored Austen numbers quantize all).

    python eval/results/gemma3-270m/diagnostics_table.py BUNDLE [BUNDLE ...] \
        --text ../shared/data/wikitext-2-raw/wiki.test.raw [--no-bos] [--sink-tokens 64] [--group-size 256]
"""

import argparse
import dataclasses
from pathlib import Path

import torch

from oscar_hf import ModelShape, OscarConfig, OscarRotations
from oscar_hf.calibrate import DATA_FREE
from oscar_hf.capture import run_capture
from oscar_hf.diagnostics import DiagnosticsObserver, summarize
from oscar_hf.models import load_gemma3_270m

COLUMNS = ("score_kl", "output_error", "k_error", "v_error")


def text_chunks(tokenizer, text: str, count: int, length: int, bos: bool) -> list[torch.Tensor]:
    """The first ``count`` chunks of ``text``, each ``[length]`` int64 token ids (the first one <bos> if ``bos``)."""
    head = text[: 8 * count * length]  # 8 characters a token is plenty
    ids = tokenizer(head, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    body = ids[: count * (length - bos)].view(count, length - bos)
    return list(torch.cat([torch.full((count, int(bos)), tokenizer.bos_token_id), body], dim=1))


class SinkObserver(DiagnosticsObserver):
    """Diagnostics with the first ``sink`` tokens of every chunk left unquantized."""

    def __init__(self, rotations: OscarRotations, config: OscarConfig, sink: int):
        super().__init__(rotations, config)
        self.sink = sink

    def _quantized(self, x: torch.Tensor, clip: float, side: str, cfg: OscarConfig | None = None) -> torch.Tensor:
        """``x [B, H, T, D]`` with tokens ``sink..T-1`` through the quantizer (centered on their own mean)."""
        return torch.cat([x[:, :, : self.sink], super()._quantized(x[:, :, self.sink :], clip, side, cfg)], dim=2)


def diagnose_with_sink(model, rotations, chunks: list[torch.Tensor], config: OscarConfig, sink: int) -> list[dict]:
    """Per-layer diagnostics (as ``oscar_hf.diagnose``) of ``rotations`` on token chunks ``[L]``, sink exact."""
    observer = SinkObserver(rotations, config, sink)
    for chunk in chunks:
        run_capture(model, observer, chunk.reshape(1, -1))
    return observer.results()


def global_mean(diagnostics: list[dict], layers: list[int]) -> dict[str, float]:
    """Token-weighted mean of every metric over ``layers``."""
    return summarize([row for row in diagnostics if row["layer"] in layers])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", help="rotation bundle folders")
    parser.add_argument("--text", required=True, help="held-out text (WikiText-2 test, raw)")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--bos", action=argparse.BooleanOptionalAction, default=True, help="start chunks with <bos>")
    parser.add_argument("--sink-tokens", type=int, default=0, help="leading tokens of a chunk kept exact")
    parser.add_argument("--group-size", type=int, help="override the bundles' recommended group_size (WikiText only)")
    args = parser.parse_args()
    model, tokenizer = load_gemma3_270m(dtype=torch.float32)
    layers = [i for i, kind in enumerate(ModelShape.from_config(model.config).layer_types) if kind == "full_attention"]
    chunks = text_chunks(tokenizer, Path(args.text).read_text(encoding="utf-8"), args.chunks, args.length, args.bos)
    header = ["rotations", "k_target / v_target, U order"]
    header += [f"Austen {c}" for c in COLUMNS[:2]] + [f"WikiText {c}" for c in COLUMNS]
    start = "starting with <bos>" if args.bos else "without <bos>"
    group = f"group_size {args.group_size}" if args.group_size else "each bundle's group_size"
    print(
        f"global layers {layers}; WikiText: {args.chunks} chunks of {args.length} tokens {start}, "
        f"{args.sink_tokens} sink tokens exact, {group}"
    )
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for bundle in args.bundles:
        rotations = OscarRotations.from_pretrained(bundle)
        config = rotations.config
        if args.group_size:
            config = dataclasses.replace(config, group_size=args.group_size)
        austen = global_mean(rotations.diagnostics, layers)
        wikitext = global_mean(diagnose_with_sink(model, rotations, chunks, config, args.sink_tokens), layers)
        cal = rotations.calibration
        order = "-" if cal["k_target"] in DATA_FREE else cal["eigen_order"]
        targets = f"{cal['k_target']} / {cal['v_target']}, {order}"
        cells = [Path(bundle).name, targets] + [f"{austen[c]:.4f}" for c in COLUMNS[:2]]
        print("| " + " | ".join(cells + [f"{wikitext[c]:.4f}" for c in COLUMNS]) + " |", flush=True)


if __name__ == "__main__":
    main()
