"""End-to-end ``model.generate`` benchmark on one GPU: the OSCAR cache against transformers' BF16 caches.

    PYTHONPATH=. python eval/bench_generate.py [--models M,..] [--methods X,..] [--lengths T,..] [--batches B,..]
                                               [--steps N] [--warmup W] [--budget-s S] [--kernels N]
                                               [--no-capacity] [--no-prefill]
                                               [--decodings generate,overlapped] [--tuning-timer steady|inductor]
                                               [--out DIR]
    PYTHONPATH=. python eval/bench_generate.py --smoke [--device cpu]   # tiny random models, < 1 minute on a CPU
    PYTHONPATH=. torchrun --nproc_per_node N eval/bench_generate.py --tp N [...]   # tensor-parallel over N GPUs

Models: random-weight bf16 models of real shapes (Qwen3-8B, Llama-3.1-8B) built from their configs directly on the
device (transformers' own init: normal std 0.02, norms at 1); every case checks that no logit is NaN or +inf.

Methods (--methods): the methods of the registry that evaluation and lm-eval use (``oscar_hf.evaluation.METHODS``),
each optionally run a benchmark way, ``<method>[+variant...]`` (``BenchMethod``). The registry builds every cache
(``make_cache``). Its calibrated methods (oscar, oscar-k4, ...) get ``OscarRotations.hadamard(model.config)`` as
their bundle: random weights have nothing to calibrate and a rotation's values do not change the timings; the
bundle recommends no config, so the method's preset sits on the OscarConfig defaults (INT2, sink 64, recent 256;
backend "auto": the Triton kernels on CUDA). Methods that read key codebooks (oscar-pq1, oscar-pq2) get random ones of
the right shapes, for the same reason. Methods that need the bundle's diagnostics (oscar-k4-half) are refused.
The variants (``VARIANTS``):

* ``compiled``: static buffers for T+N tokens, so that generate compiles the whole decode forward into one graph with
  transformers' default ``CompileConfig`` (inductor, "reduce-overhead": one CUDA graph per step). OSCAR:
  ``max_cache_len=T+N`` (device-side counts and a fixed mask size; its one-token update and attention are
  device-only operators). bf16: ``StaticCache(config=model.config, max_cache_len=...)``, the cache that
  ``cache_implementation="static"`` builds (its layers made croppable, ``UndoableStaticLayer``, so that ``--decodings
  overlapped`` defers its stop check as it does OSCAR's; nothing else differs). The ``compiled`` column is generate's
  own test (``_valid_auto_compile_criteria``), ``graphs`` the graphs torch.compile made during the call. Not for
  transformers' QuantizedCache, which it cannot compile;
* ``absorbed`` (calibrated methods): ``absorb_value_rotation(model, bundle)`` folds R_V into v_proj and o_proj (in
  place; the random weights stay random weights of the same shapes, so the methods after it time the same model) and
  the cache takes the bundle it returns: no V rotation GEMMs per step. Multi-head latent attention:
  ``absorb_latent_rotation`` folds the latent rotation into kv_b_proj: no rotation of the history back per step;
* ``gqa`` (caches that transformers' attention reads: bf16, quanto-int2, hqq-int2): SDPA's own grouped-query
  attention (``enable_gqa=True``) under the mask (``GQA_ATTENTION``), where transformers' sdpa attention copies K and
  V with the KV heads repeated whenever a mask is given, as a static cache's always is: a bf16 baseline without those
  copies (which SDPA backend runs it is up to torch).

The default list (``DEFAULT_METHODS``): oscar, oscar+compiled, oscar+absorbed+compiled, oscar-k4+compiled (INT4 K,
INT2 V), bf16 (``DynamicCache``, eager), bf16+compiled, bf16+compiled+gqa, and quanto-int2 and hqq-int2
(``QuantizedCache(backend, config=model.config, nbits=2)``, eager), whose rows say "not-installed" when the backend
does not import (``pip install -e ".[baselines]"`` installs both).

Decode, per (model, method, T, batch): a fresh cache is filled with T tokens of random bf16 K/V through each layer's
``cache.update`` in chunks (for OSCAR the real rotate, quantize and pack write path; ``fill_s``), then
``model.generate(input_ids=<T+1 random ids>, attention_mask=ones, cache=cache, max_new_tokens=N, min_new_tokens=N,
do_sample=False)`` (``past_key_values=`` before transformers 5.24) runs N = warmup + steps + 1 one-token forward
passes (``--decodings overlapped``: with ``custom_generate=oscar_hf.overlapped_sample``, which defers generate's stop
check by a step so that the host prepares and launches a step while the GPU runs the one before; ``stop_check`` says
whether it did: "deferred", or "every step" for a cache that is not croppable or on the CPU): generate feeds only the
last prompt token, and the cache must go from T to T+N tokens. A logits processor records a CUDA event after every
step. ``ms_per_step`` and ``decode_tok_s`` (batch x steps / seconds) come from the steps after the first ``warmup``
decode steps; ``ms_per_step_median`` and ``ms_per_step_max`` are the median and the longest of those steps (a step
the host launched late lengthens the mean, hardly the median), and the log lists the timed steps in order (OSCAR's
demotions, every ``flush_tokens`` steps, show there). ``gc_ms``: host milliseconds of Python garbage collections
during the timed steps (the log says after which step each ran). ``forward_ms`` (compiled methods): after
generate, the compiled decode forward of its last step is called ``steps`` more times back to back with the same
inputs (one CUDA graph replay each; every call stores one more token, so the caches are built with room for them):
the decode step without generate's host work between steps (sampling, stopping criteria, input preparation).
``compile_s`` is what the warm-up steps took beyond as many timed steps (torch.compile and CUDA-graph capture for the
compiled method); ``--kernels N`` then logs the forward's time by kernel (torch.profiler over 5 more replays: GPU time,
summed and on the critical path, and the idle gaps by the kernel starting after each; on the CPU, self time by op).
``peak_mem_gb``: torch.cuda.max_memory_allocated during the generate call, i.e. weights + cache + decode working set
(``base_mem_gb``: allocated before the cache). ``cache_gb``: the bytes of the cache's tensors after the call
(``oscar_hf.cache.cache_nbytes``: ``cache.nbytes`` for OSCAR), linear-attention and state-space layers' states
included (``state_gb``: those alone). Memory in GiB, summed over the GPUs the model uses. Cases whose cache alone
cannot fit in the free memory are reported as "oom (...)" without being run.

Several GPUs (``--gpus N``): the decoder layers are split evenly over GPUs 0..N-1 with ``accelerate.dispatch_model``
(the placement ``device_map`` gives), each cache layer lives on its attention layer's GPU, and the cache is filled
there; timestamps are CUDA events on the first GPU, which waits for the last one's logits every step.

Tensor parallelism (``--tp N``, under ``torchrun --nproc_per_node N``): every rank loads the model with
transformers' ``tp_plan="auto"`` (its attention heads and MLP split over the N GPUs, an all-reduce after each), from
a folder holding the config and no weights, so that transformers initializes each rank's shards (random weights, as
above). Each rank's cache holds its KV heads (the OSCAR cache reads the rank from the model); every rank runs the same
generate, and rank 0 times it on its GPU and writes the results. Memory columns (``cache_gb``, ``peak_mem_gb``, ...)
are rank 0's GPU; the ``tp`` column says over how many GPUs. The ranks agree on every skip (time budget, memory
pre-check), but a case that raises on one rank alone leaves the others waiting in a collective: stop such a run.
Models with multi-head latent attention are refused (transformers' plans do not split it).

Prefill (``prefill_s``): a real ``generate(max_new_tokens=1)`` over T random tokens at batch 1, and at the grid's
second batch (8) for the shortest T, eager for every method (``disable_compile``); it is retried with
``prefill_chunk_size`` when it runs out of memory. The LM head must compute one position per forward
(generate's ``logits_to_keep=1``).

Capacity (``kind=capacity``): for bf16 and oscar, the largest batch at the longest T whose fill and decode
fit in device memory: a batch-1 run gives the bytes per sequence, and batches are tried up (or down) from the one they
predict, catching and freeing each out-of-memory error.

Order: per model, the decode grid method by method, batch by batch, shortest T first, then prefill, then capacity
(the large batches and the out-of-memory searches last). No case starts after --budget-s seconds (its row says
"skipped: time budget"). Writes bench_generate_<gpu>.csv, .log (header, progress and table) and .png (decode tok/s
against T per method, at the smallest and the largest batch) under --out. Every row records the GPU, the versions,
the commit, ``inductor_pdl``: whether inductor launched its kernels early (``TORCHINDUCTOR_ENABLE_PDL=1``, sm_90+:
on an H100 it took 0.40-0.47 ms off a 128K Qwen3-8B forward, OSCAR and bf16 alike: ``-inductor-pdl`` in
eval/results), and ``inductor_cdt``: whether inductor tuned its kernels by coordinate descent
(``TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1``), which also makes batch-1 matrix-vector products its own reductions
instead of cuBLAS GEMMs (with PDL, a further 0.57-0.88 ms off that forward against the ``-inductor-pdl`` runs:
``-inductor-cdt``), and ``tuning_timer``: how that tuning timed each candidate config, ``steady`` (the default on a
GPU, ``--tuning-timer``: :func:`steady_tuning_timer`; with inductor's own timer, ``inductor``, the host's launch time
fell inside the timed window, and the same code's 128K forward took 7.38-8.17 ms from process to process on an H100,
against 7.06-7.16 ms with the steady one). Decode rows also record the GPU's clocks, power, temperature and
clock-event (throttle) reasons as the replays end (``gpu_state``: ``sm_mhz``, ``mem_mhz``, ``power_w``, ``temp_c``,
``clock_events``), to tell a slowed GPU from a slow step.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import csv
import functools
import gc
import itertools
import math
import os
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import transformers
from torch._inductor import config as inductor_config
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    StaticCache,
    cache_utils,
)
from transformers.cache_utils import StaticLayer
from transformers.masking_utils import sdpa_mask

from oscar_hf import (
    ModelShape,
    OscarRotations,
    absorb_latent_rotation,
    absorb_value_rotation,
    cache_kwargs,
    overlapped_sample,
)
from oscar_hf.cache import cache_nbytes
from oscar_hf.cache.hybrid import state_bytes
from oscar_hf.codebooks import CENTROIDS, KeyCodebook
from oscar_hf.evaluation.environment import GIB, GPU_STATE, device_slug, environment, gpu_state
from oscar_hf.evaluation.methods import METHODS, Method, make_cache
from oscar_hf.generation import deferred_stop_check
from oscar_hf.parallel import TensorParallel

TUNING_TIMERS = ("steady", "inductor")  # --tuning-timer: how inductor's kernel tuning times a candidate config
TUNING_LEAD_CYCLES = 400_000  # the GPU's spin before each call the steady timer times (~200 µs at 2 GHz)
TUNING_CALLS = 100  # calls the steady timer times per candidate config (the fastest counts)
START = time.perf_counter()
KERNEL_CALLS = 5  # profiled replays of the compiled forward (--kernels)

_8B = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
           max_position_embeddings=262144)  # above every T benchmarked (it does not change any shape)
_TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2,
             intermediate_size=256, vocab_size=512, max_position_embeddings=4096)
MODELS = {  # name: (transformers config class, its fields)
    "qwen3-8b": ("Qwen3Config", dict(_8B, num_hidden_layers=36, intermediate_size=12288, vocab_size=151936,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "llama3.1-8b": ("LlamaConfig", dict(_8B, num_hidden_layers=32, intermediate_size=14336, vocab_size=128256,
                                        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192})),
    # Qwen3-Next-80B-A3B's attention and Gated DeltaNet layers (3 of every 4 linear), with 64 experts of its 512 so
    # that the random weights fit one GPU: the cache's shapes are the model's
    "qwen3-next-80b-a3b-e64": ("Qwen3NextConfig", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=64, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, intermediate_size=5120, vocab_size=151936,
        max_position_embeddings=262144)),
    # DeepSeek-V2-Lite: multi-head latent attention (latent 512, RoPE key 64)
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=10944,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=102400, max_position_embeddings=262144)),
    # DeepSeek-V3 / Kimi-K2's attention (128 heads, latent 512 + RoPE key 64, query rank 1536) in 8 layers, the MoE
    # layers with 16 of its 256 experts, so that the random weights fit one GPU: the cache's shapes per layer are the
    # model's
    "deepseek-v3-l8": ("DeepseekV3Config", dict(
        hidden_size=7168, num_hidden_layers=8, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=8,
        first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=129280, max_position_embeddings=262144)),
    "qwen3-tiny": ("Qwen3Config", _TINY),
    "qwen3-next-tiny": ("Qwen3NextConfig", dict(_TINY, num_hidden_layers=4, linear_num_key_heads=2,
                                                linear_num_value_heads=4, linear_key_head_dim=32,
                                                linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=64, shared_expert_intermediate_size=64)),
    "deepseek-v2-tiny": ("DeepseekV2Config", dict({k: v for k, v in _TINY.items() if k != "head_dim"},
                                                  num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None,
                                                  qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                                  moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                                                  first_k_dense_replace=1, n_group=1, topk_group=1)),
    "llama-tiny": ("LlamaConfig", _TINY),
}


@dataclass(frozen=True)
class Profile:
    """Settings of a run: the grid, the steps, and sizes that scale with the models."""

    models: tuple[str, ...]
    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    steps: int  # timed decode steps
    warmup: int  # decode steps before them
    max_batch: int  # where the capacity search stops
    prefill_chunk: int  # prefill_chunk_size of the retry when an unchunked prefill runs out of memory
    fill_chunk_bytes: int  # K+V bytes per cache.update when filling a cache
    budget_s: float  # no case starts later than this, counted from the end of the imports (~15 s on a GPU host)
    gpus: int = 1  # the model's layers split evenly over this many GPUs (accelerate.dispatch_model)
    tp: int = 1  # tensor-parallel over this many GPUs (tp_plan="auto", one torchrun process each)
    capacity: bool = True  # run the capacity search
    prefill: bool = True  # run the prefill cases
    kernels: int = 0  # print this many of the compiled forward's longest kernels (0: none)
    decodings: tuple[str, ...] = ("generate",)  # keys of DECODINGS, each case run with each


# warm-up 5: OSCAR's fourth decode step carries a one-time cost (0.8-2.2 ms, like compiling), so it is not timed
FULL = Profile(("qwen3-8b", "llama3.1-8b"), (4096, 32768, 131072), (1, 8, 32), steps=16, warmup=5, max_batch=512,
               prefill_chunk=16384, fill_chunk_bytes=256 << 20, budget_s=460)
SMOKE = Profile(("qwen3-tiny", "llama-tiny"), (128, 512), (1, 4), steps=4, warmup=2, max_batch=6,
                prefill_chunk=256, fill_chunk_bytes=64 << 10, budget_s=math.inf)


GQA_ATTENTION = "sdpa_gqa"


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``query [B, Hq, q, D]``, ``key``/``value [B, Hkv, T, D]`` → ``([B, q, Hq, D], None)``: SDPA with
    ``enable_gqa`` and the bool mask (causal without one, as transformers' sdpa attention)."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         is_causal=attention_mask is None and query.shape[2] > 1, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GQA_ATTENTION, sdpa_gqa_attention)
AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)


class UndoableStaticLayer(StaticLayer):
    """transformers' StaticLayer, croppable: its length is a device counter and the rows past it are masked and
    then overwritten, so removing the newest tokens is lowering the counter (no host synchronisation)."""

    is_croppable = True

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            self.cumulative_length.add_(tokens_to_remove)  # transformers passes a negative count


def undoable_static_cache(model: torch.nn.Module, tokens: int) -> StaticCache:
    """``StaticCache(config=model.config, max_cache_len=tokens)`` with UndoableStaticLayer layers in place of its
    full-attention ones (a hybrid's linear-attention layers kept as they are)."""
    cache = StaticCache(config=model.config, max_cache_len=tokens)
    states = getattr(cache_utils, "LinearAttentionLayer", ())
    if any(type(layer) is not StaticLayer and not isinstance(layer, states) for layer in cache.layers):
        raise ValueError("undoable_static_cache serves full-attention layers and linear-attention states only")
    cache.layers = [layer if isinstance(layer, states) else UndoableStaticLayer(max_cache_len=tokens)
                    for layer in cache.layers]
    return cache


VARIANTS = {  # ways to run a registry method that only the benchmark has (the module docstring says more)
    "absorbed": "R_V folded into v_proj and o_proj, or the latent rotation into kv_b_proj (calibrated methods)",
    "compiled": "static buffers, so that generate compiles the decode forward (not for QuantizedCache)",
    "gqa": "SDPA's own grouped-query attention under the mask (caches that transformers' attention reads)",
}


def standin_codebooks(bundle: OscarRotations, bits: int, device) -> list[KeyCodebook]:
    """Random key codebooks of ``bits`` bits for every layer of ``bundle`` (identity basis, unit weights): a
    codebook's values do not change the timings."""
    generator = torch.Generator().manual_seed(0)
    books = []
    for dim in bundle.head_dims:
        sub = 8 // bits
        books.append(KeyCodebook(torch.randn(1, dim // sub, CENTROIDS, sub, generator=generator),
                                 torch.eye(dim)[None], torch.ones(1, dim)).to(device))
    return books


@dataclass(frozen=True)
class BenchMethod:
    """A method of the registry (``oscar_hf.evaluation.METHODS``) and the VARIANTS it runs with; ``name``,
    ``<method>[+variant...]`` with the variants in VARIANTS order, is what a row's "method" column says."""

    method: Method
    variants: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, spec: str) -> "BenchMethod":
        """``"oscar-k4+compiled"`` → BenchMethod; ValueError for an unknown method or variant, a variant the method
        cannot take, or a method the benchmark's stand-in bundle cannot serve."""
        name, *variants = spec.split("+")
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r} in {spec!r}; the registry's: {', '.join(METHODS)}")
        method, unknown = METHODS[name], sorted(set(variants) - set(VARIANTS))
        if unknown:
            raise ValueError(f"unknown variant(s) {unknown} in {spec!r}; known: {', '.join(VARIANTS)}")
        if method.needs_diagnostics:
            raise ValueError(f"{spec}: {name} needs a calibrated bundle's diagnostics, which the benchmark's stand-in "
                             "bundle (Hadamard rotations on random weights) does not have")
        if "compiled" in variants and method.quantized_cache:
            raise ValueError(f"{spec}: transformers cannot compile its QuantizedCache")
        if "absorbed" in variants and not method.needs_calibration:
            raise ValueError(f"{spec}: absorbed folds a calibrated method's bundle into the model; {name} has none")
        if "gqa" in variants and method.is_oscar:
            raise ValueError(f"{spec}: gqa replaces transformers' sdpa attention, which an OSCAR cache does not use")
        return cls(method, frozenset(variants))

    @property
    def name(self) -> str:
        return "+".join([self.method.name, *(v for v in VARIANTS if v in self.variants)])

    @property
    def attention(self) -> str:
        """The attn_implementation the model needs with this cache."""
        if self.method.is_oscar:
            return "oscar"
        return GQA_ATTENTION if "gqa" in self.variants else "sdpa"

    @property
    def chunked_fill(self) -> bool:
        """False for QuantizedCache, which re-quantizes everything per update: it is filled by one update per layer."""
        return self.method.quantized_cache is None

    def installed(self) -> bool:
        """Whether the method's optional package imports (else its rows say "not-installed")."""
        return self.method.installed()

    def make(self, model: torch.nn.Module, tokens: int):
        """An empty cache with room for ``tokens`` tokens: the registry's (``make_cache``), the calibrated methods'
        with a Hadamard bundle (absorbed into the model first for ``absorbed``), static for ``compiled``."""
        static = "compiled" in self.variants
        if static and not self.method.is_oscar:  # the registry's bf16, allocated up front
            return undoable_static_cache(model, tokens)
        bundle = None
        if self.method.needs_calibration:
            bundle = OscarRotations.hadamard(model.config)
            if self.method.key_codebook_bits is not None:
                bundle.key_codebooks = {self.method.key_codebook_bits: standin_codebooks(
                    bundle, self.method.key_codebook_bits, model.device)}
            if "absorbed" in self.variants:  # random weights stay random weights of the same shapes
                if ModelShape.from_config(model.config).latent is None:
                    bundle = absorb_value_rotation(model, bundle)
                else:  # folded once per model: its config then says so, and a second fold is refused
                    if id(model) not in LATENT_BUNDLES:
                        LATENT_BUNDLES[id(model)] = absorb_latent_rotation(model, bundle)
                    bundle = LATENT_BUNDLES[id(model)]
        return make_cache(self.method, model, bundle, max_cache_len=tokens if static else None)

    def bits(self, shape: ModelShape, tokens: int) -> float:
        """Stored bits per K/V element at ``tokens`` tokens, at least (the memory pre-check; bf16 models)."""
        if self.method.quantized_cache:
            return self.method.config["bits"]
        if not self.method.is_oscar:
            return 16
        return self.method.oscar_config(None, min(shape.head_dims)).bits_per_element(min(shape.head_dims), tokens)


