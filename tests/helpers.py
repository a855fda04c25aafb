"""Helpers shared by the tests: tiny random models built from configs, calibration inputs, and generation runs."""

from __future__ import annotations

import string

import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.generation.streamers import BaseStreamer

from oscar_hf import DynamicOscarLayer, OscarConfig, OscarQuantizedCache, OscarRotations, StaticOscarLayer, calibrate
from oscar_hf.demo import calibration_text
from oscar_hf.rotations import hadamard_matrix

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


# ------------------------------------------------------------------------------ calibration inputs
def token_ids(chunks: int = 3, length: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (chunks, length), generator=torch.Generator().manual_seed(seed))


def quick_calibrate(model, texts, tokenizer=None, **kwargs) -> OscarRotations:
    kwargs = {"max_length": 64, "diagnostic_tokens": 0, "show_progress": False, **kwargs}
    if "num_tokens" not in kwargs:
        kwargs["num_tokens"] = texts.numel()
    return calibrate(model, tokenizer, texts, **kwargs)


def char_tokenizer(bos: bool = False) -> PreTrainedTokenizerFast:
    """An offline character-level tokenizer: 4 specials + 73 characters (77 ids, below the tiny models' 96).
    With ``bos`` it puts its BOS ``<s>`` (id 1) before every text on its own, as Gemma's does (SmolLM2's adds none)."""
    chars = string.ascii_letters + string.digits + " .,;:!?'\"-\n"
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tokenizer


def austen(chars: int) -> str:
    """The start of the Austen excerpt shipped with oscar_hf."""
    return calibration_text()[:chars]


# ------------------------------------------------------------------------------ generation runs
NEW_TOKENS = 12


class TokenCollector(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.clone())

    def end(self):
        pass


