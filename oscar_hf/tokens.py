"""Sequences cut from running text start as the tokenizer starts a text: with its BOS token if it adds one on
its own (Gemma, Llama), without one otherwise (SmolLM2, Qwen). Used by calibration and the evaluation."""

from __future__ import annotations

import torch


def bos_prefix(tokenizer) -> list[int]:
    """``[bos_token_id]`` if ``tokenizer("x")`` starts with the tokenizer's BOS, else ``[]`` (also for None)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None and tokenizer("x")["input_ids"][:1] == [bos] else []


def text_tokens_in(total: int, length: int, prefix: list[int]) -> int:
    """How many text tokens make ``total`` tokens of chunks ``[≤ length]`` that each start with ``prefix``."""
    full, rest = divmod(total, length)
    return full * (length - len(prefix)) + max(rest - len(prefix), 0)


def prefixed_chunks(ids: torch.Tensor, length: int, prefix: list[int]) -> list[torch.Tensor]:
    """``ids [N]`` cut into consecutive chunks ``[≤ length]``: ``prefix``, then up to ``length - len(prefix)`` ids."""
    head = torch.tensor(prefix, dtype=ids.dtype)
    return [torch.cat([head, piece]) for piece in ids.split(length - len(prefix)) if len(piece)]
