"""OscarLayer / OscarQuantizedCache semantics: layout, demotion, accounting, crop, reorder, attention."""

import itertools
import types

import pytest
import torch
from helpers import make_model

import oscar_hf.cache.segments as segments
from oscar_hf import (
    DynamicOscarLayer,
    OscarConfig,
    OscarLayer,
    OscarQuantizedCache,
    OscarRotations,
    StaticOscarLayer,
    cache_kwargs,
    hadamard_matrix,
)
from oscar_hf.attention import oscar_attention_forward
from oscar_hf.evaluation import make_cache
from oscar_hf.quantizer import dequantize, dequantize_per_channel, quantize, quantize_per_channel

B, H, D = 2, 3, 64
PER_CHANNEL = {"key_quantization": "per-channel", "k_clip": 1.0, "centering": False}  # K as KIVI stores it


def rows(n: int, seed: int, dim: int = D, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(B, H, n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def random_orthogonal(dim: int, seed: int, heads: int | None = None) -> torch.Tensor:
    """``[D, D]``, or ``[heads, D, D]`` (one per KV head)."""
    shape = (dim, dim) if heads is None else (heads, dim, dim)
    return torch.linalg.qr(torch.randn(shape, generator=torch.Generator().manual_seed(seed))).Q


def make_layer(dim: int = D, per_head: bool = False, **config) -> OscarLayer:
    cfg = OscarConfig(**{"sink_tokens": 4, "recent_tokens": 8, "flush_tokens": 4, **config})
    heads = H if per_head else None
    return DynamicOscarLayer(cfg, random_orthogonal(dim, 1, heads), random_orthogonal(dim, 2, heads))


def expected_sequence(layer: OscarLayer, x: torch.Tensor, side: str, first_demoted: int) -> torch.Tensor:
    """What the layer should give back of the sequence ``x`` (keys or values) given its counts: windows exact, history
    rotated, quantized after subtracting the mean of the ``first_demoted`` tokens that reached it first, and rotated
    back."""
    cfg = layer.config
    rotation = layer.key_rotation if side == "key" else layer.value_rotation
    rotated = x @ rotation
    s, q = layer.n_sink, layer.n_history
    center = rotated[:, :, s : s + first_demoted].mean(dim=2, keepdim=True)
    clip = cfg.k_clip if side == "key" else cfg.v_clip
    history = quantize(rotated[:, :, s : s + q] - center, bits=cfg.bits, clip=clip, scale_dtype=cfg.torch_scale_dtype)
    restored = (dequantize(history, cfg.bits) + center) @ rotation.mT
    return torch.cat([x[:, :, :s], restored, x[:, :, s + q :]], dim=2)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_prefill_splits_sink_history_recent(per_head):
    layer = make_layer(per_head=per_head)
    keys, values = rows(30, 0), rows(30, 1)
    layer.update(keys, values)
    assert (layer.n_sink, layer.n_history, layer.n_recent) == (4, 18, 8)
    torch.testing.assert_close(layer.materialize("key"), expected_sequence(layer, keys, "key", 18), rtol=0, atol=1e-5)
    torch.testing.assert_close(layer.materialize("value"), expected_sequence(layer, values, "value", 18), atol=1e-5,
                               rtol=0)


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_decode_demotes_flush_tokens_at_a_time(per_head):
    layer = make_layer(per_head=per_head)
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
    for side in ("key", "value"):  # the first demotion moved flush_tokens (4) tokens
        torch.testing.assert_close(layer.materialize(side), expected_sequence(layer, keys, side, 4), rtol=0, atol=1e-5)


def test_uncentered_history_and_reset_forgets_the_means():
    layer = make_layer(centering=False)
    keys, values = rows(30, 0), rows(30, 1)
    layer.update(keys, values)
    assert layer.center["key"].numel() == 0
    cfg = layer.config
    rotated = keys @ layer.key_rotation
    history = quantize(rotated[:, :, 4:22], bits=cfg.bits, clip=cfg.k_clip, scale_dtype=cfg.torch_scale_dtype)
    torch.testing.assert_close(layer._history("key", 18), dequantize(history, cfg.bits), rtol=0, atol=1e-5)
    centered = make_layer()
    centered.update(keys, values)
    assert centered.center["key"].shape == (B, H, 1, D)
    torch.testing.assert_close(centered.center["key"], rotated[:, :, 4:22].mean(2, True))
    centered.reset()
    centered.update(values, keys)  # a new sequence: new means
    new_keys = values @ centered.key_rotation
    torch.testing.assert_close(centered.center["key"], new_keys[:, :, 4:22].mean(2, True))


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
    original = segments.Segment.grow
    monkeypatch.setattr(
        segments.Segment, "grow", lambda self, used, cap: (grows.append(cap), original(self, used, cap))
    )
    layer = make_layer(sink_tokens=0, recent_tokens=0, flush_tokens=1)
    for t in range(3000):
        x = rows(1, t)
        layer.update(x, x)
    assert layer.n_history == 3000
    assert len(grows) <= 3, f"history reallocated {len(grows)} times for 3000 tokens"


@pytest.mark.parametrize("config", [{}, PER_CHANNEL], ids=["per-token", "per-channel"])
def test_crop_removes_newest_tokens_exactly(config):
    layer = make_layer(**config)
    keys = rows(40, 0)
    layer.update(keys[:, :, :30], keys[:, :, :30])
    for t in range(30, 40):
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
    before = layer.materialize("key")
    for remove in (3, 9, 20, 8):  # into recent, through the history, into the sink
        layer.crop(-torch.tensor(remove))  # assisted generation passes a 0-d tensor
        assert all(type(n) is int for n in (layer.n_sink, layer.n_history, layer.n_recent))
        torch.testing.assert_close(layer.materialize("key"), before[:, :, : layer.length], rtol=0, atol=0)
    assert layer.length == 0
    layer.update(keys[:, :, :6], keys[:, :, :6])
    assert (layer.n_sink, layer.n_recent) == (4, 2)
    with pytest.raises(ValueError, match="negative"):
        layer.crop(3)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("config", [{}, PER_CHANNEL], ids=["per-token", "per-channel"])
def test_crop_right_after_an_update_leaves_what_the_kept_tokens_alone_leave(config, static):
    """transformers' rollbacks (assisted decoding's rejected candidates, a deferred stop check's extra step) crop
    right after an update, and need it to leave no trace (``is_croppable``): the layer then holds, bit for bit, what
    a layer that received only the kept tokens holds, though the update had pushed tokens into the history (and, the
    first time, set the means)."""
    keys, values = rows(60, 0), rows(60, 1)
    for prompt, kept in itertools.product((3, 9, 30), (0, 2, 5)):  # demoting: the first tokens, a group, more
        cfg = OscarConfig(**{"sink_tokens": 4, "recent_tokens": 8, "flush_tokens": 4, **config})
        rotations = (random_orthogonal(D, 1), random_orthogonal(D, 2))
        cropped, straight = (StaticOscarLayer(cfg, *rotations, 80) if static else DynamicOscarLayer(cfg, *rotations)
                             for _ in range(2))
        for layer in (cropped, straight):
            layer.update(keys[:, :, :prompt], values[:, :, :prompt])
        assert cropped.is_croppable
        cropped.update(keys[:, :, prompt : prompt + 6], values[:, :, prompt : prompt + 6])  # six candidates
        demoted = cropped.n_history
        cropped.crop(-(6 - kept))
        if kept:
            straight.update(keys[:, :, prompt : prompt + kept], values[:, :, prompt : prompt + kept])
        assert (cropped.n_sink, cropped.n_history, cropped.n_recent) == (
            straight.n_sink, straight.n_history, straight.n_recent), (prompt, kept, demoted)
        for side in ("key", "value"):
            assert torch.equal(cropped.materialize(side), straight.materialize(side)), (prompt, kept, side)
            assert torch.equal(cropped.center[side], straight.center[side])
        for name, t in straight.history.read(straight.n_history).items():  # (per-channel K: rows of token groups)
            assert torch.equal(cropped.history.read(straight.n_history)[name], t), name
        cropped.update(keys[:, :, 40:41], values[:, :, 40:41])  # and the layer goes on as the other does
        straight.update(keys[:, :, 40:41], values[:, :, 40:41])
        assert torch.equal(cropped.materialize("key"), straight.materialize("key"))


@pytest.mark.parametrize("config", [{}, PER_CHANNEL], ids=["per-token", "per-channel"])
def test_reorder_and_batch_ops_apply_to_every_segment(config):
    layer = make_layer(**config)
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
    model(input_ids=torch.randint(3, 90, (1, seq)), **cache_kwargs(model, cache), use_cache=True)
    history = seq - 64 - 256
    expected_bits = 16 * (64 + 256) + history * (2 + 32 / 128) + 32  # + the fp32 centering means
    assert cache.bits_per_element == pytest.approx(expected_bits / seq)
    assert cache.bits_per_element == pytest.approx(cache.config.bits_per_element(dim, seq))
    # the history alone: 2.25 bits, and one fp32 mean per head and side over its tokens
    assert cache.history_bits_per_element == pytest.approx(2.25 + 32 / history)
    assert cache.config.bits_per_element(dim) == 2.25
    layer = cache.layers[0]
    capacity = layer.history.capacity
    assert history <= capacity <= history + segments.HISTORY_GROWTH
    assert layer.sink.capacity == 64 and 256 <= layer.recent.capacity <= 256 + 7
    windows = layer.sink.capacity + layer.recent.capacity
    per_side_bytes = windows * dim * 2 + capacity * (dim // 4 + 2 + 2)  # bf16 windows + codes + fp16 scale, zero
    per_side_bytes += dim * 4  # the fp32 centering mean
    rotations = 2 * dim * dim * 2  # R_K and R_V in the model dtype
    assert cache.nbytes == shape_layers * (kv_heads * 2 * per_side_bytes + rotations)
    assert cache.nbytes == sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in [
            *layer.sink.tensors.values(),
            *layer.recent.tensors.values(),
            *layer.history.tensors.values(),
            *layer.center.tensors.values(),
            layer.key_rotation,
            layer.value_rotation,
        ]
    )


def test_symmetric_quantizer_stores_scales_alone():
    """quantizer="symmetric": no zero rows in the history (2 + 16/128 bits per element), and attention reads the
    implied zeros as the dense reference over the dequantized history does."""
    model = make_model("qwen3-gqa-qknorm-d128", dtype=torch.float32)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                quantizer="symmetric", sink_tokens=4, recent_tokens=8)
    ids = torch.randint(3, 90, (1, 60), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    layer = cache.layers[0]
    assert layer.history["key_zero"].shape[-1] == layer.history["value_zero"].shape[-1] == 0
    assert cache.config.bits_per_element(128) == 2.125
    assert cache.history_bits_per_element == pytest.approx(2.125 + 32 / layer.n_history)
    key = layer.materialize("key")
    assert key.shape[2] == 60 and bool(torch.isfinite(key).all())


def test_compact_quantizer_stores_a_byte_scale_and_zero():
    """quantizer="compact": uint8 scale and int8 zero rows in the history (2 + 16/128 bits per element), read back
    as the quantizer's rows; the analytic and the stored bits agree."""
    model = make_model("qwen3-gqa-qknorm-d128", dtype=torch.float32)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                quantizer="compact", sink_tokens=4, recent_tokens=8)
    ids = torch.randint(3, 90, (1, 60), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True)
    layer = cache.layers[0]
    assert layer.history["key_scale"].dtype == layer.history["value_scale"].dtype == torch.uint8
    assert layer.history["key_zero"].dtype == layer.history["value_zero"].dtype == torch.int8
    assert cache.config.bits_per_element(128) == 2.125
    assert cache.history_bits_per_element == pytest.approx(2.125 + 32 / layer.n_history)
    key = layer.materialize("key")
    assert key.shape[2] == 60 and bool(torch.isfinite(key).all())


def test_key_bits_store_keys_at_their_own_width():
    """4-bit K and 2-bit V: K codes twice as wide, each side reads back as the quantizer at its bits (4-bit K
    unclipped, 2-bit V clipped), and the stored bits per element are the analytic count."""
    cfg = OscarConfig(key_bits=4, sink_tokens=4, recent_tokens=8, flush_tokens=2, backend="torch")
    layer = DynamicOscarLayer(cfg, torch.eye(64), torch.eye(64))
    kv = torch.randn(2, 2, 3, 100, 64, generator=torch.Generator().manual_seed(5))
    layer.update(kv[0], kv[1])
    n = layer.n_history
    assert layer.history["key_codes"].shape[-1] == 32 and layer.history["value_codes"].shape[-1] == 16
    assert cfg.k_clip < 1.0
    for side, clip, bits in (("key", 1.0, 4), ("value", cfg.v_clip, 2)):
        center = kv[int(side == "value"), :, :, 4 : 4 + n].mean(dim=2, keepdim=True)
        rows = quantize(kv[int(side == "value"), :, :, 4 : 4 + n] - center, bits=bits, clip=clip)
        torch.testing.assert_close(layer.materialize(side)[:, :, 4 : 4 + n], dequantize(rows, bits) + center,
                                   rtol=0, atol=1e-5)
    bits, elements = layer.stored_bits_and_elements()
    assert bits / elements == pytest.approx(cfg.bits_per_element(64, 100, model_bits=32))  # fp32 windows


def test_key_bits_layers_give_listed_layers_wider_keys():
    model = make_model("qwen3-gqa-qknorm-d128", num_hidden_layers=3)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, key_bits=4,
                                                key_bits_layers=[1], sink_tokens=4, recent_tokens=8)
    model(input_ids=torch.randint(3, 90, (1, 100)), **cache_kwargs(model, cache), use_cache=True)
    assert [layer.history["key_codes"].shape[-1] for layer in cache.layers] == [32, 64, 32]
    assert {layer.history["value_codes"].shape[-1] for layer in cache.layers} == {32}
    assert cache.bits_per_element == pytest.approx(cache.config.bits_per_element(128, 100, 32, num_layers=3))
    with pytest.raises(ValueError, match="key_bits_layers lists layer 3"):
        OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, key_bits=4,
                                            key_bits_layers=[3])
    with pytest.raises(ValueError, match="for_layer"):
        DynamicOscarLayer(OscarConfig(key_bits=4, key_bits_layers=[0]), torch.eye(64), torch.eye(64))


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
    k_hat, v_hat = layer.materialize("key"), layer.materialize("value")
    dense = torch.nn.functional.scaled_dot_product_attention(
        query, k_hat.repeat_interleave(2, 1), v_hat.repeat_interleave(2, 1), attn_mask=mask, scale=D**-0.5
    )
    torch.testing.assert_close(out, dense.transpose(1, 2), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(k_hat[:, :, 2:18], keys[:, :, 2:18], atol=1e-2), "the history really is quantized"


@pytest.mark.parametrize("extra", ["softcap", "s_aux"])
def test_soft_capped_and_sink_attention_over_the_history(extra):
    """Decode with a quantized history: the torch path's output equals dense attention over the sequence it gives
    back (history dequantized and rotated back)."""
    from oscar_hf.kernels.decode.reference import dense_attention

    layer = make_layer(sink_tokens=2, recent_tokens=3, flush_tokens=2)
    layer.update(rows(20, 0), rows(20, 1))
    handle_k, handle_v = layer.update(rows(1, 3), rows(1, 4))
    assert layer.n_history > 0
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True)
    query = rows(1, 2).repeat_interleave(2, dim=1) * 4
    value = {"softcap": 1.5, "s_aux": torch.randn(2 * H, generator=torch.Generator().manual_seed(5)) * 3}[extra]
    out, _ = oscar_attention_forward(module, query, handle_k, handle_v, None, scaling=D**-0.5, **{extra: value})
    want = dense_attention(module, query, layer.materialize("key"), layer.materialize("value"), None, D**-0.5,
                           **{"softcap" if extra == "softcap" else "sinks": value})
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    plain, _ = oscar_attention_forward(module, query, handle_k, handle_v, None, scaling=D**-0.5)
    assert not torch.allclose(out, plain, atol=1e-3), "the extra changes the output"


