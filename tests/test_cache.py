"""OscarLayer / OscarQuantizedCache semantics: layout, demotion, accounting, crop, reorder, attention."""

import types

import pytest
import torch
from conftest import make_model

import oscar_hf.cache as cache_module
from oscar_hf import OscarConfig, OscarLayer, OscarQuantizedCache, OscarRotations, hadamard_matrix
from oscar_hf.attention import oscar_attention_forward
from oscar_hf.quantizer import dequantize, quantize

B, H, D = 2, 3, 64


def rows(n: int, seed: int, dim: int = D, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(B, H, n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def random_orthogonal(dim: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(dim, dim, generator=torch.Generator().manual_seed(seed))).Q


def make_layer(dim: int = D, **config) -> OscarLayer:
    cfg = OscarConfig(**{"sink_tokens": 4, "recent_tokens": 8, "flush_tokens": 4, **config})
    return OscarLayer(cfg, random_orthogonal(dim, 1), random_orthogonal(dim, 2))


def expected_sequence(layer: OscarLayer, keys: torch.Tensor, side_clip: float) -> torch.Tensor:
    """What the layer should hold for the key sequence ``keys`` given its counts: windows exact, history quantized."""
    cfg = layer.config
    rotated = keys @ layer.key_rotation
    s, q = layer.n_sink, layer.n_history
    history = quantize(rotated[:, :, s : s + q], bits=cfg.bits, clip=side_clip, scale_dtype=cfg.torch_scale_dtype)
    return torch.cat([rotated[:, :, :s], dequantize(history, cfg.bits), rotated[:, :, s + q :]], dim=2)


def test_prefill_splits_sink_history_recent():
    layer = make_layer()
    keys, values = rows(30, 0), rows(30, 1)
    layer.update(keys, values)
    assert (layer.n_sink, layer.n_history, layer.n_recent) == (4, 18, 8)
    torch.testing.assert_close(layer.materialize("key"), expected_sequence(layer, keys, 0.96), rtol=0, atol=1e-5)


def test_decode_demotes_flush_tokens_at_a_time():
    layer = make_layer()
    keys = rows(40, 0)
    layer.update(keys[:, :, :12], keys[:, :, :12])  # 4 sink + 8 recent, nothing quantized
    assert layer.n_history == 0
    history_sizes, recent_sizes = [], []
    for t in range(12, 40):
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        history_sizes.append(layer.n_history)
        recent_sizes.append(layer.n_recent)
    assert set(recent_sizes) == set(range(8, 12)), "recent holds recent_tokens .. recent_tokens + flush_tokens - 1"
    assert {b - a for a, b in zip(history_sizes, history_sizes[1:])} == {0, 4}, "demotion is flush_tokens at a time"
    torch.testing.assert_close(layer.materialize("key"), expected_sequence(layer, keys, 0.96), rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.materialize("value"), expected_sequence_value(layer, keys), rtol=0, atol=1e-5)


def expected_sequence_value(layer, values):
    cfg = layer.config
    rotated = values @ layer.value_rotation
    s, q = layer.n_sink, layer.n_history
    history = quantize(rotated[:, :, s : s + q], bits=cfg.bits, clip=0.92, scale_dtype=cfg.torch_scale_dtype)
    return torch.cat([rotated[:, :, :s], dequantize(history, cfg.bits), rotated[:, :, s + q :]], dim=2)


def test_no_full_precision_copy_of_the_history_outlives_an_update():
    layer = make_layer(sink_tokens=2, recent_tokens=4, flush_tokens=2)
    keys = rows(300, 0)
    layer.update(keys[:, :, :100], keys[:, :, :100])
    for t in range(100, 300):
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
    held = [t for seg in (layer.sink, layer.recent, layer.history) for t in seg.tensors.values()]
    full_precision_tokens = sum(t.shape[2] for t in held if t.dtype.is_floating_point and t.shape[-1] == D)
    assert full_precision_tokens <= 2 * (2 + 4 + 2 - 1)  # K and V: at most the sink and recent windows
    assert layer.n_history == 300 - 2 - layer.n_recent


def test_history_grows_in_large_chunks(monkeypatch):
    grows = []
    original = cache_module._Segment.grow
    monkeypatch.setattr(
        cache_module._Segment, "grow", lambda self, used, cap: (grows.append(cap), original(self, used, cap))
    )
    layer = make_layer(sink_tokens=0, recent_tokens=0, flush_tokens=1)
    for t in range(3000):
        x = rows(1, t)
        layer.update(x, x)
    assert layer.n_history == 3000
    assert len(grows) <= 3, f"history reallocated {len(grows)} times for 3000 tokens"


def test_crop_removes_newest_tokens_exactly():
    layer = make_layer()
    keys = rows(40, 0)
    layer.update(keys[:, :, :30], keys[:, :, :30])
    for t in range(30, 40):
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
    before = layer.materialize("key")
    for remove in (3, 9, 20, 8):  # into recent, through the history, into the sink
        layer.crop(-remove)
        torch.testing.assert_close(layer.materialize("key"), before[:, :, : layer.length], rtol=0, atol=0)
    assert layer.length == 0
    layer.update(keys[:, :, :6], keys[:, :, :6])
    assert (layer.n_sink, layer.n_recent) == (4, 2)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)


def test_reorder_and_batch_ops_apply_to_every_segment():
    layer = make_layer()
    keys = rows(30, 0)
    layer.update(keys, keys)
    full = layer.materialize("value")
    layer.reorder_cache(torch.tensor([1, 1]))
    torch.testing.assert_close(layer.materialize("value"), full[[1, 1]], rtol=0, atol=0)
    layer.batch_repeat_interleave(3)
    assert layer.materialize("value").shape[0] == 6
    layer.batch_select_indices(torch.tensor([0, 5]))
    torch.testing.assert_close(layer.materialize("value"), full[[1, 1]], rtol=0, atol=0)


def test_nbytes_and_bits_per_element_match_the_analytic_count():
    """head_dim 128, group 128, fp16 scales: 2.25 bits in the history, plus the bf16 windows."""
    model = make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16)
    shape_layers, kv_heads, dim = 2, 2, 128
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model)
    seq = 1000
    model(input_ids=torch.randint(3, 90, (1, seq)), past_key_values=cache, use_cache=True)
    history = seq - 64 - 256
    expected_bits = 16 * (64 + 256) + history * (2 + 32 / 128)
    assert cache.bits_per_element == pytest.approx(expected_bits / seq)
    assert cache.bits_per_element == pytest.approx(cache.config.bits_per_element(dim, seq))
    layer = cache.layers[0]
    capacity = layer.history.capacity
    assert history <= capacity <= history + cache_module.HISTORY_GROWTH
    assert layer.sink.capacity == 64 and 256 <= layer.recent.capacity <= 256 + 7
    windows = layer.sink.capacity + layer.recent.capacity
    per_side_bytes = windows * dim * 2 + capacity * (dim // 4 + 2 + 2)  # bf16 windows + codes + fp16 scale, zero
    rotations = 2 * dim * dim * 4
    assert cache.nbytes == shape_layers * (kv_heads * 2 * per_side_bytes + rotations)
    assert cache.nbytes == sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in [
            *layer.sink.tensors.values(),
            *layer.recent.tensors.values(),
            *layer.history.tensors.values(),
            layer.key_rotation,
            layer.value_rotation,
        ]
    )


