"""Launch heuristics of the decode kernel: per-program tiles and warps, and how the sequence is split across
programs. Pure Python; the measurements behind each rule are in ``docs/kernels/decode.md``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..packed import PackedKV
from ..utils import sm_count, triton_runs_on

DTYPES = (torch.bfloat16, torch.float16)  # the kernel's query and window dtypes
WINDOW_BLOCK = {64: 32, 128: 32, 256: 16, 512: 16}  # sink/recent tile rows per head_dim (shared memory < 40 KiB)
MAX_QUERY_ROWS = 32  # query heads x query tokens per program of a several-token call (accumulator registers)
SHORT_HISTORY_TILES = 8  # history programs of at most this many tiles are "short" (window programs finish last)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of stage 1.

    Attributes:
        block_n: history tile tokens. num_warps, num_stages: per program.
        programs_per_sm: programs per SM a wave of history programs aims for.
        min_program_tiles: fewer programs per SM (by 2, down to 8) while a history program has fewer tiles.
        fast_unpack: unpack codes with inline PTX (GPU only).
        pdl: launch both stages early (programmatic dependent launch, sm_90+), each waiting on its input.
        min_split_bytes: a split reads at least this much, so that its partial output stays cheap.
        max_registers: ptxas register cap per thread (more programs per SM, some spills).
        window_prefetch: window programs ask L2 for their rows first (None: :func:`window_prefetch`'s rule).
        max_history_programs_per_sm: a cap where window programs are few but not rare (0: none).
        window_tiles: tiles per sink/recent chunk (None: :func:`plan`'s rule, 1 or 2).
    """

    block_n: int = 64
    num_warps: int = 1
    num_stages: int = 3
    programs_per_sm: int = 16
    min_program_tiles: int = 0
    fast_unpack: bool = True
    pdl: bool = True
    min_split_bytes: int = 8 * 1024
    max_registers: int | None = None
    window_prefetch: bool | None = None
    max_history_programs_per_sm: float = 0.0
    window_tiles: int | None = None

    def __post_init__(self):
        if self.programs_per_sm < 1 or self.max_history_programs_per_sm < 0:
            raise ValueError("DecodeConfig needs programs_per_sm >= 1 and max_history_programs_per_sm >= 0 (0: no "
                             f"cap); got {self.programs_per_sm} and {self.max_history_programs_per_sm}")
        if self.window_tiles is not None and self.window_tiles < 1:
            raise ValueError(f"DecodeConfig needs window_tiles >= 1 (or None: plan's rule); got {self.window_tiles}")


def default_config(batch: int, head_dim: int, query_len: int = 1) -> DecodeConfig:
    """One warp per program, so that its reductions over tokens never leave the warp; 64-token tiles (32 at
    D = 256), 3 stages, at most 168 registers at D <= 128 (12 one-warp programs per SM on sm_90; 8 at D = 256, 255
    registers). One query token at D = 128 takes fewer, longer programs where a full wave's would cover fewer than
    24 tiles, and caps the history programs at 7.7 per SM where the window programs are between one per SM and half
    the history programs (:func:`plan_splits`). From H100 sweeps over batch, length and head_dim."""
    one_token_d128 = query_len == 1 and head_dim == 128
    if head_dim > 256:  # Gemma-4's full layers: 64-token tiles over 4 warps, 4 programs per SM (H200 sweep)
        return DecodeConfig(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4)
    return DecodeConfig(block_n=64 if head_dim <= 128 else 32, num_warps=1, num_stages=3,
                        programs_per_sm=8 if head_dim > 128 else 12,
                        min_program_tiles=24 if one_token_d128 else 0,
                        max_registers=168 if head_dim <= 128 else None,
                        max_history_programs_per_sm=7.7 if one_token_d128 else 0.0)


