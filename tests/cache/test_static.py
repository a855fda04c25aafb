"""Static layers' graph steps with the Triton backend: the append operator (rotating, demoting, the device counts,
the query rotated in the same kernel, a token left to the attention) against the growing layer's host path, the
flags it raises, and crop(-1) undoing a step: on the CPU under TRITON_INTERPRET=1 (set by ``triton_interpreter``),
or compiled on a GPU."""

import os

import pytest
import torch
from helpers import static_and_host_layers
from triton_interpreter import faster_triton_interpreter  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
pytest.importorskip("triton")

from oscar_hf import (  # noqa: E402
    OscarConfig,
    StaticOscarLayer,
)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize(  # tokens: the prompt and the steps, 9 or more demotions, the ring wrapped 3 times or more
    "prompt, config",
    [(3, dict(sink_tokens=4, recent_tokens=5, flush_tokens=3, tokens=40)),  # sink filled by steps; means set by a step
     (40, dict(sink_tokens=4, recent_tokens=8, flush_tokens=4, k_clip=1.0, v_clip=1.0, centering=False, tokens=80)),
     (30, dict(sink_tokens=0, recent_tokens=6, flush_tokens=1, group_size=32, tokens=55)),
     (20, dict(sink_tokens=2, recent_tokens=6, flush_tokens=2, key_bits=4, centering=False, tokens=50)),
     (20, dict(sink_tokens=2, recent_tokens=6, flush_tokens=2, centering=False, dtype=torch.float16, tokens=50)),
     (8, dict(sink_tokens=2, recent_tokens=3, flush_tokens=1, centering=False, dim=512, tokens=12)),
     (20, dict(sink_tokens=2, recent_tokens=6, flush_tokens=2, centering=False, heads=3, tokens=40)),
     (20, dict(sink_tokens=2, recent_tokens=6, flush_tokens=2, key_bits=4, centering=False, quantizer="symmetric",
               tokens=50)),
     (20, dict(sink_tokens=2, recent_tokens=6, flush_tokens=2, key_bits=4, centering=False, quantizer="compact",
               tokens=50))],
    ids=["sink-first", "uncentered-unclipped", "no-sink-flush-1", "4-bit-keys", "fp16", "D512", "per-head",
         "symmetric-4-bit-keys", "compact-4-bit-keys"],
)
def test_graph_step_stores_what_the_host_path_stores(prompt, config):
    """Steps through the append operator (rotation, ring buffer, device counts) leave the same sequence as the host
    path: codes, scales and zeros bit for bit without centering; with it, the means are summed in another order."""
    config = dict(config)
    dtype, dim, tokens = config.pop("dtype", torch.bfloat16), config.pop("dim", 64), config.pop("tokens")
    static, host = static_and_host_layers(dim, **config)
    kv = ((randn(2, 2, 3, tokens, dim, seed=11) * 8).round() / 4).to(dtype)
    for layer in (static, host):
        layer.update(kv[0, :, :, :prompt], kv[1, :, :, :prompt])
    assert static.graph_step and static.counts_on_device and not host.graph_step
    # CUDA graphs would otherwise copy (or refuse to capture) every buffer the step mutates
    assert all(torch._dynamo.utils.get_static_address_type(t) for t in (*static._tensors(), static.counts))
    starts = set()
    for t in range(prompt, tokens):
        assert static._takes_graph_step(kv[0, :, :, t : t + 1])
        static.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        host.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        starts.add(static.recent_start)
    assert len(starts) > 2, "the ring buffer wrapped"
    assert static.counts.tolist()[:3] == [host.n_sink, host.n_history, host.n_recent] and host.n_history > 0
    assert static.flags.tolist() == [0, 0]  # no error; the append kernel's arrival count back at zero
    exact = not static.config.centering
    for side in ("key", "value"):
        torch.testing.assert_close(static.materialize(side), host.materialize(side), rtol=0,
                                   atol=0 if exact else 0.1)
    if exact:
        for name in host.history.tensors:
            assert torch.equal(static.history[name][:, :, : host.n_history], host.history[name][:, :, : host.n_history])


