"""GSM8K greedy accuracy (chat, zero-shot, answer = the last number generated), one fresh cache per batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..model_support import cache_kwargs
from .methods import bit_columns, make_cache

INSTRUCTION = "Solve this math problem step by step. End your reply with 'The answer is N.'\n\n"
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def load_gsm8k(path: str | Path, limit: int | None = None) -> list[dict]:
    """Items ``{"question", "answer"}`` from a GSM8K jsonl (answers end in ``#### N``)."""
    items = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            if "question" not in row or "####" not in row.get("answer", ""):
                raise ValueError(f"{path}: every line needs 'question' and an 'answer' ending in '#### N'")
            items.append({"question": row["question"], "answer": row["answer"].split("####")[-1].strip()})
        if limit and len(items) >= limit:
            break
    return items


def extract_answer(text: str) -> str | None:
    numbers = NUMBER.findall(text)
    return numbers[-1].replace(",", "").rstrip(".") if numbers else None


def same_number(a: str | None, b: str) -> bool:
    try:
        return a is not None and float(a) == float(b.replace(",", ""))
    except ValueError:
        return False


@torch.no_grad()
def evaluate_gsm8k(
    model,
    tokenizer,
    items: list[dict],
    methods: list[str],
    calibrated=None,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    progress=None,
) -> list[dict]:
    """Rows with metric "accuracy" per method (context = the longest prompt + generation in tokens)."""
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for name in methods:
        correct, longest, bits = 0, 0, {}
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": INSTRUCTION + it["question"]}],
                    add_generation_prompt=True,
                    tokenize=False,
                )
                for it in batch
            ]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            cache = make_cache(name, model, calibrated)
            out = model.generate(
                **enc, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad
            )
            longest = max(longest, out.shape[1])
            bits = bit_columns(cache, model)
            for item, seq in zip(batch, out[:, enc["input_ids"].shape[1] :]):
                correct += same_number(extract_answer(tokenizer.decode(seq, skip_special_tokens=True)), item["answer"])
        rows.append(
            dict(
                method=name,
                task="gsm8k",
                context=longest,
                metric="accuracy",
                value=correct / len(items),
                **bits,
            )
        )
        if progress:
            progress(f"gsm8k {name}: {correct}/{len(items)}")
    return rows
