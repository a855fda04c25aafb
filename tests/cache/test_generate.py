"""model.generate with OscarQuantizedCache against the default cache, in every generation mode."""

import pytest
import torch
from helpers import MODES, NEW_TOKENS, VOCAB, TokenCollector, full_precision_cache, generate, make_model, prompt, run
from transformers import DynamicCache

from oscar_hf import OscarQuantizedCache, OscarRotations, cache_kwargs
from oscar_hf.evaluation import make_cache


@pytest.mark.parametrize("mode", list(MODES))
def test_token_identical_when_windows_cover_sequence(arch, mode):
    model = make_model(arch)
    make_inputs, kwargs = MODES[mode]
    expected = run(model, make_inputs(), **kwargs)
    cache = full_precision_cache(model)
    got = run(model, make_inputs(), cache=cache, **kwargs)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert cache.get_seq_length() == got.shape[1] - 1
    assert all(layer.n_history == 0 for layer in cache.layers)


def test_streamer_sees_the_same_tokens(arch):
    model = make_model(arch)
    reference, ours = TokenCollector(), TokenCollector()
    run(model, prompt(), streamer=reference)
    run(model, prompt(), cache=full_precision_cache(model), streamer=ours)
    assert len(ours.tokens) == len(reference.tokens) == NEW_TOKENS + 1
    for a, b in zip(ours.tokens, reference.tokens):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_assisted_decoding_with_assistant_model():
    model = make_model("qwen3-gqa-qknorm-d128")
    assistant = make_model("qwen3-gqa-qknorm-d128", seed=1, num_hidden_layers=1)
    expected = run(model, prompt())
    got = run(model, prompt(), cache=full_precision_cache(model), assistant_model=assistant)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_dtypes(arch, dtype):
    model = make_model(arch, dtype=dtype)
    inputs = prompt(2, left_pad=(0, 6))
    expected = run(model, inputs)
    torch.testing.assert_close(run(model, inputs, cache=full_precision_cache(model)), expected, rtol=0, atol=0)


def test_repeated_generate_calls_with_fresh_caches(arch):
    model = make_model(arch)
    expected = [run(model, prompt(seed=s)) for s in range(3)]
    for seed, want in enumerate(expected):
        torch.testing.assert_close(
            run(model, prompt(seed=seed), cache=full_precision_cache(model)), want, rtol=0, atol=0
        )


def test_cache_reuse_across_generate_calls():
    model = make_model("llama-mha-d64")
    first = prompt(length=9)
    reference_cache = DynamicCache(config=model.config)
    ours = full_precision_cache(model)
    out_ref = run(model, first, cache=reference_cache)
    out = run(model, first, cache=ours)
    follow = torch.cat([out_ref, torch.tensor([[7, 8, 9]])], dim=1)
    again = {"input_ids": follow, "attention_mask": torch.ones_like(follow)}
    torch.testing.assert_close(run(model, again, cache=ours), run(model, again, cache=reference_cache), rtol=0, atol=0)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)


def random_orthogonal_rotations(model, seed=0) -> OscarRotations:
    config = model.config
    layers, dim = (
        config.num_hidden_layers,
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )
    g = torch.Generator().manual_seed(seed)
    q = torch.linalg.qr(torch.randn(2, layers, dim, dim, generator=g, dtype=torch.float64)).Q.float()
    return OscarRotations(q[0], q[1], num_kv_heads=config.num_key_value_heads, method="random")