@pytest.mark.parametrize("dim, group_q, heads", [(64, 4, None), (128, 1, None), (128, 16, None), (64, 3, 2)],
                         ids=["64-4", "128-1", "128-16", "64-3-per-head"])
def test_append_kernel_rotates_the_step_query_like_the_rotate_gemm(dim, group_q, heads):
    """A graph step left to the attention (as OscarQuantizedCache.update leaves it) is stored by the append kernel
    that also rotates the step's query: q · R_K (its KV head's, per head) as ``rotate_queries`` computes it, bit for
    bit on exact sums, from the strided q that attention receives (17 rows at a group of 16); the layer then holds
    what steps stored at once hold, and the token is stored once."""
    from oscar_hf.kernels.append.reference import rotate_queries

    config = dict(sink_tokens=2, recent_tokens=4, flush_tokens=2, heads=heads)
    left, stored = (static_and_host_layers(dim, **config)[0] for _ in range(2))
    kv = ((randn(2, 2, 2, 14, dim, seed=5) * 8).round() / 4).to(torch.bfloat16)
    for layer in (left, stored):
        layer.update(kv[0, :, :, :9], kv[1, :, :, :9])
    for t in range(9, 14):
        query = ((randn(2, 1, 2 * group_q, dim, seed=t) * 8).round() / 4).to(torch.bfloat16).transpose(1, 2)
        left.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        stored.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
        rotated = left._store_pending(query=query)
        assert rotated.is_contiguous() and left._store_pending(query=query) is None
        torch.testing.assert_close(rotated, rotate_queries(query, left.key_rotation), rtol=0, atol=0)
    assert left.counts.tolist() == stored.counts.tolist() and left.n_history > 0
    for side in ("key", "value"):
        assert torch.equal(left.materialize(side), stored.materialize(side))


def test_a_token_left_to_the_attention_is_stored_by_the_layers_next_use():
    """A token that no attention function stored (another consumer of the handles) is stored before the layer is
    read or updated again."""
    left, stored = (static_and_host_layers(64, sink_tokens=2, recent_tokens=4, flush_tokens=2)[0] for _ in range(2))
    kv = ((randn(2, 1, 2, 9, 64, seed=6) * 8).round() / 4).to(torch.bfloat16)
    for layer in (left, stored):
        layer.update(kv[0, :, :, :6], kv[1, :, :, :6])
    for t in range(6, 9):
        stored.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
    left.update(kv[0, :, :, 6:7], kv[1, :, :, 6:7])
    assert left.get_seq_length() == 7
    left.update(kv[0, :, :, 7:8], kv[1, :, :, 7:8])
    left.update(kv[0, :, :, 8:9], kv[1, :, :, 8:9])  # stores the token left before it first
    assert left.get_seq_length() == 9 and left.counts.tolist() == stored.counts.tolist()
    for side in ("key", "value"):
        assert torch.equal(left.materialize(side), stored.materialize(side))
    left.update(kv[0, :, :, 8:9], kv[1, :, :, 8:9])
    left.reset()  # drops a token left pending
    assert left.get_seq_length() == 0


def test_a_layer_without_a_key_rotation_leaves_the_query_as_it_is():
    """With R_K the identity the pending token is stored and no rotated query is returned (the decode reads q)."""
    cfg = OscarConfig(backend="triton", sink_tokens=2, recent_tokens=4, flush_tokens=2)
    layer = StaticOscarLayer(cfg, torch.eye(64), torch.eye(64), 20)
    kv = ((randn(2, 1, 2, 7, 64, seed=7) * 8).round() / 4).to(torch.bfloat16)
    layer.update(kv[0, :, :, :6], kv[1, :, :, :6])
    layer.update(kv[0, :, :, 6:], kv[1, :, :, 6:])
    assert layer._store_pending(query=randn(1, 4, 1, 64, seed=8).to(torch.bfloat16)) is None
    assert layer.counts.tolist()[:3] == [2, 0, 5]
    torch.testing.assert_close(layer.materialize("key"), kv[0], rtol=0, atol=0)


