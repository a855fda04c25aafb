"""Perplexity, next-token KL to BF16 and top-1 agreement, with the quantized cache really in the loop.

Protocol: each segment prefills ``context`` tokens into a fresh cache, then teacher-forces
``score_tokens`` more tokens one at a time through the decode path. Every scored token therefore
attends to the quantized history (beyond the sink and recent windows), exactly as in generation.
Segments are batched (same length, no padding). KL(p_bf16 ‖ p_method) and top-1 agreement
compare each method's next-token distribution with the default cache's on the same tokens.
"""

from __future__ import annotations

import torch

from ..model_support import cache_kwargs
from ..tokens import bos_prefix, prefixed_chunks
from .methods import METHODS, bit_columns, make_cache


def text_segments(tokenizer, text: str, count: int, length: int, start_fraction: float = 1 / 3) -> torch.Tensor:
    """``count`` segments ``[count, length]`` of consecutive, non-overlapping tokens from ``text``, each starting
    with the tokenizer's BOS if it adds one on its own (``bos_prefix``; counted in ``length``, never scored)."""
    bos = bos_prefix(tokenizer)
    needed = count * (length - len(bos))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    start = int(len(ids) * start_fraction)
    if start + needed > len(ids):
        start = max(0, len(ids) - needed)
    if start + needed > len(ids):
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} segments of {length}")
    return torch.stack(prefixed_chunks(ids[start : start + needed], length, bos))


@torch.no_grad()
def teacher_forced_logprobs(model, cache, segments: torch.Tensor, context: int) -> torch.Tensor:
    """Log-probabilities ``[B, n, vocab]`` (float32) of tokens ``context .. L-1`` of ``segments [B, L]``,
    prefilling ``context`` tokens and then decoding one token at a time through ``cache``."""
    ids = segments.to(model.device)
    through = cache_kwargs(model, cache)
    out = model(input_ids=ids[:, :context], **through, use_cache=True, logits_to_keep=1)
    logits = [out.logits[:, -1].float()]
    for t in range(context, ids.shape[1] - 1):
        out = model(input_ids=ids[:, t : t + 1], **through, use_cache=True)
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1).log_softmax(-1)


def evaluate_perplexity(
    model, segments: torch.Tensor, contexts: list[int], methods: list[str], calibrated=None, progress=None,
    caches: dict | None = None,
) -> list[dict]:
    """Rows (method, task, context, metric, value, bits_per_element, history_bits) for perplexity, KL to bf16 and
    top-1.

    ``segments [B, L]``: the last ``L - context`` tokens of each are scored, for each ``context``. ``caches``, if
    given, receives each run's cache, filled, under ``(method, context)`` (the default cache's as "bf16").
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    rows = []
    for context in contexts:
        targets = segments[:, context:].to(model.device)
        reference = None
        for name in ["bf16", *[m for m in methods if m != "bf16"]]:
            cache = make_cache(name, model, calibrated)
            logprobs = teacher_forced_logprobs(model, cache, segments, context)
            nll = -logprobs.gather(-1, targets[..., None]).mean()
            bits = bit_columns(cache, model)
            if caches is not None:
                caches[name, context] = cache
            if reference is None:
                reference = logprobs
            metrics = {
                "perplexity": float(nll.exp()),
                "kl_to_bf16": float((reference.exp() * (reference - logprobs)).sum(-1).mean()),
                "top1_agreement": float((reference.argmax(-1) == logprobs.argmax(-1)).float().mean()),
            }
            if name in methods:
                rows += [
                    dict(method=name, task="perplexity", context=context, metric=k, value=v, **bits)
                    for k, v in metrics.items()
                ]
            if progress:
                progress(f"context {context} {name}: ppl {metrics['perplexity']:.3f} KL {metrics['kl_to_bf16']:.4f}")
    return rows
