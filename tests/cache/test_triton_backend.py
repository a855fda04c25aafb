"""The cache on the Triton backend: a growing layer's writes and a latent layer's reads through the kernels, and a
tiny model's generate, chunked verify steps and overlapped generate against the torch backend and plain generate: on
the CPU under TRITON_INTERPRET=1 (set by ``triton_interpreter``), or compiled on a GPU."""

import os

import pytest
import torch
from triton_interpreter import faster_triton_interpreter  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
pytest.importorskip("triton")

from helpers import make_model  # noqa: E402

from oscar_hf import (  # noqa: E402
    DynamicOscarLayer,
    OscarConfig,
    OscarQuantizedCache,
    OscarRotations,
    cache_kwargs,
)
from oscar_hf.cache import LatentOscarLayer  # noqa: E402
from oscar_hf.kernels.decode import triton as decode_triton  # noqa: E402
from oscar_hf.quantizer import unpack  # noqa: E402

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def bf16_model():
    """The tiny bf16 Qwen3 (GQA, D = 128) that the tests through a model run: on a GPU with 2 layers, under the
    interpreter (which runs every program of every launch in Python) with 1, each layer taking the same kernels."""
    layers = 2 if DEVICE == "cuda" else 1
    return make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16, num_hidden_layers=layers).to(DEVICE)


def teacher_forced_logits(model, ids, mask, cache, prompt_len):
    """Logits of the prompt's last token, then of every later token of ``ids`` fed one at a time."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, through = [], cache_kwargs(model, cache)
    with torch.no_grad():
        for start, stop in [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, ids.shape[1] - 1)]:
            out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                        position_ids=positions[:, start:stop], **through, use_cache=True)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


def test_generate_triton_matches_torch_with_int2_history():
    """Tiny bf16 model, sink 4 + recent 8, a left-padded row: the prompt and the flushes go through both triton
    kernels. Greedy generate runs on each backend; then both are teacher-forced through the torch run's tokens and
    agree step by step. (Free-running generations of a random bf16 model may part ways at a 1-ulp top-2 tie, as
    they did on an H100 with the kernel's error no larger than the torch path's.)"""
    model = bf16_model()
    ids = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)

    def cache(backend):
        return OscarQuantizedCache.from_pretrained(
            OscarRotations.hadamard(model.config), model=model, sink_tokens=4, recent_tokens=8, backend=backend
        )

    sequences = {}
    for backend in ("torch", "triton"):
        used = cache(backend)
        sequences[backend] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                            past_key_values=used, pad_token_id=0)
        assert all(layer.n_history > 0 for layer in used.layers)
    tokens = sequences["torch"]
    full_mask = torch.cat([mask, torch.ones_like(tokens[:, 30:])], 1)
    logits = {b: teacher_forced_logits(model, tokens, full_mask, cache(b), 30) for b in ("torch", "triton")}
    torch.testing.assert_close(logits["torch"].argmax(-1), tokens[:, 30:], rtol=0, atol=0)  # the replay is generate's
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0, atol=2e-2)


def test_chunks_of_several_tokens_through_the_model(monkeypatch):
    """Verify-step-sized chunks (3–5 tokens, within the recent window) through a tiny bf16 model with a left-padded
    row, as assisted decoding feeds them: the triton backend runs them in the decode kernel (with the model's own
    4-D masks) and its logits match the torch backend's (two layers: the one-layer model has a near tie)."""
    model = make_model("qwen3-gqa-qknorm-d128", dtype=torch.bfloat16).to(DEVICE)
    ids = torch.randint(3, 90, (2, 42), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    query_lengths = []
    decode_ = decode_triton.decode
    monkeypatch.setattr(decode_triton, "decode", lambda query, *a, **kw: query_lengths.append(query.shape[2]) or
                        decode_(query, *a, **kw))

    def chunked(backend):
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                    sink_tokens=4, recent_tokens=8, backend=backend)
        logits, through = [], cache_kwargs(model, cache)
        with torch.no_grad():
            for start, stop in [(0, 24), (24, 27), (27, 30), (30, 34), (34, 37), (37, 42)]:
                out = model(input_ids=ids[:, start:stop], attention_mask=mask[:, :stop],
                            position_ids=positions[:, start:stop], **through, use_cache=True)
                logits.append(out.logits.float())
        assert all(layer.n_history > 0 for layer in cache.layers)
        return torch.cat(logits[1:], 1)

    want, got = chunked("torch"), chunked("triton")
    assert sorted(set(query_lengths)) == [3, 4, 5]  # every chunk after the prompt went to the decode kernel
    torch.testing.assert_close(got, want, rtol=0, atol=4e-2)
    best, second = want.topk(2, dim=-1).values.unbind(-1)
    clear = best - second > 8e-2  # the same best token wherever the backends' bf16 sums cannot make it a tie
    assert clear.any() and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_cache_quantizes_through_the_triton_writer():
    cfg = dict(sink_tokens=2, recent_tokens=4, flush_tokens=2)
    layers = {b: DynamicOscarLayer(OscarConfig(backend=b, **cfg), torch.eye(64), torch.eye(64))
              for b in ("torch", "triton")}
    kv = randn(2, 2, 3, 25, 64, seed=10).to(torch.bfloat16)
    for layer in layers.values():
        layer.update(kv[0, :, :, :20], kv[1, :, :, :20])
        for t in range(20, 25):
            layer.update(kv[0, :, :, t : t + 1], kv[1, :, :, t : t + 1])
    torch_layer, triton_layer = layers["torch"], layers["triton"]
    assert triton_layer.n_history == torch_layer.n_history > 0
    for name in torch_layer.history.tensors:
        a = triton_layer.history[name][:, :, : triton_layer.n_history]
        assert torch.equal(a, torch_layer.history[name][:, :, : torch_layer.n_history]), name
    assert unpack(triton_layer.history["key_codes"][:, :, :1], 2).max() <= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("centering", [True, False], ids=["centered", "uncentered"])
