"""The attention variants of the model families the cache serves beyond plain full attention, on tiny random models:
soft-capped logits (Gemma-2), learned sinks (gpt-oss), chunked layers (Llama-4), per-layer head_dim and KV heads with
K = V full layers (Gemma-4), KV shared across layers (Gemma-4 E-size, Gemma-3n).

Each family: with windows that cover the sequence, generation equals the default cache's (greedy and sampled, fp32
and bf16, growing and static cache); calibrated, with most of the prompt in INT2, it runs and stores fewer bits."""

import pytest
import torch
import transformers
from helpers import FAMILIES, FAMILY_TINY, VOCAB, quick_calibrate
from helpers import build_family as build

from oscar_hf import OscarQuantizedCache, OscarRotations, cache_kwargs, check_model_supported
from oscar_hf.cache import LatentOscarLayer, OscarLayer

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = dict(max_new_tokens=8, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def prompt(length: int = 30) -> dict[str, torch.Tensor]:
    """A left-padded batch of two."""
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def generate(model, cache=None, sample: bool = False, length: int = 30, **settings):
    """(tokens, logits) of the prompt's continuation; the model's attention implementation is restored after."""
    implementation = model.config._attn_implementation
    torch.manual_seed(7)
    out = model.generate(**prompt(length), **(cache_kwargs(model, cache) if cache is not None else {}),
                         **{**SETTINGS, **settings}, do_sample=sample, **({"top_k": 20} if sample else {}))
    model.set_attn_implementation(implementation)
    return out.sequences, torch.stack(out.logits).float()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["greedy", "sample", "static"])
def test_lossless_with_covering_windows(family, dtype, mode):
    """Nothing quantized (the windows hold every token): the default cache's tokens and logits."""
    model = build(family, dtype)
    if mode == "static" and check_model_supported(model).latent is not None:
        with pytest.raises(ValueError, match="latent attention layers are stored on the host"):
            OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, max_cache_len=64)
        return
    expected = generate(model, sample=mode == "sample")
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                max_cache_len=64 if mode == "static" else None)
    got = generate(model, cache, sample=mode == "sample")
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5 if dtype == torch.float32 else 0)
    shape = check_model_supported(model)
    kinds = [type(layer).__name__ for layer in cache.layers]
    for i in range(shape.num_layers):
        kind = shape.attention(i)
        caches_nothing = not shape.reads_own_kv(i) or kind is None and not shape.has_state(i)  # KV sharing, MLP
        want = ("DummyLayer" if caches_nothing else "LinearAttentionLayer" if kind is None else
                "OscarLayer" if kind == "full_attention" else "DynamicSlidingWindowLayer")
        assert want in kinds[i], (i, kinds)
        assert shape.has_state(i) == ("WithState" in kinds[i] or kind is None and not caches_nothing)
        if want == "DynamicSlidingWindowLayer":
            assert cache.layers[i].sliding_window == shape.window(kind) == 8


@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_run(family):
    """Calibrated, most of a 96-token prompt in INT2: every OSCAR layer holds a history, and stores under 12 bits per
    element (about 3.5 in the history, 32 in the windows; 16 for a latent layer) against the model's 32."""
    model = build(family)
    rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)))
    cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=4, recent_tokens=8)
    tokens, logits = generate(model, cache, length=96)
    oscar = [layer for layer in cache.layers if isinstance(layer, (OscarLayer, LatentOscarLayer))]
    assert oscar and all(layer.n_history > 0 for layer in oscar)
    bits = sum(layer.stored_bits_and_elements()[0] for layer in oscar)
    elements = sum(layer.stored_bits_and_elements()[1] for layer in oscar)
    # a latent layer keeps its RoPE key (a fifth of its elements here) in fp32
    assert bits / elements < (16 if check_model_supported(model).latent else 12) and cache.bits_per_element < 32
    assert logits.isfinite().all() and tokens.shape == (2, 104)