def prompt(batch: int = 1, length: int = 17, seed: int = 0, left_pad: tuple[int, ...] = ()) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(left_pad):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def repetitive_prompt() -> dict:
    """A prompt whose n-grams recur, so prompt-lookup decoding proposes (and crops) candidates."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(model, inputs, cache=None, seed=0, **kwargs):
    torch.manual_seed(seed)
    extra = {"past_key_values": cache} if cache is not None else {}
    return model.generate(**inputs, max_new_tokens=NEW_TOKENS, pad_token_id=0, **extra, **kwargs)


def run(model, inputs, cache=None, seed=0, **kwargs) -> torch.Tensor:
    """Generated sequences (whatever the output type)."""
    out = generate(model, inputs, cache, seed, **kwargs)
    return out.sequences if hasattr(out, "sequences") else out


def full_precision_cache(model, rotations=None) -> OscarQuantizedCache:
    """Windows (64 + 256 tokens) that cover every test sequence: nothing is quantized."""
    return OscarQuantizedCache.from_pretrained(rotations or OscarRotations.identity(model.config), model=model)


MODES = {
    "greedy": (lambda: prompt(), {}),
    "sampling": (lambda: prompt(), dict(do_sample=True, top_k=20, temperature=0.9)),
    "left-padded-batch": (lambda: prompt(3, left_pad=(0, 5, 11)), {}),
    "beam-search": (lambda: prompt(2, left_pad=(0, 4)), dict(num_beams=3, num_return_sequences=2)),
    "num-return-sequences": (lambda: prompt(2, left_pad=(3, 0)), dict(do_sample=True, num_return_sequences=3)),
    "prompt-lookup": (repetitive_prompt, dict(prompt_lookup_num_tokens=3)),
    "return-dict": (lambda: prompt(), dict(return_dict_in_generate=True, output_scores=True)),
}


# ------------------------------------------------------------------ attention variants of other families
FAMILY_TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32, pad_token_id=0)
SLIDING_FULL = ["sliding_attention", "full_attention"]
GEMMA4 = dict(FAMILY_TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
              num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=VOCAB)

LINEAR = dict(linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=16, linear_value_head_dim=16,
              linear_conv_kernel_dim=4)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)

MLA_TINY = {**{k: v for k, v in FAMILY_TINY.items() if k != "head_dim"}, "num_key_value_heads": 2}
MLA = dict(kv_lora_rank=32, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
MLA_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32)

# name -> (config class, config fields)
FAMILIES = {
    "gemma2-softcap": ("Gemma2Config", dict(FAMILY_TINY, num_hidden_layers=3, attn_logit_softcapping=5.0,
                                            sliding_window=8,
                                            layer_types=["sliding_attention", "full_attention", "full_attention"])),
    "gpt-oss-sinks": ("GptOssConfig", dict(FAMILY_TINY, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention", "full_attention"])),
    "llama4-chunked": ("Llama4TextConfig", dict(FAMILY_TINY, num_hidden_layers=4, intermediate_size_mlp=64,
                                                attention_chunk_size=8, num_local_experts=2,
                                                no_rope_layers=[1, 1, 1, 0], interleave_moe_layer_step=2)),
    "gemma4-per-layer-geometry": ("Gemma4TextConfig", dict(GEMMA4, num_hidden_layers=4, layer_types=SLIDING_FULL * 2)),
    "gemma4-kv-sharing": ("Gemma4TextConfig", dict(GEMMA4, num_hidden_layers=6, layer_types=SLIDING_FULL * 3,
                                                   num_kv_shared_layers=2)),
    "gemma3n-kv-sharing": ("Gemma3nTextConfig", dict(FAMILY_TINY, num_hidden_layers=4, sliding_window=8,
                                                     layer_types=SLIDING_FULL * 2, num_kv_shared_layers=2,
                                                     hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                                                     laurel_rank=4, altup_num_inputs=2,
                                                     activation_sparsity_pattern=[0.0] * 4)),
    # hybrids: linear-attention (Gated DeltaNet) or Mamba layers beside full attention, or both in one layer
    "qwen3.5-hybrid": ("Qwen3_5TextConfig", dict(FAMILY_TINY, num_hidden_layers=4, **LINEAR)),
    "qwen3-next-hybrid": ("Qwen3NextConfig", dict(FAMILY_TINY, num_hidden_layers=4, num_experts=4,
                                                  num_experts_per_tok=2, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=32, **LINEAR)),
    "granite-4.0-h-hybrid": ("GraniteMoeHybridConfig", dict(FAMILY_TINY, num_hidden_layers=4, num_local_experts=0,
                                                            layer_types=["mamba", "attention"] * 2, **MAMBA)),
    "falcon-h1-hybrid": ("FalconH1Config", dict(FAMILY_TINY, num_hidden_layers=2, mamba_d_ssm=128, **MAMBA)),
    "jamba-hybrid": ("JambaConfig", dict(FAMILY_TINY, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                                         expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8,
                                         mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8)),
    "bamba-hybrid": ("BambaConfig", dict(FAMILY_TINY, num_hidden_layers=4, attn_layer_indices=[1, 3], mamba_expand=2,
                                         **MAMBA)),
    "nemotron-h-hybrid": ("NemotronHConfig", dict(FAMILY_TINY, num_hidden_layers=4, n_groups=1, chunk_size=16,
                                                  layers_block_type=["mamba", "attention", "mlp", "attention"],
                                                  mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8)),
    "zamba2-hybrid": ("Zamba2Config", dict(FAMILY_TINY, num_hidden_layers=4, hybrid_layer_ids=[1, 3],
                                           layers_block_type=["mamba", "hybrid"] * 2, mamba_d_state=8,
                                           mamba_headdim=16, mamba_ngroups=1, n_mamba_heads=8, chunk_size=16,
                                           num_mem_blocks=1, use_shared_attention_adapter=False, adapter_rank=8)),
    # multi-head latent attention: the cache holds the latent and the RoPE key
    "deepseek-v3-mla": ("DeepseekV3Config", dict(MLA_TINY, num_hidden_layers=2, first_k_dense_replace=1, **MLA_MOE,
                                                 **MLA)),
    "deepseek-v2-mla": ("DeepseekV2Config", dict(MLA_TINY, num_hidden_layers=2, first_k_dense_replace=1, **MLA_MOE,
                                                 **MLA)),
    "glm-4-moe-lite-mla": ("Glm4MoeLiteConfig", dict(MLA_TINY, num_hidden_layers=2, first_k_dense_replace=1,
                                                     **MLA_MOE, **MLA)),
    "minicpm3-mla": ("MiniCPM3Config", dict(MLA_TINY, num_hidden_layers=2, **MLA)),
    "longcat-flash-mla": ("LongcatFlashConfig", dict(MLA_TINY, num_layers=2, n_routed_experts=4, head_dim=8, **MLA)),
    "kimi-linear-mla-hybrid": ("KimiLinearConfig", dict(MLA_TINY, num_hidden_layers=2, linear_num_heads=2,
                                                        linear_head_dim=16, layer_types=["linear_attention",
                                                                                         "full_attention"],
                                                        num_experts=4, num_experts_per_token=2,
                                                        moe_intermediate_size=32, n_group=1, topk_group=1, **MLA)),
}


def build_family(name: str, dtype: torch.dtype = torch.float32, **overrides) -> transformers.PreTrainedModel:
    """A tiny random model of FAMILIES[name] (config fields changed by ``overrides``), in eval mode."""
    config_name, fields = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**{**fields, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for module in model.modules():  # learned sinks made large, so that they matter
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, std=2.0)
    model.generation_config.eos_token_id = None
    return model.eval()


# ------------------------------------------------------------------------------ exact rotations
def signed_hadamard(dim, heads=None, seed=3):
    """Hadamard rows in a random order with random signs ``[D, D]``, or ``heads`` different ones ``[heads, D, D]``
    (per-KV-head rotations). On values that are multiples of 1/4 below 64, every sum of the rotation is exact in
    fp32."""
    generator = torch.Generator().manual_seed(seed)

    def one():
        signs = torch.randint(0, 2, (dim, 1), generator=generator) * 2 - 1
        return (hadamard_matrix(dim)[torch.randperm(dim, generator=generator)] * signs).float()

    return one() if heads is None else torch.stack([one() for _ in range(heads)])


def static_and_host_layers(dim, *, max_len=120, heads=None, **config):
    """A static (max_cache_len) layer, whose one-token steps run the device-only operators (rotating in the append
    kernel), and a growing layer (the host path, the oracle: a GEMM), with the same settings: Triton backend, bf16,
    :func:`signed_hadamard` rotations (K's; V's their transpose), one per KV head where ``heads`` is given. On K/V
    that are multiples of 1/4 below 64, every sum of the rotation is exact in fp32, so both paths round it alike."""
    cfg = OscarConfig(backend="triton", **config)
    rotation = signed_hadamard(dim, heads)
    return (StaticOscarLayer(cfg, rotation, rotation.mT, max_len), DynamicOscarLayer(cfg, rotation, rotation.mT))