def test_graph_step_flags_a_full_cache_and_non_finite_rows():
    static, _ = static_and_host_layers(64, max_len=20, sink_tokens=2, recent_tokens=2, flush_tokens=2)
    kv = randn(2, 1, 2, 21, 64, seed=13).to(torch.bfloat16)
    static.update(kv[0, :, :, :19], kv[1, :, :, :19])
    static.update(kv[0, :, :, 19:20], kv[1, :, :, 19:20])
    static.update(kv[0, :, :, 20:21], kv[1, :, :, 20:21])  # the 21st token: flagged on the device, not stored
    with pytest.raises(ValueError, match="full"):
        static.get_seq_length()
    for side, flag in ((0, 1), (1, 4)):  # K's and V's programs flag their own bits (the flag layout of kernels.flags)
        static.reset()
        assert static.get_seq_length() == 0 and static.flags.tolist() == [0, 0]
        bad = kv.clone()
        bad[side, 0, 1, 3] = float("nan")  # stored by the first step, demoted by the third
        static.update(bad[0, :, :, :3], bad[1, :, :, :3])
        for t in range(3, 6):  # the NaN row reaches the history on a step
            static.update(bad[0, :, :, t : t + 1], bad[1, :, :, t : t + 1])
        assert static.flags.tolist() == [flag, 0]
        with pytest.raises(ValueError, match="NaN"):
            static.materialize("key")


@pytest.mark.parametrize("prompt, steps", [(2, 0), (9, 0), (11, 0), (11, 9)],
                         ids=["sink", "recent", "first-demotion-sets-the-means", "demotion-ring-wrapped"])
def test_crop_of_one_undoes_a_graph_step_exactly(prompt, steps):
    """After a prompt and some graph steps, a step is undone (crop(-1)), taken again and followed by one more: the
    layer then holds, bit for bit, what a layer that took those two steps once holds. crop(0) touches nothing."""
    config = dict(sink_tokens=4, recent_tokens=5, flush_tokens=3)  # a window of 7 tokens, a ring of 8 rows
    undone, straight = (static_and_host_layers(64, **config)[0] for _ in range(2))
    kv = ((randn(2, 2, 3, 40, 64, seed=14) * 8).round() / 4).to(torch.bfloat16)

    def step(layer, t):
        layer.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])

    for layer in (undone, straight):
        layer.update(kv[0, :, :, :prompt], kv[1, :, :, :prompt])
        for t in range(prompt, prompt + steps):
            step(layer, t)
    t = prompt + steps
    assert undone.is_croppable
    before = undone.counts.tolist()
    step(undone, t)
    assert undone.counts.tolist()[:4] != before[:4]
    undone.crop(0)
    undone.crop(-1)
    assert undone.counts.tolist()[:4] == before[:4] and undone.counts.tolist()[4] == -1
    for layer in (undone, straight):
        step(layer, t)
        step(layer, t + 1)
    assert undone.counts.tolist() == straight.counts.tolist()
    assert straight.n_history == (0 if prompt + steps < 11 else 3 + steps // 3 * 3)
    for side in ("key", "value"):
        assert torch.equal(undone.materialize(side), straight.materialize(side))
        assert torch.equal(undone.center[side], straight.center[side])
    for name, t in straight.history.tensors.items():
        assert torch.equal(undone.history[name][:, :, : straight.n_history], t[:, :, : straight.n_history]), name


def test_crop_of_one_after_host_side_changes_removes_the_newest_token():
    """Once host-side code has changed a static layer since its last graph step (here: two tokens at once), crop(-1)
    no longer restores the counts before that step; it drops the newest token as any crop does."""
    static, host = static_and_host_layers(64, sink_tokens=2, recent_tokens=4, flush_tokens=2)
    kv = randn(2, 1, 2, 12, 64, seed=15).to(torch.bfloat16)
    for layer in (static, host):
        for chunk in (slice(0, 8), slice(8, 9), slice(9, 11)):  # a prompt, a (graph) step, two tokens
            layer.update(kv[0, :, :, chunk], kv[1, :, :, chunk])
        layer.crop(-1)
    assert static.counts.tolist()[4] == -1
    assert static.get_seq_length() == host.get_seq_length() == 10
    torch.testing.assert_close(static.materialize("key"), host.materialize("key"), rtol=0, atol=0)