def test_kv_sharing_layers_read_the_producers_oscar_layer(monkeypatch):
    """Gemma-4 E-size: the layers that reuse K/V attend over the producing layer's OSCAR storage (its INT2 history
    included) and store nothing."""
    from oscar_hf import attention

    model = build("gemma4-kv-sharing")
    shape = check_model_supported(model)
    assert shape.kv_sharing == (None, None, "store", "store", "reuse", "reuse")
    read = {}
    forward = attention.oscar_attention_forward

    def spy(module, query, key, value, *args, **kwargs):
        read.setdefault(module.layer_idx, set()).add(getattr(getattr(key, "layer", None), "config", None) and
                                                     id(key.layer))
        return forward(module, query, key, value, *args, **kwargs)

    rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64)))
    cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=4, recent_tokens=8)
    transformers.AttentionInterface.register("oscar", spy)
    try:
        generate(model, cache)
    finally:
        attention.register()
    assert read[5] == read[3] == {id(cache.layers[3])}  # the last full layer stores, the shared one reads it
    assert type(cache.layers[5]).__name__ == "DummyLayer" and cache.layers[3].n_history > 0


def test_per_layer_geometry_bundle_round_trip(tmp_path):
    """Gemma-4's sliding layers have head_dim 16 and 2 KV heads, its full layers 32 and 1: the calibrated bundle holds
    one rotation per layer in its own shape (format_version 3), and a bundle for other shapes is refused by layer."""
    model = build("gemma4-per-layer-geometry")
    rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64)), per_head=True)
    assert [tuple(r.shape) for r in rotations.key_rotation] == [(2, 16, 16), (1, 32, 32)] * 2
    assert not rotations.uniform and rotations.format_version == 3
    loaded = OscarRotations.from_pretrained(rotations.save_pretrained(tmp_path / "bundle"))
    for ours, theirs in zip(rotations.key_rotation + rotations.value_rotation,
                            loaded.key_rotation + loaded.value_rotation):
        assert torch.equal(ours, theirs)
    assert loaded.kv_heads == (2, 1, 2, 1) and loaded.head_dims == (16, 32, 16, 32)
    with pytest.raises(ValueError, match="head_dim of layer 1 is 32 in the bundle .* but 64"):
        loaded.check_compatible(build("gemma4-per-layer-geometry", global_head_dim=64).config)
    with pytest.raises(ValueError, match="differs between layers"):
        loaded.head_dim


@pytest.mark.parametrize("family, reason", [("gemma4-kv-sharing", "share K/V"),
                                            ("gemma4-per-layer-geometry", "values come from k_proj")])
def test_value_absorption_refuses_what_it_cannot_fold(family, reason):
    from oscar_hf import absorb_value_rotation

    model = build(family)
    with pytest.raises(ValueError, match=reason):
        absorb_value_rotation(model, OscarRotations.hadamard(model.config))


# ------------------------------------------------------------------------------ quantized sliding-window layers
def sliding_model(dtype: torch.dtype = torch.float32, **fields):
    """A tiny Mistral-7B-v0.1-like model: every layer sliding-window attention (16 tokens)."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(**{**FAMILY_TINY, "num_hidden_layers": 2, "sliding_window": 16, **fields})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_all_sliding_model_is_served_losslessly_while_its_window_moves(dtype, sample):
    """Every layer sliding (window 16), 100 prompt tokens and 40 new ones: the OSCAR layers drop what leaves the
    window (the sink first), and with nothing quantized the tokens and logits are the default cache's."""
    model = sliding_model(dtype)
    assert check_model_supported(model).layer_types == ("sliding_attention",) * 2
    expected = generate(model, sample=sample, length=100, max_new_tokens=40)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model)
    got = generate(model, cache, sample=sample, length=100, max_new_tokens=40)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5 if dtype == torch.float32 else 0)
    layer = cache.layers[0]
    assert type(layer).__name__ == "SlidingOscarLayer" and layer.dropped >= 64 and layer.n_sink == 0
    assert layer.get_seq_length() == 139 and layer.length < 139