def plan_splits(batch_heads: int, n_hist: int, hist_bytes: int, cfg: DecodeConfig, sms: int,
                window_programs: int = 0) -> int:
    """History tokens per split (whole ``block_n`` tiles; ``hist_bytes``: K + V bytes per token).

    The history programs fill one wave of ``programs_per_sm · sms`` programs without spilling into a second (fewer
    when a split would read less than ``min_split_bytes``), with fewer programs per SM (by 2, down to 8) while a split
    would hold fewer than ``min_program_tiles`` tiles and the history programs outnumber the ``window_programs`` at
    least twice. The window programs (short sink/recent chunks, first in the grid) take slots of the wave: the history
    programs leave them room when that costs at most a tenth of the splits. Last, the history programs are capped at
    ``max_history_programs_per_sm · sms`` where the window programs are at least one per SM and at most half as many
    as the capped history programs (an empirical rule, applied only where it was measured to help)."""
    def chunk(splits: int) -> int:
        return max(1, cdiv(cdiv(n_hist, splits), cfg.block_n)) * cfg.block_n

    def wave(per_sm: int) -> int:
        slots = per_sm * sms
        tokens = chunk(max(1, min(slots // batch_heads, n_hist * hist_bytes // cfg.min_split_bytes)))
        splits = cdiv(n_hist, tokens)
        room = (slots - window_programs) // batch_heads
        if splits * batch_heads + window_programs > slots and room >= 0.9 * splits:
            tokens = chunk(room)
        return tokens

    per_sm = cfg.programs_per_sm
    tokens = wave(per_sm)
    while (per_sm > 8 and tokens < cfg.min_program_tiles * cfg.block_n
           and 2 * window_programs <= cdiv(n_hist, tokens) * batch_heads):
        per_sm -= 2
        tokens = wave(per_sm)
    cap = int(cfg.max_history_programs_per_sm * sms) // batch_heads  # splits per head
    if (cap and cdiv(n_hist, tokens) > cap and sms <= window_programs
            and 2 * window_programs <= cap * batch_heads):
        tokens = chunk(cap)
    return tokens


def short_history(cfg: DecodeConfig, n_hist: int, hist_splits: int) -> bool:
    """Whether the history programs read at most SHORT_HISTORY_TILES tiles each: then the window programs, whose
    loads are few and dependent, tend to finish last."""
    return n_hist <= SHORT_HISTORY_TILES * cfg.block_n * max(hist_splits, 1)


def window_prefetch(cfg: DecodeConfig, batch_heads: int, hist_capacity: int, splits: list[int],
                    device: torch.device) -> bool:
    """Whether the window programs ask L2 for their rows first: where they are few (at most one per two SMs) and the
    history programs short (judged from the history's capacity: a static cache plans once)."""
    if cfg.window_prefetch is not None:
        return cfg.window_prefetch
    hist_splits, _, total, _ = splits
    return (2 * batch_heads * (total - hist_splits) <= sm_count(device)
            and short_history(cfg, hist_capacity, hist_splits))


def supports_storage(packed: PackedKV, recent_tokens: int) -> bool:
    """Whether the kernel can serve every decode step over ``packed`` (initialized storage): bf16/fp16, head_dim
    64/128/256/512, per-token K, a group spanning whole channel sub-tiles, each at least one MMA K wide, and a recent
    window of at least one token (the newest token is read from there), on CUDA or the interpreter."""
    d, bits = packed.head_dim, (packed.key_bits, packed.value_bits)
    return (
        packed.dtype in DTYPES
        and d in WINDOW_BLOCK
        and packed.group_size >= d * max(bits) // 8
        and d * min(bits) // 8 >= 16
        and recent_tokens >= 1
        and packed.per_token_keys
        and triton_runs_on(packed.device)
    )


def supports_call(query: torch.Tensor, packed: PackedKV, attention_mask: torch.Tensor | None, recent_tokens: int,
                  mask_length: int) -> bool:
    """Whether the kernel serves this call: :func:`supports_storage`, a query of the storage's dtype with one token,
    or up to ``MAX_QUERY_ROWS / g`` tokens that are all in the recent window, and a bool mask ``[B or 1, 1, 1 or q,
    >= mask_length]`` or none."""
    q_len = query.shape[2]
    group_q = query.shape[1] // packed.heads
    return (
        (q_len == 1 or (q_len <= recent_tokens and q_len * group_q <= MAX_QUERY_ROWS))
        and query.dtype == packed.dtype
        and supports_storage(packed, recent_tokens)
        and (attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1
                                        and attention_mask.shape[2] in (1, q_len)
                                        and attention_mask.shape[-1] >= mask_length))
    )


def plan(packed: PackedKV, batch: int, lengths: tuple[int, int, int] | None = None,
         config: DecodeConfig | None = None, query_len: int = 1) -> list[int]:
    """``[history splits, sink splits, total splits, window tiles]`` of stage 1 for storage holding ``lengths``
    (sink, history, recent) tokens; None plans for its capacities, so that one launch serves every length (the kernel
    spreads the history tiles it finds in the counts over the planned splits). Splits are ordered sink, recent,
    history: the window chunks start in the first wave instead of trailing the last one.

    A window chunk is ``config.window_tiles`` tiles, or by default one where the history programs (planned for chunks
    of two) are short (:func:`short_history`), so that the window programs, which then finish last, are twice as many
    and half as long; else two."""
    d = packed.head_dim
    capacities = (packed.sink_k.shape[2], packed.key.codes.shape[2], packed.recent_k.shape[2])
    n_sink, n_hist, n_recent = lengths or capacities
    heads = batch * packed.heads
    cfg = config or default_config(batch, d, query_len)

    def splits(window_tiles: int) -> list[int]:
        win_chunk = window_tiles * WINDOW_BLOCK[d]
        sink_splits = cdiv(n_sink, win_chunk)
        window_splits = sink_splits + cdiv(n_recent, win_chunk)
        hist_chunk = plan_splits(heads, n_hist, packed.history_bytes_per_token, cfg, sm_count(packed.device),
                                 heads * window_splits)
        hist_splits = cdiv(n_hist, hist_chunk)
        return [hist_splits, sink_splits, hist_splits + window_splits, window_tiles]

    if cfg.window_tiles is not None:
        return splits(cfg.window_tiles)
    two = splits(2)
    return splits(1) if short_history(cfg, n_hist, two[0]) else two