def test_rotation_invariance(arch):
    """With nothing quantized, a random orthogonal R_K and R_V leave logits and tokens unchanged."""
    model = make_model(arch)
    inputs = prompt(2, left_pad=(0, 3))
    greedy_with_scores = dict(do_sample=False, return_dict_in_generate=True, output_scores=True)
    expected = generate(model, inputs, **greedy_with_scores)
    cache = full_precision_cache(model, random_orthogonal_rotations(model))
    got = generate(model, inputs, cache=cache, **greedy_with_scores)
    torch.testing.assert_close(got.sequences, expected.sequences, rtol=0, atol=0)
    for a, b in zip(got.scores, expected.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


QUANTIZED_MODES = ["greedy", "sampling", "left-padded-batch", "beam-search", "num-return-sequences", "prompt-lookup"]


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_quantized_history_in_every_mode(mode):
    """Small windows force INT2 history; generation runs and stays close to the full-precision model."""
    model = make_model("qwen3-gqa-qknorm-d128")
    make_inputs, kwargs = MODES[mode]
    inputs = make_inputs()
    cache = OscarQuantizedCache.from_pretrained(
        OscarRotations.hadamard(model.config), model=model, sink_tokens=4, recent_tokens=4, flush_tokens=2
    )
    out = run(model, inputs, cache=cache, **kwargs)
    assert out.shape[1] == inputs["input_ids"].shape[1] + NEW_TOKENS
    assert all(layer.n_history > 0 for layer in cache.layers)
    assert cache.bits_per_element < 16


def test_quantized_greedy_logits_close_to_full_precision():
    """INT2 with Hadamard on a tiny random model: next-token distributions stay close (KL small)."""
    model = make_model("qwen3-gqa-qknorm-d128")
    inputs = prompt(length=40)
    full = model.generate(**inputs, max_new_tokens=1, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    cache = OscarQuantizedCache.from_pretrained(
        OscarRotations.hadamard(model.config), model=model, sink_tokens=4, recent_tokens=4
    )
    model(**inputs, **cache_kwargs(model, cache), use_cache=True)  # prefill quantizes 32 of the 40 tokens
    step = model(
        input_ids=torch.tensor([[7]]),
        **cache_kwargs(model, cache),
        attention_mask=torch.ones(1, 41, dtype=torch.long),
    )
    reference = model(input_ids=torch.cat([inputs["input_ids"], torch.tensor([[7]])], dim=1)).logits[:, -1]
    kl = torch.nn.functional.kl_div(
        step.logits[:, -1].log_softmax(-1), reference.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    assert 0 < kl < 0.05
    assert full.logits[0].shape[-1] == VOCAB


def test_compiled_generate_with_a_static_cache_equals_eager():
    """max_cache_len makes the cache compileable: generate compiles the model around the cache update and the
    attention (graph breaks), with one mask shape for every step, so decoding compiles the same graphs for 2 new
    tokens as for 12, and gives the eager tokens."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model = make_model("qwen3-gqa-qknorm-d128", num_hidden_layers=3)
    inputs = prompt(2, length=20, left_pad=(0, 3))
    compile_config = CompileConfig(backend="eager", mode=None)
    compile_config._compile_all_devices = True  # transformers' switch for compiling generate off CUDA

    def cache(**kwargs):
        return OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, sink_tokens=4,
                                                   recent_tokens=8, flush_tokens=2, **kwargs)

    def compiled(new_tokens):
        torch._dynamo.reset()
        counters.clear()
        static = cache(max_cache_len=20 + NEW_TOKENS)
        out = model.generate(**inputs, max_new_tokens=new_tokens, pad_token_id=0, past_key_values=static,
                             compile_config=compile_config)
        return out, static, counters["stats"]["unique_graphs"]

    eager = run(model, inputs, cache(), disable_compile=True)
    short, _, short_graphs = compiled(2)
    out, static, graphs = compiled(NEW_TOKENS)
    assert static.is_compileable and not cache().is_compileable
    assert graphs == short_graphs > 0, "generate recompiled per step (or did not compile)"
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    torch.testing.assert_close(short, eager[:, :22], rtol=0, atol=0)
    layer = static.layers[0]
    assert layer.history.capacity == 20 + NEW_TOKENS - 4 - 8 and layer.get_mask_sizes(1) == (32, 0)


def test_static_cache_refuses_tokens_past_max_cache_len():
    model = make_model("llama-mha-d64")
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.identity(model.config), model=model, max_cache_len=20)
    with pytest.raises(ValueError, match="max_cache_len=20"):
        run(model, prompt(length=17), cache)
    with pytest.raises(ValueError, match="max_cache_len must be a positive integer"):
        OscarQuantizedCache.from_pretrained(OscarRotations.identity(model.config), model=model, max_cache_len=0)


@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_kivi_2_in_every_mode(mode):
    """The kivi-2 preset (per-channel K): token-identical to the default cache while its window covers the sequence;
    with token groups of 4 and a window of 4 the history fills, whole groups at a time, crops and beams included."""
    model = make_model("qwen3-gqa-qknorm-d128")
    make_inputs, kwargs = MODES[mode]
    expected = run(model, make_inputs(), **kwargs)
    covered = make_cache("kivi-2", model, recent_tokens=512)
    torch.testing.assert_close(run(model, make_inputs(), cache=covered, **kwargs), expected, rtol=0, atol=0)
    assert all(layer.n_history == 0 for layer in covered.layers)
    cache = make_cache("kivi-2", model, recent_tokens=4, flush_tokens=4)
    assert run(model, make_inputs(), cache=cache, **kwargs).shape == expected.shape
    assert all(layer.n_history > 0 and layer.n_history % 4 == 0 for layer in cache.layers)


def test_kivi_2_preset_on_a_long_prompt():
    """As shipped (groups of 32 tokens, window 112 .. 143): a 200-token prompt leaves 64 tokens in the history, and
    the 8th decoding step demotes one more group."""
    model = make_model("qwen3-gqa-qknorm-d128")
    cache = make_cache("kivi-2", model)
    out = run(model, prompt(length=200), cache=cache)
    assert out.shape == (1, 200 + NEW_TOKENS)
    assert [(layer.n_sink, layer.n_history, layer.n_recent) for layer in cache.layers] == [(0, 96, 115)] * 2


def test_overlapped_sample_names_a_transformers_without_deferred_stop_checks(monkeypatch):
    from transformers.generation import utils

    from oscar_hf import generation

    monkeypatch.delattr(utils, "DeferredStopCheck")
    generation.deferred_stop_check.cache_clear()
    try:
        with pytest.raises(ImportError, match="DeferredStopCheck, which transformers"):
            generation.deferred_stop_check()
    finally:
        generation.deferred_stop_check.cache_clear()


def test_overlapped_sample_gives_generate_tokens_on_the_cpu():
    """On the CPU (no events) the stop check stays per step: the loop is generate's, through custom_generate."""
    from oscar_hf import overlapped_sample

    model = make_model("llama-mha-d64")
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(6))
    runs = [model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                           past_key_values=OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config),
                                                                               model=model), **kwargs)
            for kwargs in ({}, {"custom_generate": overlapped_sample})]
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)