def test_dropping_old_tokens_changes_nothing_the_model_sees(monkeypatch):
    """With an INT2 body, a layer that drops the tokens past its window gives the same logits as one that keeps them
    all (masked out by the sliding-window mask)."""
    from oscar_hf.cache import SlidingOscarLayer

    model = sliding_model()
    runs = []
    for step in (SlidingOscarLayer.EVICTION_STEP, 10**9):
        monkeypatch.setattr(SlidingOscarLayer, "EVICTION_STEP", step)
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, sink_tokens=4,
                                                    recent_tokens=8)
        runs.append((*generate(model, cache, length=100, max_new_tokens=40), cache.layers[0]))
    (tokens, logits, dropping), (kept_tokens, kept_logits, keeping) = runs
    assert dropping.dropped > 0 and keeping.dropped == 0 and dropping.n_history < keeping.n_history
    assert torch.equal(tokens, kept_tokens)
    torch.testing.assert_close(logits, kept_logits, rtol=0, atol=1e-5)
    assert dropping.stored_bits_and_elements()[0] < keeping.stored_bits_and_elements()[0]


def test_quantize_sliding_stores_an_interleaved_models_sliding_layers_too():
    """Gemma-2 (sliding beside full): with quantize_sliding the sliding layer is an OSCAR layer as well, lossless
    with covering windows, and with an INT2 body it stores fewer bits than with the sliding layer in fp32."""
    model = build("gemma2-softcap")
    rotations = OscarRotations.hadamard(model.config)
    expected = generate(model, length=40)
    cache = OscarQuantizedCache.from_pretrained(rotations, model=model, quantize_sliding=True)
    got = generate(model, cache, length=40)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5)
    assert [type(layer).__name__ for layer in cache.layers] == ["SlidingOscarLayer"] + ["DynamicOscarLayer"] * 2
    bits = {}
    for quantize_sliding in (False, True):
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=0, recent_tokens=2,
                                                    quantize_sliding=quantize_sliding)
        generate(model, cache, length=40)
        bits[quantize_sliding] = cache.bits_per_element
    assert bits[True] < bits[False]


def test_quantized_sliding_layers_need_a_growing_cache():
    with pytest.raises(ValueError, match="without max_cache_len .*every layer of this model is sliding"):
        OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(sliding_model().config), model=sliding_model(),
                                            max_cache_len=64)
    model = build("gemma2-softcap")
    with pytest.raises(ValueError, match="build the cache without max_cache_len"):
        OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, max_cache_len=64,
                                            quantize_sliding=True)


def test_a_crop_past_what_a_sliding_layer_holds_is_refused():
    model = sliding_model()
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model)
    generate(model, cache, length=100, max_new_tokens=40)
    layer = cache.layers[0]
    layer.crop(-3)
    assert layer.get_seq_length() == 136
    with pytest.raises(ValueError, match="left its window"):
        layer.crop(-(layer.length + 1))


def test_sliding_recent_tokens_sets_only_the_sliding_layers_window():
    model = build("gemma2-softcap")
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, recent_tokens=16,
                                                quantize_sliding=True, sliding_recent_tokens=4)
    assert [layer.config.recent_tokens for layer in cache.layers] == [4, 16, 16]
    generate(model, cache, length=100)
    sliding, full = cache.layers[:2]
    assert sliding.dropped > 0 and sliding.n_recent <= sliding.recent_limit == 4 + 8 - 1 and full.n_history > 0


