"""Long-generation recall probe: a list of facts demoted into the quantized history, many tokens of other text
after it, then a verbatim copy of the list, scored item by item.

A prompt is plain text, not a chat: ``[text before] LIST_HEADER [items, one per line] [text after] ASK``. The
items are ``"Word: 1234"`` pairs (random words of ``WORDS`` and four-digit numbers). Everything up to the end of
the list is prefilled; the text after it (``after`` tokens, at least a thousand in the default grid) is then
teacher-forced ``step`` tokens per forward pass (1 by default: one token at a time, through the decode path that
generation takes), so the list crosses the recent window into the history, and every demotion and buffer move
of the cache happens while the model runs; then ``generate`` writes the copy (greedy). An item counts when a line
of the copy equals it exactly. Since perplexity and needle retrieval both survive bookkeeping bugs that garble
the history a little, a verbatim copy of many digits is the check that catches them; the default cache's score
is the bar for every method.
"""

from __future__ import annotations

import random

import torch

from ..model_support import cache_kwargs
from ..tokens import bos_prefix
from .methods import bit_columns, make_cache

LIST_HEADER = "List of codes:\n"
ASK = "\n\nList of codes (repeated from above):\n"
WORDS = ("apple", "river", "candle", "mirror", "tiger", "violin", "garden", "rocket", "pencil", "castle", "lemon",
         "anchor", "falcon", "marble", "harbor", "copper", "meadow", "lantern", "saddle", "glacier")


def recall_items(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct ``"Word: 1234"`` items."""
    if not 1 <= count <= len(WORDS):
        raise ValueError(f"items must be between 1 and {len(WORDS)}; got {count}")
    return [f"{word.capitalize()}: {rng.randrange(1000, 10000)}" for word in rng.sample(WORDS, count)]


def recall_prompt(tokenizer, items: list[str], before: list[int], after: list[int]) -> tuple[torch.Tensor, int]:
    """Input ids ``[1, n]`` of the probe, the list between the text tokens ``before`` and ``after``, and how many of
    them end with the list (the prefill)."""
    lead = tokenizer.decode(before) + "\n\n" if before else ""
    head = bos_prefix(tokenizer) + tokenizer(lead + LIST_HEADER + "\n".join(items),
                                             add_special_tokens=False)["input_ids"]
    tail = tokenizer("\n\n" + tokenizer.decode(after) + ASK, add_special_tokens=False)["input_ids"]
    return torch.tensor([head + tail]), len(head)


def score_copy(answer: str, items: list[str]) -> int:
    """Items that a line of ``answer`` equals exactly (surrounding spaces ignored)."""
    lines = {line.strip() for line in answer.splitlines()}
    return sum(item in lines for item in items)


@torch.no_grad()
def evaluate_recall(
    model,
    tokenizer,
    text: str,
    depths: list[int],
    methods: list[str],
    calibrated=None,
    *,
    items: int = 6,
    after: int = 1024,
    trials: int = 2,
    step: int = 1,
    seed: int = 0,
    progress=None,
) -> list[dict]:
    """Rows with metric "recall_exact" (the fraction of the list's items copied exactly) per method, depth (text
    tokens before the list) and trial (``needle``: a different list and stretch of ``text`` each, drawn from
    ``random.Random(seed)``)."""
    if step < 1 or after < 1 or trials < 1:
        raise ValueError(f"step, after and trials must be >= 1; got {step}, {after}, {trials}")
    if not depths or min(depths) < 0:
        raise ValueError(f"depths must be text tokens before the list, >= 0; got {depths}")
    rng = random.Random(seed)
    needed = max(depths) + after
    pool = tokenizer(text[: 16 * needed * (trials + 1)], add_special_tokens=False)["input_ids"]
    if len(pool) < needed:
        raise ValueError(f"the text has {len(pool)} tokens, fewer than the {needed} one probe needs")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for trial in range(trials):
        listing = recall_items(rng, items)
        for depth in depths:
            offset = rng.randrange(len(pool) - depth - after + 1)
            ids, prefill = recall_prompt(tokenizer, listing, pool[offset : offset + depth],
                                         pool[offset + depth : offset + depth + after])
            budget = len(tokenizer("\n".join(listing) + "\n", add_special_tokens=False)["input_ids"]) + 16
            ids = ids.to(model.device)
            for name in methods:
                cache = make_cache(name, model, calibrated)
                through = cache_kwargs(model, cache)
                model(input_ids=ids[:, :prefill], **through, use_cache=True, logits_to_keep=1)
                for start in range(prefill, ids.shape[1] - 1, step):
                    model(input_ids=ids[:, start : min(start + step, ids.shape[1] - 1)], **through, use_cache=True,
                          logits_to_keep=1)
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **through,
                                     max_new_tokens=budget, do_sample=False, pad_token_id=pad)
                answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                found = score_copy(answer, listing)
                rows.append(dict(method=name, task="recall", context=ids.shape[1], metric="recall_exact",
                                 value=found / items, **bit_columns(cache, model), depth=depth,
                                 needle=trial))
                if progress:
                    progress(f"recall depth {depth} trial {trial} {name}: {found}/{items}"
                             + ("" if found == items else f" ({answer.strip()[:60]!r})"))
    return rows