LATENT_BUNDLES: dict[int, OscarRotations] = {}  # id(model): the bundle its latent absorption returned
DEFAULT_METHODS = ("oscar", "oscar+compiled", "oscar+absorbed+compiled", "oscar-k4+compiled", "bf16", "bf16+compiled",
                   "bf16+compiled+gqa", "quanto-int2", "hqq-int2")
CAPACITY_METHODS = ("oscar", "bf16")
DECODINGS = {"generate": None, "overlapped": overlapped_sample}  # name: generate's custom_generate

COLUMNS = ["model", "method", "kind", "tp", "T", "batch", "decoding", "prefill_s", "prefill_chunk", "decode_tok_s",
           "ms_per_step", "ms_per_step_median", "ms_per_step_max", "forward_ms", "compile_s", "fill_s", "generate_s",
           "compiled", "graphs", "base_mem_gb", "peak_mem_gb", "cache_gb", "state_gb", "stop_check", "gc_ms",
           *GPU_STATE,
           "status", "prefill_status"]
TABLE = ["model", "method", "kind", "tp", "T", "batch", "decoding", "prefill_s", "decode_tok_s", "ms_per_step",
         "forward_ms", "compile_s", "peak_mem_gb", "cache_gb", "status"]
LOG: list[str] = []


def is_main() -> bool:
    """Whether this process reports (the only one, or tensor-parallel rank 0)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def say(line: str) -> None:
    """Print a progress line now, and keep it for the .log file (rank 0 only under --tp)."""
    if is_main():
        print(line, flush=True)
        LOG.append(line)


# ------------------------------------------------------------------------------------------------ setup
def build_model(name: str, device: torch.device, gpus: int = 1, tp: int = 1) -> torch.nn.Module:
    """A random-weight bf16 ``MODELS[name]``, initialized directly on ``device``, in eval mode; with ``gpus > 1``
    its decoder layers are then split evenly over GPUs 0..gpus-1 (embeddings on the first, norm and LM head on the
    last), as ``device_map`` would place them; with ``tp > 1``, tensor-parallel (``tp_plan="auto"``: module
    docstring)."""
    config_class, fields = MODELS[name]
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(0)
    if tp > 1:
        model = tensor_parallel_model(name, config)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if not model._supports_logits_to_keep():
        raise RuntimeError(f"{name}: forward takes no logits_to_keep, so generate would compute logits over the prompt")
    model.generation_config.pad_token_id = 0
    if gpus > 1:
        from accelerate import dispatch_model

        model = dispatch_model(model, device_map=split_map(config.num_hidden_layers, gpus))
    return model.eval()


def tensor_parallel_model(name: str, config) -> torch.nn.Module:
    """``config``'s model loaded with ``tp_plan="auto"`` from a folder of this rank holding the config and a
    weights file with no tensors: transformers initializes every shard where it lives (no 16 GB checkpoint to write
    and read)."""
    from safetensors.torch import save_file

    if ModelShape.from_config(config).latent is not None:
        raise ValueError(f"{name}: transformers' tensor-parallel plans do not split multi-head latent attention")
    folder = Path(tempfile.gettempdir()) / f"bench-generate-{name}-rank{os.environ.get('RANK', '0')}"
    folder.mkdir(exist_ok=True)
    config.save_pretrained(folder)
    save_file({}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its load report lists every weight as missing, as intended
    try:
        return AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.bfloat16,
                                                    attn_implementation="sdpa")
    finally:
        transformers.logging.set_verbosity(verbosity)


def local_shape(model: torch.nn.Module) -> ModelShape:
    """The model's shape with the KV heads this process holds (a 1/N share of each layer's under --tp N)."""
    shape, tp = ModelShape.from_config(model.config), TensorParallel.of(model)
    return shape if tp is None else replace(shape, kv_heads=tuple(h // tp.size for h in shape.kv_heads))


def split_map(layers: int, gpus: int) -> dict[str, int]:
    """A device_map with the decoder layers split evenly over GPUs 0..gpus-1 in order, the embeddings on the first,
    the final norm, rotary embedding and LM head on the last."""
    last = gpus - 1
    return {"model.embed_tokens": 0, **{f"model.layers.{i}": i * gpus // layers for i in range(layers)},
            "model.norm": last, "model.rotary_emb": last, "lm_head": last}


def layer_devices(model: torch.nn.Module) -> list[torch.device]:
    """The device of each decoder layer's weights."""
    return [next(layer.parameters()).device for layer in model.model.layers]