# ------------------------------------------------------------------------------------------------------ hybrids
@pytest.mark.parametrize("family", ["qwen3.5-hybrid", "falcon-h1-hybrid", "deepseek-v3-mla"])
def test_hybrid_beam_search_reorders_states_and_oscar_layers_alike(family):
    """Beam search over a left-padded batch: the linear-attention / Mamba states and the OSCAR layers are reordered
    together, so that the beams are the default cache's."""
    model = build(family)
    settings = dict(num_beams=3, num_return_sequences=2, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(**prompt(), **settings)
    implementation = model.config._attn_implementation
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model)
    got = model.generate(**prompt(), **cache_kwargs(model, cache), **settings)
    model.set_attn_implementation(implementation)
    assert torch.equal(got, expected)


def test_hybrid_calibration_rotates_only_the_attention_layers():
    """Qwen3.5 (three Gated DeltaNet layers, then full attention): calibration captures the full-attention layer
    alone; the bundle keys layers by their global id, the identity where a layer has no K/V."""
    model = build("qwen3.5-hybrid")
    rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)))
    eye = torch.eye(32)
    assert [torch.equal(r, eye) for r in rotations.key_rotation] == [True, True, True, False]
    assert not torch.equal(rotations.value_rotation[3], eye)


# --------------------------------------------------------------------------------- multi-head latent attention
def test_latent_bytes_at_deepseek_v3s_shape():
    """DeepSeek-V3's latent (512 channels, RoPE key 64, bf16, groups of 128): a history token takes 128 bytes of
    codes, 16 of scales and zeros and 128 of RoPE key, 272 against 1,152 in bf16 (4.24x)."""
    from oscar_hf import OscarConfig

    layer = LatentOscarLayer(OscarConfig(group_size=128, sink_tokens=0, recent_tokens=0, flush_tokens=1),
                             torch.linalg.qr(torch.randn(512, 512, generator=torch.Generator().manual_seed(0))).Q)
    latent, rope = torch.randn(2, 1, 1, 1000, 576, dtype=torch.bfloat16).split([512, 64], dim=-1)
    layer.update(latent[0], rope[0])
    bits, elements = layer.stored_bits_and_elements()
    assert layer.n_history == 1000 and elements == 1000 * 576
    assert bits - 8 * 4 * 512 == 1000 * 272 * 8  # (the fp32 latent mean is one vector per sequence)


def test_latent_layer_returns_the_dequantized_latent_in_the_models_basis():
    """Calibrated rotation, INT2 history: what update returns is the stored latent rotated back, close to the input
    (the windows exact), and the RoPE key exact."""
    from oscar_hf import OscarConfig
    from oscar_hf.quantizer import dequantize, quantize

    rotation = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(0))).Q
    layer = LatentOscarLayer(OscarConfig(sink_tokens=2, recent_tokens=4, flush_tokens=2, k_clip=1.0), rotation)
    latent = torch.randn(1, 1, 40, 64, generator=torch.Generator().manual_seed(1))
    rope = torch.randn(1, 1, 40, 8, generator=torch.Generator().manual_seed(2))
    got_latent, got_rope = layer.update(latent, rope)
    assert torch.equal(got_rope, rope) and torch.equal(got_latent[:, :, :2], latent[:, :, :2])
    assert torch.equal(got_latent[:, :, -layer.n_recent:], latent[:, :, -layer.n_recent:])
    history = slice(2, 2 + layer.n_history)
    rows = latent[:, :, history] @ rotation
    mean = rows.mean(dim=2, keepdim=True)
    want = (dequantize(quantize(rows - mean, bits=2, clip=1.0), 2) + mean) @ rotation.mT
    torch.testing.assert_close(got_latent[:, :, history], want, rtol=0, atol=1e-5)
    assert (got_latent[:, :, history] - latent[:, :, history]).norm() < 0.5 * latent[:, :, history].norm()
    layer.crop(-3)
    assert layer.get_seq_length() == 37


def test_mla_calibration_rotates_the_latent():
    model = build("deepseek-v3-mla")
    rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)))
    assert rotations.head_dims == (32, 32) and rotations.kv_heads == (1, 1)
    assert not torch.equal(rotations.key_rotation[0], torch.eye(32))
    assert torch.equal(rotations.value_rotation[0], torch.eye(32))
    assert (rotations.key_eigenvalues[0] > 0).all()  # the latent's attention-weighted second moment