def test_latent_layer_reads_its_history_through_the_dequantize_kernel(dtype, centering):
    """A multi-head latent attention layer (latent 64 channels, rotated, groups of 32) with backend "triton" reads
    back what the torch twin reads (a decode step's handle, dense): fp32 within 1e-6, bf16 within one ulp of the
    dequantized rows' rounding."""
    rotation = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(3)))[0]
    latent, rope = randn(2, 2, 1, 90, 64, seed=13).to(dtype), randn(2, 1, 90, 16, seed=14).to(dtype)
    got = {}
    for backend in ("torch", "triton"):
        layer = LatentOscarLayer(OscarConfig(sink_tokens=4, recent_tokens=8, flush_tokens=4, group_size=32,
                                             centering=centering, backend=backend), rotation)
        layer.update(latent[0], rope)
        got[backend] = layer.update(latent[1, :, :, :3], rope[:, :, :3])[0].dense()
        assert layer.n_history > 70
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got["triton"], got["torch"], rtol=2**-6, atol=2**-6)
    else:
        torch.testing.assert_close(got["triton"], got["torch"], rtol=1e-6, atol=1e-6)


class _ImmediateEvent:
    """torch.Event for the CPU, which has none (and computes before the host reads anyway)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args):
        pass

    def synchronize(self):
        pass


@pytest.mark.parametrize("stop", ["eos", "max-length"])
def test_overlapped_generate_equals_generate_and_leaves_the_same_cache(monkeypatch, stop):
    """overlapped_sample with the stop check deferred (let onto the CPU here): the same tokens as generate, the extra
    step of an EOS stop undone (crop(-1)), so that the cache holds what generate's holds and continues alike."""
    from oscar_hf import generation, overlapped_sample

    model = bf16_model()
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(5)).to(DEVICE)

    def run(eos, **kwargs):
        cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model, sink_tokens=4,
                                                    recent_tokens=8, flush_tokens=3, backend="triton",
                                                    max_cache_len=60)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             past_key_values=cache, eos_token_id=eos, pad_token_id=0, disable_compile=True, **kwargs)
        more = torch.cat([out, out[:, -1:]], dim=1)  # one more turn from the cache
        again = model.generate(input_ids=more, attention_mask=torch.ones_like(more), max_new_tokens=3,
                               do_sample=False, past_key_values=cache, pad_token_id=0, disable_compile=True)
        return out, again, cache

    plain, _, _ = run(None)
    new = plain[0, 30:].tolist()
    eos = next(t for i, t in enumerate(new) if i >= 4 and t not in new[:i]) if stop == "eos" else None
    want, want_again, want_cache = run(eos)
    finished = []
    if DEVICE == "cpu":
        monkeypatch.setattr(torch, "Event", _ImmediateEvent)
        rule = generation.deferred_stop_check().is_supported  # its rule, as if on an accelerator
        monkeypatch.setattr(generation.deferred_stop_check(), "is_supported",
                            staticmethod(lambda device, *args, **kwargs: rule(torch.device("meta"), *args, **kwargs)))
    finish = generation.deferred_stop_check().finish
    monkeypatch.setattr(generation.deferred_stop_check(), "finish",
                        lambda self: finished.append(finish(self)) or finished[-1])
    got, got_again, got_cache = run(eos, custom_generate=overlapped_sample)
    assert finished == [1 if stop == "eos" else 0], "the stop check was deferred; an EOS stop undid a step"
    assert got.shape[1] < 40 if stop == "eos" else got.shape[1] == 40
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_again, want_again, rtol=0, atol=0)
    assert got_cache.layers[0].counts.tolist()[:4] == want_cache.layers[0].counts.tolist()[:4]
    assert not got_cache.layers[0].defers_host_reads


def test_overlapped_sample_refuses_beams_and_a_cache_too_small():
    from oscar_hf import overlapped_sample

    model = bf16_model()
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    cache = OscarQuantizedCache.from_pretrained(OscarRotations.hadamard(model.config), model=model,
                                                backend="triton", max_cache_len=38)
    with pytest.raises(ValueError, match="beam"):
        model.generate(input_ids=ids, max_new_tokens=4, num_beams=2, custom_generate=overlapped_sample)
    with pytest.raises(ValueError, match=r"max_cache_len=38\) cannot hold the 39 tokens"):
        model.generate(input_ids=ids, max_new_tokens=10, past_key_values=cache, custom_generate=overlapped_sample)
    assert cache.get_seq_length() == 0  # refused before the prefill