def cuda_devices(model: torch.nn.Module) -> set[torch.device]:
    return {d for d in layer_devices(model) if d.type == "cuda"}


def memory_gib(model: torch.nn.Module, stat: Callable[[torch.device], int]) -> float | None:
    """``stat`` (bytes of a device: torch.cuda.memory_allocated, ...) summed over the model's GPUs, in GiB (None on
    the CPU)."""
    devices = cuda_devices(model)
    return sum(stat(d) for d in devices) / GIB if devices else None


def free_gib(model: torch.nn.Module) -> float:
    return memory_gib(model, lambda d: torch.cuda.mem_get_info(d)[0])


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_time(profile: Profile) -> bool:
    return any_rank(time.perf_counter() - START > profile.budget_s)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any tensor-parallel rank: every rank must take the same branch around a generate,
    whose collectives would otherwise wait for a rank that skipped it."""
    if not torch.distributed.is_initialized():
        return flag
    vote = torch.tensor([int(flag)], device="cuda" if torch.cuda.is_available() else "cpu")
    torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MAX)
    return bool(vote.item())


# ----------------------------------------------------------------------------------------------- timing
def timestamp(device: torch.device | None):
    """A point in time without synchronizing: a CUDA event recorded on the current stream, or the host clock (on the
    CPU, and for None: a model split over several GPUs, after synchronizing them all)."""
    if device is None:
        for index in range(torch.cuda.device_count()):
            torch.cuda.synchronize(index)
        return time.perf_counter()
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def steady_tuning_timer() -> None:
    """Make inductor time each candidate config it tunes (coordinate descent) behind a GPU spin, after a read of twice
    L2's size. Inductor's own timer zero-fills a buffer of L2's size before each call, leaving dirty lines, and counts
    the fastest call; its timings of one config vary from process to process, so that processes tune the forward's
    kernels differently and the same code's forward time varies by up to 11% (H100, Qwen3-8B at 128K). With this timer
    a config's timings agree between processes within ±2.4% (10th to 90th percentile). Each timed call waits behind a
    spin of ``TUNING_LEAD_CYCLES`` (the host has queued it by then), after the read (clean lines, as the forward's
    weight streams leave them); the fastest of ``TUNING_CALLS`` counts. Calls with another ``return_mode`` or
    ``quantiles`` keep inductor's timer."""
    from torch._inductor.runtime import benchmarking

    timer = type(benchmarking.benchmarker)
    stock = timer.benchmark_gpu

    def benchmark_gpu(self, fn, *args, **kwargs):
        if args or kwargs.get("return_mode", "min") != "min" or "quantiles" in kwargs:
            return stock(self, fn, *args, **kwargs)
        flush = torch.ones(torch.cuda.get_device_properties().L2_cache_size // 2, dtype=torch.int32, device="cuda")
        fn()
        event = functools.partial(torch.cuda.Event, enable_timing=True)
        pairs = [(event(), event()) for _ in range(TUNING_CALLS)]
        for start, end in pairs:
            flush.amax()
            torch.cuda._sleep(TUNING_LEAD_CYCLES)
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return min(start.elapsed_time(end) for start, end in pairs)

    timer.benchmark_gpu = benchmark_gpu


def clock_device(model: torch.nn.Module) -> torch.device | None:
    """The device whose events time ``model``'s steps, or None when its layers span several GPUs."""
    return model.device if len(set(layer_devices(model))) == 1 else None


def seconds(start, stop) -> float:
    """Seconds between two timestamps (waits for the later CUDA event)."""
    if isinstance(start, float):
        return stop - start
    stop.synchronize()
    return start.elapsed_time(stop) / 1e3


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class StepClock(LogitsProcessor):
    """Passed to generate: after each forward pass, a timestamp, the host's clock and the number of compiled graphs
    so far, and (on the device, without synchronizing) whether every score so far was below +inf, NaN excluded (-inf
    is how other logits processors mask tokens)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks, self.graphs, self.host = [], [], []
        self.finite = torch.ones((), dtype=torch.bool, device=device)  # (device None: the CPU)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.finite &= (scores < math.inf).all().to(self.finite.device)
        self.marks.append(timestamp(self.device))
        self.host.append(time.perf_counter())
        self.graphs.append(compiled_graphs())
        return scores

    def check(self, steps: int) -> None:
        if len(self.marks) != steps:
            raise RuntimeError(f"generate ran {len(self.marks)} steps instead of {steps}")
        if not self.finite.item():
            raise RuntimeError("NaN or +inf logits")


class GcPauses:
    """Python's garbage collections during a ``with`` block (``gc.callbacks``): ``(generation, host start, ms)``."""

    def __init__(self):
        self.pauses, self._start = [], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], self._start, 1e3 * (time.perf_counter() - self._start)))

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