MLA_FAMILIES = [name for name in FAMILIES if "mla" in name]


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_latent_rotation_absorbed_into_kv_b_proj_changes_only_roundings(family):
    """Calibrated latent rotations folded into kv_b_proj, the absorbed bundle's cache returning the latent in the
    rotated basis: the same stored codes, so greedy tokens and logits match the unabsorbed model's over an INT2
    history, fp32 (to roundings)."""
    import copy

    from oscar_hf import absorb_latent_rotation

    model = build(family)
    rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)))
    absorbed_model = copy.deepcopy(model)
    absorbed = absorb_latent_rotation(absorbed_model, rotations)
    assert absorbed.calibration["latent_rotation_absorbed"] and not rotations.calibration.get(
        "latent_rotation_absorbed")
    runs = {}
    for name, m, bundle in (("plain", model, rotations), ("absorbed", absorbed_model, absorbed)):
        cache = OscarQuantizedCache.from_pretrained(bundle, model=m, sink_tokens=2, recent_tokens=4, flush_tokens=2)
        runs[name] = generate(m, cache, length=40)
        layers = [layer for layer in cache.layers if isinstance(layer, LatentOscarLayer)]
        assert layers and all(layer.absorbed == (name == "absorbed") and layer.n_history > 20 for layer in layers)
    assert torch.equal(runs["plain"][0], runs["absorbed"][0])
    torch.testing.assert_close(runs["absorbed"][1], runs["plain"][1], rtol=1e-4, atol=1e-4)
    # a bundle and a model that do not match would read the latent in the wrong basis: refused both ways
    for m, bundle in ((absorbed_model, rotations), (model, absorbed)):
        with pytest.raises(ValueError, match="wrong basis"):
            OscarQuantizedCache.from_pretrained(bundle, model=m)
    # and the check above can fail: the absorbed bundle's layers, told otherwise, read the wrong basis
    cache = OscarQuantizedCache.from_pretrained(absorbed, model=absorbed_model, sink_tokens=2, recent_tokens=4,
                                                flush_tokens=2)
    for layer in cache.layers:
        if isinstance(layer, LatentOscarLayer):
            layer.absorbed = False
    assert (generate(absorbed_model, cache, length=40)[1] - runs["plain"][1]).abs().max() > 1e-2


def test_latent_absorption_refuses_what_it_cannot_fold():
    from oscar_hf import absorb_latent_rotation

    with pytest.raises(ValueError, match="needs multi-head latent attention"):
        absorb_latent_rotation(build("qwen3.5-hybrid"), OscarRotations.hadamard(build("qwen3.5-hybrid").config))
    model = build("deepseek-v3-mla")
    absorbed = absorb_latent_rotation(model, OscarRotations.hadamard(model.config))
    with pytest.raises(ValueError, match="bundle's latent rotation is already absorbed"):
        absorb_latent_rotation(build("deepseek-v3-mla"), absorbed)
    with pytest.raises(ValueError, match="model's latent rotation is already absorbed"):
        absorb_latent_rotation(model, OscarRotations.hadamard(model.config))


def test_mla_capture_reports_the_attention_each_latent_token_receives():
    """Each query's attention sums to 1 over the tokens it sees, so a T-token chunk's weights sum to T per sequence;
    the first token, which every query sees, receives the most under random weights' near-uniform attention."""
    from oscar_hf.capture import run_capture

    class Recorder:
        def __init__(self):
            self.seen = []

        def observe(self, *args):
            raise AssertionError("a latent attention layer's K/V reach the observer as its latent")

        def observe_latent(self, layer_idx, latent, weights):
            self.seen.append((layer_idx, latent.shape, weights))

    model, recorder = build("deepseek-v3-mla"), Recorder()
    run_capture(model, recorder, torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0)))
    assert [(i, tuple(shape)) for i, shape, _ in recorder.seen] == [(0, (2, 1, 20, 32)), (1, (2, 1, 20, 32))]
    for _, _, weights in recorder.seen:
        torch.testing.assert_close(weights.sum(-1), torch.full((2,), 20.0))
        assert (weights.argmax(-1) == 0).all()


