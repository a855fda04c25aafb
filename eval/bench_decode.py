"""Decode-attention and write-kernel benchmark of the Triton backend on one CUDA GPU.

    PYTHONPATH=. python eval/bench_decode.py [--quick] [--sweep] [--shapes qwen3-8b,...] [--key-bits 4] [--out DIR]
    PYTHONPATH=. python eval/bench_decode.py --smoke          # CPU, TRITON_INTERPRET=1, tiny shapes, no timings

1. Checks both kernels against their torch oracles (write: bit-identical; decode: as close to an fp32 reference
   as the torch twin), for the inline-PTX and the plain unpacking; aborts if neither unpacking is right.
2. Measures the device copy bandwidth (a large device-to-device copy, bytes read + written).
3. Times the decode kernel over T x batch x shape, from CUDA graphs that run the call on several rotated input sets
   (more bytes than the L2 cache; no Python launch overhead), two ways (:class:`GraphTime`): each replay after
   triton.testing.do_bench's L2 flush (median; the flush's dirty lines and the replay's launch weigh on short
   calls), and replays back to back (``steady_*`` columns), as calls run within a decode step's graph. It reports
   GB/s over the packed bytes read (codes + scales/zeros + sink/recent windows + q), the fraction of the copy
   bandwidth, and the speedup over bf16 torch SDPA decode (same context and GQA, query heads packed per KV head; the
   same timing). The eager time of one call (Python launch overhead included) is reported too, and the fraction of
   the copy bandwidth that a kernel which only reads the same bytes reaches (``read_frac_copy_bw``: the ceiling at
   that size, where launch and ramp-up weigh on a few microseconds of data), and the fraction that a kernel reading
   only the history's codes, scales and zeros with the decode's layout and split pattern reaches
   (``steady_layout_read_frac_copy_bw``: the best of a few launch shapes).
4. Times the write kernel on a 32K-token prefill of one layer (as the cache calls it: bf16 rows, centered in the
   kernel), and the layer's whole prefill update, against that layer's bf16 SDPA prefill (GPU time).
5. Times a 4-token verify step (assisted decoding) over 32K and 128K tokens of one layer: the decode kernel with
   several query tokens, against dequantizing the history (torch, or the Triton kernel) then SDPA; eager, and GPU
   time (kernels only, torch.profiler); the CSV keeps the 128K one.

Prints a table and writes eval/results/bench_decode_<gpu>.csv (--sweep: every tile config at every point;
--key-bits 4: 4-bit K with 2-bit V everywhere, the CSV named ..._<gpu>-k4.csv). Each point also records the GPU's
clocks, power, temperature and clock-event (throttle) reasons as its timings end (``gpu_state``).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

SHAPES = {  # name: (query heads, KV heads, head_dim)
    "qwen3-8b": (32, 8, 128),
    "llama3.2-1b-d64": (32, 8, 64),
    "d256-16q4kv": (16, 4, 256),
    "gpt-oss-20b": (64, 8, 64),
    "gemma2-9b": (16, 8, 256),
    "gemma4-12b-full": (16, 1, 512),  # Gemma-4-12B's full-attention layers (its sliding ones: 8 KV heads x 256)
}
# The attention terms a shape's model adds (decode's keyword arguments): gpt-oss's learned sink logit per query head,
# Gemma-2's logit soft-capping. The SDPA baseline reads the same bytes without them (SDPA has neither).
EXTRAS = {"gpt-oss-20b": lambda hq: {"sinks": torch.randn(hq, device=DEVICE)},
          "gemma2-9b": lambda hq: {"softcap": 50.0}}
SINK, RECENT = 64, 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a handful of points (< 1 minute)")
    p.add_argument("--sweep", action="store_true", help="time every tile config at every point")
    p.add_argument("--smoke", action="store_true", help="CPU/TRITON_INTERPRET=1 run of the whole script, tiny shapes")
    p.add_argument("--shapes", default=None, help="comma-separated subset of the grid's shapes")
    p.add_argument("--key-bits", type=int, choices=(2, 4), default=2, help="K's bits (V's are 2)")
    p.add_argument("--quantizer", choices=("uniform", "symmetric", "compact"), default="uniform",
                   help="the history's grid: uniform (an fp16 scale and zero per token and side), symmetric (a scale "
                        "alone) or compact (a byte scale and a byte zero)")
    p.add_argument("--out", default="eval/results", help="folder for the CSV")
    return p.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from oscar_hf import DynamicOscarLayer, OscarConfig  # noqa: E402
from oscar_hf.evaluation.environment import device_slug, environment, gpu_state  # noqa: E402
from oscar_hf.kernels import PackedKV, quantize_kv  # noqa: E402
from oscar_hf.kernels.decode.launch import DecodeConfig, default_config, plan  # noqa: E402
from oscar_hf.kernels.decode.reference import attend as torch_attend  # noqa: E402
from oscar_hf.kernels.decode.triton import decode  # noqa: E402
from oscar_hf.kernels.dequantize.triton import fill_history  # noqa: E402
from oscar_hf.kernels.write.triton import quantize_pack_kv  # noqa: E402
from oscar_hf.quantizer import BYTE_META, decode_byte_scale, grid_for, quantize  # noqa: E402
from oscar_hf.rotations import hadamard_matrix  # noqa: E402

DEVICE = "cpu" if ARGS.smoke else "cuda"


class Attn(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


# ---------------------------------------------------------------------------------------------- checks
def check_write() -> None:
    rows = 8 if ARGS.smoke else 300
    cases = ((128, None, torch.bfloat16), (64, 32, torch.float16), (256, None, torch.bfloat16))
    for d, group, dtype in cases[:1] if ARGS.smoke or ARGS.quick else cases:  # (each case compiles a kernel)
        k, v = ((torch.randn(4, rows, d, device=DEVICE) * 3).to(dtype) for _ in range(2))
        clip = OscarConfig(key_bits=ARGS.key_bits).side_clip  # as the cache clips: 2-bit rows only
        got = quantize_pack_kv(k, v, key_bits=ARGS.key_bits, group_size=group, k_clip=clip["key"],
                               v_clip=clip["value"], method=ARGS.quantizer)
        want = (quantize(k, bits=ARGS.key_bits, group_size=group, clip=clip["key"], method=ARGS.quantizer),
                quantize(v, group_size=group, clip=clip["value"], method=ARGS.quantizer))
        for g, w in zip(got, want):
            if not all(torch.equal(a, b) for a, b in zip(g, w)):
                sys.exit(f"ABORT: write kernel differs from quantizer.quantize (D={d}, group={group}, {dtype})")
    print("write kernel: bit-identical to quantizer.quantize")


def check_decode(fast_unpack: bool) -> bool:
    """Real layers (prefill + one decode step through the triton writer, left padding) vs the torch twin."""
    cases = ((4, 128, torch.bfloat16, 700), (4, 64, torch.float16, 300), (8, 256, torch.bfloat16, 90))
    for groups, d, dtype, n in cases[:1] if ARGS.smoke or ARGS.quick else cases:
        cfg = OscarConfig(sink_tokens=8, recent_tokens=16, flush_tokens=4, key_bits=ARGS.key_bits, backend="triton",
                          quantizer=ARGS.quantizer)
        layer = DynamicOscarLayer(cfg, torch.eye(d), torch.eye(d))
        kv = torch.randn(2, 2, 2, n, d, device=DEVICE).to(dtype)
        kv[:, 1, :, :37] = 30.0  # left padding with huge K/V: a leak would show
        mask = torch.ones(2, 1, 1, n, dtype=torch.bool, device=DEVICE)
        mask[1, ..., :37] = False
        layer.update(kv[0, :, :, :-1], kv[1, :, :, :-1])
        key, value = layer.update(kv[0, :, :, -1:], kv[1, :, :, -1:])
        query = torch.randn(2, 2 * groups, 1, d, device=DEVICE).to(dtype)
        config = replace(default_config(2, d), fast_unpack=fast_unpack)
        got = decode(query, layer.packed(), mask, None, config).float()
        want = torch_attend(Attn(groups), query, layer.packed(), key.new, value.new, mask, None).float()
        parts = {side: layer.materialize(side, dtype=torch.float32) for side in ("key", "value")}
        exact = torch.nn.functional.scaled_dot_product_attention(
            query.float().view(2, 2, groups, d), parts["key"], parts["value"], attn_mask=mask[:, :, 0, None, :]
        ).reshape(2, 1, 2 * groups, d)
        err, naive_err = (got - exact).abs().max().item(), (want - exact).abs().max().item()
        scales = layer.history["value_scale"][:, :, : layer.n_history]  # V steps: the rounding bound
        step = scales.float().abs().max().item() if scales.numel() else 0.0
        bound = 2 * naive_err + torch.finfo(dtype).eps * (exact.abs().max().item() + 0.75 * step)
        if not err <= bound:
            print(f"  mismatch: {config} g={groups} D={d} {dtype}: {err:.2g} > {bound:.2g} "
                  f"(torch twin {naive_err:.2g})")
            if dtype == torch.bfloat16:
                return False
    return True


# ------------------------------------------------------------------------------------------- synthetic data
def synthetic_packed(batch: int, heads: int, d: int, n_hist: int, dtype=torch.bfloat16) -> PackedKV:
    """A PackedKV holding SINK + n_hist + RECENT tokens of random data (codes need no quantization to time),
    centered, K codes of ``--key-bits``, zeros stored or implied by ``--quantizer``, its counts on the device as a
    static cache holds them (the launch reads no host state: CUDA-graph capturable)."""
    packed = PackedKV.empty(batch, heads, d, sink=SINK, history=n_hist, recent=RECENT, dtype=dtype, device=DEVICE,
                            key_bits=ARGS.key_bits, centered=True, quantizer=ARGS.quantizer)
    for t in packed.windows:
        t.normal_()
    for rows, (s_lo, s_hi, z_lo, z_hi) in ((packed.key, (0.02, 0.05, -0.1, -0.05)),
                                           (packed.value, (0.5, 1.0, -1.5, -1.0))):
        rows.codes.random_(0, 256)
        if rows.meta == BYTE_META:  # byte scales near s_lo..s_hi, zeros a step or two below 0
            rows.scale.random_(*(int(torch.searchsorted(decode_byte_scale(torch.arange(256, dtype=torch.uint8)), s))
                                 for s in (s_lo, s_hi)))
            rows.zero.random_(-24, -8)
        else:
            rows.scale.uniform_(s_lo, s_hi)
            rows.zero.uniform_(z_lo, z_hi)
    for center in packed.centers:
        center.normal_()
    packed.counts = torch.tensor([SINK, n_hist, RECENT, 0], dtype=torch.int32, device=DEVICE)
    return packed


def history_bytes(batch: int, heads: int, d: int, n_hist: int) -> int:
    """The history's K and V codes and their scales and zeros (one group per token and side: fp16 scale and zero,
    an fp16 scale alone with the symmetric quantizer, a byte each with the compact one)."""
    meta = 2 * grid_for(ARGS.quantizer).meta_bits(torch.float16) // 8
    return batch * heads * n_hist * (d * (ARGS.key_bits + 2) // 8 + meta)


def packed_bytes(batch: int, hq: int, heads: int, d: int, n_hist: int) -> int:
    windows = 2 * batch * heads * (SINK + RECENT) * d * 2
    return history_bytes(batch, heads, d, n_hist) + windows + batch * hq * d * 2


# ------------------------------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class GraphTime:
    """ms per call of a CUDA graph running calls back to back, two ways:

    * ``flushed``: ``triton.testing.do_bench``'s median over replays, each after its L2 flush. That flush is a
      256 MB memset, which leaves the L2 full of dirty lines: the replay pays their write-back, and its launch.
    * ``steady``: replays back to back (the median of three runs of many), as calls run inside a decode step's
      graph; the rotated input sets (more bytes than the L2) keep each call's data cold.
    """

    flushed: float
    steady: float


def graph_time(calls) -> GraphTime:
    """:class:`GraphTime` of a CUDA graph running ``calls`` back to back (smoke: one eager pass, wall clock)."""
    if ARGS.smoke:
        start = time.perf_counter()
        for call in calls:
            call()
        ms = (time.perf_counter() - start) * 1e3 / len(calls)
        return GraphTime(ms, ms)
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    flushed = triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median") / len(calls)
    replays = max(10, int(60 / (flushed * len(calls))))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        runs.append(start.elapsed_time(end) / replays / len(calls))
    del graph
    return GraphTime(flushed, sorted(runs)[1])


def eager_time(fn) -> float:
    if ARGS.smoke:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def device_time(fn, calls: int = 20) -> float:
    """GPU ms per call of ``fn``: the summed device time of its kernels and copies (torch.profiler), without the
    host work between them (smoke: the eager time)."""
    if ARGS.smoke:
        return eager_time(fn)
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / calls / 1e3


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy, bytes read + written."""
    n = (1 << 20) if ARGS.smoke else min(1 << 30, torch.cuda.mem_get_info()[0] // 8)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * n / (eager_time(lambda: dst.copy_(src)) * 1e-3) / 1e9


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Sums int32s ``x[n]`` (grid-strided): a kernel that only reads, as the decode kernel mostly does."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def read_time(nbytes: int) -> GraphTime:
    """ms of the fastest plain read of ``nbytes`` (``_read_kernel``, 1 to 8 programs of 8 warps per SM, CUDA graphs
    over rotated buffers as for the decode kernel; the best of each timing): what reading that many bytes costs at
    best, launch included."""
    n, block = nbytes // 4, 1024
    sms = 4 if ARGS.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    sets = [torch.ones(n, dtype=torch.int32, device=DEVICE) for _ in range(rotations(nbytes))]
    times = []
    for per_sm in (1, 2, 4, 8):
        out = torch.empty(sms * per_sm * block, dtype=torch.int32, device=DEVICE)
        calls = [lambda x=x: _read_kernel[(sms * per_sm,)](x, out, n, BLOCK=block, num_warps=8) for x in sets]
        times.append(graph_time(calls))
    return GraphTime(min(t.flushed for t in times), min(t.steady for t in times))


@triton.jit
def _layout_read_kernel(kc, vc, ks, kz, vs, vz, out_ptr, stride_kb, stride_kh, stride_vb, stride_vh, stride_zb,
                        stride_zh, H, n_hist, S, WK: tl.constexpr, WV: tl.constexpr, TN: tl.constexpr,
                        ZEROS: tl.constexpr):
    """Sums what a decode's history program reads (grid ``B·H × S``): the K and V code rows (int32 words, ``WK`` and
    ``WV`` per token) and the scale (and, ZEROS, zero) vectors of tiles ``split, split + S, ...`` of ``TN`` tokens,
    with the decode's layout and split pattern and no arithmetic on them."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    acc = tl.zeros([TN], tl.int32)
    meta = b * stride_zb + h * stride_zh
    for start in tl.range(split * TN, n_hist, S * TN, num_stages=3):
        rows = start + tl.arange(0, TN)
        live = rows < n_hist
        k = tl.load(kc + b * stride_kb + h * stride_kh + rows[:, None] * WK + tl.arange(0, WK)[None, :],
                    mask=live[:, None], other=0)
        v = tl.load(vc + b * stride_vb + h * stride_vh + rows[:, None] * WV + tl.arange(0, WV)[None, :],
                    mask=live[:, None], other=0)
        acc += tl.sum(k, axis=1) + tl.sum(v, axis=1)
        for vec in tl.static_range(4 if ZEROS else 2):
            ptr = (ks if vec == 0 else vs if vec == 1 else kz if vec == 2 else vz)
            acc += tl.load(ptr + meta + rows, mask=live, other=0).to(tl.int32)
    tl.store(out_ptr + bh * tl.num_programs(1) + split, tl.sum(acc, axis=0))


def layout_read_time(layers: list[PackedKV], batch: int, configs: list[DecodeConfig]) -> GraphTime:
    """ms of the fastest :func:`_layout_read_kernel` over the layers' histories, over the history splits of each
    config's plan (one warp per program, as the decode's), and twice the first's and 4 warps: what reading the history
    costs with the decode's layout and split pattern, the best of those launch shapes."""
    packed = layers[0]
    n_hist = packed.key.codes.shape[2]
    planned = [plan(packed, batch, config=c)[0] for c in configs]
    shapes = {(s, 1) for s in planned} | {(2 * planned[0], 1), (planned[0], 4)}
    times = []
    for splits, warps in sorted(shapes):
        out = torch.empty(batch * packed.heads * splits, dtype=torch.int32, device=DEVICE)

        def call(p, splits=splits, warps=warps, out=out):
            kc, vc = (rows.codes.view(torch.int32) for rows in (p.key, p.value))
            zeros = not p.key.implied_zero
            scales = (p.key.scale, p.key.zero if zeros else p.key.scale, p.value.scale,
                      p.value.zero if zeros else p.value.scale)  # (the scales stand in for absent zeros: unread)
            metas = [t.view(torch.int16) if t.element_size() == 2 else t for t in scales]  # fp16 or bytes
            _layout_read_kernel[(batch * p.heads, splits)](
                kc, vc, *metas, out, *kc.stride()[:2], *vc.stride()[:2], *metas[0].stride()[:2], p.heads, n_hist,
                splits, WK=kc.shape[-1], WV=vc.shape[-1], TN=configs[0].block_n, ZEROS=zeros, num_warps=warps)

        times.append(graph_time([lambda p=p: call(p) for p in layers]))
    return GraphTime(min(t.flushed for t in times), min(t.steady for t in times))


