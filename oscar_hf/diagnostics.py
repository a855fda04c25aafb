"""Per-layer diagnostics of a rotation bundle on held-out tokens: what INT2 does to K, V and attention.

For every layer, with each chunk's K and V after its first ``sink_tokens`` quantized in the layout the cache stores
(the sink stays exact, as in the cache; no recent window, so the numbers isolate the quantizer): V per token, K per
token or, with ``key_quantization="per-channel"``, per channel over groups of ``flush_tokens`` consecutive tokens (a
chunk's last partial group stays exact, as the cache keeps it in its recent window); the sides in
``OscarConfig.centered_sides`` centered on the mean of the quantized tokens (the cache centers on the first tokens
that reach its history: after a prefill, those between its windows). Reports relative K and V error
``‖x̂ − x‖²/‖x‖²`` over the quantized tokens, attention-score ``KL(p_full ‖ p_int2)`` (causal, mean over query rows
and heads), relative attention-output error, and clip rates over the quantized tokens.
"""

from __future__ import annotations

import torch

from .capture import run_capture
from .config import OscarConfig
from .quantizer import clip_rows, dequantize, quantize
from .rotations import OscarRotations

METRICS = ("k_error", "v_error", "score_kl", "output_error", "k_clip_rate", "v_clip_rate")


class DiagnosticsObserver:
    """Accumulates the diagnostics of one bundle over the chunks it observes."""

    def __init__(self, rotations: OscarRotations, config: OscarConfig):
        self.rotations, self.config = rotations, config
        self.sums: dict[int, dict[str, float]] = {}

    def _quantized(self, x: torch.Tensor, clip: float, side: str, cfg: OscarConfig | None = None,
                   codebook=None) -> torch.Tensor:
        """``x [B, H, T, D]`` of ``side`` ("key" or "value") through the quantizer in the layout a layer with config
        ``cfg`` (default the observer's) stores it: the first ``sink_tokens`` exact, the rest centered on its mean
        over T when ``side`` is in ``centered_sides``, as the cache does; ``clip`` is the per-token clip ratio
        (per-channel K is never clipped); ``codebook``: the layer's, for product-quantized K."""
        cfg = cfg or self.config
        sink = min(cfg.sink_tokens, x.shape[2])
        if sink:
            rest = self._quantized(x[:, :, sink:], clip, side, cfg.replace(sink_tokens=0), codebook)
            return torch.cat([x[:, :, :sink], rest], dim=2)
        centered = side in cfg.centered_sides
        center = x.mean(dim=2, keepdim=True) if centered else torch.zeros_like(x[:, :, :1])
        x = x - center
        bits = cfg.side_bits[side]
        if side == "value":
            rows = quantize(x, bits=bits, group_size=cfg.group_size, clip=clip, scale_dtype=cfg.torch_scale_dtype,
                            method=cfg.quantizer)
            return dequantize(rows, bits) + center
        # whole demotion units, as the cache demotes them; a last partial unit stays exact (recent window)
        layout, whole = cfg.key_layout, x.shape[2] // cfg.demotion_unit * cfg.demotion_unit
        group = cfg.resolved_group_size(x.shape[-1])
        rows = layout.quantize(x[:, :, :whole], bits=bits, clip=clip, group_size=group, config=cfg, codebook=codebook)
        return torch.cat([layout.dequantize(rows, bits, codebook), x[:, :, whole:]], dim=2) + center

    def observe(self, layer_idx, query, key, value, output, scaling) -> None:
        cfg, device = self.config.for_layer(layer_idx), key.device
        r_k = self.rotations.key_rotation[layer_idx].to(device)  # [D, D], or [H, D, D] per KV head
        r_v = self.rotations.value_rotation[layer_idx].to(device)
        k, v = key.float() @ r_k, value.float() @ r_v
        book = None
        if cfg.key_layout.uses_codebook:
            bits = cfg.side_bits["key"]
            if bits in self.rotations.key_codebooks and self.rotations.key_codebooks[bits][layer_idx] is None:
                return  # a layer the cache leaves in the model dtype (sliding-window): no codebook, no diagnostics
            book = self.rotations.key_codebook(layer_idx, bits).to(device)
        clip = cfg.side_clip
        k_hat = self._quantized(k, clip["key"], "key", cfg, book)
        v_hat = self._quantized(v, clip["value"], "value", cfg)
        b, h, t, d = k.shape
        q = (query.float().reshape(b, h, -1, d) @ r_k).reshape(b, h, -1, t, d)  # [B, H, g, T, D], each KV head's R
        causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        log_p = (torch.einsum("bhgtd,bhsd->bhgts", q, k) * scaling).masked_fill(~causal, -torch.inf).log_softmax(-1)
        log_p_hat = (torch.einsum("bhgtd,bhsd->bhgts", q, k_hat) * scaling).masked_fill(~causal, -torch.inf)
        log_p_hat = log_p_hat.log_softmax(-1)
        kl = (log_p.exp() * (log_p - log_p_hat)).nan_to_num().sum(-1).mean()
        out = (output.float().reshape(b, h, -1, d) @ r_v).reshape(b, h, -1, t, d)
        out_hat = torch.einsum("bhgts,bhsd->bhgtd", log_p_hat.exp(), v_hat)
        q_k, q_v = (x[:, :, min(cfg.sink_tokens, t):] for x in (k, v))  # the quantized tokens (none: errors 0)
        values = {
            "k_error": float(((k_hat - k) ** 2).sum() / (q_k**2).sum().clamp_min(1e-30)),
            "v_error": float(((v_hat - v) ** 2).sum() / (q_v**2).sum().clamp_min(1e-30)),
            "score_kl": float(kl),
            "output_error": float(((out_hat - out) ** 2).sum() / (out**2).sum()),
            "k_clip_rate": float((clip_rows(q_k, clip["key"]) != q_k).float().mean().nan_to_num()),
            "v_clip_rate": float((clip_rows(q_v, clip["value"]) != q_v).float().mean().nan_to_num()),
        }
        totals = self.sums.setdefault(layer_idx, dict.fromkeys(METRICS, 0.0) | {"tokens": 0})
        for name, value in values.items():
            totals[name] += value * b * t
        totals["tokens"] += b * t

    def results(self) -> list[dict]:
        return [
            {"layer": layer, **{name: totals[name] / totals["tokens"] for name in METRICS}, "tokens": totals["tokens"]}
            for layer, totals in sorted(self.sums.items())
        ]


