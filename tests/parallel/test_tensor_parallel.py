"""Tensor parallelism (transformers' tp_plan) on two CPU processes (torchrun, gloo): the cache and calibration give
what one process gives."""

import pytest
import torch
from helpers import make_model
from parallel.tp_worker import CACHE_SETTINGS, calibrate_both, launch, run_cache

from oscar_hf import OscarQuantizedCache, OscarRotations
from oscar_hf.cache import DynamicOscarLayer
from oscar_hf.config import OscarConfig
from oscar_hf.parallel import TensorParallel

ARCH = "qwen2-gqa-bias-d64"  # 2 KV heads (1 per rank), 4 query heads, q/k/v biases split with their rows
TOLERANCE = 1e-3  # logits of ~1: the ranks' all-reduces sum in another order than one process


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The model, its bundles (shared and per head), and the two ranks' outputs (torchrun once)."""
    root = tmp_path_factory.mktemp("tp")
    model = make_model(ARCH)
    model.save_pretrained(root / "model")
    bundles = calibrate_both(model)
    for per_head, rotations in bundles.items():
        rotations.save_pretrained(root / ("per-head" if per_head else "shared"))
    ranks = launch(root / "model", root, "float32", [root / "shared", root / "per-head"])
    return root, model, bundles, ranks


@pytest.mark.parametrize("bundle", ["shared", "per-head"])
def test_cache_on_two_ranks_gives_one_process_logits(run, bundle):
    root, model, _, ranks = run
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.from_pretrained(root / bundle), model=model,
                                                **CACHE_SETTINGS)
    logits, tokens = run_cache(model, cache)
    assert cache.layers[0].n_history > 0  # the prompt reached the INT2 history
    for outputs, nbytes in ranks:
        torch.testing.assert_close(outputs[f"{bundle}.logits"], logits, atol=TOLERANCE, rtol=0)
        assert outputs[f"{bundle}.tokens"].tolist() == tokens.tolist()
        # each rank stores its half of the heads and of per-head rotations, and all of a shared one
        shared_rotations = sum(layer.key_rotation.nbytes + layer.value_rotation.nbytes for layer in cache.layers)
        assert 2 * nbytes[bundle] - cache.nbytes == (shared_rotations if bundle == "shared" else 0)


def test_a_rank_reading_the_other_heads_rotations_would_fail_the_comparison(run):
    """The per-head comparison can fail: the same cache with the heads' rotations swapped is far off."""
    root, model, bundles, ranks = run
    swapped = OscarRotations.from_pretrained(root / "per-head")
    swapped.key_rotation = [r.flip(0) for r in swapped.key_rotation]
    swapped.value_rotation = [r.flip(0) for r in swapped.value_rotation]
    logits, _ = run_cache(model, OscarQuantizedCache.from_pretrained(swapped, model=model, **CACHE_SETTINGS))
    assert (ranks[0][0]["per-head.logits"] - logits).abs().max() > 10 * TOLERANCE


@pytest.mark.parametrize("per_head", [False, True])
def test_calibration_on_two_ranks_gives_one_process_bundle(run, per_head):
    root, _, bundles, _ = run
    one = bundles[per_head]
    for rank in range(2):  # every rank computes the whole bundle
        two = OscarRotations.from_pretrained(root / f"calibrated-per-head-{per_head}-rank{rank}")
        assert two.per_head == per_head and two.calibration["tokens"] == one.calibration["tokens"]
        for name in ("key_rotation", "value_rotation", "key_eigenvalues", "value_eigenvalues"):
            assert len(getattr(two, name)) == len(getattr(one, name)) == 2
            for a, b in zip(getattr(two, name), getattr(one, name)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert [row["layer"] for row in two.diagnostics] == [row["layer"] for row in one.diagnostics] == [0, 1]
        for a, b in zip(two.diagnostics, one.diagnostics):
            assert a["tokens"] == b["tokens"] and a["k_error"] > 0
            for metric in ("k_error", "v_error", "score_kl", "output_error", "k_clip_rate", "v_clip_rate"):
                assert a[metric] == pytest.approx(b[metric], rel=1e-4, abs=1e-7), metric


# ------------------------------------------------------------------------------------ one process
def test_a_layer_keeps_the_rotations_of_its_rank_heads():
    rotations = torch.linalg.qr(torch.randn(4, 8, 8))[0]
    layer = DynamicOscarLayer(OscarConfig(), rotations, rotations.flip(0))
    layer.tensor_parallel = TensorParallel(1, 2)
    kv = torch.randn(1, 2, 3, 8)
    layer.update(kv, kv)
    torch.testing.assert_close(layer.key_rotation, rotations[2:])
    torch.testing.assert_close(layer.value_rotation, rotations.flip(0)[2:])


def test_per_head_rotations_for_a_share_of_the_heads_name_tensor_parallelism():
    layer = DynamicOscarLayer(OscarConfig(), torch.eye(8).expand(2, 8, 8), torch.eye(8).expand(2, 8, 8))
    with pytest.raises(ValueError, match="tp_plan"):
        layer.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8))


@pytest.mark.parametrize("rank, size, message", [(2, 2, "rank 2 of 2"), (-1, 2, "rank -1"), (0, 0, "of 0")])
def test_a_bad_rank_is_refused(rank, size, message):
    with pytest.raises(ValueError, match=message):
        TensorParallel(rank, size)


def test_heads_split_evenly_or_not_at_all():
    tp = TensorParallel(1, 4)
    assert tp.heads(8) == slice(2, 4)
    assert tp.is_split(2, 8) and not tp.is_split(8, 8)
    with pytest.raises(ValueError, match="do not split evenly"):
        tp.heads(6)
    with pytest.raises(ValueError, match="neither all nor"):
        tp.is_split(3, 8)


def test_a_model_on_one_process_has_no_tensor_parallelism():
    assert TensorParallel.of(make_model(ARCH)) is None