class ForwardRecorder:
    """Stands in for generate's compiled forward (``model._compiled_call``) and keeps the arguments of its last call,
    so that the compiled decode step can be replayed without generate's loop around it."""

    def __init__(self, forward: Callable):
        self.forward, self.kwargs = forward, None

    def __call__(self, **kwargs):
        self.kwargs = kwargs
        return self.forward(**kwargs)


@contextlib.contextmanager
def recorded_forward(model: torch.nn.Module, compiled: bool):
    """Yields a ForwardRecorder installed as the compiled forward that generate will call, or None when generate
    does not compile (or this transformers keeps it elsewhere)."""
    if not compiled:
        yield None
        return
    model.get_compiled_call(model.generation_config.compile_config)
    if not hasattr(model, "_compiled_call"):
        yield None
        return
    recorder = model._compiled_call = ForwardRecorder(model._compiled_call)
    try:
        yield recorder
    finally:
        model._compiled_call = recorder.forward


@torch.no_grad()  # as generate: grad mode is part of the compiled graphs' guards
def replay_ms(recorder: ForwardRecorder, steps: int, device: torch.device) -> float:
    """ms per call of the recorded forward, called ``steps`` times back to back after one untimed call (one CUDA
    graph replay each for the compiled methods: the decode step without generate's host work between steps)."""
    recorder.forward(**recorder.kwargs)
    start = timestamp(device)
    for _ in range(steps):
        recorder.forward(**recorder.kwargs)
    return 1e3 * seconds(start, timestamp(device)) / steps