def test_attention_matches_a_dense_reference_over_dequantized_kv():
    """Decode output = softmax(q·K̂ᵀ/√D)·V̂ with K̂, V̂ the dequantized cache rotated back; prefill chunk is exact."""
    layer = make_layer(sink_tokens=2, recent_tokens=3, flush_tokens=2)
    keys, values = rows(20, 0), rows(20, 1)
    handle_k, handle_v = layer.update(keys, values)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    query = rows(1, 2).repeat_interleave(2, dim=1)  # [B, 2H, 1, D]
    mask = torch.ones(B, 1, 1, 20, dtype=torch.bool)
    # Prefill: the current chunk attends to its own exact K/V, so a last-row query sees exact data.
    out, _ = oscar_attention_forward(module, query, handle_k, handle_v, mask, scaling=D**-0.5)
    exact = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1), attn_mask=mask, scale=D**-0.5
    )
    torch.testing.assert_close(out, exact.transpose(1, 2), rtol=1e-4, atol=1e-5)
    # Decode: the history is read back quantized.
    handle_k, handle_v = layer.update(rows(1, 3), rows(1, 4))
    mask = torch.ones(B, 1, 1, 21, dtype=torch.bool)
    out, _ = oscar_attention_forward(module, query, handle_k, handle_v, mask, scaling=D**-0.5)
    k_hat = layer.materialize("key") @ layer.key_rotation.T
    v_hat = layer.materialize("value") @ layer.value_rotation.T
    dense = torch.nn.functional.scaled_dot_product_attention(
        query, k_hat.repeat_interleave(2, 1), v_hat.repeat_interleave(2, 1), attn_mask=mask, scale=D**-0.5
    )
    torch.testing.assert_close(out, dense.transpose(1, 2), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(k_hat[:, :, 2:18], keys[:, :, 2:18], atol=1e-2), "the history really is quantized"


def test_attention_rejects_unsupported_kwargs():
    layer = make_layer()
    k, v = layer.update(rows(5, 0), rows(5, 1))
    module = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    for kwargs in ({"softcap": 30.0}, {"s_aux": torch.zeros(3)}, {"sliding_window": 4}):
        with pytest.raises(NotImplementedError):
            oscar_attention_forward(module, rows(1, 2), k, v, None, **kwargs)


def test_cache_refuses_a_model_whose_attention_is_not_oscar():
    model = make_model("llama-mha-d64")
    cache = OscarQuantizedCache(model.config, OscarRotations.identity(model.config))
    with pytest.raises(RuntimeError, match="oscar_hf.enable"):
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache, use_cache=True)