def rotations(bytes_per_set: int) -> int:
    l2 = 0 if ARGS.smoke else torch.cuda.get_device_properties(0).L2_cache_size
    return max(1, min(16, math.ceil(4 * l2 / bytes_per_set)))


def fits(nbytes: int) -> bool:
    return ARGS.smoke or nbytes < 0.8 * torch.cuda.mem_get_info()[0]


def sweep_configs(batch: int, d: int, fast_ok: bool) -> list[DecodeConfig]:
    """The default config; --sweep: tile configs, programs per SM, register caps and the plain unpacking too."""
    base = replace(default_config(batch, d), fast_unpack=fast_ok)
    if not ARGS.sweep:
        return [base]
    tiles = {  # (block_n, warps, stages)
        64: [(64, 1, 3), (128, 1, 3), (128, 1, 2), (64, 1, 4), (64, 2, 3)],
        128: [(64, 1, 3), (128, 1, 3), (32, 1, 3), (64, 1, 2), (64, 1, 4), (64, 2, 3)],
        256: [(32, 1, 3), (16, 1, 3), (64, 1, 3), (32, 1, 2), (32, 1, 4), (32, 2, 3)],
        512: [(32, 4, 2), (32, 2, 2), (64, 4, 2), (64, 2, 2), (16, 2, 2), (32, 4, 3)],
    }[d]
    configs = [base] + [replace(base, block_n=n, num_warps=w, num_stages=s) for n, w, s in tiles
                        if (n, w, s) != (base.block_n, base.num_warps, base.num_stages)]
    configs += [replace(base, programs_per_sm=p, min_program_tiles=0) for p in ((2, 3, 6) if d > 256 else
                                                                                 (8, 10, 12, 24))]
    configs += [replace(base, max_registers=r) for r in (None, 168, 128) if r != base.max_registers]
    return configs + ([replace(base, fast_unpack=False)] if fast_ok else [])