def test_attention_rejects_a_sliding_window_on_an_oscar_layer():
    layer = make_layer()
    k, v = layer.update(rows(5, 0), rows(5, 1))
    module = types.SimpleNamespace(num_key_value_groups=1, is_causal=True)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        oscar_attention_forward(module, rows(1, 2), k, v, None, sliding_window=4)


@pytest.mark.parametrize("q_len", [1, 5])
def test_dense_attention_equals_the_models_own_eager_attention(q_len):
    """Soft-capped logits (Gemma-2's eager attention) and learned sink logits (gpt-oss's), GQA 2, causal over the
    last q_len tokens, a left-padded row."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    from oscar_hf.kernels.decode.reference import dense_attention

    query, key, value = rows(q_len, 0).repeat_interleave(2, 1) * 3, rows(12, 1), rows(12, 2)
    mask = torch.ones(B, 1, q_len, 12, dtype=torch.bool).tril(12 - q_len)
    mask[1, ..., :3] = False
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    sinks = torch.randn(2 * H, generator=torch.Generator().manual_seed(3))
    module = types.SimpleNamespace(num_key_value_groups=2, training=False, sinks=sinks, head_dim=D)
    want, _ = gemma2_eager(module, query, key, value, additive, scaling=D**-0.5, softcap=2.0)
    torch.testing.assert_close(dense_attention(module, query, key, value, mask, D**-0.5, softcap=2.0), want)
    want, _ = gpt_oss_eager(module, query, key, value, additive, scaling=D**-0.5)
    torch.testing.assert_close(dense_attention(module, query, key, value, mask, D**-0.5, sinks=sinks), want)


def test_cache_refuses_a_model_whose_attention_is_not_oscar():
    model = make_model("llama-mha-d64")
    cache = OscarQuantizedCache(model.config, OscarRotations.identity(model.config))
    with pytest.raises(RuntimeError, match="oscar_hf.enable"):
        model(input_ids=torch.tensor([[5, 6, 7]]), **cache_kwargs(model, cache), use_cache=True)


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
    assert type(cache.layers[0]) is DynamicOscarLayer and cache.layers[1].is_sliding


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


# ------------------------------------------------------------------------- per-channel K (KIVI's key layout)
def signed_permutation(dim: int, seed: int) -> torch.Tensor:
    """An orthogonal matrix whose products are exact in any summation order, so that the expected per-channel
    scales (a min or max one fp32 ulp off can cross an fp16 rounding boundary) do not depend on GEMM shapes."""
    g = torch.Generator().manual_seed(seed)
    eye = torch.eye(dim)[torch.randperm(dim, generator=g)]
    return eye * torch.where(torch.rand(dim, generator=g) < 0.5, -1.0, 1.0)


def make_per_channel_layer(per_head: bool = False, **config) -> OscarLayer:
    cfg = OscarConfig(**{"sink_tokens": 4, "recent_tokens": 8, "flush_tokens": 4, **PER_CHANNEL, **config})
    if per_head:  # one per KV head
        return DynamicOscarLayer(cfg, *(torch.stack([signed_permutation(D, seed + 10 * h) for h in range(H)])
                                        for seed in (1, 2)))
    return DynamicOscarLayer(cfg, signed_permutation(D, 1), signed_permutation(D, 2))


def expected_per_channel_sequence(layer: OscarLayer, x: torch.Tensor, side: str) -> torch.Tensor:
    """What a per-channel-K layer should give back of the sequence ``x`` given its counts: windows exact; in the
    history, rotated K quantized per channel over groups of flush_tokens tokens (from its first token), V per token,
    rotated back."""
    cfg = layer.config
    rotation = layer.key_rotation if side == "key" else layer.value_rotation
    s, q = layer.n_sink, layer.n_history
    block = x[:, :, s : s + q] @ rotation
    scale_dtype = cfg.torch_scale_dtype
    if side == "key":
        quantized = quantize_per_channel(block, token_group=cfg.flush_tokens, bits=cfg.bits, scale_dtype=scale_dtype)
        history = dequantize_per_channel(quantized, cfg.bits)
    else:
        history = dequantize(quantize(block, bits=cfg.bits, clip=cfg.v_clip, scale_dtype=scale_dtype), cfg.bits)
    return torch.cat([x[:, :, :s], history @ rotation.mT, x[:, :, s + q : layer.length]], dim=2)


def assert_holds(layer: OscarLayer, sequence: dict[str, torch.Tensor]) -> None:
    for side, x in sequence.items():
        expected = expected_per_channel_sequence(layer, x, side)
        torch.testing.assert_close(layer.materialize(side), expected, rtol=0, atol=1e-5)


def test_per_channel_keys_with_centered_values():
    """centering with per-channel K centers V alone: K is stored as without it, V's history holds v - μ_V."""
    layer = make_per_channel_layer(centering=True)
    keys, values = rows(30, 0), rows(30, 1)
    layer.update(keys, values)
    rotated = {"key": keys @ layer.key_rotation, "value": values @ layer.value_rotation}
    torch.testing.assert_close(layer.materialize("key"), expected_per_channel_sequence(layer, keys, "key"),
                               rtol=0, atol=1e-5)
    s, q = layer.n_sink, layer.n_history
    mean = rotated["value"][:, :, s : s + q].mean(2, keepdim=True)
    assert layer.center["key"].numel() == 0
    torch.testing.assert_close(layer.center["value"], mean)
    cfg = layer.config
    history = quantize(rotated["value"][:, :, s : s + q] - mean, bits=cfg.bits, clip=cfg.v_clip,
                       scale_dtype=cfg.torch_scale_dtype)
    torch.testing.assert_close(layer._history("value", q), dequantize(history, cfg.bits) + mean, rtol=0, atol=1e-5)
    bits, _ = layer.stored_bits_and_elements()
    uncentered = make_per_channel_layer()
    uncentered.update(keys, values)
    assert bits == uncentered.stored_bits_and_elements()[0] + 32 * B * H * D  # one fp32 μ_V per row and head