def test_sliding_window_layers_fall_back_to_plain_sdpa():
    model = make_model(
        "qwen3-gqa-qknorm-d128",
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=6,
        use_sliding_window=True,
    )
    inputs = {"input_ids": torch.randint(3, 90, (1, 20))}
    expected = model.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.identity(model.config), model=model)
    got = model.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=0, past_key_values=cache)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert type(cache.layers[0]) is OscarLayer and cache.layers[1].is_sliding


def test_bundle_config_and_overrides():
    model = make_model("llama-mha-d64")
    bundle = OscarRotations.hadamard(model.config)
    bundle.config = OscarConfig(recent_tokens=32, k_clip=0.9)
    cache = OscarQuantizedCache.from_pretrained(bundle, model=model, sink_tokens=16)
    assert (cache.config.recent_tokens, cache.config.k_clip, cache.config.sink_tokens) == (32, 0.9, 16)
    with pytest.raises(ValueError, match="sink_tokens"):
        OscarQuantizedCache.from_pretrained(bundle, model=model, sink_tokens=-1)
    with pytest.raises(ValueError, match="unknown OscarConfig field"):
        OscarQuantizedCache.from_pretrained(bundle, model=model, window=3)
    with pytest.raises(ValueError, match="group_size"):
        OscarQuantizedCache.from_pretrained(bundle, model=model, group_size=128)


def test_from_pretrained_checks_the_bundle_against_the_model(tmp_path):
    model = make_model("qwen3-gqa-qknorm-d128")
    other = make_model("llama-mha-d64")
    OscarRotations.hadamard(other.config).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="head_dim"):
        OscarQuantizedCache.from_pretrained(tmp_path / "llama", model=model)
    hadamard = OscarRotations.hadamard(model.config)
    torch.testing.assert_close(hadamard.key_rotation[0], hadamard_matrix(128).float())


def test_backend_auto_is_triton_on_cuda_and_torch_on_cpu():
    pytest.importorskip("triton")
    from oscar_hf.kernels import ATTENTION_BACKENDS, WRITE_BACKENDS, attention_backend, write_backend

    assert attention_backend("auto", torch.device("cpu")) is ATTENTION_BACKENDS["torch"]
    assert write_backend("auto", torch.device("cpu")) is WRITE_BACKENDS["torch"]
    assert attention_backend("auto", torch.device("cuda")) is ATTENTION_BACKENDS["triton"]
    assert write_backend("auto", torch.device("cuda")) is WRITE_BACKENDS["triton"]
    with pytest.raises(ValueError, match="'cutlass' is not available"):
        attention_backend("cutlass", torch.device("cpu"))
