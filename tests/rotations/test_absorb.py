"""absorb_value_rotation: R_V folded into v_proj and o_proj gives the same model, with and without the OSCAR cache."""

import copy

import pytest
import torch
from helpers import VOCAB, make_model

import oscar_hf.kernels.dequantize.reference as dequantize_reference
from oscar_hf import ModelShape, OscarQuantizedCache, OscarRotations, absorb_value_rotation, cache_kwargs

ARCHS = ["qwen2-gqa-bias-d64", "llama-mha-d64"]  # GQA with a v_proj bias; MHA without biases


def random_orthogonal(*shape: int, seed: int) -> torch.Tensor:
    """Random orthogonal matrices ``[*shape[:-1], D, D]`` (``shape[-1]`` is D)."""
    return torch.linalg.qr(torch.randn(*shape, shape[-1], generator=torch.Generator().manual_seed(seed))).Q


def random_bundle(model, per_head: bool = False) -> OscarRotations:
    """Random rotations per layer, or per layer and KV head."""
    shape = ModelShape.from_config(model.config)
    dims = (shape.num_layers, *((shape.num_kv_heads,) if per_head else ()), shape.head_dim)
    return OscarRotations(random_orthogonal(*dims, seed=1), random_orthogonal(*dims, seed=2),
                          num_kv_heads=shape.num_kv_heads, method="oscar", calibration={"tokens": 1})


@pytest.fixture(params=[(arch, per_head) for arch in ARCHS for per_head in (False, True)],
                ids=lambda p: p[0] + ("-per-head" if p[1] else ""))
def models(request):
    """(original model, its bundle, absorbed copy, the bundle absorb_value_rotation returned), with rotations per
    layer or per layer and KV head (each KV head block of v_proj and each query head block of o_proj takes its KV
    head's R_V)."""
    arch, per_head = request.param
    model = make_model(arch)
    with torch.no_grad():  # the random init leaves biases at zero; make the bias fold matter
        for module in model.modules():
            if getattr(module, "v_proj", None) is not None and module.v_proj.bias is not None:
                module.v_proj.bias.normal_()
    bundle = random_bundle(model, per_head)
    absorbed = copy.deepcopy(model)
    return model, bundle, absorbed, absorb_value_rotation(absorbed, bundle)


def prompt(length: int = 40) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))


def test_returned_bundle(models):
    model, bundle, _, absorbed_bundle = models
    assert torch.equal(absorbed_bundle.key_rotation, bundle.key_rotation)
    assert torch.equal(absorbed_bundle.value_rotation, torch.eye(bundle.head_dim).expand_as(bundle.value_rotation))
    assert absorbed_bundle.calibration == {"tokens": 1, "value_rotation_absorbed": True}
    assert not torch.equal(bundle.value_rotation, absorbed_bundle.value_rotation)  # the input bundle is untouched


@torch.no_grad()
def test_plain_forward_is_unchanged(models):
    """v_proj emits v·R_V, attention mixes rows so its output is o·R_V per head, and o_proj takes o·R_V: exact."""
    model, _, absorbed, _ = models
    for name in ("v_proj", "o_proj"):
        weights = [getattr(m.model.layers[0].self_attn, name).weight for m in (model, absorbed)]
        assert not torch.allclose(*weights), name
    torch.testing.assert_close(absorbed(prompt()).logits, model(prompt()).logits, atol=1e-4, rtol=0)


@torch.no_grad()
def test_same_logits_through_an_unquantized_cache(models):
    """Windows of 64 + 256 tokens hold the whole prompt: the only difference is where R_V is applied."""
    model, bundle, absorbed, absorbed_bundle = models
    reference = model(prompt(), **cache_kwargs(model, OscarQuantizedCache.from_pretrained(bundle, model=model))).logits
    cache = OscarQuantizedCache.from_pretrained(absorbed_bundle, model=absorbed)
    torch.testing.assert_close(absorbed(prompt(), **cache_kwargs(absorbed, cache)).logits, reference, atol=1e-4, rtol=0)


@torch.no_grad()
def test_same_greedy_generation_with_int2_history(models, monkeypatch):
    """Sink 4, recent 4: most of the 40-token prompt is read back from INT2. Both caches store v·R_V (rotated
    at write time, or emitted so by v_proj), so the two runs agree up to float rounding."""
    model, bundle, absorbed, absorbed_bundle = models

    def generate(m, rotations):
        cache = OscarQuantizedCache.from_pretrained(rotations, model=m, sink_tokens=4, recent_tokens=4, flush_tokens=2)
        out = m.generate(prompt(), past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True)
        assert cache.layers[0].n_history > 0
        return out.sequences, torch.stack(out.logits)

    tokens, logits = generate(model, bundle)
    calls = []
    real_unrotate = dequantize_reference.unrotate
    monkeypatch.setattr(dequantize_reference, "unrotate", lambda x, r: calls.append(r.shape) or real_unrotate(x, r))
    absorbed_tokens, absorbed_logits = generate(absorbed, absorbed_bundle)
    # the absorbed V rotation is the identity: the cache skips its GEMMs (only the K history is rotated back, once
    # per layer and decode step)
    assert len(calls) == len(absorbed.model.layers) * 7
    assert torch.equal(absorbed_tokens, tokens)
    torch.testing.assert_close(absorbed_logits, logits, atol=1e-4, rtol=0)  # INT2 moves them by ~0.1


def test_bundle_for_another_model_raises_and_leaves_the_model_alone():
    model = make_model("qwen2-gqa-bias-d64")
    before = copy.deepcopy(model.state_dict())
    other = OscarRotations.identity(make_model("mistral-gqa-d64").config)  # 1 KV head instead of 2
    with pytest.raises(ValueError, match="num_kv_heads"):
        absorb_value_rotation(model, other)
    deeper = OscarRotations.identity(make_model("qwen2-gqa-bias-d64", num_hidden_layers=3).config)
    with pytest.raises(ValueError, match="num_layers"):
        absorb_value_rotation(model, deeper)
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
