"""head_dims that are not powers of two (80 = 16·5, 96 = 32·3, 192 = 64·3): Hadamard and calibrated rotations, and the
cache over them on both backends. The Triton kernels decline these shapes in their ``supports*`` predicates, so the
"triton" backend runs the torch twins: the same logits, bit for bit (on the CPU under TRITON_INTERPRET=1, set by
``triton_interpreter``)."""

import pytest
import torch
from helpers import make_model, quick_calibrate, token_ids
from transformers import DynamicCache
from triton_interpreter import faster_triton_interpreter  # noqa: F401

from oscar_hf import OscarQuantizedCache, OscarRotations, cache_kwargs
from oscar_hf.kernels import ATTENTION_BACKENDS

pytestmark = pytest.mark.usefixtures("one_thread")

HEAD_DIMS = [80, 96, 192]
PREFILL, TOTAL = 40, 48  # with 4 sink and 8 recent tokens, 28 of the prefill's 40 tokens go to the INT2 history
BACKENDS = [b for b in ("torch", "triton") if b in ATTENTION_BACKENDS]


def model_at(head_dim: int):
    return make_model("llama-mha-d64", head_dim=head_dim)


def teacher_forced(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[TOTAL - PREFILL + 1, V]`` (fp32) at positions ``PREFILL - 1`` on: the prefill in one
    forward, then one token per step."""
    kwargs = cache_kwargs(model, cache)
    logits = [model(input_ids=ids[:, :PREFILL], **kwargs, use_cache=True).logits[:, -1]]
    for t in range(PREFILL, ids.shape[1]):
        logits.append(model(input_ids=ids[:, t:t + 1], **kwargs, use_cache=True).logits[:, -1])
    return torch.cat(logits).float()


def kl_to_full_precision(model, logits: torch.Tensor, ids: torch.Tensor) -> float:
    reference = model(input_ids=ids).logits[0, PREFILL - 1:].float()
    return torch.nn.functional.kl_div(logits.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                      reduction="batchmean").item()


def assert_quantized_and_close(model, rotations, **config):
    """With most of the prompt in INT2: finite logits close to the model's own (KL about 2e-4 on these random
    models, at head_dims 64 and 128 too), the same on every backend, growing or static."""
    ids = token_ids(1, TOTAL, seed=3)
    runs = {}
    for backend in BACKENDS:
        for max_cache_len in (None, 64):
            cache = OscarQuantizedCache.from_pretrained(rotations, model=model, backend=backend, sink_tokens=4,
                                                        recent_tokens=8, max_cache_len=max_cache_len, **config)
            runs[backend, max_cache_len] = teacher_forced(model, cache, ids)
            assert all(layer.n_history >= PREFILL - 12 for layer in cache.layers)
    logits = runs["torch", None]
    assert logits.isfinite().all()
    assert 0 < kl_to_full_precision(model, logits, ids) < 5e-3
    for run, other in runs.items():
        assert torch.equal(other, logits), run


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_lossless_with_covering_windows(head_dim, backend):
    """Nothing quantized (the default windows hold all 48 tokens): DynamicCache's logits exactly."""
    model = model_at(head_dim)
    ids = token_ids(1, TOTAL, seed=3)
    expected = teacher_forced(model, DynamicCache(), ids)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, backend=backend)
    assert torch.equal(teacher_forced(model, cache, ids), expected)
    assert all(layer.n_history == 0 for layer in cache.layers)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_quantized_history_with_hadamard_rotations(head_dim):
    model = model_at(head_dim)
    rotations = OscarRotations.hadamard(model.config)
    torch.testing.assert_close(rotations.key_rotation[0].double() @ rotations.key_rotation[0].double().T,
                               torch.eye(head_dim, dtype=torch.float64), rtol=0, atol=1e-6)
    assert_quantized_and_close(model, rotations)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_calibration(head_dim):
    """calibrate's defaults (R = U·H·P from the query and key-weighted value covariances) at these head_dims: orthogonal
    rotations, and a cache over them that stays close."""
    model = model_at(head_dim)
    rotations = quick_calibrate(model, token_ids(2, 64))
    assert rotations.key_rotation.shape == (2, head_dim, head_dim)
    for r in (*rotations.key_rotation, *rotations.value_rotation):
        torch.testing.assert_close(r.double() @ r.double().T, torch.eye(head_dim, dtype=torch.float64), rtol=0,
                                   atol=1e-5)
    assert_quantized_and_close(model, rotations)


def test_group_size_must_divide_head_dim():
    """80 channels: groups of 16 (5 per row) are served, groups of 32 refused."""
    model = model_at(80)
    rotations = OscarRotations.hadamard(model.config)
    assert_quantized_and_close(model, rotations, group_size=16)
    with pytest.raises(ValueError, match="group_size=32 must divide head_dim=80"):
        OscarQuantizedCache.from_pretrained(rotations, model=model, group_size=32)