def busy_spans(kernels: list[tuple[str, float, float]]) -> list[list]:
    """The union of the kernels' intervals (``kernels``: ``(name, start, end)``) as ``[start, end, name]`` spans in
    order, each named after the kernel that starts it."""
    busy = []
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end, name])
    return busy


def critical_path_us(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """Each kernel's share of the GPU's wall time, by name: ``kernels`` are ``(name, start, end)``; walking them by end
    time, a kernel is charged the busy time (some kernel running) between the latest end before it and its own end,
    and the gaps where no kernel runs are charged to "(idle)". A kernel launched early that waits for its predecessor
    is so charged from that predecessor's end; the charges sum to the span from the first start to the last end."""
    busy = busy_spans(kernels)
    charged: dict[str, float] = {}
    covered = busy[0][0] if busy else 0.0
    for name, _, end in sorted(kernels, key=lambda k: k[2]):
        added = sum(max(0.0, min(hi, end) - max(lo, covered)) for lo, hi, _ in busy)
        charged[name] = charged.get(name, 0.0) + added
        covered = max(covered, end)
    if len(busy) > 1:
        charged["(idle)"] = sum(gap for _, gap in _gaps(busy))
    return charged


def _gaps(busy: list[list]) -> list[tuple[str, float]]:
    """``(name of the span after it, length)`` of each gap between the :func:`busy_spans` ``busy``."""
    return [(name, lo - hi) for (_, hi, _), (lo, _, name) in zip(busy, busy[1:])]


def idle_before_us(kernels: list[tuple[str, float, float]]) -> dict[str, float]:
    """The gaps where no kernel runs, summed by the name of the kernel whose start ends each gap (``kernels``:
    ``(name, start, end)``): which launches leave the GPU idle."""
    idle: dict[str, float] = {}
    for name, gap in _gaps(busy_spans(kernels)):
        idle[name] = idle.get(name, 0.0) + gap
    return idle


@torch.no_grad()
def kernel_times(recorder: ForwardRecorder, top: int, device: torch.device, calls: int = KERNEL_CALLS) -> list[str]:
    """Lines for the log: time per call of the recorded forward, in all and for its ``top`` longest kernels
    (torch.profiler over ``calls`` more replays; GPU time of CUDA kernels, or self CPU time of ops on the CPU; a
    kernel launched n times per forward is one row, "x n"). Kernel times are summed, so kernels that overlap
    (stage 2 of the decode launches early and waits for stage 1) count twice; on CUDA each row also gives the
    kernel's time on the critical path (:func:`critical_path_us`), whose rows and idle gaps sum to the replays'
    span."""
    cuda = device.type == "cuda"
    with torch.profiler.profile(activities=[getattr(torch.profiler.ProfilerActivity, "CUDA" if cuda else "CPU")]) as p:
        for _ in range(calls):
            recorder.forward(**recorder.kwargs)
        if cuda:
            torch.cuda.synchronize(device)
    time_us = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in p.key_averages() if time_us(e) > 0), key=lambda e: -time_us(e))
    total = sum(map(time_us, events)) / calls / 1e3
    if not cuda:
        lines = [f"    CPU time per forward {total:.3f} ms in {sum(e.count for e in events) // calls} ops; longest:"]
        return lines + [f"    {time_us(e) / calls / 1e3:8.3f} ms x{e.count // calls:4d}  {e.key[:100]}"
                        for e in events[:top]]
    intervals = [(e.name, e.time_range.start, e.time_range.end) for e in p.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0]
    critical = critical_path_us(intervals)
    span = sum(critical.values()) / calls / 1e3
    lines = [f"    GPU time per forward {total:.3f} ms summed over {sum(e.count for e in events) // calls} kernels "
             f"(kernels that run at once, as the decode's stages do, count twice); {span:.3f} ms per forward from "
             f"the first kernel's start to the last one's end over the {calls} replays, idle gaps included (critical "
             f"path: each kernel charged the time its end adds past the ends before it); longest, summed / critical:"]
    lines += [f"    {time_us(e) / calls / 1e3:8.3f} / {critical.get(e.key, 0.0) / calls / 1e3:6.3f} ms "
              f"x{e.count // calls:4d}  {e.key[:100]}" for e in events[:top]]
    if "(idle)" in critical:
        lines.append(f"    {'':8s}   {critical['(idle)'] / calls / 1e3:6.3f} ms        (idle: no kernel running), "
                     "the most before:")
        idle = sorted(idle_before_us(intervals).items(), key=lambda kv: -kv[1])
        lines += [f"    {'':8s}   {gap / calls / 1e3:6.3f} ms        {name[:100]}" for name, gap in idle[:top]]
    return lines


@contextlib.contextmanager
def lm_head_positions(model: torch.nn.Module):
    """Yields a list that receives, for every call of the LM head, the number of positions it computed."""
    positions = []
    handle = model.get_output_embeddings().register_forward_hook(lambda mod, args, out: positions.append(out.shape[-2]))
    try:
        yield positions
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------------ cases
def check_length(cache, expected: int) -> None:
    length = int(cache.get_seq_length())
    if length != expected:
        raise RuntimeError(f"the cache holds {length} tokens, expected {expected}")