def test_per_channel_prefill_demotes_whole_token_groups():
    layer = make_per_channel_layer()  # sink 4, recent 8, token group 4
    keys, values = rows(30, 0), rows(30, 1)
    layer.update(keys, values)
    assert (layer.n_sink, layer.n_history, layer.n_recent) == (4, 16, 10), "26 past the sink: 4 whole groups"
    used = layer.history.read(layer.n_history)
    assert used["key_scale"].shape == used["key_zero"].shape == (B, H, 4, D), "one scale per channel and group"
    assert used["key_codes"].shape == (B, H, 16, D // 4) and used["value_scale"].shape == (B, H, 16, 1)
    assert_holds(layer, {"key": keys, "value": values})


@pytest.mark.parametrize(
    "chunks, steps",
    [([12] + [1] * 28, {0, 4}), ([5, 1, 7, 3, 1, 1, 13, 2, 1, 6], {0, 4, 8, 12})],
    ids=["decode", "uneven-chunks"],
)
def test_per_channel_demotions_move_whole_token_groups(chunks, steps):
    layer = make_per_channel_layer()
    keys, values = rows(sum(chunks), 0), rows(sum(chunks), 1)
    start, history_sizes = 0, [0]
    for n in chunks:
        layer.update(keys[:, :, start : start + n], values[:, :, start : start + n])
        start += n
        history_sizes.append(layer.n_history)
        assert layer.n_recent <= 11 and (layer.n_history == 0 or layer.n_recent >= 8)
    assert {b - a for a, b in zip(history_sizes, history_sizes[1:])} == steps
    assert_holds(layer, {"key": keys, "value": values})


@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_per_channel_crop_into_a_token_group_requantizes_its_survivors_with_their_next_group(per_head):
    layer = make_per_channel_layer(per_head)
    keys, values = rows(60, 0), rows(60, 1)
    layer.update(keys[:, :, :30], values[:, :, :30])  # sink 4, history 16 (positions 4..19), recent 10
    before = {side: layer.materialize(side) for side in ("key", "value")}
    layer.crop(-(layer.n_recent + 6))  # leaves 2 tokens (12, 13) of the group 12..15
    assert (layer.n_sink, layer.n_history, layer.n_recent) == (4, 8, 2)
    for side, x in before.items():
        torch.testing.assert_close(layer.materialize(side), x[:, :, :14], rtol=0, atol=0)
    for t in range(14, 60):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
        assert layer.n_history % 4 == 0
    # tokens 12 and 13 went back to the window as read from the history, and were quantized again from there
    given = {"key": keys, "value": values}
    assert_holds(layer, {side: torch.cat([x[:, :, :12], before[side][:, :, 12:14], x[:, :, 14:]], dim=2)
                         for side, x in given.items()})


def test_kivi_2_stores_what_its_bits_per_element_say():
    """The kivi-2 preset (K per channel over 32 tokens, V per token over 32 channels, fp16 scales; no sink, recent
    112): the stored bytes, counted from the tensors, match the analytic formula at every length."""
    model = make_model("qwen3-gqa-qknorm-d128")  # fp32 (fast on the CPU): 2 layers, 2 KV heads, head_dim 128
    cache = make_cache("kivi-2", model)
    ids = torch.randint(3, 90, (1, 240), generator=torch.Generator().manual_seed(0))
    through = cache_kwargs(model, cache)
    with torch.no_grad():
        model(input_ids=ids[:, :200], **through, use_cache=True)  # 88 past the window: 2 groups
        assert cache.bits_per_element == pytest.approx((136 * 32 + 64 * (2 + 16 / 32 + 16 / 32)) / 200)
        for t in range(200, 240):  # decode: the window cycles through 112 .. 143 tokens
            model(input_ids=ids[:, t : t + 1], **through, use_cache=True)
            assert cache.bits_per_element == pytest.approx(cache.config.bits_per_element(128, t + 1, model_bits=32))
    layer = cache.layers[0]
    assert (layer.n_sink, layer.n_history, layer.n_recent) == (0, 128, 112)
    key_bytes = 128 * 128 // 4 + 2 * (128 // 32) * 128 * 2  # codes + fp16 scale and zero per channel and group
    value_bytes = 128 * 128 // 4 + 2 * 128 * (128 // 32) * 2  # codes + fp16 scale and zero per token and group
    window_bytes = 2 * 112 * 128 * 4
    assert layer.stored_bits_and_elements() == (8 * 2 * (key_bytes + value_bytes + window_bytes), 2 * 2 * 240 * 128)
    assert layer.history["key_scale"].shape[2] == -(-layer.history.capacity // 32)


def test_per_channel_keys_bypass_the_triton_kernels(monkeypatch):
    triton = pytest.importorskip("triton")
    from oscar_hf.kernels.decode.launch import supports_call

    keys, values = rows(30, 0, dtype=torch.bfloat16), rows(30, 1, dtype=torch.bfloat16)
    layers = {backend: make_layer(backend=backend, **PER_CHANNEL) for backend in ("torch", "triton")}
    for layer in layers.values():
        layer.update(keys, values)
    stored = {backend: layer.history.read(layer.n_history) for backend, layer in layers.items()}
    for name, t in stored["torch"].items():
        assert torch.equal(stored["triton"][name], t), f"{name}: the torch writer stores per-channel K"
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)  # supports_call's stand-in for a CUDA query
    per_token = make_layer()
    per_token.update(keys, values)
    query = rows(1, 2, dtype=torch.bfloat16)
    assert supports_call(query, per_token.packed(), None, per_token.config.recent_tokens, per_token.length)
    assert not supports_call(query, layers["triton"].packed(), None, 8, layers["triton"].length)


@pytest.mark.parametrize("centering", [False, True])
def test_per_channel_keys_in_groups_of_one_token(centering):
    """flush_tokens=1 makes every per-channel K group one token: scale and zero per channel, [B, H, n, D], exact on
    reading back up to the fp16 zero (each channel's min and max are the value itself); V stays per token."""
    layer = make_layer(key_quantization="per-channel", k_clip=1.0, flush_tokens=1, centering=centering)
    keys, values = rows(20, 0), rows(20, 1)
    layer.update(keys, values)
    n = layer.n_history
    assert n == 20 - 4 - 8 and layer.history["key_scale"].shape[-1] == D
    stored = layer.materialize("key")[:, :, 4 : 4 + n]
    torch.testing.assert_close(stored, keys[:, :, 4 : 4 + n], rtol=0, atol=1e-4)  # (the fp16 zero: rounded down)
    assert not layer.packed().per_token_keys and layer.packed().key_token_group == 1
    if centering:
        with pytest.raises(ValueError, match="center both K and V or neither"):
            layer.packed().centers  # noqa: B018
