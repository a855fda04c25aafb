"""Static layers' decode steps with the Triton backend: the decode operator (planned once, counts read on the device)
against the host launch and the torch twin, and generate's compiled decode step as one graph: on the CPU under
TRITON_INTERPRET=1 (set by ``triton_interpreter``), or compiled on a GPU."""

import os

import pytest
import torch
from triton_interpreter import faster_triton_interpreter  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
pytest.importorskip("triton")

from helpers import make_model, signed_hadamard, static_and_host_layers  # noqa: E402

from oscar_hf import (  # noqa: E402
    OscarQuantizedCache,
    OscarRotations,
)
from oscar_hf.kernels.decode import reference as decode_reference  # noqa: E402
from oscar_hf.kernels.decode.triton import decode  # noqa: E402


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def naive_attend(module, query, key, value, mask, scaling):
    """The torch twin over the handles' layer, the handles' tokens read at full precision."""
    return decode_reference.attend(module, query, key.layer.packed(), key.new, value.new, mask, scaling)


def bf16_model():
    """The tiny bf16 Qwen3 (GQA, D = 128) that the tests through a model run: on a GPU with 2 layers, under the
    interpreter (which runs every program of every launch in Python) with 1, each layer taking the same kernels."""
    layers = 2 if DEVICE == "cuda" else 1
    return make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16, num_hidden_layers=layers).to(DEVICE)


class Attn(torch.nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def test_graph_step_decode_equals_the_host_decode():
    """The decode operator (planned once for the capacities, counts and ring start read on the device; q rotated by
    its stage 0) gives the host launch's output over the same tokens, a left-padded row included."""
    from oscar_hf.kernels.decode.triton import decode_static

    static, host = static_and_host_layers(128, max_len=400, sink_tokens=4, recent_tokens=8, flush_tokens=3)
    kv = randn(2, 2, 2, 300, 128, seed=12).to(torch.bfloat16)
    kv[:, 1, :, :5] = 30.0
    mask = torch.ones(2, 1, 1, 400, dtype=torch.bool, device=DEVICE)
    mask[1, ..., :5] = False
    for layer in (static, host):
        layer.update(kv[0, :, :, :250], kv[1, :, :, :250])
    for t in range(250, 300):
        for layer in (static, host):
            layer.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        if t % 7 == 0:
            query = randn(2, 8, 1, 128, seed=t).to(torch.bfloat16)
            got = decode_static(query, static.packed(), mask, None, static._decode_splits)
            want = decode(query, host.packed(), mask[..., :301], None)
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert static.recent_start != 0


def test_graph_step_decode_with_per_head_rotations_equals_the_host_decode():
    """Per-KV-head rotations through the graph step (the append kernel rotating q by its KV head's R_K, the decode's
    history share taken back by each KV head's R_V in one batched GEMM) give the host launch's output, whose stage 0
    rotates q itself, and the torch twin's."""
    from oscar_hf.kernels.decode.triton import decode_static

    static, host = static_and_host_layers(64, max_len=120, heads=2, sink_tokens=4, recent_tokens=8, flush_tokens=3)
    kv = randn(2, 2, 2, 100, 64, seed=16).to(torch.bfloat16)
    mask = torch.ones(2, 1, 1, 120, dtype=torch.bool, device=DEVICE)
    for layer in (static, host):
        layer.update(kv[0, :, :, :90], kv[1, :, :, :90])
    for t in range(90, 100):
        query = randn(2, 6, 1, 64, seed=t).to(torch.bfloat16)
        key, value = host.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        static.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        if t % 4 == 1:
            rotated = static._store_pending(query=query)
            got = decode_static(query, static.packed(), mask, None, static._decode_splits, rotated)
            want = decode(query, host.packed(), mask[..., : t + 1], None)
            twin = naive_attend(Attn(3), query, key, value, mask[..., : t + 1], None)
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(got.float(), twin.float(), rtol=2e-2, atol=2e-2)
    static.check_flags()  # stores the last token left pending; no flag raised
    assert host.n_history > 0 and static.counts.tolist()[:3] == [host.n_sink, host.n_history, host.n_recent]


def per_head_bundle(config) -> OscarRotations:
    """Per-KV-head rotations for ``config``: :func:`signed_hadamard` ones, different per layer and head (V's: K's
    transposed)."""
    layers, heads, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    key = torch.stack([signed_hadamard(dim, heads, seed=layer) for layer in range(layers)])
    return OscarRotations(key, key.mT, num_kv_heads=heads)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_compiled_generate_is_one_graph_with_a_static_cache(per_head):
    """With max_cache_len and the Triton backend, generate's compiled decode step traces whole (update and attention
    included: no graph break, one graph for every step) and gives the eager static cache's tokens, which equal
    the growing cache's; with shared rotations and with one per KV head."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = bf16_model()
    bundle = per_head_bundle(model.config) if per_head else OscarRotations.hadamard(model.config)
    ids = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    compile_config = CompileConfig(backend="aot_eager", mode=None)  # inductor works too, but compiles C++ slowly
    compile_config._compile_all_devices = True

    def run(max_cache_len=None, **kwargs):
        cache = OscarQuantizedCache.from_pretrained(bundle, model=model, sink_tokens=4, recent_tokens=8,
                                                    flush_tokens=3, backend="triton", max_cache_len=max_cache_len)
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              past_key_values=cache, pad_token_id=0, **kwargs), cache

    growing, _ = run()
    eager, _ = run(50, disable_compile=True)
    torch._dynamo.reset()
    counters.clear()
    compiled, cache = run(50, compile_config=compile_config)
    assert cache.layers[0].graph_step and cache.layers[0].n_history > 0
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    torch.testing.assert_close(eager, growing, rtol=0, atol=0)