def kv_shapes(shape: ModelShape, layer: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(heads, channels) of what ``layer`` hands ``cache.update`` as K and as V: its K/V, a latent attention layer's
    latent and RoPE key; None where it caches none (linear attention, state-space, KV-sharing or MLP layers)."""
    if not shape.reads_own_kv(layer) or shape.attention(layer) is None:
        return None
    if shape.latent is not None:
        return (1, shape.latent[0]), (1, shape.latent[1])
    return ((shape.kv_heads[layer], shape.head_dims[layer]),) * 2


def kv_elements(shape: ModelShape, layer: int) -> int:
    """K/V elements ``layer`` caches per token and sequence."""
    shapes = kv_shapes(shape, layer)
    return 0 if shapes is None else sum(h * d for h, d in shapes)


@torch.no_grad()
def fill_cache(cache, shape: ModelShape, batch: int, tokens: int, chunk_bytes: int | None,
               devices: list[torch.device]):
    """Write ``tokens`` tokens of random bf16 K/V into every layer that caches K/V (on ``devices[layer]``) through
    ``cache.update``, chunk by chunk with all layers per chunk, as a chunked prefill would (``chunk_bytes`` None: one
    chunk). One random chunk per device and shape is reused: values do not change timings. (Linear-attention and
    state-space layers start their states at the first generated token.)"""
    per_token = batch * 2 * max(kv_elements(shape, layer) for layer in range(shape.num_layers))
    chunk = tokens if chunk_bytes is None else max(1, min(tokens, chunk_bytes // per_token))
    random = {}

    def states(layer: int, side: int) -> torch.Tensor:
        heads, dim = kv_shapes(shape, layer)[side]
        key = (devices[layer], side, heads, dim)
        if key not in random:
            random[key] = torch.randn(batch, heads, chunk, dim, dtype=torch.bfloat16, device=devices[layer])
        return random[key]

    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        for layer in range(shape.num_layers):
            if kv_shapes(shape, layer) is not None:
                cache.update(states(layer, 0)[:, :, :n], states(layer, 1)[:, :, :n], layer)


def random_ids(model: torch.nn.Module, batch: int, tokens: int) -> torch.Tensor:
    """Random token ids, the same on every tensor-parallel rank (which must run the same inputs)."""
    generator = torch.Generator().manual_seed(batch * 1_000_003 + tokens)
    return torch.randint(model.config.vocab_size, (batch, tokens), generator=generator).to(model.device)


def measure_decode(model: torch.nn.Module, method: BenchMethod, length: int, batch: int, profile: Profile,
                   decoding: str) -> dict:
    """Fill a fresh ``method`` cache with ``length`` tokens at ``batch``, then time generate's decode steps over it
    (with ``DECODINGS[decoding]`` as its custom_generate)."""
    device, shape = clock_device(model), local_shape(model)
    new_tokens = profile.warmup + profile.steps + 1
    base = memory_gib(model, torch.cuda.memory_allocated)
    replays = profile.steps + 1 + (KERNEL_CALLS if profile.kernels else 0)
    cache = method.make(model, length + new_tokens + replays)  # room for the replays
    start = timestamp(device)
    fill_cache(cache, shape, batch, length, profile.fill_chunk_bytes if method.chunked_fill else None,
               layer_devices(model))
    fill_s = seconds(start, timestamp(device))
    check_length(cache, length)
    ids = random_ids(model, batch, length + 1)
    clock = StepClock(device)
    # transformers 5.24 names generate's cache "cache" (before: "past_key_values")
    compiled = model._valid_auto_compile_criteria({"cache": cache, "past_key_values": cache}, model.generation_config)
    graphs = compiled_graphs()
    for d in cuda_devices(model):
        torch.cuda.reset_peak_memory_stats(d)
    # overlapped_sample's own rule for a cache that generate returns (the one passed in)
    deferred = DECODINGS[decoding] is overlapped_sample and deferred_stop_check().is_supported(
        ids.device, cache, cache_is_returned=True, is_assistant=False)
    with recorded_forward(model, compiled) as recorder, GcPauses() as collections:
        start = timestamp(device)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList([clock]),
                             custom_generate=DECODINGS[decoding])
        generate_s = seconds(start, timestamp(device))
        clock.check(new_tokens)
        check_length(cache, length + new_tokens)
        peak = memory_gib(model, torch.cuda.max_memory_allocated)
        forward_ms = replay_ms(recorder, profile.steps, device) if recorder and recorder.kwargs else None
        if profile.kernels and forward_ms is not None:
            for line in kernel_times(recorder, profile.kernels, device):
                say(line)
        clocks = gpu_state(device) if device is not None else {}  # sampled as the replays end: was the GPU slowed?
    if out.shape != (batch, length + 1 + new_tokens):
        raise RuntimeError(f"generate returned {tuple(out.shape)}")
    timed_s = seconds(clock.marks[profile.warmup], clock.marks[-1])
    step_s = timed_s / profile.steps
    timed = clock.marks[profile.warmup:]
    in_order = [1e3 * seconds(a, b) for a, b in zip(timed, timed[1:])]
    steps_ms = sorted(in_order)
    # collections that can delay a timed step: between the host's last warm-up mark and its last mark
    pauses = [(generation, bisect.bisect(clock.host, begin), ms) for generation, begin, ms in collections.pauses
              if clock.host[profile.warmup - 1] < begin < clock.host[-1]]
    say(f"    steps {profile.warmup + 1} to {len(clock.marks) - 1} (ms): {' '.join(f'{ms:.3f}' for ms in in_order)}; "
        "garbage collections meanwhile: "
        + (", ".join(f"generation {g} {ms:.2f} ms after step {i - 1}" for g, i, ms in pauses) or "none"))
    result = {"decode_tok_s": batch * profile.steps / timed_s, "ms_per_step": 1e3 * step_s,
              "ms_per_step_median": statistics.median(steps_ms), "ms_per_step_max": steps_ms[-1],
              "forward_ms": forward_ms,
              "compile_s": max(0.0, seconds(clock.marks[0], clock.marks[profile.warmup]) - profile.warmup * step_s),
              "fill_s": fill_s, "generate_s": generate_s, "compiled": compiled,
              "graphs": clock.graphs[-1] - graphs, "cache_gb": cache_nbytes(cache) / GIB,
              "state_gb": sum(map(state_bytes, cache.layers)) / GIB,
              "stop_check": "deferred" if deferred else "every step",
              "gc_ms": sum(ms for *_, ms in pauses),
              "base_mem_gb": base, "peak_mem_gb": peak, **clocks}
    if compiled_graphs() != clock.graphs[profile.warmup]:
        result["status"] = "error: torch.compile compiled during the timed steps or replays (raise --warmup)"
    return result


def measure_prefill(model: torch.nn.Module, method: BenchMethod, length: int, batch: int, chunk: int | None) -> dict:
    """Time a real eager prefill: ``generate(max_new_tokens=1)`` over ``length`` random tokens, chunked if ``chunk``."""
    device = clock_device(model)
    cache = method.make(model, length + 1)
    ids = random_ids(model, batch, length)
    clock = StepClock(device)
    with lm_head_positions(model) as positions:
        start = timestamp(device)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, cache),
                       max_new_tokens=1, min_new_tokens=1, do_sample=False, prefill_chunk_size=chunk,
                       disable_compile=True, logits_processor=LogitsProcessorList([clock]))
    prefill_s = seconds(start, clock.marks[0])
    clock.check(1)
    check_length(cache, length)
    if set(positions) != {1}:
        raise RuntimeError(f"the LM head computed {max(positions)} positions in one forward, not 1 (logits_to_keep)")
    return {"prefill_s": prefill_s, "prefill_chunk": chunk or 0}


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}" + (f": {lines[0][:200]}" if lines else "")


def attempt(fn: Callable, *args) -> dict:
    """``{"status": "ok", **fn(*args)}``, or only a status ("oom", "error: ...") if it raises; frees memory after."""
    try:
        return {"status": "ok", **fn(*args)}
    except Exception as exc:  # one failing case must not end the run
        if is_oom(exc):
            return {"status": "oom"}
        traceback.print_exc()
        return {"status": describe(exc)}
    finally:
        free_memory()


def use_attention(model: torch.nn.Module, method: BenchMethod) -> None:
    if model.config._attn_implementation != method.attention:
        model.set_attn_implementation(method.attention)


def decode_case(model: torch.nn.Module, method: BenchMethod, length: int, batch: int, profile: Profile,
                decoding: str) -> dict:
    """One decode row: measured, or why not (not installed, time budget, a cache larger than the free memory)."""
    if not method.installed():
        return {"status": "not-installed"}
    if out_of_time(profile):
        return {"status": "skipped: time budget"}
    if model.device.type == "cuda":
        shape = local_shape(model)
        elements = sum(kv_elements(shape, layer) for layer in range(shape.num_layers)) * length * batch
        needed, free = method.bits(shape, length) * elements / 8 / GIB, free_gib(model)
        if any_rank(needed > free):
            return {"status": f"oom (the cache needs {needed:.1f} GiB, {free:.1f} GiB free)"}
    return attempt(measure_decode, model, method, length, batch, profile, decoding)


def prefill_case(model: torch.nn.Module, method: BenchMethod, length: int, batch: int, profile: Profile) -> dict:
    """Prefill columns: unchunked, or chunked by ``profile.prefill_chunk`` if that runs out of memory."""
    if out_of_time(profile):
        return {"prefill_status": "skipped: time budget"}
    result = attempt(measure_prefill, model, method, length, batch, None)
    if result["status"] == "oom" and length > profile.prefill_chunk:
        result = attempt(measure_prefill, model, method, length, batch, profile.prefill_chunk)
    return {"prefill_s": result.get("prefill_s"), "prefill_chunk": result.get("prefill_chunk"),
            "prefill_status": result["status"]}


def capacity_case(model: torch.nn.Module, method: BenchMethod, length: int, profile: Profile) -> dict:
    """The largest batch at ``length`` tokens whose fill and decode fit: a batch-1 run gives the memory per sequence,
    then batches are tried one by one up from the batch it predicts while they fit (or down until one fits)."""
    decoding = profile.decodings[0]
    tried = {1: decode_case(model, method, length, 1, profile, decoding)}
    if tried[1]["status"] != "ok":
        return {"batch": 1, **tried[1]}
    batch = profile.max_batch
    if tried[1]["peak_mem_gb"] is not None:
        per_sequence = tried[1]["peak_mem_gb"] - tried[1]["base_mem_gb"]
        batch = min(batch, max(1, int(free_gib(model) // per_sequence)))
    while 1 <= batch <= profile.max_batch and not out_of_time(profile):
        if batch not in tried:
            tried[batch] = attempt(measure_decode, model, method, length, batch, profile, decoding)
            say(f"    capacity {method.name} T={length} B={batch}: {tried[batch]['status']}")
        batch += 1 if tried[batch]["status"] == "ok" else -1
        if batch in tried:
            break
    best = max(b for b, result in tried.items() if result["status"] == "ok")
    if best == profile.max_batch:
        limit = "the largest batch searched"
    else:
        limit = f"batch {best + 1}: " + (tried[best + 1]["status"] if best + 1 in tried else "not tried, time budget")
    return {**tried[best], "batch": best, "decoding": decoding, "status": f"ok ({limit})"}


# ------------------------------------------------------------------------------------------------- runs
def prefill_cases(profile: Profile) -> list[tuple[int, int]]:
    """(T, batch) of the prefill runs: the smallest grid batch (1) at every T, the second one (8) at the shortest T."""
    batches, lengths = sorted(profile.batches), sorted(profile.lengths)
    return [(length, batches[0]) for length in lengths] + [(lengths[0], batch) for batch in batches[1:2]]


DECODE_FIELDS = ("decode_tok_s", "ms_per_step", "ms_per_step_median", "ms_per_step_max", "forward_ms", "compile_s",
                 "graphs", "fill_s", "peak_mem_gb", "cache_gb", "gc_ms", *GPU_STATE, "status")
PREFILL_FIELDS = ("prefill_s", "prefill_chunk", "prefill_status")


def progress(row: dict, fields: tuple[str, ...]) -> None:
    values = " ".join(f"{k}={cell(row[k])}" for k in fields if row.get(k) is not None)
    say(f"[{time.perf_counter() - START:4.0f} s] {row['model']} {row['method']} {row['kind']} T={row['T']} "
        f"B={row['batch']} {row.get('decoding', '')}: {values}")


def bench_model(name: str, methods: list[BenchMethod], profile: Profile, device: torch.device) -> list[dict]:
    """Every row of one model: the decode grid (method by method, batch by batch, shortest T first, each decoding in
    turn over the same compiled graphs), prefill (in the first decoding's rows), capacity (with the first decoding).
    That puts the large batches last, and makes torch.compile build three graphs per model (static shapes; batch 1 and
    any T; any batch and T) where an order by cache size would make four."""
    start = time.perf_counter()
    model = build_model(name, device, profile.gpus, profile.tp)
    where = (f"{profile.gpus} GPUs" if profile.gpus > 1 else f"{profile.tp} GPUs, tensor-parallel" if profile.tp > 1
             else device)
    say(f"built {name} on {where} in {time.perf_counter() - start:.1f} s "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters)")
    grid = {}
    cases = sorted(itertools.product(profile.lengths, profile.batches), key=lambda case: (case[1], case[0]))
    for method in methods:
        use_attention(model, method)
        for (length, batch), decoding in itertools.product(cases, profile.decodings):
            row = {"model": name, "method": method.name, "kind": "grid", "T": length, "batch": batch,
                   "decoding": decoding, "tp": profile.tp}
            grid[method.name, length, batch, decoding] = row
            row.update(decode_case(model, method, length, batch, profile, decoding))
            progress(row, DECODE_FIELDS)
        torch.compiler.reset()  # drops compiled graphs and their CUDA-graph memory pools
        free_memory()
    for method in (m for m in methods if m.installed() and profile.prefill):
        use_attention(model, method)
        for length, batch in prefill_cases(profile):
            row = grid[method.name, length, batch, profile.decodings[0]]
            row.update(prefill_case(model, method, length, batch, profile))
            progress(row, PREFILL_FIELDS)
    capacity = []
    for method in (m for m in methods if m.name in CAPACITY_METHODS and profile.capacity):
        use_attention(model, method)
        length = max(profile.lengths)
        capacity.append({"model": name, "method": method.name, "kind": "capacity", "T": length,
                         **capacity_case(model, method, length, profile)})
        progress(capacity[-1], DECODE_FIELDS)
    return list(grid.values()) + capacity


# ------------------------------------------------------------------------------------------------ output
def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def table(rows: list[dict]) -> list[str]:
    cells = [TABLE] + [[cell(row.get(k)) for k in TABLE] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(TABLE))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in cells]


def plot(rows: list[dict], path: Path, profile: Profile, title: str) -> None:
    """Decode tok/s against T, one line per (model, method, decoding), one panel per batch (the smallest and the
    largest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({min(profile.batches), max(profile.batches)})
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, batch in zip(axes[0], panels):
        methods = dict.fromkeys(r["method"] for r in rows)  # one color each, in the order they ran
        lines = itertools.product(enumerate(profile.models), enumerate(methods), enumerate(profile.decodings))
        for (i, model), (j, method), (k, decoding) in lines:
            points = sorted((r["T"], r["decode_tok_s"]) for r in rows if r["kind"] == "grid" and r["batch"] == batch
                            and r["model"] == model and r["method"] == method and r["decoding"] == decoding
                            and r["status"] == "ok")
            if points:
                label = f"{model} {method}" + (f" {decoding}" if len(profile.decodings) > 1 else "")
                ax.plot(*zip(*points), ["-", "--", ":", "-."][i % 4], color=f"C{j}", marker="os^v"[k % 4],
                        label=label)
        ax.set(xscale="log", yscale="log", xlabel="prompt tokens T", ylabel="decode tokens/s", title=f"batch {batch}")
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(profile.lengths, [str(t) for t in profile.lengths])
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(rows: list[dict], env: dict, profile: Profile, out: Path, smoke: bool) -> None:
    """The CSV, the .log (progress and table) and the plot, named after the device."""
    out.mkdir(parents=True, exist_ok=True)
    slug = device_slug(env) + (f"-tp{profile.tp}" if profile.tp > 1 else "") + ("-smoke" if smoke else "")
    path = out / f"bench_generate_{slug}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS + list(env), extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**row, **env} for row in rows)
    for line in table(rows):
        say(line)
    skipped = sum("time budget" in str(row.get(k)) for row in rows for k in ("status", "prefill_status"))
    if skipped:
        say(f"{skipped} measurements were skipped by the time budget (--budget-s): run them with a smaller grid")
    plot(rows, path.with_suffix(".png"), profile, " ".join(f"{k}={v}" for k, v in env.items()))
    say(f"wrote {path} and its .log and .png ({time.perf_counter() - START:.0f} s in all)")
    path.with_suffix(".log").write_text("\n".join(LOG) + "\n")


def positive(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return int(text)


def ints(text: str) -> tuple[int, ...]:
    return tuple(positive(x) for x in text.split(","))


def names(known: dict) -> Callable:
    """An argparse type: a comma-separated list of keys of ``known``."""

    def parse(text: str) -> tuple[str, ...]:
        unknown = [name for name in text.split(",") if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {', '.join(known)}")
        return tuple(text.split(","))

    return parse


def bench_methods(text: str) -> tuple[BenchMethod, ...]:
    """An argparse type: comma-separated BenchMethod specs (duplicates dropped)."""
    try:
        methods = [BenchMethod.parse(spec) for spec in text.split(",")]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return tuple({m.name: m for m in methods}.values())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=names(MODELS), help=f"comma-separated, of {', '.join(MODELS)} "
                   f"(default {','.join(FULL.models)})")
    p.add_argument("--methods", type=bench_methods, default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated <method>[+variant...]: a method of oscar_hf.evaluation.METHODS "
                        f"({', '.join(METHODS)}) and variants of {', '.join(VARIANTS)} "
                        f"(default {','.join(DEFAULT_METHODS)})")
    p.add_argument("--lengths", type=ints, help=f"prompt tokens T (default {','.join(map(str, FULL.lengths))})")
    p.add_argument("--batches", type=ints, help=f"batch sizes (default {','.join(map(str, FULL.batches))})")
    p.add_argument("--steps", type=positive, help=f"timed decode steps (default {FULL.steps})")
    p.add_argument("--warmup", type=positive, help=f"decode steps before them (default {FULL.warmup})")
    p.add_argument("--budget-s", type=float, help=f"start no case after this many seconds (default {FULL.budget_s})")
    p.add_argument("--smoke", action="store_true", help="tiny random models, small T: the whole script in < 1 minute "
                   "on a CPU (longer on a GPU, where it also compiles)")
    p.add_argument("--device", help="cuda or cpu (default: cuda if available; only --smoke runs on the CPU)")
    p.add_argument("--gpus", type=positive, help="split each model's layers over this many GPUs (default 1)")
    p.add_argument("--tp", type=positive, help="tensor-parallel over this many GPUs, one torchrun process each "
                   "(torchrun --nproc_per_node N ... --tp N); no capacity search")
    p.add_argument("--no-capacity", dest="capacity", action="store_false", default=None,
                   help="skip the capacity search")
    p.add_argument("--no-prefill", dest="prefill", action="store_false", default=None,
                   help="skip the prefill cases")
    p.add_argument("--kernels", type=positive, help="after forward_ms, print the compiled forward's N longest kernels "
                   "(GPU time per forward, torch.profiler)")
    p.add_argument("--decodings", type=names(DECODINGS),
                   help="comma-separated, each case run with each: generate (its own loop, the default), "
                        "overlapped (custom_generate=oscar_hf.overlapped_sample: the stop check deferred by a step, "
                        "the host one step ahead of the GPU)")
    p.add_argument("--tuning-timer", choices=TUNING_TIMERS, default="steady",
                   help="how inductor's kernel tuning times a candidate config on a GPU: steady (default: "
                        "steady_tuning_timer) or inductor (its own timer)")
    p.add_argument("--out", default="eval/results", help="folder for the CSV, .log and .png")
    args = p.parse_args()
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.device.type != "cuda" and not args.smoke:
        p.error("the full benchmark needs a CUDA GPU (--smoke runs on the CPU)")
    if (args.gpus or 1) > max(1, torch.cuda.device_count()):
        p.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA devices")
    if (args.tp or 1) != int(os.environ.get("WORLD_SIZE", "1")):
        p.error(f"--tp {args.tp or 1} under {os.environ.get('WORLD_SIZE', 'no')} torchrun processes: run it as "
                "torchrun --nproc_per_node N eval/bench_generate.py --tp N")
    if args.tp and args.gpus:
        p.error("--tp and --gpus split a model two ways: give one")
    if args.tp and args.tp > 1:
        if args.capacity:
            p.error("--tp runs no capacity search (a rank out of memory alone would stall the others)")
        args.capacity = False
    overrides = {k: getattr(args, k) for k in ("models", "lengths", "batches", "steps", "warmup", "budget_s", "gpus",
                                             "tp", "capacity", "prefill", "kernels", "decodings")}
    args.profile = replace(SMOKE if args.smoke else FULL, **{k: v for k, v in overrides.items() if v is not None})
    return args


def main() -> None:
    args = parse_args()
    if args.device.type == "cpu":
        torch.set_num_threads(1)  # the tiny smoke models gain nothing from threads, and a busy CPU loses a lot
    profile, methods = args.profile, list(args.methods)
    steady = args.device.type == "cuda" and args.tuning_timer == "steady"
    if steady:
        steady_tuning_timer()
    env = {**environment(args.device), "inductor_pdl": inductor_config.triton.enable_pdl,
           "inductor_cdt": inductor_config.coordinate_descent_tuning,
           "tuning_timer": "steady" if steady else "inductor"}
    say(" ".join(f"{k}={v}" for k, v in env.items()))
    say(f"models={','.join(profile.models)} methods={','.join(m.name for m in methods)} lengths={profile.lengths} "
        f"batches={profile.batches} decodings={profile.decodings} steps={profile.steps} warmup={profile.warmup} "
        f"budget_s={profile.budget_s}")
    rows = []
    for name in profile.models:
        try:
            rows += bench_model(name, methods, profile, args.device)
        except Exception:  # a model that cannot be built must not end the run
            say(f"{name}: FAILED\n{traceback.format_exc()}")
        free_memory()
    if is_main():
        write_results(rows, env, profile, Path(args.out), args.smoke)


if __name__ == "__main__":
    main()