def _interleaved(config_name: str, **fields):
    def make():
        torch.manual_seed(0)
        config = getattr(transformers, config_name)(**{**FAMILY_TINY, "num_hidden_layers": 2, "sliding_window": 8,
                                                       "layer_types": ["sliding_attention", "full_attention"],
                                                       **fields})
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        model.generation_config.eos_token_id = None
        return model
    return make


@pytest.mark.parametrize("make", [lambda: build("gpt-oss-sinks"), lambda: build("gemma4-per-layer-geometry"),
                                  _interleaved("Gemma3TextConfig"), _interleaved("Cohere2Config")],
                         ids=["gpt-oss", "gemma4", "gemma3", "cohere2"])
def test_quantize_sliding_is_lossless_in_bf16_while_the_windows_move(make):
    """Interleaved sliding and full layers, the sliding ones OSCAR layers too (window 8, 100 + 20 tokens): with
    nothing quantized, bf16 tokens and logits are the default cache's, bit for bit, as the windows drop tokens."""
    model = make().to(torch.bfloat16)
    expected = generate(model, length=100, max_new_tokens=20)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                quantize_sliding=True)
    got = generate(model, cache, length=100, max_new_tokens=20)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert type(cache.layers[0]).__name__ == "SlidingOscarLayer" and cache.layers[0].dropped > 0


@pytest.mark.parametrize("layout", ["per-channel", "product"])
def test_latent_layers_refuse_key_layouts_other_than_per_token(layout):
    model = build("deepseek-v3-mla")
    with pytest.raises(ValueError, match=f"key_quantization='{layout}' is not available for multi-head latent"):
        OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                            key_quantization=layout, k_clip=1.0, centering=layout == "product")


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_mla_decode_steps_attend_the_latent_absorbed(family, monkeypatch):
    """Over an INT2 history, decode steps attend the stored latent absorbed (no expansion through kv_b_proj): the
    same greedy tokens as the expanding path over the same cache, and logits equal to fp32 roundings; left padding
    included."""
    from oscar_hf.cache import latent as latent_module

    model = build(family)
    rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)))
    calls = []
    attend = LatentOscarLayer.attend_absorbed
    monkeypatch.setattr(LatentOscarLayer, "attend_absorbed", lambda *a, **k: calls.append(1) or attend(*a, **k))
    runs = {}
    for name, tokens in (("absorbed", latent_module.ABSORBED_QUERY_TOKENS), ("expanded", 0), ("unpatched", 16)):
        monkeypatch.setattr(latent_module, "ABSORBED_QUERY_TOKENS", tokens)
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=2, recent_tokens=4,
                                                    flush_tokens=2)
        if name == "unpatched":  # an attention module whose expand_kv was not patched reads the handle densely
            for module in model.modules():
                module.__dict__.pop("expand_kv", None)
        runs[name] = generate(model, cache, length=40)
        layers = sum(isinstance(layer, LatentOscarLayer) for layer in cache.layers)
        # every decode step of every latent layer, then none
        assert len(calls) == layers * (SETTINGS["max_new_tokens"] - 1)
    assert torch.equal(runs["absorbed"][0], runs["expanded"][0])
    torch.testing.assert_close(runs["absorbed"][1], runs["expanded"][1], rtol=1e-4, atol=1e-4)
    assert torch.equal(runs["unpatched"][0], runs["expanded"][0]) and torch.equal(runs["unpatched"][1],
                                                                                  runs["expanded"][1])
