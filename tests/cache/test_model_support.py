"""Which models the OSCAR cache serves, and clear refusals for the ones it cannot serve correctly."""

import warnings

import pytest
import torch
import transformers
from helpers import MLA, MLA_MOE, MLA_TINY, VOCAB, make_model

from oscar_hf import OscarQuantizedCache, OscarRotations, UnsupportedModelError, cache_kwargs, check_model_supported

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
)


def tiny(config_name: str, **fields):
    config = getattr(transformers, config_name)(**{**TINY, **fields})
    return transformers.AutoModelForCausalLM.from_config(config).eval()


REFUSED = {
    "sparse-attention-deepseek-v3.2": (
        lambda: transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV32Config(
            **MLA_TINY, num_hidden_layers=2, first_k_dense_replace=1, **MLA_MOE, **MLA)),
        "DeepSeek Sparse Attention",
    ),
    "all-chunked": (lambda: tiny("Llama4TextConfig", intermediate_size_mlp=64, attention_chunk_size=8,
                                 num_local_experts=2, no_rope_layers=[1, 1]), "nothing to quantize"),
    # transformers' MiniMax raises on any cache but its own MiniMaxCache, inside the first forward
    "minimax-own-cache": (lambda: tiny("MiniMaxConfig", num_local_experts=2,
                                       layer_types=["linear_attention", "full_attention"]), "MiniMaxCache"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_at_from_pretrained_with_a_clear_error(case):
    build, reason = REFUSED[case]
    model = build()
    with pytest.raises(UnsupportedModelError, match=reason):
        check_model_supported(model)
    with pytest.raises(UnsupportedModelError, match=reason):
        OscarQuantizedCache.from_pretrained(OscarRotations.identity(model.config), model=model)
    assert model.config._attn_implementation != "oscar", "a refused model is left untouched"


ATTENTION_FREE = {
    "mamba": ("MambaConfig", dict(state_size=4)),
    "mamba2": ("Mamba2Config", dict(state_size=4, num_heads=4, head_dim=16, n_groups=1)),
    "falcon_mamba": ("FalconMambaConfig", dict(state_size=4)),
    "rwkv": ("RwkvConfig", dict(attention_hidden_size=32, intermediate_size=64)),
    "xlstm": ("xLSTMConfig", dict(num_heads=2)),
}


@pytest.mark.parametrize("model_type", list(ATTENTION_FREE))
def test_attention_free_families_are_refused_for_having_no_attention(model_type):
    """Pure state-space and recurrent models: nothing to quantize, whatever their modeling code routes."""
    config_name, fields = ATTENTION_FREE[model_type]
    config = getattr(transformers, config_name)(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, **fields)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match=rf"\({model_type}\): .*no attention, so no K/V to quantize"):
        check_model_supported(model)


def test_encoder_decoder_refused():
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    model = transformers.T5ForConditionalGeneration(config)
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        check_model_supported(model)


def test_gemma3_head_dim_256_with_sliding_layers_is_served():
    config = transformers.Gemma3TextConfig(
        **{**TINY, "head_dim": 256, "num_hidden_layers": 3},
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    inputs = {"input_ids": torch.randint(3, VOCAB, (2, 20)), "attention_mask": torch.ones(2, 20, dtype=torch.long)}
    inputs["attention_mask"][1, :4] = 0
    expected = model.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=0)
    cache = OscarQuantizedCache.from_pretrained(
        OscarRotations.hadamard(model.config), model=model, k_clip=1.0, v_clip=1.0
    )
    got = model.generate(**inputs, max_new_tokens=10, do_sample=False, pad_token_id=0, past_key_values=cache)
    assert (got == expected).all()
    assert [type(layer).__name__ for layer in cache.layers][2] == "DynamicOscarLayer"


def test_supported_architectures_report_their_shape(arch):
    shape = check_model_supported(make_model(arch))
    assert shape.num_layers == 2 and "full_attention" in shape.layer_types


def test_cache_kwargs_names_the_argument_the_installed_transformers_takes():
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns); before it, a ``cache=`` went
    unread into the model's kwargs and the cache stayed empty."""
    model = make_model("qwen3-gqa-qknorm-d128")
    rotations = OscarRotations.hadamard(model.config)
    forward_cache, generate_cache = (OscarQuantizedCache.from_pretrained(rotations, model=model) for _ in range(2))
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model(input_ids=ids, **cache_kwargs(model, forward_cache), use_cache=True)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_kwargs(model, generate_cache),
                             max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert forward_cache.get_seq_length() == 5
    assert out.shape == (1, 8) and generate_cache.get_seq_length() == 7  # all but the last new token

    class Legacy(torch.nn.Module):  # remote code that kept the old name
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_kwargs(Legacy(), forward_cache) == {"past_key_values": forward_cache}