def time_configs(batch: int, hq: int, heads: int, d: int, n_hist: int, configs,
                 extras=None) -> tuple[list, list, GraphTime]:
    """(:class:`GraphTime` of CUDA graphs over rotated input sets, eager ms of one call) per config; the queries
    used; and :func:`layout_read_time` over the same histories. ``extras``: decode's keyword arguments (sinks,
    softcap)."""
    extras = extras or {}
    n_sets = rotations(packed_bytes(batch, hq, heads, d, n_hist))
    layers = [synthetic_packed(batch, heads, d, n_hist) for _ in range(n_sets)]
    queries = [torch.randn(batch, hq, 1, d, dtype=torch.bfloat16, device=DEVICE) for _ in range(n_sets)]
    times = []
    for config in configs:
        calls = [lambda q=q, packed=packed: decode(q, packed, None, None, config, **extras)
                 for q, packed in zip(queries, layers)]
        times.append((graph_time(calls), eager_time(calls[0])))
    return times, queries, layout_read_time(layers, batch, configs)


def sdpa_time(queries, batch: int, heads: int, context: int, d: int) -> dict[str, tuple[float, str]]:
    """The fastest bf16 SDPA decode over a dense cache of ``context`` tokens we can run: every SDPA backend, with
    the query heads packed per KV head (as pack_gqa) and as ``q_len = 1`` with ``enable_gqa``. Returns ``(ms,
    which)`` per timing of :class:`GraphTime` (``flushed``, ``steady``), each the best under that timing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n_sets = rotations(2 * batch * heads * context * d * 2)
    sets = [torch.randn(2, batch, heads, context, d, dtype=torch.bfloat16, device=DEVICE) for _ in range(n_sets)]
    layouts = {"packed": ([q.view(batch, heads, -1, d) for q in queries], {}),
               "gqa": ([q.view(batch, -1, 1, d) for q in queries], {"enable_gqa": True})}
    backends = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
                if DEVICE == "cuda" else [SDPBackend.MATH])
    best = {"flushed": (math.inf, "none"), "steady": (math.inf, "none")}
    for layout, (qs, kwargs) in layouts.items():
        calls = [lambda kv=kv, q=qs[i % len(qs)]: torch.nn.functional.scaled_dot_product_attention(q, kv[0], kv[1],
                                                                                                  **kwargs)
                 for i, kv in enumerate(sets)]
        for backend in backends:
            try:
                with sdpa_kernel(backend):
                    timed = graph_time(calls)
            except RuntimeError:
                continue
            for timing in best:
                best[timing] = min(best[timing], (getattr(timed, timing), f"{layout}/{backend.name.lower()}"))
    return best


def bench_decode(shape: str, batch: int, context: int, copy_gbps: float, fast_ok: bool) -> list[dict]:
    hq, heads, d = SHAPES[shape]
    n_hist = context - SINK - RECENT
    size, sdpa_size = packed_bytes(batch, hq, heads, d, n_hist), 2 * batch * heads * context * d * 2
    if not fits(max(rotations(size) * size, rotations(sdpa_size) * sdpa_size) + (1 << 30)):
        print(f"{shape:16s} B={batch:<3d} T={context:<7d} skipped: does not fit in GPU memory")
        return []
    extras = EXTRAS[shape](hq) if shape in EXTRAS else {}
    configs = sweep_configs(batch, d, fast_ok)
    times, queries, layout_read = time_configs(batch, hq, heads, d, n_hist, configs, extras)
    history_size = history_bytes(batch, heads, d, n_hist)
    sdpa = sdpa_time(queries, batch, heads, context, d)
    (sdpa_ms, sdpa_kind), (steady_sdpa_ms, steady_sdpa_kind) = sdpa["flushed"], sdpa["steady"]
    read = read_time(size)
    clocks = gpu_state(DEVICE)  # as the point's timings end: was the GPU slowed?
    rows = []
    for c, (kernel, eager_ms) in zip(configs, times):
        kernel_ms, steady_ms = kernel.flushed, kernel.steady
        gbps = size / (kernel_ms * 1e-3) / 1e9
        rows.append({"shape": shape, "hq": hq, "hkv": heads, "d": d, "batch": batch, "T": context, "n_hist": n_hist,
                     "block_n": c.block_n, "warps": c.num_warps, "stages": c.num_stages, "pps": c.programs_per_sm,
                     "min_program_tiles": c.min_program_tiles, "max_registers": c.max_registers,
                     "fast_unpack": c.fast_unpack, "kernel_ms": kernel_ms,
                     "eager_ms": eager_ms, "GBps": gbps,
                     "frac_copy_bw": gbps / copy_gbps, "sdpa_ms": sdpa_ms, "sdpa_kind": sdpa_kind,
                     "sdpa_GBps": sdpa_size / (sdpa_ms * 1e-3) / 1e9, "speedup_vs_sdpa": sdpa_ms / kernel_ms,
                     "read_ms": read.flushed, "read_frac_copy_bw": size / (read.flushed * 1e-3) / 1e9 / copy_gbps,
                     "steady_kernel_ms": steady_ms, "steady_frac_copy_bw": size / (steady_ms * 1e-3) / 1e9 / copy_gbps,
                     "steady_sdpa_ms": steady_sdpa_ms, "steady_sdpa_kind": steady_sdpa_kind,
                     "steady_speedup_vs_sdpa": steady_sdpa_ms / steady_ms, "steady_read_ms": read.steady,
                     "steady_read_frac_copy_bw": size / (read.steady * 1e-3) / 1e9 / copy_gbps,
                     "steady_layout_read_ms": layout_read.steady,
                     "steady_layout_read_frac_copy_bw": history_size / (layout_read.steady * 1e-3) / 1e9 / copy_gbps,
                     "rotations": rotations(size), "extras": "+".join(extras) or "none", **clocks})
    print_best(rows, clocks)
    return rows


def print_best(rows: list[dict], clocks: dict) -> None:
    """One line for the fastest of ``rows`` (one point)."""
    best = min(rows, key=lambda r: r["kernel_ms"])
    shape, batch, context = best["shape"], best["batch"], best["T"]
    sdpa_ms, sdpa_kind = best["sdpa_ms"], best["sdpa_kind"]
    print(f"{shape:16s} B={batch:<3d} T={context:<7d} {best['kernel_ms']:8.4f} ms "
          f"{best['GBps']:7.0f} GB/s "
          f"{100 * best['frac_copy_bw']:5.1f}% copy  sdpa {sdpa_ms:8.4f} ms ({sdpa_kind}) "
          f"x{best['speedup_vs_sdpa']:5.2f}  read-only {100 * best['read_frac_copy_bw']:5.1f}%  "
          f"eager {best['eager_ms']:.4f} ms  [{best['block_n']}/{best['warps']}w/{best['stages']}s/"
          f"pps{best['pps']}{'<' + str(best['min_program_tiles']) + 't' if best['min_program_tiles'] else ''}/"
          f"reg{best['max_registers']}/{'ptx' if best['fast_unpack'] else 'plain'}]  steady: "
          f"{best['steady_kernel_ms']:.4f} ms {100 * best['steady_frac_copy_bw']:5.1f}% copy sdpa "
          f"{best['steady_sdpa_ms']:.4f} ms x{best['steady_speedup_vs_sdpa']:5.2f} read-only "
          f"{100 * best['steady_read_frac_copy_bw']:5.1f}% history layout read-only "
          f"{100 * best['steady_layout_read_frac_copy_bw']:5.1f}%"
          + (f"  SM {clocks['sm_mhz']} MHz, clock events {clocks['clock_events']}" if clocks else ""))


def bench_verify(context: int, q_len: int = 4) -> dict:
    """Attention of ``q_len`` query tokens (assisted decoding's verify step) over a Qwen3-8B layer holding
    ``context`` tokens, batch 1, eager: the decode kernel reading the packed history (``decode``, several query
    tokens), against the history dequantized by torch (``dequantize.reference``) or by the Triton dequantize
    kernel (``dequantize.triton.fill_history``), each followed by SDPA. Aborts if the kernel disagrees with the torch
    twin."""
    hq, heads, d = SHAPES["qwen3-8b"]
    config = OscarConfig(sink_tokens=SINK, recent_tokens=RECENT, key_bits=ARGS.key_bits, backend="triton",
                         quantizer=ARGS.quantizer)
    layer = DynamicOscarLayer(config, torch.eye(d), torch.eye(d))
    k, v = (torch.randn(1, heads, context, d, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    layer.update(k[:, :, :-q_len], v[:, :, :-q_len])
    key, value = layer.update(k[:, :, -q_len:], v[:, :, -q_len:])
    query = torch.randn(1, hq, q_len, d, device=DEVICE).to(torch.bfloat16)
    module = Attn(hq // heads)
    fused = decode(query, layer.packed(), None, None)
    want = torch_attend(module, query, layer.packed(), key.new, value.new, None, None)
    err = (fused.float() - want.float()).abs().max().item()
    if not err <= 1.6e-2 * (1 + want.float().abs().max().item()):
        sys.exit(f"ABORT: the {q_len}-token decode differs from the torch twin by {err:.3g} at T={context}")
    calls = {"fused": lambda: decode(query, layer.packed(), None, None)}
    for name, fill in (("torch", None), ("triton", fill_history)):
        calls[name] = lambda f=fill: torch_attend(module, query, layer.packed(), key.new, value.new, None, None, f)
    times = {name: eager_time(call) for name, call in calls.items()}
    gpu = {name: device_time(call) for name, call in calls.items()}
    print(f"verify step, {q_len} query tokens over {context} tokens (Qwen3-8B layer, B=1, max error vs naive "
          f"{err:.2g}), eager ms (GPU ms): decode kernel {times['fused']:.3f} ({gpu['fused']:.3f}); history "
          f"dequantized by torch {times['torch']:.3f} ({gpu['torch']:.3f}), by the Triton kernel "
          f"{times['triton']:.3f} ({gpu['triton']:.3f}), + SDPA")
    return {"verify_T": context, "verify_q": q_len, "verify_kernel_ms": times["fused"],
            "verify_torch_ms": times["torch"], "verify_dequant_ms": times["triton"],
            "verify_kernel_gpu_ms": gpu["fused"], "verify_torch_gpu_ms": gpu["torch"],
            "verify_dequant_gpu_ms": gpu["triton"]}


def bench_write(tokens: int) -> dict:
    """The write kernel as a prefill calls it (one Qwen3-8B layer's bf16 K and V rows minus their fp32 means, the
    centering done in the kernel), and the layer's whole prefill update (rotations, means, windows, the kernel),
    against that layer's bf16 SDPA prefill: GPU time (torch.profiler), and the eager time of the kernel's call
    (launch and flag read included)."""
    hq, heads, d = SHAPES["qwen3-8b"]
    k, v = (torch.randn(1, heads, tokens, d, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    centers = {f"{side}_center": x.mean(dim=2, keepdim=True, dtype=torch.float32)
               for side, x in (("key", k), ("value", v))}
    clip = OscarConfig(key_bits=ARGS.key_bits).side_clip
    kwargs = dict(key_bits=ARGS.key_bits, k_clip=clip["key"], v_clip=clip["value"], method=ARGS.quantizer, **centers)
    kernel_ms, eager_ms = (timer(lambda: quantize_pack_kv(k, v, **kwargs)) for timer in (device_time, eager_time))
    torch_ms = device_time(lambda: quantize_kv(k, v, **kwargs))
    rotation = hadamard_matrix(d).float().to(DEVICE)
    config = OscarConfig(sink_tokens=SINK, recent_tokens=RECENT, key_bits=ARGS.key_bits, backend="triton",
                         quantizer=ARGS.quantizer)
    update_ms = device_time(lambda: DynamicOscarLayer(config, rotation, rotation).update(k, v))
    q = torch.randn(1, hq, tokens, d, device=DEVICE).to(torch.bfloat16)
    kr, vr = (t.repeat_interleave(hq // heads, dim=1) for t in (k, v))
    prefill_ms = device_time(lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True))
    print(f"write kernel, {tokens} tokens x {heads} KV heads x D{d} (K and V, centered): GPU {kernel_ms:.3f} ms, "
          f"eager {eager_ms:.3f} ms (torch writer GPU {torch_ms:.3f} ms); the layer's prefill update GPU "
          f"{update_ms:.3f} ms; bf16 SDPA prefill of one layer GPU {prefill_ms:.3f} ms -> the kernel adds "
          f"{100 * kernel_ms / prefill_ms:.2f}% (target <= 5%), the whole update {100 * update_ms / prefill_ms:.2f}%")
    return {"tokens": tokens, "write_ms": kernel_ms, "write_eager_ms": eager_ms, "torch_write_ms": torch_ms,
            "update_ms": update_ms, "sdpa_prefill_ms": prefill_ms, "overhead": kernel_ms / prefill_ms,
            "update_overhead": update_ms / prefill_ms}


def main():
    if not ARGS.smoke and not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA GPU (or --smoke for a CPU interpreter run)")
    env = environment(DEVICE, "cpu-interpreter" if ARGS.smoke else None)
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    torch.manual_seed(0)
    check_write()
    fast_ok = check_decode(fast_unpack=True)
    if not fast_ok and not check_decode(fast_unpack=False):
        sys.exit("ABORT: the decode kernel does not match the torch twin")
    print("decode kernel: matches the torch twin" if fast_ok else "WARNING: the inline-PTX unpacking is WRONG on this "
          "GPU; timing the plain path. Set DecodeConfig.fast_unpack's default to False in "
          "oscar_hf/kernels/decode/launch.py.")
    copy_gbps = copy_bandwidth()
    print(f"device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")
    if ARGS.smoke:
        SHAPES["smoke-4q1kv"] = (4, 1, 128)
        grid = [("smoke-4q1kv", 1, 400)]
    elif ARGS.quick:
        grid = [("qwen3-8b", b, t) for b in (1, 8) for t in (32768, 131072)]
        grid += [("qwen3-8b", 32, 32768), ("llama3.2-1b-d64", 8, 32768), ("d256-16q4kv", 8, 32768)]
        grid += [("gpt-oss-20b", 1, 131072), ("gpt-oss-20b", 8, 32768), ("gemma2-9b", 8, 32768)]
        grid += [("gemma4-12b-full", 1, 131072), ("gemma4-12b-full", 8, 32768)]
    else:
        grid = [(s, b, t) for s in SHAPES for b in (1, 8, 32) for t in (4096, 16384, 32768, 131072)]
    if ARGS.shapes:
        unknown = set(ARGS.shapes.split(",")) - set(SHAPES)
        if unknown:
            sys.exit(f"unknown --shapes {sorted(unknown)}; known: {sorted(SHAPES)}")
        grid = [point for point in grid if point[0] in ARGS.shapes.split(",")]
    rows = []
    for shape, batch, context in grid:
        rows += [{**env, **row} for row in bench_decode(shape, batch, context, copy_gbps, fast_ok)]
        if not ARGS.smoke:
            torch.cuda.empty_cache()
    write = bench_write(16 if ARGS.smoke else 32768)
    verify = [bench_verify(t) for t in ((400,) if ARGS.smoke else (32768, 131072))]
    out = Path(ARGS.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ("-k4" if ARGS.key_bits == 4 else "") + ("" if ARGS.quantizer == "uniform" else f"-{ARGS.quantizer}")
    path = out / f"bench_decode_{device_slug(env)}{suffix}.csv"
    rows = [{**row, "key_bits": ARGS.key_bits, "quantizer": ARGS.quantizer, "copy_GBps": copy_gbps,
             **{f"write_{k}": v for k, v in write.items()}, **verify[-1]} for row in rows]
    with open(path, "w", newline="") as f:  # the copy bandwidth, write and verify results repeat on every row
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
