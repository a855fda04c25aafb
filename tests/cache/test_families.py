"""The attention variants of the model families the cache serves beyond plain full attention, on tiny random models:
soft-capped logits (Gemma-2), learned sinks (gpt-oss), chunked layers (Llama-4), per-layer head_dim and KV heads with
K = V full layers (Gemma-4), KV shared across layers (Gemma-4 E-size, Gemma-3n).

Each family: with windows that cover the sequence, generation equals the default cache's (greedy and sampled, fp32
and bf16, growing and static cache); calibrated, with most of the prompt in INT2, it runs and stores fewer bits."""

import pytest
import torch
import transformers
from helpers import FAMILIES, VOCAB, quick_calibrate
from helpers import build_family as build

from oscar_hf import OscarQuantizedCache, OscarRotations, cache_kwargs, check_model_supported
from oscar_hf.cache import OscarLayer

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = dict(max_new_tokens=8, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def prompt(length: int = 30) -> dict[str, torch.Tensor]:
    """A left-padded batch of two."""
    ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def generate(model, cache=None, sample: bool = False, length: int = 30):
    """(tokens, logits) of the prompt's continuation; the model's attention implementation is restored after."""
    implementation = model.config._attn_implementation
    torch.manual_seed(7)
    out = model.generate(**prompt(length), **(cache_kwargs(model, cache) if cache is not None else {}), **SETTINGS,
                         do_sample=sample, **({"top_k": 20} if sample else {}))
    model.set_attn_implementation(implementation)
    return out.sequences, torch.stack(out.logits).float()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["greedy", "sample", "static"])
def test_lossless_with_covering_windows(family, dtype, mode):
    """Nothing quantized (the windows hold every token): the default cache's tokens and logits."""
    model = build(family, dtype)
    check_model_supported(model)
    expected = generate(model, sample=mode == "sample")
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                max_cache_len=64 if mode == "static" else None)
    got = generate(model, cache, sample=mode == "sample")
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-5 if dtype == torch.float32 else 0)
    shape = check_model_supported(model)
    kinds = [type(layer).__name__ for layer in cache.layers]
    for i, kind in enumerate(shape.layer_types):
        want = ("DummyLayer" if not shape.reads_own_kv(i) else
                "OscarLayer" if kind == "full_attention" else "DynamicSlidingWindowLayer")
        assert want in kinds[i], (i, kinds)
        if want == "DynamicSlidingWindowLayer":
            assert cache.layers[i].sliding_window == shape.window(kind) == 8


@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_run(family):
    """Calibrated, most of a 96-token prompt in INT2: every OSCAR layer holds a history, and stores under 12 bits per
    element (about 3.5 in the history, 32 in the windows) against the model's 32."""
    model = build(family)
    rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0)))
    cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=4, recent_tokens=8)
    tokens, logits = generate(model, cache, length=96)
    oscar = [layer for layer in cache.layers if isinstance(layer, OscarLayer)]
    assert oscar and all(layer.n_history > 0 for layer in oscar)
    bits = sum(layer.stored_bits_and_elements()[0] for layer in oscar)
    elements = sum(layer.stored_bits_and_elements()[1] for layer in oscar)
    assert bits / elements < 12 and cache.bits_per_element < 32
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

    transformers.AttentionInterface.register("oscar", spy)
    try:
        rotations = quick_calibrate(model, torch.randint(3, VOCAB, (2, 64)))
        cache = OscarQuantizedCache.from_pretrained(rotations, model=model, sink_tokens=4, recent_tokens=8)
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