@torch.no_grad()
def diagnose(
    model, rotations: OscarRotations, chunks: list[torch.Tensor], config: OscarConfig | None = None
) -> list[dict]:
    """Per-layer diagnostics (dicts with METRICS, "layer" and "tokens") of ``rotations`` on token chunks."""
    observer = DiagnosticsObserver(rotations, config or OscarConfig())
    for chunk in chunks:
        run_capture(model, observer, chunk.reshape(1, -1))
    return observer.results()


def summarize(diagnostics: list[dict]) -> dict[str, float]:
    """Token-weighted mean of every metric over layers."""
    tokens = sum(row["tokens"] for row in diagnostics) or 1
    return {name: sum(row[name] * row["tokens"] for row in diagnostics) / tokens for name in METRICS}


def format_table(diagnostics: list[dict]) -> str:
    """A per-layer text table with a mean row."""
    header = f"{'layer':>5} " + " ".join(f"{name:>12}" for name in METRICS)
    lines = [header, "-" * len(header)]
    for row in diagnostics:
        lines.append(f"{row['layer']:>5} " + " ".join(f"{row[name]:>12.4g}" for name in METRICS))
    lines.append(f"{'mean':>5} " + " ".join(f"{value:>12.4g}" for value in summarize(diagnostics).values()))
    return "\n".join(lines)


def format_comparison(named: dict[str, list[dict]]) -> str:
    """One row per bundle with its layer-mean metrics."""
    width = max(len(name) for name in named)
    header = f"{'rotations':<{width}} " + " ".join(f"{name:>12}" for name in METRICS)
    lines = [header, "-" * len(header)]
    for name, diagnostics in named.items():
        lines.append(f"{name:<{width}} " + " ".join(f"{value:>12.4g}" for value in summarize(diagnostics).values()))
    return "\n".join(lines)


def most_sensitive_layers(diagnostics: list[dict] | None, fraction: float, metric: str = "score_kl") -> list[int]:
    """The ``round(fraction · layers)`` layers with the largest ``metric`` in a bundle's diagnostics (by default the
    attention-score KL that INT2 keys cause): where more K bits (``OscarConfig.key_bits_layers``) pay most."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1]; got {fraction}")
    if not diagnostics or any(metric not in row for row in diagnostics):
        raise ValueError(f"the bundle's diagnostics have no {metric!r} for every layer (calibrate with "
                         "diagnostic_tokens > 0)")
    ranked = sorted(diagnostics, key=lambda row: row[metric], reverse=True)
    return sorted(row["layer"] for row in ranked[: round(fraction * len(diagnostics))])
