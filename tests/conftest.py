"""Test setup: fully offline, tiny random models built from configs."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import oscar_hf  # noqa: E402,F401  (registers the "oscar" attention)

VOCAB = 96

# name -> (config class, extra config fields). Small enough for fast CPU generate.
ARCHITECTURES = {
    "llama-mha-d64": ("LlamaConfig", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=64, hidden_size=128)),
    "qwen2-gqa-bias-d64": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=256)),
    "qwen3-gqa-qknorm-d128": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128, hidden_size=128),
    ),
    "mistral-gqa-d64": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=1, head_dim=64, hidden_size=128, sliding_window=None),
    ),
}


def make_model(
    arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> transformers.PreTrainedModel:
    """A tiny random decoder of architecture ``arch`` (a key of ARCHITECTURES), in eval mode."""
    config_name, fields = ARCHITECTURES[arch]
    defaults = dict(
        vocab_size=VOCAB,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = getattr(transformers, config_name)(**{**defaults, **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # random models would stop at random; keep lengths fixed
    return model.eval()


@pytest.fixture(params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param
